"""The GPU kernels (native Triton) compile for NVIDIA Hopper and AMD CDNA3 targets on a host without a GPU.

Triton's pip wheel compiles to a cubin (CUDA, sm_90) or an hsaco (ROCm, gfx942) on the CPU. A subprocess without
TRITON_INTERPRET (conftest turns it on for this process) traces the kernels' JAX wrappers at K3.1-like shapes with
the jax-triton launch replaced by a recorder (`triton_call._gpu_launch`), then compiles every recorded launch as
jax-triton would (`triton_call.compile_launch`). Hopper launches must fit its 227 KB of shared memory per block;
on gfx942 (64 KB of LDS per CU) the Hopper-tuned presets are only compiled, not held to a budget (docs/gpu.md, AMD),
except sparse MLA's all-heads preset (128-head blocks), whose gfx942 compile takes minutes on this CPU. Inline PTX
(`triton_call.ON_NVIDIA`) must reach the sm_90 binaries (the MoE MXFP4 decode) and stay out of the gfx942 ones.
A second sm_90 run compiles every opt-in preset of the indexer (`FAST`) and sparse MLA (`WIDE`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOPPER_SHARED = 232448  # bytes of shared memory one block may use on sm_90

SCRIPT = textwrap.dedent("""
    import json, sys
    from unittest import mock
    import jax, jax.numpy as jnp, numpy as np
    from triton.backends.compiler import GPUTarget
    import pallas_kernels.triton_call as tc
    from kimi_jax import quant as Q
    from pallas_kernels.indexer import gpu_triton as ix
    from pallas_kernels.kda import gpu_triton as kda
    from pallas_kernels.mla import sparse_gpu_triton as mla
    from pallas_kernels.moe import gpu_route as route, gpu_triton as moe, mxfp4 as mx
    from pallas_kernels import norm
    from kimi_jax.config import MoEConfig

    backend, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    presets = len(sys.argv) > 4 and sys.argv[4] == "presets"
    launches = []

    def record(args, *, out_shape, **kw):
        launches.append((args, dict(kw, out_shape=out_shape)))
        return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    S = jax.ShapeDtypeStruct

    def preset_launches():
        # every opt-in preset (`FAST`, `WIDE`) at K3.1 widths, fp8 keys / rows: the knob combinations they name
        fmt = Q.IndexKeyFormat("fp8", 128)
        parts = tuple(S((3000, 64, p.width), p.dtype) for p in fmt.parts)
        for name, kw in sorted(ix.FAST.items()):
            jax.eval_shape(lambda q, w, p, bt, pos: ix.scores(q, w, p, bt, pos, fmt=fmt, **kw),
                           S((32, 32, 128), jnp.float32), S((32, 32), jnp.float32), parts, S((32, 2048), jnp.int32),
                           S((32,), jnp.int32))
        fmt = Q.LatentFormat("fp8", 512, 64)
        parts = tuple(S((4096, 64, p.width), p.dtype) for p in fmt.parts)
        for name, kw in sorted(mla.WIDE.items()):
            jax.eval_shape(lambda q, p, bt, idx: mla.decode(q, p, bt, idx, fmt=fmt, scale=0.07, value_dim=512, **kw),
                           S((4, 96, 576), jnp.float32), parts, S((4, 40), jnp.int32), S((4, 2048), jnp.int32))

    def default_launches():
        B, H, d, page = 4, 32, 128, 64
        for dt in ("fp8", "mxfp4", "bf16"):
            fmt = Q.IndexKeyFormat(dt, d)
            parts = tuple(S((512, page, p.width), p.dtype) for p in fmt.parts)
            for kw in ({}, ix.FAST[ix.STORAGE_PRESET], ix.FAST[ix.STORAGE_PRESET_SHORT],
                       dict(exact=False, orient="qk", q_inside=True, prefetch=True)):
                jax.eval_shape(lambda q, w, p, bt, pos: ix.scores(q, w, p, bt, pos, fmt=fmt, **kw),
                               S((B, H, d), jnp.float32), S((B, H), jnp.float32), parts, S((B, 128), jnp.int32),
                               S((B,), jnp.int32))
        E, K, N = 16, 1024, 512
        for quant in (False, True):
            w = (mx.MXFP4Weight(S((E, N, K // 2), jnp.uint8), S((E, N, K // 32), jnp.uint8)) if quant
                 else S((E, K, N), jnp.bfloat16))
            for rows in (8, 32, 146):
                jax.eval_shape(lambda x, w, g: moe.grouped_matmul(x, (w,), g, out_dtype=jnp.bfloat16),
                               S((E * rows, K), jnp.bfloat16), w, S((E,), jnp.int32))
        # decode routing and tile plan: Kimi-Linear (256 experts, top-8), DeepSeek (8 groups), K3.1 (896, top-16)
        for E, k, G, N in ((256, 8, 1, 1), (256, 8, 1, 32), (256, 8, 8, 32), (896, 16, 1, 32)):
            cfg = MoEConfig(num_experts=E, top_k=k, intermediate_size=64, num_groups=G, topk_groups=max(1, G // 2))
            jax.eval_shape(lambda lg, b: route.select_experts(lg, b, cfg), S((N, E), jnp.float32), S((E,), jnp.float32))
            jax.eval_shape(lambda i: route.slot_tile_plan(i, E, 16), S((N, k), jnp.int32))
        H, d, T, cu = 96, 128, 1024, np.array([0, 300, 1024])  # K3's KDA heads, its lower-bound gate fused
        gate = (S((H,), jnp.float32), S((H * d,), jnp.float32))
        for dt in (jnp.bfloat16, jnp.float32):  # prefill: A1, A2, B
            jax.eval_shape(lambda q, k, v, f, b, s0, a, dtb: kda.chunk(q, k, v, f, b, cu, s0, A_log=a, dt_bias=dtb,
                                                                       gate_form="lower_bound"),
                           *[S((1, T, H, d), dt)] * 3, S((1, T, H, d), jnp.float32), S((1, T, H), jnp.float32),
                           S((2, H, d, d), jnp.float32), *gate)
        jax.eval_shape(lambda q, k, v, f, b, pool, slots, a, dtb: kda.recurrent(
            q, k, v, f, b, pool, slots, A_log=a, dt_bias=dtb, gate_form="lower_bound"),
                       *[S((64, 1, H, d), jnp.bfloat16)] * 3, S((64, 1, H, d), jnp.float32),
                       S((64, 1, H), jnp.float32), S((80, H, d, d), jnp.float32), S((64,), jnp.int32), *gate)
        for D in (2304, 7168):  # RMSNorm at Kimi-Linear's and K3.1's widths, 32 decode rows
            jax.eval_shape(lambda x, w: norm.rmsnorm(x, w, 1e-6, "gpu"), S((32, 1, D), jnp.bfloat16),
                           S((D,), jnp.bfloat16))
        # the whole decode step after the projections at Kimi-Linear's 32 heads of 128, 32 sequences (bf16)
        P, K = 32 * 128, 4
        jax.eval_shape(lambda x, f, b, g, c, a, dtb, on, pools, slots: kda.decode_step(
            x, f, b, g, c, a, dtb, on, pools, slots, gate_form="plain"),
                       (S((32, P), jnp.bfloat16),) * 3, S((32, P), jnp.float32), S((32, 32), jnp.float32),
                       S((32, P), jnp.float32), (S((K, P), jnp.float32),) * 3, S((32,), jnp.float32),
                       S((P,), jnp.float32), S((128,), jnp.float32),
                       (S((33, 32, 128, 128), jnp.float32),) + (S((33, K - 1, P), jnp.bfloat16),) * 3,
                       S((32,), jnp.int32))
        B, k = 32, 2048  # sparse MLA at K3.1's latent (512 + 64), top-2048: exact default and the storage presets
        for dt in ("bf16", "fp8", "nvfp4"):
            fmt = Q.LatentFormat(dt, 512, 64)
            parts = tuple(S((4096, 64, p.width), p.dtype) for p in fmt.parts)
            wide = [(96, mla.storage_preset(B, 96))] if backend == "cuda" else []  # minutes on gfx942
            for H, kw in [(16, {}), (16, mla.storage_preset(B, 16))] + wide:
                jax.eval_shape(lambda q, p, bt, idx: mla.decode(q, p, bt, idx, fmt=fmt, scale=0.07, value_dim=512,
                                                                **kw),
                               S((B, H, 576), jnp.float32), parts, S((B, 512), jnp.int32), S((B, k), jnp.int32))
        for dt in ("bf16", "fp8"):  # its causal mode (dense MLA decode) at Kimi-Linear's 32 heads, 8K-position tables
            fmt = Q.LatentFormat(dt, 512, 64)
            parts = tuple(S((4096, 64, p.width), p.dtype) for p in fmt.parts)
            for kw in [{}] + ([mla.storage_preset(B, 32)] if backend == "cuda" else []):  # 128 heads: see `wide`
                jax.eval_shape(lambda q, p, bt, pos: mla.causal_decode(q, p, bt, pos, fmt=fmt, scale=0.07,
                                                                       value_dim=512, **kw),
                               S((B, 32, 576), jnp.float32), parts, S((B, 128), jnp.int32), S((B,), jnp.int32))

    with mock.patch.object(tc, "_gpu_launch", record):
        preset_launches() if presets else default_launches()
    target = GPUTarget(backend, int(arch) if backend == "cuda" else arch, warp)
    out = []
    for args, kw in launches:
        c = tc.compile_launch(target, args, **kw)
        binary = "ptx" if backend == "cuda" else "amdgcn"
        out.append(dict(name=kw["name"], shared=c.metadata.shared, wgmma="wgmma" in c.asm.get(binary, ""),
                        fp8_dot=kw["constexprs"].get("CDT") == 2, mxfp4=kw["constexprs"].get("QUANT") is True,
                        prmt="prmt.b32" in c.asm.get(binary, "")))
    print("RESULT" + json.dumps(out))
""")


def _compile(backend: str, arch: str, warp: int, *mode: str) -> list[dict]:
    # importing jax_triton (earlier tests in this worker may have) sets TRITON_CACHE_DIR to "", which Triton's own
    # compile rejects ("Could not create or locate cache dir"): the subprocess gets Triton's default cache instead
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not (k == "TRITON_CACHE_DIR" and not v)}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT, backend, arch, str(warp), *mode], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


def test_native_kernels_compile_for_hopper():
    res = _compile("cuda", "90", 32)
    assert {r["name"] for r in res} == {"dsa_indexer_scores_triton", "moe_grouped_matmul_triton", "kda_intra_rows",
                                        "kda_intra_wu", "kda_state", "kda_decode", "kda_decode_step",
                                        "sparse_mla_decode_triton", "sparse_mla_merge_triton", "moe_select_experts",
                                        "moe_slot_tile_plan", "rmsnorm"}
    assert len(res) == 57
    too_big = [r for r in res if r["shared"] > HOPPER_SHARED]
    assert not too_big, too_big
    assert all(r["wgmma"] for r in res if r["fp8_dot"])  # the fp8 codes go to Hopper's wgmma as stored
    mxfp4 = [r for r in res if r["mxfp4"]]
    assert mxfp4 and all(r["prmt"] for r in mxfp4)  # the MXFP4 decode is the PTX byte-permute sequence on NVIDIA


def test_every_preset_compiles_for_hopper():
    """Every opt-in preset of the indexer (`FAST`) and sparse MLA (`WIDE`) at K3.1 widths with fp8 keys / rows,
    compiled for sm_90 (each preset names a combination of knobs the default launches above do not all reach), within
    Hopper's shared memory."""
    from pallas_kernels.indexer import gpu_triton as ix
    from pallas_kernels.mla import sparse_gpu_triton as mla

    res = _compile("cuda", "90", 32, "presets")
    names = [r["name"] for r in res]
    assert names.count("dsa_indexer_scores_triton") == len(ix.FAST)
    assert names.count("sparse_mla_decode_triton") == len(mla.WIDE)
    too_big = [r for r in res if r["shared"] > HOPPER_SHARED]
    assert not too_big, too_big
    assert all(r["wgmma"] for r in res if r["fp8_dot"])


def test_native_kernels_compile_for_cdna3():
    try:
        res = _compile("hip", "gfx942", 64)
    except AssertionError as e:  # a triton wheel without the AMD backend or its linker
        if "amd" in str(e).lower() and ("No module" in str(e) or "not found" in str(e)):
            pytest.skip("this triton has no AMD backend")
        raise
    assert len(res) == 47
    assert any(r["mxfp4"] for r in res)  # compiled on the arithmetic decode (no PTX on AMD)


def test_a_launch_tells_an_nvidia_gpu_from_jaxs_gpu_client(monkeypatch):
    """jax-triton launches compile the PTX paths (the MXFP4 decode) in only where `_device_is_nvidia()`: it reads JAX's
    GPU client -- CUDA or ROCm -- before Triton's driver, whose lookup can fail where JAX's GPU works."""
    import pallas_kernels.triton_call as tc

    class Client:
        def __init__(self, platform, version):
            self.platform, self.platform_version = platform, version

    class Device:
        def __init__(self, client):
            self.client = client

    try:
        for platform, version, nvidia in (("cuda", "cuda 13000", True), ("rocm", "rocm 60400", False)):
            monkeypatch.setattr(tc.jax, "devices", lambda backend=None, c=Client(platform, version): [Device(c)])
            tc._device_is_nvidia.cache_clear()
            assert tc._device_is_nvidia() is nvidia
    finally:
        tc._device_is_nvidia.cache_clear()


def test_a_legacy_triton_call_becomes_the_ffi_call_on_the_same_buffers():
    """`triton_ffi.as_ffi_call` turns jax-triton's legacy custom call (the compressed kernel proto in backend_config)
    into jaxlib's typed-FFI Triton call, which XLA's command buffers can capture: the proto moves to the `opaque`
    attribute byte for byte, and operands, results, layouts and the in-place alias stay as they were."""
    import zlib

    import jax
    import jax.numpy as jnp
    from jax.extend.core import Primitive
    from jax._src.interpreters import mlir

    from pallas_kernels import triton_ffi

    proto = zlib.compress(b"kernel-call proto \x00\x01\xff bytes")
    prim = Primitive("fake_triton_launch")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda x, y: [jax.core.ShapedArray(x.shape, x.dtype)])

    def legacy_then_ffi(ctx, x, y):
        out_type = mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
        legacy = mlir.custom_call(triton_ffi.LEGACY_TARGET, result_types=[out_type], operands=[x, y],
                                  backend_config=proto, api_version=2,
                                  operand_output_aliases={1: 0}, operand_layouts=[(0,), (0,)], result_layouts=[(0,)])
        return triton_ffi.as_ffi_call(legacy, "my_kernel")

    mlir.register_lowering(prim, legacy_then_ffi, platform="cpu")
    x = jnp.zeros(8, jnp.float32)
    text = jax.jit(lambda a, b: prim.bind(a, b)[0]).lower(x, x).as_text()
    assert f"@{triton_ffi.FFI_TARGET}(" in text and f"@{triton_ffi.LEGACY_TARGET}(" not in text
    assert 'name = "my_kernel"' in text and "opaque = " in text
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 1" \
           in text
    assert "operand_layouts" in text and "result_layouts" in text
    # the proto itself, as MLIR escapes it in the opaque string
    escaped = "".join(chr(c) if 32 <= c < 127 and chr(c) not in '"\\' else f"\\{c:02X}" for c in proto)
    assert escaped in text
    assert not triton_ffi.ffi_target_registered()  # a CPU jaxlib: launches would stay legacy
