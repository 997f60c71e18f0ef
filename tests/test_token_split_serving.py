"""Token-split prefill inside the serving engine (docs/serving.md, "Sharded serving"), on 8 faked CPU devices
against one device.

With `--dcp N` over a context axis, prefill chunks of at least `token_split_min_tokens` tokens run split by tokens
over that axis (`ModelRunner` program `prefill_split_C`): device d runs tokens [d·C/N, (d+1)·C/N) of the chunk at
whatever position the chunk starts, the KDA state and conv tails continue exactly from the tokens before it, and each
rank writes the latent rows / index keys it owns into its DCP pages. The engine must give the same greedy tokens as
one device running every chunk whole, with log-probs within float32 noise — through many chunks (positions > 0),
chunks that start and end inside a page and cross into the next, the smallest split (K−1 = 3 tokens per device), the
dense and the DSA-indexer attention, and preemption (a recompute prefills its prompt + output again through the
split). `/stats` counts the prompt tokens that took the split.

Subprocesses, because the CPU device count is fixed once per process when JAX starts its backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from server_process import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    from kimi_jax.config import get_preset
    from kimi_jax.engine import Engine, EngineConfig, SamplingParams
    from kimi_jax.model import random_model
    from kimi_jax.tokenizer import Tokenizer

    case = json.loads(sys.argv[1])
    cfg = get_preset("tiny")
    if not case["indexer"]:  # MLA without the DSA indexer (as Kimi-Linear): dense attention over the pages
        cfg = cfg.replace(indexer=None)
    tok = Tokenizer.tiny()
    rng = np.random.RandomState(0)
    prompts = [list(map(int, rng.randint(5, 900, n))) for n in case["lengths"]]
    for i, more in case.get("extend", []):  # a prompt that continues an earlier one: a prefix-cache hit
        prompts.append(prompts[i] + list(map(int, rng.randint(5, 900, more))))
    params = SamplingParams(max_tokens=case["gen"], temperature=0.0, logprobs=True, ignore_eos=True)

    def run(model, dcp, threshold, num_blocks=None):
        ecfg = EngineConfig(max_num_seqs=case["slots"], max_model_len=case["max_len"],
                            prefill_chunk_sizes=tuple(case["chunks"]), dcp=dcp, num_blocks=num_blocks,
                            token_split_min_tokens=threshold, images=False)
        eng = Engine(model, tok, ecfg).start()
        streams = [eng.submit(p, params) for p in prompts]
        outs = [s.collect(1)[0][0] for s in streams]
        stats = eng.stats()
        eng.shutdown()
        return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs], stats

    one = run(random_model(cfg), 1, 0)
    split = run(random_model(cfg, mesh=case["mesh"]), case["dcp"], case["threshold"], case["num_blocks"])
    keys = ("token_split_prefill_tokens", "token_split_chunk_sizes", "num_preemptions", "compilations",
            "compilations_at_start", "block_tokens", "dcp", "prefix_cache_hits")
    print(json.dumps({"tokens_equal": one[0] == split[0], "tokens": split[0],
                      "max_dlogprob": max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(one[1], split[1])),
                      "one": {"token_split_prefill_tokens": one[2]["token_split_prefill_tokens"]},
                      "split": {k: split[2][k] for k in keys}}))
""")


def _run(**case) -> dict:
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(case)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _split_tokens(lengths, chunks, threshold) -> int:
    """Prompt tokens that go through token-split chunks: each prompt's first n − 1 tokens are cut into the chunk
    sizes largest first (`ModelRunner.plan_chunks`), and the chunks of at least `threshold` tokens split."""
    total = 0
    for n in lengths:
        left = n - 1
        for c in sorted(chunks, reverse=True):
            k, left = divmod(left, c)
            total += k * c if c >= threshold else 0
    return total


@pytest.mark.slow
def test_token_split_prefill_over_8_context_devices_equals_one_device():
    """`--mesh expert=8,tensor=1,context=8 --dcp 8` (the K3.1 layout: attention token-split over 8 devices, the
    experts 8-way over the same devices), the DSA indexer on, chunk sizes 96 and 24 token-split (12 and 3 tokens per
    device: 3 is the KDA conv halo, the smallest split), 1 plain. A table entry covers 512 positions here, so every
    chunk starts and ends inside a page, and the 600-token prompt's sixth 96-token chunk (positions 480…575)
    crosses into its second page; its chunks 2…6 start at positions > 0 and continue the KDA state and conv tails
    of the ones before. The 70-token prompt takes two 24-token chunks, the 7-token one none. The fourth prompt is
    the 70-token one and 130 more tokens: it resumes from that prompt's prefix-cache checkpoint (69 tokens: two
    24-token chunks and 21 one-token chunks) and prefills the rest in a 96- and a 24-token chunk starting at
    positions 69 and 165: not multiples of 8, so each chunk's first token lives on rank 5 (position p on rank
    p mod 8), not on the device holding it."""
    lengths, chunks = (600, 70, 7), (96, 24, 1)
    r = _run(mesh="expert=8,tensor=1,context=8", dcp=8, chunks=chunks, threshold=24, lengths=lengths, gen=10,
             slots=4, max_len=1024, num_blocks=None, indexer=True, extend=[[1, 130]])
    assert r["tokens_equal"], r
    assert r["max_dlogprob"] < 1e-4, r
    split = r["split"]
    assert split["dcp"] == 8 and split["block_tokens"] == 512 and split["token_split_chunk_sizes"] == [96, 24]
    assert split["prefix_cache_hits"] == 1, r
    from_scratch = _split_tokens(lengths, chunks, 24)
    assert from_scratch == 6 * 96 + 2 * 24
    assert split["token_split_prefill_tokens"] == from_scratch + 96 + 24, r
    assert r["one"]["token_split_prefill_tokens"] == 0  # one device: no context axis, no split
    assert split["compilations"] == split["compilations_at_start"], r  # the split programs compiled at start


@pytest.mark.slow
def test_preemption_with_token_split_prefill_equals_one_device():
    """`--mesh context=4,tensor=2 --dcp 4`: the token split over the context axis while every device of a context
    shard splits its heads over the tensor axis (and the routed experts run expert-parallel over it), MLA without
    an indexer (the dense paged attention per rank), 64-token chunks split 4 ways. A pool of 5 usable pages of 256
    positions per rank cannot hold four sequences growing to two pages each, so the youngest are preempted; each
    recompute prefills its prompt and its output so far again through the token split, from position 0 on, and
    the tokens are still one device's."""
    lengths, chunks = (200, 215, 230, 245), (64, 1)
    r = _run(mesh="context=4,tensor=2", dcp=4, chunks=chunks, threshold=64, lengths=lengths, gen=80, slots=4,
             max_len=1024, num_blocks=6, indexer=False)
    split = r["split"]
    assert split["num_preemptions"] > 0, r
    assert r["tokens_equal"], r
    assert r["max_dlogprob"] < 1e-4, r
    assert split["token_split_chunk_sizes"] == [64]
    # the prompts' chunks, and more: every recompute prefills again
    assert split["token_split_prefill_tokens"] > _split_tokens(lengths, chunks, 64), r
    assert split["compilations"] == split["compilations_at_start"], r


def test_the_serve_flag_sets_the_threshold_and_refuses_bad_values(capsys):
    """`--token-split-min-tokens N` (default 1024) reaches `EngineConfig.token_split_min_tokens`; a negative value is
    refused before any model loads."""
    from kimi_jax.engine.engine import DEFAULT_TOKEN_SPLIT_MIN_TOKENS, EngineConfig
    from kimi_jax.serve.__main__ import build_parser, main

    parser = build_parser()
    assert "--token-split-min-tokens" in parser.format_help()
    assert parser.parse_args([]).token_split_min_tokens == DEFAULT_TOKEN_SPLIT_MIN_TOKENS == 1024
    assert EngineConfig().token_split_min_tokens == DEFAULT_TOKEN_SPLIT_MIN_TOKENS
    assert parser.parse_args(["--token-split-min-tokens", "0"]).token_split_min_tokens == 0
    assert main(["--token-split-min-tokens", "-1"]) == 2
    assert "--token-split-min-tokens" in capsys.readouterr().err


SIZES_SCRIPT = textwrap.dedent(r"""
    import json
    import numpy as np
    from kimi_jax.config import get_preset
    from kimi_jax.engine.guide import NUM_VOCAB_CLASSES
    from kimi_jax.engine.runner import ModelRunner
    from kimi_jax.model import abstract_model

    cfg = get_preset("tiny")

    def runner(mesh, dcp, chunks, threshold):
        model = abstract_model(cfg, mesh=mesh)
        try:
            r = ModelRunner(model, max_num_seqs=2, max_model_len=1024, prefill_chunk_sizes=chunks,
                            class_masks=np.zeros((NUM_VOCAB_CLASSES, cfg.vocab_size), bool),
                            stop_mask=np.zeros(cfg.vocab_size, bool), dcp=dcp, token_split_min_tokens=threshold)
        except ValueError as e:
            return "error: " + str(e)
        return {"sizes": list(r.token_split_sizes), "programs": [n for n in r.program_names if "prefill" in n],
                "summary": r.token_split_summary()}

    print(json.dumps({
        "context": runner("expert=8,tensor=1,context=8", 8, (1024, 256, 64, 1), 256),
        "default_threshold_off": runner("expert=8,tensor=1,context=8", 8, (1024, 256, 64, 1), 0),
        "tensor_axis": runner("8x1", 8, (1024, 256, 64, 1), 256),
        "not_a_multiple": runner("context=4,tensor=2", 4, (1026, 64, 1), 1000),
        "below_the_halo": runner("expert=8,tensor=1,context=8", 8, (16, 1), 16),
    }))
""")


def test_which_chunk_sizes_split_and_which_are_refused():
    """The runner compiles `prefill_split_C` instead of `prefill_C` for the chunk sizes at or above the threshold
    when DCP runs over a context axis; none over the tensor axis (a plain chunk already splits by heads there) or
    with the threshold 0; a size that does not split over the devices, or leaves one fewer tokens than the conv halo,
    is a clear error at construction (from abstract shapes: nothing compiles)."""
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SIZES_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["context"]["sizes"] == [1024, 256]
    assert r["context"]["programs"] == ["prefill_split_1024", "prefill_split_256", "prefill_64", "prefill_1"]
    assert "[1024, 256] split 8 ways over the 'context' axis" in r["context"]["summary"]
    assert r["default_threshold_off"]["sizes"] == [] and "threshold 0" in r["default_threshold_off"]["summary"]
    assert r["tensor_axis"]["sizes"] == [] and "tensor axis" in r["tensor_axis"]["summary"]
    assert r["tensor_axis"]["programs"] == ["prefill_1024", "prefill_256", "prefill_64", "prefill_1"]
    assert r["not_a_multiple"].startswith("error: prefill chunk size 1026 does not split over --dcp 4"), r
    assert "set it to 0" in r["not_a_multiple"]
    assert r["below_the_halo"].startswith("error: prefill chunk size 16 over --dcp 8 devices leaves 2 tokens"), r


EXPORT_SCRIPT = textwrap.dedent(r"""
    import json, sys
    from kimi_jax.export import build_parser, export_programs

    out, results = sys.argv[1], {}
    for mesh, dcp in (("expert=8,tensor=1,context=8", 8), ("context=4,tensor=2", 4)):
        args = build_parser().parse_args([
            "--platform", "tpu", "--model", "tiny", "--mesh", mesh, "--dcp", str(dcp), "--programs", "prefill",
            "--prefill-chunk-sizes", "64,1", "--token-split-min-tokens", "64", "--max-num-seqs", "2",
            "--max-model-len", "1024", "--out", f"{out}/{dcp}"])
        results[mesh] = {name: {"ok": e["ok"], "kernels": e.get("kernel_names", []), "error": e.get("error")}
                         for name, e in export_programs(args)["programs"].items()}
    print(json.dumps(results))
""")


def test_the_token_split_program_exports_for_tpu_with_its_mosaic_kernels(tmp_path):
    """`prefill_split_64` lowers for a TPU mesh (`python -m kimi_jax.export --dcp N --token-split-min-tokens 64`)
    on the expert / context overlay and on a context x tensor mesh: every kernel inside the shard_map over the
    context axis is reached through a nested shard_map over the remaining axes (GSPMD refuses Mosaic custom calls,
    even over an axis of size 1), and the chunked KDA kernel and the MoE grouped matmul are in it."""
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for mesh, programs in r.items():
        assert sorted(programs) == ["prefill_1", "prefill_split_64"], (mesh, programs)
        split = programs["prefill_split_64"]
        assert split["ok"], (mesh, split["error"])
        assert {"kda_chunk_tpu", "moe_grouped_matmul_tpu"} <= set(split["kernels"]), (mesh, split["kernels"])
