"""`python -m kimi_jax.export` (DESIGN.md's public interface): the engine's programs built from abstract shapes and
exported with `jax.export` for a platform this machine does not have.

Exporting for TPU applies Mosaic's real lowering rules (block shapes, memory spaces, no device queries), so these
tests are how every preset's decode step and prefill programs are checked to lower on a TPU mesh: on 1, 2 and 8
faked devices (tensor, tensor x data, and the expert / context overlay), each program must hold the Mosaic kernel
of every op family its architecture has — the kernels reached through their partitioned entry points, never
partitioned by GSPMD (which refuses custom calls).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server_process import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]
MESHES = ("1x1", "2x1", "2x4", "expert=8,tensor=1,context=8")

# Every preset on every mesh in one process (8 faked CPU devices): the full-size presets are built abstractly, so
# this costs tracing time only. For each program, the Mosaic kernels it must hold, from the architecture:
# KDA layers -> the recurrent kernel at one token per sequence, the chunked kernel in longer prefill chunks; MLA
# with a DSA indexer -> the indexer's score kernel and sparse MLA at one token; MLA without one -> the dense paged
# kernel; routed experts -> the grouped matmul everywhere.
SCRIPT = textwrap.dedent(r"""
    import json, sys
    from kimi_jax.config import get_preset
    from kimi_jax.export import build_parser, export_programs

    presets, meshes, out = sys.argv[1].split(","), sys.argv[2].split(";"), sys.argv[3]
    results = {}
    for preset in presets:
        cfg = get_preset(preset)
        kinds = set(cfg.layer_kinds)
        one_token, chunk = set(), set()
        if "kda" in kinds:
            one_token.add("kda_recurrent_tpu"); chunk.add("kda_chunk_tpu")
        if "mla" in kinds:
            one_token |= {"indexer_scores_tpu", "mla_sparse_decode_tpu"} if cfg.indexer is not None \
                else {"mla_paged_dense_decode_tpu"}
        if cfg.moe is not None and any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
            one_token.add("moe_grouped_matmul_tpu"); chunk.add("moe_grouped_matmul_tpu")
        # a prefill program returns only the cache: an MLA layer's attention output is live there only if a later
        # layer reads it (kimi-k3.1-reduced's one MLA layer is its last: XLA drops that attention, keeps the writes)
        live = {"indexer_scores_tpu", "mla_sparse_decode_tpu", "mla_paged_dense_decode_tpu"}
        if "mla" not in cfg.layer_kinds[:-1]:
            live = set()
        want = {"step": one_token, "prefill_1": {k for k in one_token if k in live or "mla" not in k and
                                                 "indexer" not in k}, "prefill_256": chunk}
        for mesh in meshes:
            args = build_parser().parse_args([
                "--platform", "tpu", "--model", preset, "--mesh", mesh, "--programs", "step,prefill",
                "--prefill-chunk-sizes", "256,1", "--max-num-seqs", "4", "--max-model-len", "1024",
                "--out", f"{out}/{preset}_{len(results)}"])
            summary = export_programs(args)
            for name, entry in summary["programs"].items():
                assert entry["ok"], (preset, mesh, name, entry.get("error"))
                missing = want[name] - set(entry["kernel_names"])
                assert not missing, (preset, mesh, name, "lacks", missing, entry["kernel_names"])
            results[f"{preset} {mesh}"] = sorted(summary["programs"])
            print(preset, mesh, "ok", flush=True)
    print(json.dumps(results))
""")


def _run_export_script(presets, meshes, tmp_path, timeout):
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(presets), ";".join(meshes), str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_small_presets_export_for_tpu_on_every_mesh_with_their_mosaic_kernels(tmp_path):
    presets = ("tiny", "kimi-k3.1-reduced")
    results = _run_export_script(presets, MESHES, tmp_path, timeout=900)
    assert set(results) == {f"{p} {m}" for p in presets for m in MESHES}
    assert all(v == ["prefill_1", "prefill_256", "step"] for v in results.values())


@pytest.mark.slow
def test_full_size_presets_export_for_tpu_with_their_mosaic_kernels(tmp_path):
    """Kimi-Linear-48B (MLA without an indexer: the dense paged kernel), DeepSeek-V3.2 (no KDA), Kimi K3 and
    K3.1 Pro at full size, built from abstract shapes: one device and the 8-device expert / context overlay."""
    presets = ("kimi-linear-48b", "deepseek-v3.2", "kimi-k3", "kimi-k3.1-pro")
    meshes = ("1x1", "expert=8,tensor=1,context=8")
    results = _run_export_script(presets, meshes, tmp_path, timeout=1800)
    assert set(results) == {f"{p} {m}" for p in presets for m in meshes}


def _cli(*args, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the CLI fakes the mesh's CPU devices itself
    return subprocess.run([sys.executable, "-m", "kimi_jax.export", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_writes_serialized_programs_and_a_summary(tmp_path):
    """The command line as DESIGN.md gives it: DIR/step.jax, DIR/prefill_<C>.jax (serialized `jax.export`
    modules that deserialize) and DIR/summary.json; exit status 0; the 8 devices the mesh needs are faked."""
    import jax

    out = tmp_path / "tiny_2x4"
    r = _cli("--platform", "tpu", "--model", "tiny", "--mesh", "2x4", "--prefill-chunk-sizes", "64,1",
             "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["platform"] == "tpu" and summary["devices"] == 8
    names = set(summary["programs"])
    assert {"step", "prefill_64", "prefill_1", "insert", "copy_blocks"} <= names
    for name in names:
        assert (out / f"{name}.jax").is_file(), name
    step = jax.export.deserialize(bytearray((out / "step.jax").read_bytes()))
    assert step.platforms == ("tpu",) and step.nr_devices == 8
    assert len(step.in_avals) == len(summary["programs"]["step"]["inputs"])
    assert "kda_recurrent_tpu" in summary["programs"]["step"]["kernel_names"]
    assert summary["dtype"] == "bfloat16" and summary["attention_precision"] == "storage"  # what serve would run


def test_cli_reference_kernels_hold_no_mosaic_call(tmp_path):
    """--kernels reference exports the plain-jnp definition: no custom call at all."""
    r = _cli("--platform", "tpu", "--model", "tiny", "--kernels", "reference", "--programs", "step",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    step = json.loads((tmp_path / "summary.json").read_text())["programs"]["step"]
    assert step["ok"] and step["kernel_calls"] == {} and step["kernel_names"] == []


def test_cli_cuda_export_lowers_without_a_gpu(tmp_path):
    """--platform cuda lowers on a machine without a GPU, on a mesh too. "auto" picks the GPU kernels where
    jax-triton can launch them — it imports only with a GPU jaxlib, so on a CPU host "auto" takes the reference for
    the Triton families and the programs hold plain XLA (docs/export.md); with a GPU jaxlib the jax-triton calls
    are in the exported programs (such calls bind the file to this JAX)."""
    from pallas_kernels.triton_call import available

    r = _cli("--platform", "cuda", "--model", "tiny", "--mesh", "2x1", "--programs", "step,prefill",
             "--prefill-chunk-sizes", "64,1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["platform"] == "cuda"
    calls = summary["programs"]["step"]["kernel_calls"]
    assert (calls.get("triton_kernel_call", 0) > 0) == available(), calls


@pytest.mark.parametrize("args,message", [
    (("--mesh", "3y"), "--mesh"),
    (("--dcp", "3"), "--dcp 3"),
    (("--kv-dtype", "int3"), "kv dtype"),
])
def test_cli_bad_arguments_fail_with_a_clear_message(tmp_path, args, message):
    r = _cli("--platform", "tpu", "--model", "tiny", *args, "--out", str(tmp_path), timeout=300)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-2000:]
