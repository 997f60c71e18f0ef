"""lm-evaluation-harness itself against the live tiny server (serve_helpers): its ``local-completions`` model with the
remote tokenizer, on two tiny local tasks over ``tests/data/lm_eval_tiny.jsonl`` -- a multiple-choice task
(loglikelihood requests: echo + logprobs) and a generation task (generate_until) -- and their numbers checked against
the model itself.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from kimi_jax.engine import SamplingParams  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lm_eval_tiny.jsonl")
MAX_GEN = 6


def _tasks():
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": DATA}}, "test_split": "test",
              "doc_to_text": "{{question}}"}
    mc = {**common, "task": "kimi_jax_tiny_mc", "output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
          "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}
    gen = {**common, "task": "kimi_jax_tiny_gen", "output_type": "generate_until", "doc_to_target": " {{target}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_GEN, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}]}
    return [mc, gen]


@pytest.fixture(scope="module")
def results(served):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import evaluator

    args = {"model": "tiny", "base_url": served.base_url + "/completions", "tokenizer_backend": "remote",
            "max_length": served.engine.max_model_len, "num_concurrent": 2, "max_retries": 1}
    return evaluator.simple_evaluate(model="local-completions", model_args=args, tasks=_tasks(), log_samples=True,
                                     bootstrap_iters=0, random_seed=0)


def _lp(model, ids, width=32):
    """log_softmax(Model.logits) of ids, right-padded to one width (one compile; the model is causal)."""
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(jax.nn.log_softmax(model.logits(padded)[0], axis=-1))


def test_loglikelihood_task_matches_the_model(results, served):
    tok, model = served.tokenizer, served.model
    samples = results["samples"]["kimi_jax_tiny_mc"]
    docs = [json.loads(line) for line in open(DATA)]
    assert len(samples) == len(docs)
    correct = 0
    for s in samples:
        doc = docs[s["doc_id"]]
        got = [float(r[0][0]) for r in s["resps"]]  # per choice: (loglikelihood, is_greedy)
        want = []
        for choice in doc["choices"]:
            ctx, cont = tok.encode(doc["question"]), tok.encode(" " + choice)
            lp = _lp(model, ctx + cont)
            want.append(sum(lp[len(ctx) + j - 1, t] for j, t in enumerate(cont)))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
        correct += int(np.argmax(want) == doc["answer"])
    assert results["results"]["kimi_jax_tiny_mc"]["acc,none"] == pytest.approx(correct / len(docs))


def test_generate_until_task_is_the_servers_greedy_output(results, served):
    samples = results["samples"]["kimi_jax_tiny_gen"]
    assert len(samples) == 4 and "exact_match,none" in results["results"]["kimi_jax_tiny_gen"]
    tok, engine = served.tokenizer, served.engine
    for s in samples:
        prompt = tok.encode(s["doc"]["question"])
        (out,) = engine.generate(prompt, SamplingParams(max_tokens=MAX_GEN, temperature=0.0, stop=("\n",)))
        assert s["resps"][0][0] == out.text
