"""Session 14: the XLA on each side of the Mosaic MXFP4 MoE kernel, piece by piece, at K3 decode shapes (E = 112,
K = 3584, N = 3072, 8 and 32 rows per expert), with candidate rewrites of the unpadding. No Mosaic kernel runs."""
import sys

sys.path.insert(0, "bench")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import pipelined_seconds  # noqa: E402
from pallas_kernels.moe import mgpu_mxfp4 as mm  # noqa: E402

E, K, N = 112, 3584, 3072


def t_us(f, *a):
    jax.block_until_ready(f(*a))
    return pipelined_seconds(f, *a, reps=20, rounds=5) * 1e6


for rows in (8, 32):
    M = E * rows
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
    cuts = jnp.sort(jax.random.randint(jax.random.key(1), (E - 1,), 0, M + 1))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, cuts.dtype), cuts, jnp.full((1,), M, cuts.dtype)])).astype(jnp.int32)
    plan = jax.jit(lambda g: mm._pad_plan(g, M, E, rows))
    src, tg, nt, pad_row, live = plan(sizes)
    m_pad = src.shape[0]
    out_t = jax.random.normal(jax.random.key(2), (N, m_pad), jnp.float32)
    res = {
        "pad_plan": t_us(plan, sizes),
        "prepare_rows": t_us(jax.jit(lambda a, g: mm.prepare_rows(a, g, E, rows)), x, sizes),
        "row gather + planes (plan given)": t_us(jax.jit(
            lambda a, s: mm._planes_in_contraction_order(a.at[s].get(mode="fill", fill_value=0))), x, src),
        "unpad (current)": t_us(jax.jit(lambda o, p, l: mm.unpad_output(o, p, l, jnp.bfloat16)), out_t, pad_row, live),
        "unpad: transpose, barrier, row take": t_us(jax.jit(lambda o, p, l: jnp.where(
            l[:, None], jnp.take(jax.lax.optimization_barrier(o.T), p, axis=0), 0).astype(jnp.bfloat16)),
            out_t, pad_row, live),
        "unpad: bf16 transpose, barrier, row take": t_us(jax.jit(lambda o, p, l: jnp.where(
            l[:, None], jnp.take(jax.lax.optimization_barrier(o.T.astype(jnp.bfloat16)), p, axis=0), 0)),
            out_t, pad_row, live),
        "transpose alone": t_us(jax.jit(lambda o: o.T.astype(jnp.bfloat16)), out_t),
        "copy of outT (floor)": t_us(jax.jit(lambda o: o * 2), out_t),
    }
    a = np.asarray(mm.unpad_output(out_t, pad_row, live, jnp.bfloat16).astype(jnp.float32))
    b = np.asarray(jnp.where(live[:, None], jnp.take(out_t.T, pad_row, axis=0), 0).astype(jnp.bfloat16).astype(jnp.float32))
    print(f"rows/expert {rows}: M {M}, m_pad {m_pad}, unpad variants agree: {np.array_equal(a, b)}")
    for k, v in res.items():
        print(f"  {k:42s} {v:8.1f} us")
