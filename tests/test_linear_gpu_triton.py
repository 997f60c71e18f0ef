"""The decode-size projection kernel (`pallas_kernels.linear_gpu_triton.skinny_matmul`): y = x @ w with float32
accumulation for 1 … 64 rows, against its definition `jnp.dot` (`reference`).

CPU: Triton's interpreter on small shapes, covering one and many rows, a K run that ends past K (masked), N not a
multiple of the column block, explicit tiles, and the refusal of shapes it does not take. GPU (`-m gpu`): Kimi-Linear-
48B's projection widths at 1, 8 and 32 rows.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import linear_gpu_triton as L


def operands(M, K, N, seed=0, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), dtype)
    return x, w


def assert_close(got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.max(np.abs(got - want)) <= rtol * np.max(np.abs(want))


@pytest.mark.parametrize("M,K,N,tiles", [
    (1, 256, 192, None),           # one row: 3 column blocks, 2 K runs
    (5, 384, 80, None),            # N past a whole column block; the last K run ends past K
    (32, 512, 128, (64, 128, 4)),  # explicit tiles
    (64, 160, 48, (16, 32, 3)),    # the most rows; a K run of 64 over K = 160 in 3 runs (the last masked)
])
def test_equals_the_definition_in_the_interpreter(M, K, N, tiles):
    x, w = operands(M, K, N)
    got = L.skinny_matmul(x, w, interpret=True, tiles=tiles, out_dtype=jnp.float32)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    assert_close(got, L.reference(x, w, out_dtype=jnp.float32), 1e-5)
    assert L.skinny_matmul(x.astype(jnp.bfloat16), w, interpret=True, tiles=tiles).dtype == jnp.bfloat16


def test_the_tile_plan_depends_on_the_weight_only():
    """(BN, BK, SPLIT) come from (K, N): every batch size sums a row over the same K runs. Enough programs to cover
    the GPU (≈ 264) where K allows, never a run shorter than one BK step."""
    assert L.plan(2304, 4096) == (64, 128, 8)  # 64 column blocks × 8 runs of 384
    assert L.plan(4096, 2304) == (64, 128, 8)
    assert L.plan(2304, 163840) == (64, 128, 1)  # the LM head has 2,560 column blocks already
    BN, BK, split = L.plan(256, 64)
    assert split * BK <= 256


def test_refuses_what_it_does_not_take():
    assert L.supports(1, 2304, 4096, jnp.bfloat16) and L.supports(64, 16, 16, jnp.float16)
    assert not L.supports(65, 2304, 4096, jnp.bfloat16)  # a matmul: XLA's tiling
    assert not L.supports(8, 2304, 4096, jnp.float32)  # 16-bit weights only
    assert not L.supports(8, 2300, 4096, jnp.bfloat16)
    x, w = operands(2, 100, 64)
    with pytest.raises(ValueError, match="skinny_matmul takes"):
        L.skinny_matmul(x, w, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 32])
@pytest.mark.parametrize("K,N", [(2304, 4096), (4096, 2304), (2304, 1024)])
def test_equals_the_definition_on_the_device(M, K, N):
    x, w = operands(M, K, N, seed=M)
    assert_close(L.skinny_matmul(x, w, out_dtype=jnp.float32), L.reference(x, w, out_dtype=jnp.float32), 1e-4)


def test_the_model_through_the_kernel_equals_xla_dot():
    """The tiny model in bfloat16 with every decode-size projection on the kernel (Triton's interpreter): a
    20-token prefill of 2 prompts (40 rows) and decode steps (2 rows) give XLA's dot's logits, to bf16 rounding of
    the projections' outputs, and the same greedy tokens. The kernel takes the projections it supports (the count
    is checked) and leaves the rest to XLA."""
    from kimi_jax.config import get_preset
    from kimi_jax.kernels import KernelConfig
    from kimi_jax.model import random_model
    from sharding import linear as linear_sharded

    cfg = get_preset("tiny")
    ids = np.random.RandomState(3).randint(0, 1000, (2, 24))
    logits = {}
    for kind in ("reference", "gpu_interpret"):
        model = random_model(cfg, dtype=jnp.bfloat16, kernels=KernelConfig(linear=kind))
        lg, cache = model.prefill(ids[:, :20], 24)
        steps = [np.asarray(lg, np.float32)]
        for t in range(20, 24):
            lg, cache = model.decode_step(cache, ids[:, t])
            steps.append(np.asarray(lg, np.float32))
        logits[kind] = steps
    for ref, got in zip(logits["reference"], logits["gpu_interpret"]):
        assert np.max(np.abs(got - ref)) <= 2e-2 * np.max(np.abs(ref))
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    ctx = linear_sharded.ForwardContext(kernels=KernelConfig(linear="gpu_interpret"))
    assert linear_sharded.backend(ctx, 2, jnp.zeros((cfg.hidden_size, 128), jnp.bfloat16)) == "gpu_interpret"
    assert linear_sharded.backend(ctx, 2, jnp.zeros((cfg.hidden_size, 128), jnp.float32)) == "reference"
    assert linear_sharded.backend(ctx, 65, jnp.zeros((cfg.hidden_size, 128), jnp.bfloat16)) == "reference"
