"""Native Triton GPU kernel (launched through jax-triton; CPU tests: Triton's interpreter): a decode-size projection,
a few rows times a weight, `y [M, N] = x [M, K] @ w [K, N]` with float32 accumulation, for M ≤ 64.

Why: a decode step multiplies one to a few dozen rows by each weight matrix, so its time is the weight's bytes.
XLA's GPU compiler rewrites one row times a weight under 10M elements into a multiply and a column reduction over
the `[in, out]` weight, and runs 2-32 rows as a matmul tiled for large M; both read the weight at 0.2-0.35 of the
copy rate on an H100 (`bench/gemv.py`). This kernel reads each weight byte once, in wide contiguous tiles, with
enough programs in flight to cover the memory latency.

Grid (N / BN, SPLIT). Program (n, s) owns output columns [n·BN, (n+1)·BN) and the s-th of SPLIT equal runs of the
contraction axis; it walks its run BK at a time: x `[MP, BK]` (rows ≥ M masked to 0, MP = M padded to a power of
two ≥ 16, the smallest tensor-core dot) times w `[BK, BN]`, accumulated in float32. The SPLIT partial sums
`[SPLIT, MP, N]` float32 are added in XLA in a fixed order and cast. The reference is `reference` (jnp.dot with
float32 accumulation).

The tile settings depend on (K, N) only, never on M, so each row's products are summed over the same K runs
whatever the batch (the tensor cores' own summation inside one K step may still differ with MP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .triton_call import available as _launcher_available
from .triton_call import call, jit, tl

__all__ = ["MAX_ROWS", "available", "plan", "reference", "skinny_matmul", "supports"]

MAX_ROWS = 64  # beyond this a projection is a matmul, and XLA's tiling is the right one
TARGET_PROGRAMS = 264  # ≈ 2 per SM on an H100 / H200 (132 SMs)


def available() -> bool:
    return _launcher_available()


def supports(M: int, K: int, N: int, dtype) -> bool:
    """Whether the kernel takes this projection: 1 … MAX_ROWS rows, 16-bit weights, K and N multiples of 16."""
    return (1 <= M <= MAX_ROWS and K % 16 == 0 and N % 16 == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def plan(K: int, N: int) -> tuple[int, int, int]:
    """(BN, BK, SPLIT) for a `[K, N]` weight: BN = 64 output columns (128-byte rows of bf16), BK = 128 (each the
    largest power of two ≤ the dim where that is smaller: Triton's blocks are powers of two), and the K axis split
    until there are ≈ TARGET_PROGRAMS programs (at most K / BK runs)."""
    BN = min(64, 1 << (N.bit_length() - 1))
    BK = min(128, 1 << (K.bit_length() - 1))
    n_blocks = -(-N // BN)
    split = 1
    while n_blocks * split < TARGET_PROGRAMS and 2 * split * BK <= K:
        split *= 2
    return BN, BK, split


@jit
def _skinny_kernel(x_ptr, w_ptr, o_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, MP: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, K_RUN: tl.constexpr):
    """Program (column block n, K run s): o[s, :, n·BN : (n+1)·BN] = x[:, run] @ w[run, n·BN : (n+1)·BN] in float32,
    x `[M, K]`, w `[K, N]`, o `[SPLIT, MP, N]` float32 (rows ≥ M are zero)."""
    n = tl.program_id(0)
    s = tl.program_id(1)
    rows = tl.arange(0, MP)
    cols = n * BN + tl.arange(0, BN)
    acc = tl.zeros([MP, BN], tl.float32)
    for j in range(0, K_RUN // BK):
        ks = s * K_RUN + j * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + ks[:, None].to(tl.int64) * N + cols[None, :], mask=(ks[:, None] < K) & (cols[None, :] < N),
                    other=0.0)
        acc += tl.dot(x, w)
    out = (s * MP + rows[:, None]).to(tl.int64) * N + cols[None, :]
    tl.store(o_ptr + out, acc, mask=cols[None, :] < N)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "num_warps", "num_stages", "tiles"))
def skinny_matmul(x_mk, w_kn, *, out_dtype=None, interpret: bool = False, num_warps: int = 4, num_stages: int = 4,
                  tiles=None):
    """y `[M, N]` = x `[M, K]` @ w `[K, N]`, float32 accumulation, in `out_dtype` (default x's). x is cast to w's
    dtype (bf16 / f16) first, as `Linear` does. `tiles` = (BN, BK, SPLIT) overrides `plan(K, N)`; `interpret`:
    Triton's interpreter (CPU tests)."""
    M, K = x_mk.shape
    N = w_kn.shape[1]
    if not supports(M, K, N, w_kn.dtype):
        raise ValueError(f"skinny_matmul takes 1 … {MAX_ROWS} rows of a 16-bit [K, N] weight with K, N multiples "
                         f"of 16; got x {x_mk.shape}, w {w_kn.shape} {w_kn.dtype}")
    BN, BK, split = tiles or plan(K, N)
    if BN & (BN - 1) or BK & (BK - 1) or min(BN, BK) < 16:
        raise ValueError(f"tiles BN = {BN}, BK = {BK} must be powers of two ≥ 16")
    k_run = -(-K // (split * BK)) * BK  # each run a whole number of BK steps; the last one masked past K
    MP = max(16, 1 << (M - 1).bit_length())
    parts = call(x_mk.astype(w_kn.dtype), w_kn, kernel=_skinny_kernel, grid=(-(-N // BN), split),
                 out_shape=[jax.ShapeDtypeStruct((split, MP, N), jnp.float32)], interpret=interpret,
                 num_warps=num_warps, num_stages=num_stages, name="skinny_matmul_triton",
                 M=M, K=K, N=N, MP=MP, BN=BN, BK=BK, K_RUN=k_run)[0]
    total = parts[0]
    for i in range(1, split):  # a fixed order: the same sums for every M
        total = total + parts[i]
    return total[:M].astype(out_dtype or x_mk.dtype)


def reference(x_mk, w_kn, *, out_dtype=None):
    """The definition: `jnp.dot` with float32 accumulation, x cast to w's dtype (what `Linear` computes)."""
    y = jnp.dot(x_mk.astype(w_kn.dtype), w_kn, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x_mk.dtype)
