"""Expert parallelism: routed experts split over the mesh's expert axes (`sharding.mesh.expert_axes`: "model", or
("context", "model") for the expert overlay such as `expert=8,tensor=1,context=8`; as `sharding.rules` places
w1/w2/w3), tokens split over ("data", <expert axes>), the expert FFN run where the expert lives. Below, "the expert
group" is the devices that together hold one copy of every expert (one slice of the expert axes; size m), and a
device's rank in it counts context-major, the order in which `sharding.rules` splits the experts. Two dispatch
methods:

* "ragged" — each device sorts its own (token, slot) pairs by expert and sends each expert's rows to the device that
  owns it with `jax.lax.ragged_all_to_all`, one slice per expert (slice e goes to device e // E_local). The receive
  offsets are computed from an all-gather of the per-expert counts so that rows arrive grouped by local expert
  (and by source device within an expert): the receive buffer is already in grouped-matmul order, no second sort.
  The results travel back the same way, landing in the sender's sorted order; the combine is local. Traffic per
  device: its own N_local·k rows out and back. The receive buffer is sized for the worst case (every pair of every
  device on one device: m·N_local·k rows), so dispatch is dropless; the grouped matmul only computes the rows
  that arrived (its tile schedule skips the rest).
* "allgather" — all-gather the tokens (and routing) over the expert group, run the local experts on the pairs routed
  to them (rows of other devices' experts form the uncovered tail that the kernels skip), weight and sum each
  token's local slots, and reduce-scatter (`psum_scatter`) the partial sums back to token shards. Traffic per
  device: the gathered tokens in, a full fp32 partial sum out; no data-dependent sizes. Also the fallback where
  `ragged_all_to_all` does not lower (XLA:CPU), and the only choice when the tokens do not split over the expert
  group (then they stay replicated over it and the partial sums are `psum`-ed).

Token layout. Outside the context-parallel programs a `Model`'s activations split their batch over "data" and are
replicated over "context" and "model" (attention either runs whole on every device or all-reduces its
row-parallel output), on the "model"-only layouts and on the overlay alike. So the rows `[N, D]` are cut over
("data", <expert axes>) in mesh order when N divides: each data shard's rows are sub-cut over its expert group,
which only slices what every device already holds, and the `[N, D]` result comes back as a global array in the
caller's row order (GSPMD regathers it for the next, replicated, op). With N not dividing (decode batches) the rows
stay replicated over the expert group and the result is psum-ed, i.e. already in the caller's layout.

"auto" picks by bytes moved: all-gather while the expert group is smaller than top_k (measured on 2 H200s, k = 8:
all-gather 2.26 ms, ragged 2.86 ms, one GPU 3.67 ms — `bench/moe.py`), ragged beyond.

Both are deterministic for a fixed mesh: sorts are stable, combines sum slots in a fixed order, collectives move
data (psum_scatter sums a fixed number of partials in the collective's fixed order). Results equal the one-device
`expert_ffn` up to that fp32 summation order.

Entry points: `ep_expert_ffn` (routing given, as `ops.expert_ffn`) and `ep_moe` (routes with
`kimi_jax.modules.moe.route` inside the shard_map first). A `Model` on a mesh whose expert axes split the routed
experts runs every MoE layer through `ep_expert_ffn` (`sharding.moe.routed_experts`): under plain GSPMD
the kernels' custom calls (Pallas on GPU and TPU) cannot be split, so XLA would gather every expert to every device.
Inputs are global arrays; outputs are global `[N, D]` float32 arrays sharded like the tokens.
`ep_expert_ffn_manual` runs the same local bodies from INSIDE a shard_map that is already manual over "context" (the
context-parallel programs, `kimi_jax.parallel`, on overlay meshes): local tokens in, local `[n, D]` out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import ops
from pallas_kernels.moe.routing import route

from .mesh import expert_axes

MODEL, DATA = "model", "data"
METHODS = ("auto", "ragged", "allgather")


def expert_group_axis(mesh, axes=None):
    """The shard_map axis name of the expert group: "model" for the "model"-only layouts (exactly the name the
    programs used before the overlay existed, so they compile the same), else the tuple of the expert axes that have
    more than one device (`expert=8,tensor=1,context=8` -> "context"; `expert=8,tensor=2,context=4` ->
    ("context", "model"), context-major as `sharding.rules` splits the experts).
    `axes`: the expert axes (default: `sharding.mesh.expert_axes(mesh)`)."""
    axes = tuple(expert_axes(mesh) if axes is None else axes)
    bad = [a for a in axes if a not in mesh.axis_names or a == DATA]
    if bad or not axes:
        raise ValueError(f"expert axes {axes} must be non-data axes of the mesh {dict(mesh.shape)}")
    if axes == (MODEL,):
        return MODEL
    big = tuple(a for a in axes if mesh.shape[a] > 1) or axes[-1:]
    return big[0] if len(big) == 1 else big


def _axis_names(axis) -> tuple:
    return axis if isinstance(axis, tuple) else (axis,)


def _group_size(mesh, axis) -> int:
    """m: devices in one expert group (the product of the expert axes' sizes)."""
    size = 1
    for a in _axis_names(axis):
        size *= int(mesh.shape[a])
    return size


def _shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # older JAX

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def _num_experts(w):
    """Experts of a dense `[E, K, N]` array, an `MXFP4Weight` or a Mosaic-prepared weight."""
    n = getattr(w, "num_experts", None)
    return w.shape[0] if n is None else n


def _excl_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis) - a


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` built from all-gathers (for backends where it does not lower, e.g. XLA:CPU);
    same contract. Costs a full all-gather of `operand`: for tests, not for speed."""
    del recv_sizes  # implied by the senders' sizes
    m = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    spd = input_offsets.shape[0] // m
    ops_all = jax.lax.all_gather(operand, axis_name)  # [m, rows, ...]
    io, ss, oo = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    io, ss, oo = (jax.lax.dynamic_slice_in_dim(a, me * spd, spd, axis=1) for a in (io, ss, oo))  # [m, spd]
    r = jnp.arange(output.shape[0])[:, None, None]
    hit = (r >= oo[None]) & (r < oo[None] + ss[None])  # [rows, m, spd]
    any_hit = jnp.any(hit, axis=(1, 2))
    src = jnp.argmax(jnp.any(hit, axis=2), axis=1)
    src_row = jnp.sum(jnp.where(hit, io[None] + r - oo[None], 0), axis=(1, 2))
    got = ops_all[src, src_row]
    mask = any_hit.reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, got, output)


def _ragged_local(x, idx, wt, w_gate, w_up, w_down, *, axis, act, backend, interpret, a2a):
    """Per device: x [n, D] local tokens, idx/wt [n, k]; expert weights hold this device's E_l experts; `axis` names
    the expert group (one mesh axis or a tuple; rank `me` of m, experts [me·E_l, (me+1)·E_l) live here)."""
    m = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    E_l = _num_experts(w_gate)
    E = E_l * m
    n, k = idx.shape
    _, token_of_row, sizes, slot_row = ops.dispatch_plan(idx, E)  # sizes [E]: rows this device sends to expert e
    x_rows = x[token_of_row]
    counts = jax.lax.all_gather(sizes, axis)  # [m, E]: counts[src, e]
    tot = jnp.sum(counts, axis=0)  # rows expert e receives
    blk = _excl_cumsum(tot.reshape(m, E_l), axis=1)  # start of local expert l's rows on its owner
    before = _excl_cumsum(counts, axis=0)  # [m, E]: rows of lower-ranked sources, per expert
    send_off = _excl_cumsum(sizes, axis=0)
    out_off = blk.reshape(E) + before[me]
    recv = jax.lax.dynamic_slice_in_dim(counts, me * E_l, E_l, axis=1)  # [m, E_l]: from src, for my expert l
    cap = m * n * k
    buf = a2a(x_rows, jnp.zeros((cap,) + x_rows.shape[1:], x_rows.dtype), send_off.astype(jnp.int32),
              sizes.astype(jnp.int32), out_off.astype(jnp.int32), recv.reshape(E).astype(jnp.int32),
              axis_name=axis)
    local_sizes = jax.lax.dynamic_slice_in_dim(tot, me * E_l, E_l)
    y = ops.expert_ffn_sorted(buf, local_sizes, w_gate, w_up, w_down, act, backend=backend, interpret=interpret,
                              fill_uncovered=False)
    # send back: slice (src, l) sits at blk[me, l] + before[src, me·E_l + l] and goes to src, where it lands at
    # the start of expert (me·E_l + l) in src's sorted rows.
    my_blk = jax.lax.dynamic_index_in_dim(blk, me, axis=0, keepdims=False)  # [E_l]
    ret_in = my_blk[None, :] + jax.lax.dynamic_slice_in_dim(before, me * E_l, E_l, axis=1)  # [m, E_l]
    src_off = _excl_cumsum(counts, axis=1)  # [m, E]: where expert e starts in src's sorted rows
    ret_out = jax.lax.dynamic_slice_in_dim(src_off, me * E_l, E_l, axis=1)
    y_back = a2a(y, jnp.zeros((n * k,) + y.shape[1:], y.dtype), ret_in.reshape(E).astype(jnp.int32),
                 recv.reshape(E).astype(jnp.int32), ret_out.reshape(E).astype(jnp.int32),
                 sizes.astype(jnp.int32), axis_name=axis)
    return ops.combine_slots(y_back[slot_row], wt)  # y_back is in this device's sorted order


def _allgather_local(x, idx, wt, w_gate, w_up, w_down, *, axis, act, backend, interpret, split):
    """Per device: tokens split over the expert group `axis` when `split` (gathered here), else replicated over it."""
    if split:
        x, idx, wt = (jax.lax.all_gather(a, axis, tiled=True) for a in (x, idx, wt))
    me = jax.lax.axis_index(axis)
    E_l = _num_experts(w_gate)
    lo = me * E_l
    local = (idx >= lo) & (idx < lo + E_l)
    lid = jnp.where(local, idx - lo, E_l)  # other devices' experts -> one trailing group, never computed
    _, token_of_row, sizes, slot_row = ops.dispatch_plan(lid, E_l + 1)
    # rows back in (token, slot) order (`ops.expert_ffn`), those of other devices' experts (never written) zeroed
    y = ops.expert_ffn_sorted(x, sizes[:E_l], w_gate, w_up, w_down, act, backend=backend, interpret=interpret,
                              fill_uncovered=False, token_of_row=token_of_row, out_rows=slot_row)
    part = ops.combine_slots(jnp.where(local.reshape(-1)[:, None], y, 0.0), wt)
    if split:
        return jax.lax.psum_scatter(part, axis, scatter_dimension=0, tiled=True)
    return jax.lax.psum(part, axis)


def _token_spec(mesh, n_tokens: int, axis=MODEL):
    """(PartitionSpec of the `[N, ...]` token arrays, whether they split over the expert group `axis`): rows over
    ("data", *expert axes) — the data shards of the caller's batch, each cut over its expert group — when N divides,
    else over "data" alone (replicated over the group), else replicated."""
    d, m = mesh.shape.get(DATA, 1), _group_size(mesh, axis)
    if n_tokens % (d * m) == 0:
        return P((DATA,) + _axis_names(axis)), True
    if n_tokens % d == 0:
        return P(DATA), False
    return P(), False


def resolve_method(method: str, split: bool, model_size: int = 2, top_k: int = 8) -> str:
    """"auto": by bytes moved per device. `model_size`: m, the devices of one expert group (the "model" axis, or the
    product of the expert axes). With n local tokens of width D over m devices, all-gather + reduce-scatter
    moves ≈ (m−1)·n·D·(2 + 4) bytes (bf16 tokens in, fp32 partial sums out); ragged all-to-all moves
    ≈ (m−1)/m·n·k·D·(2 + 4) (bf16 rows out, fp32 results back). All-gather is cheaper while m < k — measured on
    two H200s at K3 shapes (k = 8): all-gather 2.26 ms, ragged 2.86 ms (`bench/moe.py`). XLA:CPU has no
    ragged_all_to_all, so CPU always takes all-gather."""
    if method not in METHODS:
        raise ValueError(f"unknown expert-parallel method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "auto":
        ragged_ok = split and jax.default_backend() in ("gpu", "cuda", "tpu")
        return "ragged" if ragged_ok and model_size >= top_k else "allgather"
    if method == "ragged" and not split:
        raise ValueError("method='ragged' needs the token count to split over data × expert-axes devices; "
                         "pad the tokens or use method='allgather'")
    return method


@functools.lru_cache(maxsize=64)
def _compiled(mesh, axis, method, split, tok_spec, act, backend, interpret, emulate_a2a):
    if method == "ragged":
        a2a = emulated_ragged_all_to_all if emulate_a2a else jax.lax.ragged_all_to_all
        local = functools.partial(_ragged_local, axis=axis, act=act, backend=backend, interpret=interpret, a2a=a2a)
    else:
        local = functools.partial(_allgather_local, axis=axis, act=act, backend=backend, interpret=interpret,
                                  split=split)
    w_spec = P(axis)
    return jax.jit(_shard_map(local, mesh, in_specs=(tok_spec, tok_spec, tok_spec, w_spec, w_spec, w_spec),
                              out_specs=tok_spec))


def place_experts(w, mesh, expert_axes=None):
    """Put expert weights (dense or MXFP4) on `mesh`, split on dim 0 over the mesh's expert axes (as
    `sharding.rules` does). `expert_axes` as in `ep_expert_ffn`."""
    w = ops._as_weight(w)
    spec = P(expert_group_axis(mesh, expert_axes))
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), w)


def place_tokens(a, mesh, expert_axes=None):
    """Put a per-token array (`[N, ...]`) on `mesh` the way `ep_expert_ffn` splits tokens."""
    spec, _ = _token_spec(mesh, a.shape[0], expert_group_axis(mesh, expert_axes))
    return jax.device_put(a, NamedSharding(mesh, spec))


def ep_expert_ffn(x_nd, expert_idx_nk, weight_nk, w_gate, w_up, w_down, activation, *, mesh, method: str = "auto",
                  backend: str = "auto", interpret: bool = False, emulate_a2a: bool = False, expert_axes=None):
    """Expert-parallel `ops.expert_ffn`: same arguments (x `[N, D]`, expert ids `[N, k]` int32, weights `[N, k]`
    float32, expert weights) plus `mesh` (axes "data" and the expert axes); returns `[N, D]` float32.

    `expert_axes`: the mesh axes the experts split over, default `sharding.mesh.expert_axes(mesh)` — ("model",), or
    ("context", "model") on the overlay meshes. Expert weights (dense `[E, K, N]` or MXFP4) are split over them on
    dim 0, context-major (E must divide by the product of their sizes); arrays already placed that way
    (`place_experts`, `place_tokens`) are not moved. `emulate_a2a` swaps `ragged_all_to_all` for an all-gather
    emulation (tests on CPU, where it does not lower)."""
    w_gate, w_up, w_down = (ops._as_weight(w) for w in (w_gate, w_up, w_down))
    axis = expert_group_axis(mesh, expert_axes)
    E, m = _num_experts(w_gate), _group_size(mesh, axis)
    if E % m:
        names = " x ".join(f"{a}={mesh.shape[a]}" for a in _axis_names(axis))
        raise ValueError(f"{E} experts do not split over the expert axes {names} ({m} devices)")
    tok_spec, split = _token_spec(mesh, x_nd.shape[0], axis)
    method = resolve_method(method, split, m, expert_idx_nk.shape[1])
    f = _compiled(mesh, axis, method, split, tok_spec, ops.resolve_activation(activation), backend, interpret,
                  emulate_a2a)
    toks = [jax.device_put(a, NamedSharding(mesh, tok_spec)) for a in (x_nd, expert_idx_nk, weight_nk)]
    w_spec = NamedSharding(mesh, P(axis))
    return f(*toks, *(jax.tree.map(lambda a: jax.device_put(a, w_spec), w) for w in (w_gate, w_up, w_down)))


def ep_moe(x_nd, router_de, bias_e, cfg, w_gate, w_up, w_down, activation, *, mesh, method: str = "auto",
           backend: str = "auto", interpret: bool = False, emulate_a2a: bool = False, expert_axes=None):
    """Route (docs/model.md §7, `pallas_kernels.moe.routing.route`, per token — the same on any split) then
    `ep_expert_ffn`."""
    tok_spec, _ = _token_spec(mesh, x_nd.shape[0], expert_group_axis(mesh, expert_axes))
    routed = jax.jit(_shard_map(lambda x, r, b: route(x, r, b, cfg), mesh, in_specs=(tok_spec, P(), P()),
                                out_specs=(tok_spec, tok_spec)))
    weight, idx = routed(jax.device_put(x_nd, NamedSharding(mesh, tok_spec)),
                         jax.device_put(router_de, NamedSharding(mesh, P())),
                         jax.device_put(bias_e, NamedSharding(mesh, P())))
    return ep_expert_ffn(x_nd, idx, weight, w_gate, w_up, w_down, activation, mesh=mesh, method=method,
                         backend=backend, interpret=interpret, emulate_a2a=emulate_a2a, expert_axes=expert_axes)


def ep_expert_ffn_manual(x_nd, expert_idx_nk, weight_nk, w_gate, w_up, w_down, activation, *, expert_axes,
                         token_axis=None, method: str = "auto", backend: str = "auto", interpret: bool = False,
                         emulate_a2a: bool = False):
    """Expert-parallel `ops.expert_ffn` called INSIDE a shard_map that is already manual over the expert axes other
    than "model": the context-parallel programs of `kimi_jax.parallel` (manual over ("data", "context"),
    "model" left to GSPMD) on an overlay mesh whose routed experts split over ("context", "model").

    Arguments are this device's views inside the caller's shard_map:
    * x_nd `[n, D]`, expert_idx_nk `[n, k]` int32 (global expert ids), weight_nk `[n, k]` float32 — with
      `token_axis` (the token-split prefill: "context") this device's own tokens, other devices along that axis
      holding other tokens; with token_axis None (DCP decode) the same tokens on every device of the expert group.
      In both cases replicated over "model".
    * expert weights: this device's share along the manual expert axes (dense `[E / C, K, N]`, MXFP4 or
      Mosaic-prepared; C = the manual expert axes' size, context-major as `sharding.rules` splits them), still
      split over "model" by GSPMD when "model" is an expert axis.
    `expert_axes`: the mesh's expert axes (`sharding.mesh.expert_axes`). Returns `[n, D]` float32, same rows as x_nd.

    "model" joins the manual axes through a nested shard_map (GSPMD cannot split the kernels' custom calls), so
    each device runs exactly its E / (C·M) experts with the same local bodies as `ep_expert_ffn`:
    * token_axis given: the rows (replicated over "model") are sub-cut over "model" (padded to a multiple of M),
      which splits them over the whole expert group context-major, the order the experts split in; dispatch by
      `method` ("auto": `resolve_method`); the result is all-gathered back over "model".
    * token_axis None: every device holds all tokens, so it computes its own experts' contributions for all of
      them and the partial sums are psum-ed over the group (`_allgather_local` with split=False): nothing gathered.
    """
    w_gate, w_up, w_down = (ops._as_weight(w) for w in (w_gate, w_up, w_down))
    mesh = jax.sharding.get_abstract_mesh()  # the caller's mesh, with its manual axes
    group = expert_group_axis(mesh, expert_axes)
    names = _axis_names(group)
    split = token_axis is not None
    if split and token_axis not in names:
        raise ValueError(f"tokens split over {token_axis!r}, which is not one of the expert axes {names}")
    if not set(names) - {MODEL} <= set(mesh.manual_axes):
        raise ValueError(f"call ep_expert_ffn_manual inside a shard_map manual over {names} (but for "
                         f"{MODEL!r}); manual now: {tuple(mesh.manual_axes)}")
    inner = tuple(a for a in names if a not in mesh.manual_axes)  # ("model",) when it is an expert axis, else ()
    m, sub = _group_size(mesh, group), (_group_size(mesh, inner) if split and inner else 1)
    method = resolve_method(method, split, m, expert_idx_nk.shape[1])
    n = x_nd.shape[0]
    pad = -n % sub  # padded rows: zero weights, so they add nothing
    toks = [jnp.pad(a, ((0, pad), (0, 0))) if pad else a for a in (x_nd, expert_idx_nk, weight_nk)]

    def local(x_nd, idx_nk, wt_nk, wg, wu, wd):
        if sub > 1:  # my slice of the rows the "model" devices of my context shard all hold
            rows = x_nd.shape[0] // sub
            j = jax.lax.axis_index(inner)
            x_nd, idx_nk, wt_nk = (jax.lax.dynamic_slice_in_dim(a, j * rows, rows) for a in (x_nd, idx_nk, wt_nk))
        kw = {"axis": group, "act": ops.resolve_activation(activation), "backend": backend, "interpret": interpret}
        if method == "ragged":
            a2a = emulated_ragged_all_to_all if emulate_a2a else jax.lax.ragged_all_to_all
            y_nd = _ragged_local(x_nd, idx_nk, wt_nk, wg, wu, wd, a2a=a2a, **kw)
        else:
            y_nd = _allgather_local(x_nd, idx_nk, wt_nk, wg, wu, wd, split=split, **kw)
        return jax.lax.all_gather(y_nd, inner, tiled=True) if sub > 1 else y_nd

    # every axis still automatic joins through a nested shard_map, not only an expert axis: GSPMD cannot partition
    # the kernels' custom calls even over an axis of size 1 (the overlay `expert=8,tensor=1,context=8`)
    free = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if free:
        w_spec = P(inner) if inner else P()
        local = jax.shard_map(local, in_specs=(P(), P(), P(), w_spec, w_spec, w_spec), out_specs=P(),
                              axis_names=set(free), check_vma=False)
    return local(*toks, w_gate, w_up, w_down)[:n]
