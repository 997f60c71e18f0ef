"""The routed-expert case the expert-parallel scripts share (tests/test_moe_kernels.py, test_expert_overlay.py,
test_cp_overlay.py run them in subprocesses on 8 fake CPU devices; `tests/` is on their PYTHONPATH)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import reference


def situ(g, u):
    """SiTU (SPEC §7) at K3's betas: 4·tanh(g/4)·σ(g) · 25·tanh(u/25)."""
    return 4.0 * jnp.tanh(g / 4.0) * jax.nn.sigmoid(g) * (25.0 * jnp.tanh(u / 25.0))


def routed_case(N: int, D: int, F: int, E: int, k: int, *, gate_scale: float, down_scale: float, seed: int = 0):
    """N rows routed to k distinct experts of E each (the first 12 rows' first choice is expert 3: one hot
    expert), random float32 weights gate / up `[E, D, F]` / gate_scale and down `[E, F, D]` / down_scale.
    Returns (rng after drawing them, x `[N, D]`, idx int32 `[N, k]`, wt `[N, k]`, wg, wu, wd, the one-device
    reference `[N, D]` as numpy)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    idx = idx.at[:12, 0].set(3)
    wt = jnp.asarray(rng.random((N, k)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, D, F)) / gate_scale, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, D)) / down_scale, jnp.float32)
    ref = np.asarray(reference.expert_ffn(x, idx, wt, wg, wu, wd, situ))
    return rng, x, idx, wt, wg, wu, wd, ref


def check(tag: str, out, want, tol: float = 1e-5) -> float:
    """Max error relative to the reference's largest value; asserts it is below tol and prints '<tag> ok'."""
    err = float(np.abs(np.asarray(out) - want).max() / np.abs(want).max())
    assert err < tol, (tag, err)
    print(tag, "ok", err)
    return err
