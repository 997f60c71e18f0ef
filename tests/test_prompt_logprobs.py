"""Prompt log-probs and the tokenizer endpoints as evaluation clients use them: ``/tokenizer_info``, ``/tokenize`` of
a control token's name, and ``/v1/completions`` with ``echo`` + ``logprobs`` (``max_tokens`` 0 or 1) and vLLM's
``prompt_logprobs`` -- against the shared float32 tiny server (serve_helpers), whose prompt scores must equal the
log-softmax of ``Model.logits``.
"""

from __future__ import annotations

import json

import httpx
import jax
import numpy as np
import pytest

from kimi_jax.engine.prompt_logprobs import PromptScorer, bucket_length

MODEL = "tiny"
IDS = [17, 402, 88, 911, 5, 260, 731, 44, 123, 9, 301, 77, 650]  # 13 tokens: runs in the 16 bucket


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ref_lp(served):
    """log_softmax(Model.logits) of IDS, float32 [T, V]."""
    return np.asarray(jax.nn.log_softmax(served.model.logits(np.array([IDS]))[0], axis=-1))


def _post(http, body, status=200):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    return r.json()


def test_tokenizer_info_and_control_token_names(http, served):
    tok = served.tokenizer
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|end_of_msg|>" and info["bos_token"] == "[BOS]" and info["pad_token"] == "[PAD]"
    assert info["model_max_length"] == served.engine.max_model_len and "chat_template" in info
    assert info["added_tokens_decoder"][str(tok.eos_id)]["content"] == "<|end_of_msg|>"
    # what lm-eval's RemoteTokenizer does with them: /tokenize the name, take the first id
    for name in ("eos_token", "bos_token", "pad_token"):
        ids = http.post("/tokenize", json={"prompt": info[name], "add_special_tokens": False}).json()["tokens"]
        assert ids == [tok.special_tokens[info[name]]]
    longer = http.post("/tokenize", json={"prompt": "a <|end_of_msg|>"}).json()["tokens"]
    assert tok.eos_id not in longer  # inside longer text a control name stays text
    assert http.post("/detokenize", json={"tokens": [tok.eos_id]}).json()["prompt"] == "<|end_of_msg|>"


def test_echo_logprobs_max_tokens_1_equal_log_softmax_of_model_logits(http, served, ref_lp):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1, temperature 0."""
    out = _post(http, {"prompt": [IDS, IDS[:5]], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    tok = served.tokenizer
    first, second = sorted(out["choices"], key=lambda c: c["index"])
    lp = first["logprobs"]
    assert len(lp["tokens"]) == len(IDS) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = np.array([ref_lp[t - 1, IDS[t]] for t in range(1, len(IDS))])
    np.testing.assert_allclose(lp["token_logprobs"][1:len(IDS)], want, rtol=0, atol=1e-4)
    for t in range(1, len(IDS)):  # the single top entry is the argmax of the model's distribution
        (val,) = lp["top_logprobs"][t].values()
        assert abs(val - ref_lp[t - 1].max()) < 1e-4
    assert lp["tokens"][:len(IDS)] == [tok.decode([t]) for t in IDS]
    assert first["text"].startswith(tok.decode(IDS)) and lp["text_offset"][0] == 0
    assert lp["text_offset"][len(IDS)] == len(tok.decode(IDS))  # the generated token follows the echo
    # the other prompt of the batch is scored on its own
    want2 = [ref_lp[t - 1, IDS[t]] for t in range(1, 5)]
    np.testing.assert_allclose(second["logprobs"]["token_logprobs"][1:5], want2, rtol=0, atol=1e-4)
    # as lm-eval sums them: the continuation's log-likelihood
    ctxlen = 6
    assert abs(sum(lp["token_logprobs"][ctxlen:-1]) - want[ctxlen - 1:].sum()) < 1e-3


def test_max_tokens_0_echo_reports_the_prompt_only(http, ref_lp):
    out = _post(http, {"prompt": IDS, "echo": True, "logprobs": 2, "max_tokens": 0})
    (ch,) = out["choices"]
    assert len(ch["logprobs"]["tokens"]) == len(IDS) and ch["finish_reason"] == "length"
    assert all(len(d) == 2 for d in ch["logprobs"]["top_logprobs"][1:])
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(IDS)
    err = _post(http, {"prompt": IDS, "max_tokens": 0}, status=400)["error"]
    assert err["param"] == "max_tokens"


def test_vllm_prompt_logprobs(http, ref_lp):
    out = _post(http, {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0})
    (ch,) = out["choices"]
    pl = ch["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(IDS)
    for t in range(1, len(IDS)):
        entry = pl[t][str(IDS[t])]
        assert abs(entry["logprob"] - ref_lp[t - 1, IDS[t]]) < 1e-4
        assert entry["rank"] == 1 + int((ref_lp[t - 1] > ref_lp[t - 1, IDS[t]] + 1e-6).sum())
        top3 = np.argsort(-ref_lp[t - 1])[:3]
        assert {str(int(i)) for i in top3} <= set(pl[t])
    assert ch["logprobs"] is None  # no logprobs asked: none, and no echo either


def test_streamed_echo_carries_the_prompt_logprobs(http):
    body = {"model": MODEL, "prompt": IDS, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0,
            "stream": True}
    chunks = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(IDS)
    full = _post(http, {k: v for k, v in body.items() if k != "stream"})
    streamed = first["logprobs"]["token_logprobs"] + [x for c in chunks[1:] for ch in c["choices"]
                                                      if ch["logprobs"] for x in ch["logprobs"]["token_logprobs"]]
    assert streamed == full["choices"][0]["logprobs"]["token_logprobs"]


def test_scorer_is_model_logits_of_the_padded_bucket(served):
    """The padding follows the prompt: the scores are Model.logits of the bucket-padded ids, bit for bit, and equal
    the unpadded forward to float32 rounding."""
    scorer = PromptScorer(served.model, served.engine.max_model_len)
    s = scorer.score(IDS)
    L = bucket_length(len(IDS), served.engine.max_model_len)
    padded = np.zeros((1, L), np.int32)
    padded[0, :len(IDS)] = IDS
    lp = np.asarray(jax.nn.log_softmax(served.model.logits(padded)[0], axis=-1))
    np.testing.assert_array_equal(s.logprobs, [lp[t - 1, IDS[t]] for t in range(1, len(IDS))])
