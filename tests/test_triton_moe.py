"""The GPU MoE grouped matmul (native Triton, `pallas_kernels.moe.gpu_triton`) against `jax.lax.ragged_dot`.

CPU: Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at the bars of tests/test_moe_kernels.py:
max |error| ≤ 1e-5 of max |reference| for one matmul (bf16 and MXFP4, whose decode is exact), 2e-2 for the expert
FFN (h rounded to bf16 after differently ordered sums), uncovered rows exactly zero, the same bits twice.
`gpu`-marked tests run it through jax-triton: `JAX_PLATFORMS=cuda python -m pytest tests/test_triton_moe.py -m gpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

from test_moe_kernels import M_ROWS, SIZES, _device_mxfp4_case, _ffn_case, _rel, situ  # noqa: E402

from pallas_kernels.moe import gpu_triton, mxfp4 as mx, ops, reference  # noqa: E402
from pallas_kernels.moe.gpu_triton import GpuConfig  # noqa: E402


def _weights(kind, E, K, N, seed=3):
    if kind == "bf16":
        w = jnp.asarray(np.random.default_rng(seed).standard_normal((E, K, N)) / 20, jnp.bfloat16)
        return w, w
    w = mx.random_weight(jax.random.key(seed), E, K, N)
    return w, mx.dequantize(w, jnp.bfloat16)


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
@pytest.mark.parametrize("cfg", [GpuConfig(bm=32, bn=64, bk=128), GpuConfig(bm=16, bn=64, bk=64, swap_ab=True),
                                 GpuConfig(bm=32, bn=32, bk=64, bm_small=16)])
def test_triton_grouped_matmul_matches_ragged_dot(kind, cfg):
    """Several contraction steps, an empty group, uncovered tail rows (zeros), short and full tiles."""
    E, K, N = len(SIZES), 256, 128
    x = jnp.asarray(np.random.default_rng(2).standard_normal((M_ROWS, K)), jnp.bfloat16)
    w, w_ref = _weights(kind, E, K, N)
    gs = jnp.asarray(SIZES, jnp.int32)
    want = jax.jit(reference.grouped_matmul)(x, w_ref, gs)
    got = jax.jit(lambda a, b, g: ops.grouped_matmul(a, b, g, backend="gpu", interpret=True, config=cfg))(x, w, gs)
    assert got.shape == (M_ROWS, N) and got.dtype == jnp.float32
    assert _rel(got, want) < 1e-5
    assert not np.asarray(got[sum(SIZES):]).any()


def test_triton_grouped_matmul_pads_fewer_rows_than_a_tile_and_gates():
    """M < bm (x padded for the row window), bf16 output, and two weights through the activation (in XLA)."""
    E, K, N = 3, 128, 64
    x = jax.random.normal(jax.random.key(7), (10, K), jnp.bfloat16)
    (wg, wg_ref), (wu, wu_ref) = _weights("bf16", E, K, N, 4), _weights("mxfp4", E, K, N, 5)
    gs = jnp.asarray([4, 0, 5], jnp.int32)
    want = situ(reference.grouped_matmul(x, wg_ref, gs), reference.grouped_matmul(x, wu_ref, gs))
    got = ops.gated_grouped_matmul(x, wg, wu, gs, situ, backend="gpu", interpret=True,
                                   config=GpuConfig(bm=16, bn=64, bk=64))
    assert got.dtype == jnp.bfloat16 and _rel(got, want) < 1e-2  # bf16 output
    assert not np.asarray(got[9:]).any()


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_triton_expert_ffn_matches_reference_and_is_deterministic(kind):
    x, idx, wt, ws, ws_ref = _ffn_case(kind)
    want = reference.expert_ffn(x, idx, wt, *ws_ref, situ)
    configs = (GpuConfig(bm=16, bn=64, bk=128), GpuConfig(bm=16, bn=128, bk=64))
    f = jax.jit(lambda *a: ops.expert_ffn(*a, situ, backend="gpu", interpret=True, configs=configs))
    got = f(x, idx, wt, *ws)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel(got, want) < 2e-2
    again = f(x, idx, wt, *ws)
    assert np.array_equal(np.asarray(got).view(np.int32), np.asarray(again).view(np.int32))


def test_triton_is_another_name_of_the_gpu_backend():
    assert ops.resolve_backend("triton", quantized=True) == "gpu" and ops.resolve_backend("triton") == "gpu"
    assert ops.resolve_backend("gpu") == "gpu" and "gpu" in ops.FUSE_GATE_UP
    with pytest.raises(ValueError, match="bm_small"):
        gpu_triton.grouped_matmul(jnp.zeros((32, 64), jnp.bfloat16), (jnp.zeros((2, 64, 32), jnp.bfloat16),),
                                  jnp.asarray([16, 16]), config=GpuConfig(bm=32, bm_small=32), interpret=True)
    with pytest.raises(ValueError, match="dequant"):  # the Pallas kernel's f16-trick / fp8 decodes are gone
        gpu_triton.grouped_matmul(jnp.zeros((32, 64), jnp.bfloat16), (mx.random_weight(jax.random.key(0), 2, 64, 32),),
                                  jnp.asarray([16, 16]), config=GpuConfig(bm=32, dequant="2d"), interpret=True)


# ------------------------------------------------------------------------------------------------ device

@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None, GpuConfig(bm=16, bn=64, bk=256), GpuConfig(bm=16, bn=64, bk=256, swap_ab=True),
                                 GpuConfig(bm=64, bn=128, bk=128), GpuConfig(bm=16, bn=64, bk=256, dequant="asm"),
                                 GpuConfig(bm=16, bn=64, bk=256, swap_ab=True, dequant="asm"),
                                 GpuConfig(bm=64, bn=128, bk=128, dequant="asm"),
                                 GpuConfig(bm=16, bn=64, bk=256, dequant="bf16")])
def test_gpu_triton_mxfp4_on_device(cfg):
    """Each MXFP4 decode compiled for the GPU (the PTX forms and the arithmetic one): the grouped matmul
    (decode-sized and larger groups, an empty one, uncovered tail rows) against ragged_dot on the exactly
    dequantised weights, and the model's expert FFN."""
    sizes, x, w, gs, want = _device_mxfp4_case()
    got = jax.jit(lambda a, b, g: ops.grouped_matmul(a, b, g, backend="gpu", config=cfg))(x, w, gs)
    assert _rel(got, want) < 1e-4
    assert not np.asarray(got[sum(sizes):]).any()
    if cfg is None:
        xf, idx, wt, ws, ws_ref = _ffn_case("mxfp4")
        ref = reference.expert_ffn(xf, idx, wt, *ws_ref, situ)
        out = jax.jit(lambda *a: ops.expert_ffn(*a, situ, backend="gpu"))(xf, idx, wt, *ws)
        assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_expert", [8, 146])
def test_gpu_triton_bf16_default_configs_on_device(rows_per_expert):
    """The default configs of both regimes (decode: swap_ab; prefill: 128-row tiles with 64-row tails)."""
    E, K, N = 16, 1024, 512
    sizes = np.random.default_rng(1).multinomial(E * rows_per_expert, np.ones(E) / E)
    M = int(sizes.sum()) + 5
    x = jax.random.normal(jax.random.key(2), (M, K), jnp.bfloat16)
    w, _ = _weights("bf16", E, K, N)
    gs = jnp.asarray(sizes, jnp.int32)
    want = jax.jit(reference.grouped_matmul)(x, w, gs)
    got = jax.jit(lambda a, b, g: ops.grouped_matmul(a, b, g, backend="gpu"))(x, w, gs)
    assert _rel(got, want) < 1e-4
    assert not np.asarray(got[int(sizes.sum()):]).any()
