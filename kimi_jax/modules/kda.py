"""KDA layer (docs/model.md §4): projections, short causal convs, per-channel gated delta rule, gated per-head norm.

Cache per sequence (`KDACache`): recurrent state `[B, H, dk, dv]` float32 and the conv tails of q, k, v
(`[B, K−1, P]` each). Prefill (T > 1) runs the chunked op, decode (T == 1) the recurrent op; both are the ops of
`pallas_kernels.kda`, so swapping in a kernel changes nothing here.

Speculative verification (`defer=True`, docs/model.md §12): the layer runs T tokens (the last accepted token + drafts)
with the recurrent op but does not commit a state; it returns a `KDAPending` (the old cache and the T tokens' inputs to
the recurrence and the convs). Once the engine knows how many of the T tokens each sequence keeps, `commit` replays
the recurrence over just those (the rest made inert: no decay, no write) and cuts the conv tails there. This costs
one more pass over the state instead of keeping T states per layer alive until acceptance.

Every op runs through the partitioned KDA entry point (`sharding.kda`), which takes the `ForwardContext`: heads
over the tensor axis, and under the token-split prefill (this device holds a contiguous slice of the prompt) the
convs take their K−1 halo from the previous device, padded tail tokens are made inert (g = 0, β = 0), and the
slices' state transitions are combined across devices (exact: every device ends with the whole prompt's state).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.kda import reference as kda_ops
from sharding import kda as kda_sharded
from sharding.context import ForwardContext

from ..config import KDAConfig
from .layers import Linear, normal_init, param_key


class KDACache(NamedTuple):
    state_bhkv: jax.Array  # float32
    q_tail_bkp: jax.Array
    k_tail_bkp: jax.Array
    v_tail_bkp: jax.Array

    @staticmethod
    def zeros(batch: int, cfg: KDAConfig, dtype) -> "KDACache":
        H, d, K = cfg.num_heads, cfg.head_dim, cfg.conv_kernel
        tail = lambda: jnp.zeros((batch, K - 1, H * d), dtype)  # three distinct buffers (the cache is donated)
        return KDACache(jnp.zeros((batch, H, d, d), jnp.float32), tail(), tail(), tail())


class KDASlots(NamedTuple):
    """A batch's view of a KDA cache kept per slot, for decode: `pool` a `KDACache` over all S slots, `slots` `[B]`
    int32 distinct slot ids. Row b reads and writes `pool`'s slot `slots[b]`: the recurrent kernel updates its state
    in place, the conv tails are read by row and written back by row, so a step over a few of the slots moves only
    their rows (no gathered copy of the states going in and back out). The layer returns a `KDASlots` over the
    updated pool."""

    pool: KDACache
    slots: jax.Array


class KDAPending(NamedTuple):
    """A verify pass's uncommitted KDA update: the cache before it and, for its T tokens, the recurrence inputs
    (q, k `[B, T, H, dk]` L2-normalised, v `[B, T, H, dv]`, log-decay g `[B, T, H, dk]` float32, beta `[B, T, H]`
    float32) and the raw projections that enter the convs (`[B, T, P]`, the tails' dtype)."""

    old: KDACache
    q_bthk: jax.Array
    k_bthk: jax.Array
    v_bthv: jax.Array
    g_bthk: jax.Array
    beta_bth: jax.Array
    q_in_btp: jax.Array
    k_in_btp: jax.Array
    v_in_btp: jax.Array


def commit(pending: KDAPending, keep_b, ctx: ForwardContext = ForwardContext()) -> KDACache:
    """The cache after the first `keep_b[b]` of the verify pass's T tokens (0 ≤ keep ≤ T, int `[B]`).

    State: the recurrent op over all T steps with steps t ≥ keep made inert (g = 0, β = 0 leave the state as it is),
    from the old state. Conv tails: the last K−1 inputs of (old tail ++ the kept tokens' projections)."""
    old = pending.old
    B, T = pending.beta_bth.shape[:2]
    kept_bt = jnp.arange(T, dtype=jnp.int32)[None, :] < jnp.asarray(keep_b, jnp.int32).reshape(B, 1)
    g = jnp.where(kept_bt[:, :, None, None], pending.g_bthk, 0.0)
    beta = jnp.where(kept_bt[:, :, None], pending.beta_bth, 0.0)
    _, state = kda_sharded.recurrent(ctx, pending.q_bthk, pending.k_bthk, pending.v_bthv, g, beta, old.state_bhkv)
    Km1 = old.q_tail_bkp.shape[1]
    rows_bj = jnp.asarray(keep_b, jnp.int32).reshape(B, 1) + jnp.arange(Km1, dtype=jnp.int32)[None, :]

    def tail(old_tail, new_btp):
        xx = jnp.concatenate([old_tail.astype(new_btp.dtype), new_btp], axis=1)  # [B, K−1+T, P]
        return jnp.take_along_axis(xx, rows_bj[:, :, None], axis=1).astype(old_tail.dtype)

    return KDACache(state, tail(old.q_tail_bkp, pending.q_in_btp), tail(old.k_tail_bkp, pending.k_in_btp),
                    tail(old.v_tail_bkp, pending.v_in_btp))


class KimiDeltaAttention(nnx.Module):
    def __init__(self, hidden: int, cfg: KDAConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        H, d, K = cfg.num_heads, cfg.head_dim, cfg.conv_kernel
        P = H * d
        self.q_proj = Linear(hidden, P, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(hidden, P, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(hidden, P, rngs=rngs, dtype=dtype)
        # conv kernels `[K, P]`, tap K−1 = current token (checkpoints store [P, 1, K]); float32 as released
        self.q_conv1d = nnx.Param(normal_init(rngs, (K, P), K ** -0.5, jnp.float32))
        self.k_conv1d = nnx.Param(normal_init(rngs, (K, P), K ** -0.5, jnp.float32))
        self.v_conv1d = nnx.Param(normal_init(rngs, (K, P), K ** -0.5, jnp.float32))
        self.f_a_proj = Linear(hidden, d, rngs=rngs, dtype=dtype)
        self.f_b_proj = Linear(d, P, rngs=rngs, dtype=dtype)
        self.b_proj = Linear(hidden, H, rngs=rngs, dtype=dtype)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(param_key(rngs), (H,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(jax.random.normal(param_key(rngs), (P,), jnp.float32) * 0.5 - 2.0)
        self.o_norm = nnx.Param((1.0 + 0.1 * jax.random.normal(param_key(rngs), (d,))).astype(jnp.float32))
        if cfg.output_gate_rank is None:
            self.g_proj = Linear(hidden, P, rngs=rngs, dtype=dtype)
        else:
            self.g_a_proj = Linear(hidden, cfg.output_gate_rank, rngs=rngs, dtype=dtype)
            self.g_b_proj = Linear(cfg.output_gate_rank, P, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(P, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x_btd, cache: Optional[KDACache] = None, *, ctx: ForwardContext = ForwardContext(),
                 use_chunk: Optional[bool] = None, defer: bool = False):
        """x `[B, T, D]` (after input_layernorm) -> (out `[B, T, D]`, new KDACache).

        `defer`: speculative verification — run the T tokens with the recurrent op and return a `KDAPending`
        instead of the new cache (`commit` turns it into one once the kept length is known). `cache` a `KDASlots`:
        decode against those slots of a pool, returning the `KDASlots` of the updated pool."""
        cfg = self.cfg
        B, T, _ = x_btd.shape
        H, d = cfg.num_heads, cfg.head_dim
        slots = None
        if isinstance(cache, KDASlots):
            if defer or use_chunk or ctx.token_split:
                raise ValueError("a KDASlots cache is for decode (the recurrent op), not prefill or verification")
            pool, slots = cache
            use_chunk = False
            if T == 1 and kda_sharded.decode_step_splits(ctx, H, d):
                return self._decode_step(x_btd, pool, slots, ctx)
            cache = KDACache(pool.state_bhkv, pool.q_tail_bkp[slots], pool.k_tail_bkp[slots], pool.v_tail_bkp[slots])
        if cache is None:
            cache = KDACache.zeros(B, cfg, x_btd.dtype)
        if defer and ctx.context_parallel:
            raise ValueError("speculative verification (defer=True) does not run under context parallelism")

        # q, k, v enter the delta rule in the activation dtype, as transformers' conv (its output cast back to the
        # hidden states' dtype) and fla's in-kernel l2norm leave them: in bf16 the GPU kernels' products run on
        # the tensor cores at full rate; in float32 (the exactness tests) nothing changes
        act = x_btd.dtype

        def branch(proj, conv_w, tail):
            """-> (conv + SiLU output `[B, T, H, d]` in `act`, new tail, the projection that entered the conv)."""
            x_btp = proj(x_btd)
            y, new_tail = kda_sharded.causal_conv(ctx, x_btp, conv_w[...], tail)
            return jax.nn.silu(y).astype(act).reshape(B, T, H, d), new_tail, x_btp

        q, q_tail, q_in = branch(self.q_proj, self.q_conv1d, cache.q_tail_bkp)
        k, k_tail, k_in = branch(self.k_proj, self.k_conv1d, cache.k_tail_bkp)
        v, v_tail, v_in = branch(self.v_proj, self.v_conv1d, cache.v_tail_bkp)
        q, k = kda_ops.l2norm(q).astype(act), kda_ops.l2norm(k).astype(act)
        f = self.f_b_proj(self.f_a_proj(x_btd), out_dtype=jnp.float32).reshape(B, T, H, d)
        g = kda_ops.gate(f, self.A_log[...][:H], self.dt_bias[...].reshape(H, d), cfg.gate_form,
                         cfg.gate_lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x_btd, out_dtype=jnp.float32))
        if use_chunk is None:
            use_chunk = T > 1 and not defer
        pending = None
        if defer:
            pending = KDAPending(cache, q, k, v, g, beta, q_in.astype(cache.q_tail_bkp.dtype),
                                 k_in.astype(cache.k_tail_bkp.dtype), v_in.astype(cache.v_tail_bkp.dtype))
        if ctx.token_split:
            real_t = ctx.token_mask(T)  # [T] bool: False on the padding after the prompt
            g = jnp.where(real_t[None, :, None, None], g, 0.0)  # inert steps: no decay, no write
            beta = jnp.where(real_t[None, :, None], beta, 0.0)
        if use_chunk or ctx.token_split:
            o, state = kda_sharded.chunk(ctx, q, k, v, g, beta, cache.state_bhkv)
        else:
            o, state = kda_sharded.recurrent(ctx, q, k, v, g, beta, cache.state_bhkv, slot_ids=slots)
        # gated per-head RMSNorm, float32
        o = kda_ops.gated_rmsnorm(o, self._output_gate(x_btd).reshape(B, T, H, d), self.o_norm[...],
                                  cfg.o_norm_eps)
        out = self.o_proj(o.reshape(B, T, H * d).astype(x_btd.dtype))
        if pending is not None:
            return out, pending
        if slots is not None:
            put = lambda pool_tail, tail: pool_tail.at[slots].set(tail.astype(pool_tail.dtype))
            return out, KDASlots(KDACache(state, put(pool.q_tail_bkp, q_tail), put(pool.k_tail_bkp, k_tail),
                                          put(pool.v_tail_bkp, v_tail)), slots)
        return out, KDACache(state, q_tail, k_tail, v_tail)

    def _output_gate(self, x):
        """The output gate's logits `[..., H·dv]` float32."""
        if self.cfg.output_gate_rank is None:
            return self.g_proj(x, out_dtype=jnp.float32)
        return self.g_b_proj(self.g_a_proj(x), out_dtype=jnp.float32)

    def _decode_step(self, x_btd, pool: KDACache, slots, ctx: ForwardContext):
        """One token per sequence against the slots `slots [B]` of `pool`: the projections, then the rest of the layer
        up to o_proj as one op (`sharding.kda.decode_step`; one kernel on a GPU) -> (out `[B, 1, D]`, the
        `KDASlots` of the updated pool)."""
        cfg = self.cfg
        B, _, D = x_btd.shape
        x = x_btd.reshape(B, D)
        o, pools = kda_sharded.decode_step(
            ctx, (self.q_proj(x), self.k_proj(x), self.v_proj(x)),
            self.f_b_proj(self.f_a_proj(x), out_dtype=jnp.float32), self.b_proj(x, out_dtype=jnp.float32),
            self._output_gate(x), (self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]),
            self.A_log[...][:cfg.num_heads], self.dt_bias[...], self.o_norm[...],
            (pool.state_bhkv, pool.q_tail_bkp, pool.k_tail_bkp, pool.v_tail_bkp), slots,
            gate_form=cfg.gate_form, lower_bound=cfg.gate_lower_bound, o_norm_eps=cfg.o_norm_eps)
        return self.o_proj(o).reshape(B, 1, D), KDASlots(KDACache(*pools), slots)
