"""Context parallelism for the WHOLE model: token-split prefill, head-split prefill, DCP and TP decode programs.

    prefill(model, ids, mesh, mode="token" | "head", max_len=None, layout="contiguous", logits="all" | "last")
        -> (logits float32 `[B, T, V]` (or `[B, 1, V]` with logits="last"), ModelCache)
    decode_step(model, cache, token_ids, mesh, mode="dcp" | "tp", layout="contiguous") -> (logits `[B, V]`, cache)
    generate(model, ids, max_new_tokens, mesh, prefill_mode="token", decode_mode="dcp") -> numpy int `[B, T + n]`
    decode_comm_bytes_per_step(cfg, n=, batch=, seq_len=, kv_dtype=, index_dtype=) -> bytes for the whole model
    token_split_chunk(model, ctx, chunk) -> f(params, ids [1, chunk], PagedModelCache) -> PagedModelCache: the
        serving engine's token-split prefill of one chunk at any position, into its DCP-split paged cache

Every program runs the model's one forward driver (`KimiForCausalLM.hidden_states`) inside ONE shard_map that is
manual over the context and data axes, with a `ForwardContext` whose mode says what the layers do
(`sharding.context`): the op entry points (`sharding.kda`, `sharding.moe`) nest their own shard_map over the
remaining (tensor) axis, and the MLA layers run their context-parallel attention (`MultiHeadLatentAttention.
attend_context_parallel`). `mesh` has a "context" axis (`sharding.make_mesh("context=8")`, `"data=2,context=4"`,
`"tensor=2,context=4"`, the overlay `"expert=8,tensor=1,context=8"`):

* token (prefill): the prompt is cut by tokens over "context" (device d holds tokens [d·Tl, (d+1)·Tl); a prompt
  that does not divide is padded at the end, and the padding is inert). KDA layers take their conv halo from the
  previous device and combine per-device affine state transitions (exact); MLA layers all-gather the latent rows
  and index keys. The cache comes back with KDA states replicated over "context" and the MLA rows + index keys
  split over "context" by tokens — already the DCP layout.
* head (prefill, for comparison): the same devices as one tensor-parallel group (heads, experts and vocab split by
  `sharding.rules`); MLA uses the same query-chunked attention.
* dcp (decode): every device runs the step for the new token, writes the new latent row / index key on the device
  that owns its position, scores only its own keys, keeps a local top-k, exchanges (score, position) candidates,
  attends over its share of the winners and merges the partial outputs by log-sum-exp.
* tp (decode, for comparison): the tensor-parallel step with the MLA cache replicated and the same sparse top-k.
Routed experts run where they live (`sharding.moe`): over ("context", "model") on the overlay meshes, over "model"
otherwise. K3-family NoPE MLA only (DeepSeek's RoPE would need global positions in the projection).

MLA cache layouts ("contiguous": device d holds positions [d·L, (d+1)·L); "round_robin": position p on device
p mod n, see `sharding.context_parallel.dcp_place`). `max_len` is rounded up to a multiple of the context size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding import context_parallel as cp
from sharding.context import DEFAULT_MAX_CHUNK_BYTES, LAYOUTS, ForwardContext, context_for_mesh
from sharding.context_parallel import CONTEXT
from sharding.mesh import expert_axes
from sharding.rules import mesh_partition_spec, path_name

from .cache import index_key_bytes_per_token, latent_bytes_per_token
from .modules.decoder import ModelCache, PagedModelCache
from .modules.kda import KDACache
from .modules.mla import MLACache
from .model import _as_ids
from .paged_cache import LayerPool

MODES_PREFILL = ("token", "head")
MODES_DECODE = ("dcp", "tp")


def _check(model, mesh: Mesh, axis: str, layout: str):
    cfg = model.config
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no {axis!r} axis (axes {mesh.axis_names}); build one with "
                         f"sharding.make_mesh('context=N') or make_mesh('data=D,tensor=M,context=N')")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown DCP layout {layout!r}; choose one of {LAYOUTS}")
    if cfg.mla is not None and cfg.mla.rope is not None:
        raise NotImplementedError("context parallelism covers NoPE MLA (the K3 family); RoPE MLA (DeepSeek) would "
                                  "need global positions in the projections")


def _context(model, mesh: Mesh, axis: str, **fields):
    """The `ForwardContext` of a program over `mesh` whose context role is played by `axis`."""
    ctx = context_for_mesh(mesh, model.kernels, **fields)
    return ctx.replace(axes=dataclasses.replace(ctx.axes, context=axis))


def _batch_axis(mesh: Mesh, B: int):
    d = mesh.shape.get("data", 1)
    return "data" if d > 1 and B % d == 0 else None


def _manual_axes(mesh: Mesh, axis: str):
    return frozenset(a for a in mesh.axis_names if a in (axis, "data"))


def _smap(f, mesh, in_specs, out_specs, manual):
    kw = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    if set(manual) != set(mesh.axis_names):
        kw["axis_names"] = set(manual)
    return jax.shard_map(f, **kw)


def _store(model) -> dict:
    return model.__dict__.setdefault("_context_parallel", {})


def _placed_params(model, mesh: Mesh):
    """Parameters on `mesh` by `sharding.rules` (heads / vocab over "model"; routed experts over the mesh's expert
    axes: "model", or ("context", "model") on the overlay meshes; everything else replicated over "context" and
    "data"), cached per mesh. A `Model` loaded on the same mesh already holds them so: nothing moves."""
    key = ("params", mesh)
    store = _store(model)
    if key not in store:
        place = lambda path, a: jax.device_put(a, NamedSharding(mesh, mesh_partition_spec(path_name(path),
                                                                                         a.shape, mesh)))
        store[key] = jax.tree_util.tree_map_with_path(place, model.params)
    return store[key]


def _program_expert_axes(model, mesh: Mesh, axis: str) -> tuple:
    """The mesh's expert axes when a CP program over `axis` runs the routed experts expert-parallel: they include
    `axis` (the overlay meshes) and split the experts (E divides their size, as `sharding.rules` requires to split
    them at all). () otherwise: the "model"-only layouts keep the programs they had."""
    axes = expert_axes(mesh)
    moe = getattr(model.config, "moe", None)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    if axis not in axes or moe is None or ways < 2 or moe.num_experts % ways:
        return ()
    return axes


def _param_in_specs(model, mesh: Mesh, axis: str, expert_axes: tuple):
    """in_specs of the parameters for a CP program's shard_map. Without `expert_axes`: P() for all, i.e. whole over
    the manual axes ("context", "data"); "model" splits stay with GSPMD. With them: each parameter keeps the manual
    part of its placement — the routed experts stay split over `axis` on dim 0 (each context device takes its own
    E / context experts, still split over "model" by GSPMD) instead of being gathered to every context shard."""
    if not expert_axes:
        return P()
    manual = _manual_axes(mesh, axis)

    def keep_manual(entry):
        names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in manual)
        return None if not names else names[0] if len(names) == 1 else names

    def spec(path, a):
        return P(*(keep_manual(e) for e in mesh_partition_spec(path_name(path), a.shape, mesh)))

    return jax.tree_util.tree_map_with_path(spec, model.params)


def _cache_specs(cfg, bax, axis, split_mla: bool):
    mla = P(bax, axis) if split_mla else P(bax)
    layers = tuple(KDACache(P(bax), P(bax), P(bax), P(bax)) if k == "kda" else MLACache(mla, mla)
                   for k in cfg.layer_kinds)
    return ModelCache(P(bax), layers)


def _token_prefill_fn(model, mesh, axis, B, T_pad, valid_len, layout, last_only, max_chunk_bytes):
    key = ("token", mesh, axis, B, T_pad, valid_len, layout, last_only, max_chunk_bytes)
    store = _store(model)
    if key in store:
        return store[key]
    bax = _batch_axis(mesh, B)
    eaxes = _program_expert_axes(model, mesh, axis)
    ctx = _context(model, mesh, axis, mode="prefill_token_split", valid_len=valid_len, layout=layout,
                   max_chunk_bytes=max_chunk_bytes)
    graphdef = model.graphdef
    cspec = _cache_specs(model.config, bax, axis, True)

    def body(params, ids, cache):
        m = nnx.merge(graphdef, params)
        h, new = m.hidden_states(ids, cache, ctx=ctx)
        if last_only:  # only the last real token's logits (TTFT): its hidden row, from whichever device holds it
            h = cp.global_rows_shard(h, [valid_len - 1], axis=axis)
        return m.logits(h), new._replace(length=cache.length + valid_len)

    out_logits = P(bax) if last_only else P(bax, axis)
    pspec = _param_in_specs(model, mesh, axis, eaxes)
    f = jax.jit(_smap(body, mesh, (pspec, P(bax, axis), cspec), (out_logits, cspec), _manual_axes(mesh, axis)),
                donate_argnums=(2,))
    store[key] = (f, cspec, bax)
    return store[key]


def _fresh_cache(model, mesh, B, max_len, cspec):
    cfg, dtype = model.config, model.dtype
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), cspec, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(lambda: ModelCache.zeros(cfg, B, max_len, dtype), out_shardings=shardings)()


def _head_mesh(mesh: Mesh, axis: str) -> Mesh:
    """The same devices as ("data", "context" = 1, "model" = context·model): one tensor-parallel group."""
    d = mesh.shape.get("data", 1)
    devs = np.asarray(mesh.devices).reshape(d, -1)
    return Mesh(devs.reshape(d, 1, devs.shape[1]), ("data", "context", "model"))


def _head_fn(model, mesh, kind, valid_len, last_only, max_chunk_bytes):
    key = ("head", mesh, kind, valid_len, last_only, max_chunk_bytes)
    store = _store(model)
    if key in store:
        return store[key]
    graphdef = model.graphdef
    ctx = context_for_mesh(mesh, model.kernels, mode="decode_tp" if kind == "decode" else "prefill_head_split",
                           valid_len=valid_len, max_chunk_bytes=max_chunk_bytes)

    def fwd(params, ids, cache):
        m = nnx.merge(graphdef, params)
        if kind == "decode":  # replicated cache, heads split over the tensor axis, sparse top-k attention
            return m(ids, cache, ctx=ctx)
        h, new = m.hidden_states(ids, cache, ctx=ctx)
        if last_only:
            h = h[:, valid_len - 1:valid_len]
        return m.logits(h), new

    store[key] = jax.jit(fwd, donate_argnums=(2,))
    return store[key]


def _prefill_program(model, shape, mesh: Mesh, mode: str, max_len, axis: str, layout: str, logits: str,
                     max_chunk_bytes: int):
    """The jitted prefill program for prompts of `shape` (B, T): (f, args(ids) -> f's arguments, abstract_args
    (ShapeDtypeStructs with shardings, for `f.lower`), post(f's outputs) -> prefill's returns)."""
    if mode not in MODES_PREFILL:
        raise ValueError(f"unknown prefill mode {mode!r}; choose one of {MODES_PREFILL}")
    if logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
    _check(model, mesh, axis, layout)
    B, T = shape
    n = mesh.shape[axis]
    max_len = -(-(max_len or T) // n) * n
    if T > max_len:
        raise ValueError(f"prompt of {T} tokens does not fit a cache of {max_len}")
    last_only = logits == "last"
    cfg, dtype = model.config, model.dtype

    def abstract(m, cspec, ids_shape, ids_spec):
        sds = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, spec))
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: sds(a, mesh_partition_spec(path_name(path), a.shape, m)), model.params)
        cache = jax.eval_shape(lambda: ModelCache.zeros(cfg, B, max_len, dtype))
        cache = jax.tree.map(lambda spec, a: sds(a, spec), cspec, cache, is_leaf=lambda x: isinstance(x, P))
        return params, jax.ShapeDtypeStruct(ids_shape, jnp.int32, sharding=NamedSharding(m, ids_spec)), cache

    if mode == "head":
        hm = _head_mesh(mesh, axis)
        f = _head_fn(model, hm, "prefill", T, last_only, max_chunk_bytes)
        bax = _batch_axis(hm, B)
        cspec = _cache_specs(cfg, bax, None, False)

        def args(ids):
            cache = _fresh_cache(model, hm, B, max_len, cspec)
            return _placed_params(model, hm), jax.device_put(jnp.asarray(ids), NamedSharding(hm, P(bax))), cache

        return f, args, abstract(hm, cspec, (B, T), P(bax)), (lambda out: out)
    K = cfg.kda.conv_kernel if cfg.kda is not None else 1
    T_pad = -(-T // n) * n
    if T_pad // n < K - 1:
        raise ValueError(f"a {T}-token prompt is too short to split over {n} devices: each needs at least "
                         f"{K - 1} tokens for the KDA conv halo (use >= {(K - 1) * n} tokens or fewer devices)")
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    f, cspec, bax = _token_prefill_fn(model, mesh, axis, B, T_pad, T, layout, last_only, max_chunk_bytes)

    def args(ids):
        ids_pad = np.pad(ids, ((0, 0), (0, T_pad - T)), constant_values=pad_id)
        cache = _fresh_cache(model, mesh, B, max_len, cspec)
        return (_placed_params(model, mesh), jax.device_put(jnp.asarray(ids_pad), NamedSharding(mesh, P(bax, axis))),
                cache)

    post = lambda out: ((out[0] if last_only else out[0][:, :T]), out[1])
    return f, args, abstract(mesh, cspec, (B, T_pad), P(bax, axis)), post


def prefill(model, input_ids, mesh: Mesh, *, mode: str = "token", max_len: Optional[int] = None,
            axis: str = CONTEXT, layout: str = "contiguous", logits: str = "all",
            max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES):
    """Prefill a fresh cache with the prompt `input_ids` int `[B, T]`, split over `mesh`'s `axis`.

    mode "token": tokens split (see the module doc); "head": tensor parallel over the same devices.
    max_len: cache length (default T), rounded up to a multiple of the axis size. logits "all": `[B, T, V]`;
    "last": `[B, 1, V]`, the last prompt token only (what time-to-first-token needs; no `[T, V]` buffer).
    Returns (logits float32 jax array, `ModelCache`): token mode — MLA rows split over `axis` in `layout` order
    (`to_position_order` undoes round_robin); head mode — position order, replicated."""
    ids = np.asarray(_as_ids(input_ids, model.config))
    f, args, _, post = _prefill_program(model, ids.shape, mesh, mode, max_len, axis, layout, logits, max_chunk_bytes)
    return post(f(*args(ids)))


class PrefillPlan:
    """A compiled prefill program for one prompt shape, with its per-device memory need known BEFORE it runs
    (`prefill_plan`). `run(ids)` returns what `prefill` returns (the same program)."""

    def __init__(self, compiled, args, post, cfg):
        self.compiled, self._args, self._post, self._cfg = compiled, args, post, cfg
        ma = compiled.memory_analysis()
        get = lambda k: int(getattr(ma, k, 0) or 0) if ma is not None else 0
        self.memory = dict(temp=get("temp_size_in_bytes"), argument=get("argument_size_in_bytes"),
                           output=get("output_size_in_bytes"), alias=get("alias_size_in_bytes"))

    @property
    def new_bytes(self) -> int:
        """Bytes per device a run allocates beyond the (already placed) parameters: temporaries + outputs not
        aliased to donated inputs + the fresh cache it donates (= the aliased outputs): temp + output."""
        return self.memory["temp"] + self.memory["output"]

    def run(self, input_ids):
        return self._post(self.compiled(*self._args(np.asarray(_as_ids(input_ids, self._cfg)))))


def prefill_plan(model, shape, mesh: Mesh, *, mode: str = "token", max_len: Optional[int] = None,
                 axis: str = CONTEXT, layout: str = "contiguous", logits: str = "all",
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> PrefillPlan:
    """Lower and compile the prefill program for prompts of `shape` (B, T) from abstract inputs (nothing is
    allocated or run): `plan.memory` has XLA's per-device temp / argument / output / alias bytes, `plan.run(ids)`
    runs it. Lets a caller skip a prompt that would not fit instead of failing inside a collective."""
    f, args, abstract, post = _prefill_program(model, tuple(shape), mesh, mode, max_len, axis, layout, logits,
                                               max_chunk_bytes)
    return PrefillPlan(f.lower(*abstract).compile(), args, post, model.config)


def _dcp_decode_fn(model, mesh, axis, B, layout):
    key = ("dcp", mesh, axis, B, layout)
    store = _store(model)
    if key in store:
        return store[key]
    bax = _batch_axis(mesh, B)
    eaxes = _program_expert_axes(model, mesh, axis)
    ctx = _context(model, mesh, axis, mode="decode_dcp", layout=layout)
    graphdef = model.graphdef
    cspec = _cache_specs(model.config, bax, axis, True)

    def body(params, ids, cache):
        m = nnx.merge(graphdef, params)
        return m(ids, cache, ctx=ctx)

    pspec = _param_in_specs(model, mesh, axis, eaxes)
    f = jax.jit(_smap(body, mesh, (pspec, P(bax), cspec), (P(bax), cspec), _manual_axes(mesh, axis)),
                donate_argnums=(2,))
    store[key] = (f, cspec)
    return store[key]


def decode_step(model, cache, token_ids, mesh: Mesh, *, mode: str = "dcp", axis: str = CONTEXT,
                layout: str = "contiguous"):
    """One token per sequence (`token_ids` int `[B]`). The cache is donated. Returns (logits float32 `[B, V]`,
    cache). mode "dcp": the cache's MLA rows split over `axis` in `layout` order (as `prefill(mode="token")`
    returns them; a position-ordered cache is re-placed as "contiguous"); "tp": the cache in position order
    (`prefill(mode="head")`'s, or a token prefill's after `to_position_order`), re-placed replicated while the
    heads split over the same devices."""
    if mode not in MODES_DECODE:
        raise ValueError(f"unknown decode mode {mode!r}; choose one of {MODES_DECODE}")
    _check(model, mesh, axis, layout)
    tok = jnp.asarray(token_ids, jnp.int32).reshape(-1, 1)
    B = tok.shape[0]
    if mode == "tp":
        hm = _head_mesh(mesh, axis)
        f = _head_fn(model, hm, "decode", 0, False, 0)
        bax = _batch_axis(hm, B)
        # the cache as a head-split prefill leaves it (replicated but for the batch, on the head mesh): a cache from
        # a token-split prefill is still split over `axis` of `mesh`, whose "model" axis is not the head mesh's
        cspec = _cache_specs(model.config, bax, None, False)
        cache = jax.tree.map(lambda s, a: jax.device_put(a, NamedSharding(hm, s)), cspec, cache,
                             is_leaf=lambda x: isinstance(x, P))
        logits, cache = f(_placed_params(model, hm), jax.device_put(tok, NamedSharding(hm, P(bax))), cache)
        return logits[:, 0], cache
    n = mesh.shape[axis]
    if cache.max_len % n:
        raise ValueError(f"a cache of {cache.max_len} tokens does not split over {n} devices (prefill with "
                         f"sharding.context_parallel.prefill, which rounds max_len up)")
    f, cspec = _dcp_decode_fn(model, mesh, axis, B, layout)
    place = lambda s, a: jax.device_put(a, NamedSharding(mesh, s))
    cache = jax.tree.map(place, cspec, cache, is_leaf=lambda x: isinstance(x, P))
    logits, cache = f(_placed_params(model, mesh), place(P(_batch_axis(mesh, B)), tok), cache)
    return logits[:, 0], cache


def generate(model, input_ids, max_new_tokens: int, mesh: Mesh, *, prefill_mode: str = "token",
             decode_mode: str = "dcp", axis: str = CONTEXT, layout: str = "contiguous") -> np.ndarray:
    """Greedy generation: `prefill` (token or head split) then `decode_step` (DCP or TP). Returns numpy int
    `[B, T + max_new_tokens]`, the tokens `Model.generate` gives at temperature 0."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if max_new_tokens <= 0:
        return ids
    if prefill_mode == "head" and decode_mode == "dcp" and layout != "contiguous":
        raise ValueError("a head-split prefill leaves the cache in position order: decode it with "
                         "layout='contiguous'")
    logits, cache = prefill(model, ids, mesh, mode=prefill_mode, max_len=ids.shape[1] + max_new_tokens, axis=axis,
                            layout=layout, logits="last")
    if prefill_mode == "token" and decode_mode == "tp":  # TP decode reads the cache in position order
        cache = to_position_order(cache, mesh.shape[axis], layout)
    tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    out = [np.asarray(tok)]
    for _ in range(1, max_new_tokens):
        logits, cache = decode_step(model, cache, tok, mesh, mode=decode_mode, axis=axis, layout=layout)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out.append(np.asarray(tok))
    return np.concatenate([ids, np.stack(out, axis=1)], axis=1)


def to_position_order(cache, n: int, layout: str = "contiguous"):
    """A cache from `prefill(mode="token", layout=layout)` with its MLA arrays back in position order (the layout
    `Model.prefill` uses), as global arrays."""
    if layout == "contiguous":
        return cache

    def unplace(a):  # storage row d·L + l holds position l·n + d
        B, S = a.shape[:2]
        return jnp.swapaxes(a.reshape((B, n, S // n) + a.shape[2:]), 1, 2).reshape(a.shape)

    layers = tuple(MLACache(unplace(c.kv_bsc), unplace(c.index_k_bsd)) if isinstance(c, MLACache) else c
                   for c in cache.layers)
    return cache._replace(layers=layers)


# ----------------------------------------------------------------------------------------------------------------
# the serving engine's token-split prefill chunk
# ----------------------------------------------------------------------------------------------------------------

def token_split_context(ctx: ForwardContext, chunk: int) -> ForwardContext:
    """The context of a token-split prefill chunk of `chunk` tokens under the engine's serving context `ctx`: plain
    mode with `dcp` > 1 over the mesh's context axis (`dcp_axis`), the axis the chunk's tokens split over.

    Only a context axis: there a plain chunk runs every token on every device of the axis, and the token split
    divides that work N ways with the weights as they are. A DCP axis that is the tensor axis already splits a
    plain chunk's work by heads over the same devices; a token split there would need every device to hold every
    head's weights."""
    if ctx.dcp < 2 or ctx.dcp_axis != ctx.axes.context:
        raise ValueError(f"the engine's token-split prefill runs over a context axis that holds the DCP split "
                         f"(--mesh ...,context=N --dcp N); this engine has dcp={ctx.dcp}"
                         + (f" over the {ctx.dcp_axis!r} axis" if ctx.dcp > 1 else ""))
    return ctx.replace(mode="prefill_token_split", valid_len=int(chunk))


def check_token_split_chunk(cfg, dcp: int, chunk: int) -> None:
    """A chunk of `chunk` tokens splits over `dcp` devices: equal slices (no padding: a padded token would have to
    be kept out of the paged cache too), each at least the K−1 tokens of the KDA conv halo."""
    K = cfg.kda.conv_kernel if cfg.kda is not None else 1
    if chunk % dcp:
        raise ValueError(f"prefill chunk size {chunk} does not split over --dcp {dcp} devices; token-split chunk "
                         f"sizes must be multiples of {dcp}")
    if chunk // dcp < K - 1:
        raise ValueError(f"prefill chunk size {chunk} over --dcp {dcp} devices leaves {chunk // dcp} tokens per "
                         f"device, fewer than the {K - 1} of the KDA conv halo; token-split chunks need at least "
                         f"{(K - 1) * dcp} tokens")


def _paged_cache_specs(cache: PagedModelCache, axis: str) -> PagedModelCache:
    """shard_map specs of an engine cache under the token split: the MLA pool parts split over `axis` on dim 0 (as
    the engine places them under DCP: each rank its own pages), everything else whole."""
    whole = lambda tree: jax.tree.map(lambda _: P(), tree)

    def layer(c):
        if isinstance(c, LayerPool):
            return LayerPool(tuple(P(axis) for _ in c.latent), tuple(P(axis) for _ in c.index), P())
        return whole(c)

    return cache.replace(length=P(), block_tables=P(), layers=tuple(layer(c) for c in cache.layers))


def token_split_chunk(model, ctx: ForwardContext, chunk: int):
    """The forward of one prefill chunk of one sequence into the engine's paged cache, split by tokens over the DCP
    axis: `f(params, ids [1, chunk] int32, cache: PagedModelCache (batch 1, the MLA pools included)) -> new cache`,
    to be traced inside the caller's jit (`engine.runner.ModelRunner` compiles one per token-split chunk size).
    `ctx` is the engine's serving context (plain mode, `dcp` > 1 over the context axis: `token_split_context`).

    One shard_map, manual over the context axis (and "data"), runs `KimiForCausalLM.hidden_states` under
    `token_split_context`: device d holds tokens [d·c, (d+1)·c) of the chunk (c = chunk / dcp), at positions
    length + d·c …. KDA layers continue from the cache's state and conv tails — the state enters device 0's
    slice and the affine combine of the slices' transitions carries it on, the tails are device 0's conv halo —
    so every device ends with the exact state after the chunk (`sharding.kda`); MLA layers gather the chunk's rows,
    index keys and queries, each rank stores the rows it owns in its pages (the DCP layout the decode step reads)
    and attends every query of the chunk over its own keys, earlier chunks' included, keeping its own tokens' merged
    outputs (`MultiHeadLatentAttention.attend_paged`); routed experts run where they live."""
    mesh = ctx.mesh
    check_token_split_chunk(model.config, ctx.dcp, chunk)
    split = token_split_context(ctx, chunk)
    axis = ctx.axes.context
    pspec = _param_in_specs(model, mesh, axis, _program_expert_axes(model, mesh, axis))
    graphdef = model.graphdef

    def body(params, ids, cache):
        _, new = nnx.merge(graphdef, params).hidden_states(ids, cache, ctx=split)
        return new

    def forward(params, ids, cache):
        cspec = _paged_cache_specs(cache, axis)
        return _smap(body, mesh, (pspec, P(None, axis), cspec), cspec, _manual_axes(mesh, axis))(params, ids, cache)

    return forward


# ----------------------------------------------------------------------------------------------------------------
# accounting
# ----------------------------------------------------------------------------------------------------------------

def decode_comm_bytes_per_step(cfg, *, n: int, batch: int, seq_len: int, kv_dtype: str = "fp8",
                               index_dtype: str = "fp8") -> dict:
    """Bytes per DCP decode step for the whole model (all MLA layers; KDA layers and per-token parts exchange
    nothing under DCP): `context_parallel.decode_comm_bytes` per layer with the cache's row sizes
    (`kimi_jax.cache`), times the MLA layer count. Keys as there (payload_* per device contributed, recv_* per
    device received on a ring) plus "mla_layers" and "per_layer"; recv_naive_latents is the naive all-gather of
    every other device's cached rows, recv_naive_scores the all-gather of full score rows."""
    m, ix = cfg.mla, cfg.indexer
    per = cp.decode_comm_bytes(
        n=n, batch=batch, heads=m.num_heads, value_dim=m.kv_lora_rank, seq_len=seq_len,
        topk=None if ix is None else ix.topk,
        latent_row_bytes=latent_bytes_per_token(m.kv_lora_rank, m.qk_rope_head_dim, kv_dtype),
        index_row_bytes=0 if ix is None else index_key_bytes_per_token(ix.head_dim, index_dtype))
    layers = len(cfg.mla_layers)
    out = {k: v * layers for k, v in per.items() if k.startswith(("payload", "recv"))}
    out.update(mla_layers=layers, per_layer=per, slots_per_device=per["slots_per_device"])
    return out


__all__ = ["prefill", "prefill_plan", "PrefillPlan", "decode_step", "generate", "to_position_order", "decode_comm_bytes_per_step",
           "token_split_chunk", "token_split_context", "check_token_split_chunk", "MODES_PREFILL", "MODES_DECODE"]
