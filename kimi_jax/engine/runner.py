"""The device programs of the engine, compiled ahead of time for a fixed set of shapes.

The batch cache is a ``PagedModelCache``: MLA rows live in pools of 64-token pages shared by every slot (stored as
``kv_dtype``, quantised on write), KDA state stays per slot.  Pages are handed out on the host by a
``BlockAllocator``; every program that touches MLA rows takes the block tables as a fixed-shape int32 input, so
growing sequences never change a shape.

* ``prefill[C](params, ids [1, C], cache1, state, table1 [1, max_blocks]) -> (cache1, state)`` for each prefill chunk
  size C: runs C prompt tokens of one sequence at its current length.  ``cache1`` is that sequence's per-sequence
  state (length + KDA layers, batch 1; no MLA rows); its MLA rows go straight into the pools of ``state`` through
  ``table1``.  Exact tokens, no padding -- padding would enter the KDA recurrent state.
* ``prefill_split[C](params, ids [1, C], cache1, state, table1) -> (cache1, state)``: the same chunk split by tokens
  over the DCP axis (``kimi_jax.parallel.token_split_chunk``): device d of that axis runs tokens [d·C/N,
  (d+1)·C/N) of it -- the KDA state and conv tails continue exactly across the devices and from the earlier chunks,
  each rank writes the rows it owns into its pages and attends the chunk's queries over its own keys.  Compiled
  instead of ``prefill[C]`` for the chunk sizes C >= ``token_split_min_tokens`` when ``dcp`` = N > 1 runs over a
  context axis (``token_split_sizes``); ``prefill()`` picks it for those sizes.  Where it pays: long chunks, whose
  per-token work (projections, KDA, experts), which a plain chunk runs on every device of the context axis, then
  splits N ways.
* ``prefill_img[C](params, ids [1, C], feats [1, C, D], mask [1, C], cache1, state, table1)``: the same with image
  features spliced in where ``mask`` is set (the decoder's ``mm`` input), for chunks that hold image tokens; compiled
  only with ``images=True`` (a model with a vision tower), so text-only chunks keep their program and cost (image
  chunks never take the token split).
* ``insert(state, cache1, slot, prompt_mask_row, counts_row) -> state``: puts a prefilled sequence's KDA state and
  length into one slot and sets that slot's penalty rows (counts are non-zero when a preempted sequence resumes).
* ``step(params, state, tokens [B], active [B], rows, controls, tables, block_tables [B, max_blocks]) -> (state,
  SampleOut)``: one decode token for every slot plus sampling, fused.  Inactive slots get a dummy token; their cache
  length is held and their table row is null, so they never write a page.
* ``verify(params, state, tokens [B, k+1], n_draft [B], active [B], rows, controls, tables, block_tables) -> (state,
  VerifyOut)``, compiled only with ``spec_tokens = k > 0``: speculative verification (``spec_decode``): row b feeds
  its next token and ``n_draft[b]`` drafts (the rest padding), the drafts are accepted or rejected in the program,
  and the cache keeps ``1 + accepted`` tokens per active row (KDA layers replay their recurrence over just those).
  The block tables must cover positions ``length … length + n_draft`` of every active row.  With ``draft_q``
  (a draft model that samples its drafts) it also takes the drafts' distributions ``q [B, k, V]`` float32 and
  ``has_q [B, k]`` bool, for docs/model.md §12's min(1, p/q) acceptance.
* ``copy_blocks(state, src [max_blocks], dst [max_blocks]) -> state``: page copies in every MLA pool (a request's
  ``n`` sequences share one prefill; a prefix-cache checkpoint part-way into a page keeps a copy of it).  Null-padded
  (0 -> 0 is a no-op).
* ``take_cache1(state, slot) -> cache1``: a copy of one slot's per-sequence state (length + KDA layers), the
  inverse of ``insert``: the prefix cache's checkpoint of a sequence that finishes or is preempted.
* small helpers: zero state, zero batch-1 cache, copy of a batch-1 cache (prefix-cache checkpoints).

All of them are lowered and compiled once in ``compile()`` (in parallel threads; XLA compilation releases the GIL) and
then called as ``Compiled`` executables: a call with any other shape is an error, not a silent recompile.  So the set
of XLA programs is exactly ``len(prefill_chunk_sizes) · (2 with images, else 1) + 7`` (+ 1 with speculation; a
token-split chunk size has its ``prefill_split`` program in place of its ``prefill``),
independent of traffic (the vision tower itself, run by ``Model.encode_images`` at admission, compiles once per
patch-count bucket the images fall in -- ``modules.vision_buckets``, at most 18 at K3's image sizes -- not once per
image size).

``params`` is the model's parameters as a flat list of arrays (``jax.tree.leaves(model.params)``), rebuilt into its
``nnx.State`` inside each program. The batch state is donated to every program that updates it (updated in place).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.kda import state_dims as kda_state_dims
from sharding.partition import placement

from ..cache import PAGE_TOKENS
from ..inflight import InflightBound
from ..modules.decoder import PagedModelCache
from ..modules.kda import KDASlots
from ..parallel import check_token_split_chunk, token_split_chunk
from ..paged_cache import LayerPool, PagedCacheSpec
from .guide import MAX_ALLOWED_IDS
from .param_leaves import ParamLeaves
from .sampler import Controls, RowParams, Rows, Tables, sample
from .spec_decode import verify_sample

log = logging.getLogger("kimi_jax.engine")


class DeviceState(NamedTuple):
    cache: PagedModelCache  # batch cache, B = max_num_seqs; MLA layers are the shared page pools
    counts: jax.Array  # i32 [B, V]: generated-token counts (frequency / presence penalties)
    prompt_mask: jax.Array  # bool [B, V]: tokens of the prompt (repetition penalty)


KV_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8",
                  "nvfp4": "nvfp4"}


def resolve_kv_dtype(name: Optional[str], model_dtype=None) -> Optional[str]:
    """The paged latent format for ``--kv-dtype``: fp32 | bf16 | fp8 | nvfp4.  ``auto`` / None: the model's
    activation dtype (fp32 or bf16); None when that is not known yet (argument checking only)."""
    key = "auto" if name is None else str(name).lower()
    if key == "auto":
        if model_dtype is None:
            return None
        return "bf16" if jnp.dtype(model_dtype) == jnp.bfloat16 else "fp32"
    if key not in KV_DTYPE_NAMES:
        raise ValueError(f"unknown kv dtype {name!r}; choose one of auto, fp32, bf16, fp8, nvfp4")
    return KV_DTYPE_NAMES[key]


def default_index_dtype(kv_dtype: str) -> str:
    """Index keys next to a latent format: unquantised beside fp32 / bf16 rows, else fp8 (docs/model.md §6)."""
    return kv_dtype if kv_dtype in ("fp32", "bf16") else "fp8"


class ModelRunner:
    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, prefill_chunk_sizes: Sequence[int],
                 kv_dtype: Optional[str] = None, class_masks: np.ndarray, stop_mask: np.ndarray,
                 num_blocks: Optional[int] = None, index_dtype: Optional[str] = None, latent_scales=None,
                 images: bool = False, spec_tokens: int = 0, draft_q: bool = False, dcp: int = 1,
                 decode_buckets: Sequence[int] = (), token_split_min_tokens: int = 0, plain_sampling: bool = False):
        """``kv_dtype``: fp32 | bf16 | fp8 | nvfp4 (None: the model's dtype); ``num_blocks``: pages per MLA pool
        (per DCP rank), the null page included (None: ``1 + max_num_seqs · max_blocks``, every slot full);
        ``dcp``: decode context parallelism — the pages split over that many ranks token by token (the mesh's
        tensor or context axis of that size, `ForwardContext.dcp_axis`), a table entry covering 64 · dcp positions;
        ``token_split_min_tokens``: with dcp > 1 over a context axis, prefill chunk sizes of at least this many
        tokens run split by tokens over it (``prefill_split``; each must be a multiple of dcp); 0: never;
        ``images``: also compile the image prefill programs (``prefill_img``); ``spec_tokens``: drafts per verify
        step (0: no ``verify`` program); ``draft_q``: the verify program takes the drafts' q (sampled drafts);
        ``decode_buckets``: row counts below ``max_num_seqs`` that get `step` (and `verify`) programs of their own
        over just those slots, so a step with few sequences running computes few rows (`bucket_for`);
        ``plain_sampling``: also compile every step and verify program with the plain sampler (`sampler.sample`'s
        ``plain``: no ``lax.cond``), which `step` / `verify` run when told no running row needs the filter or top
        log-probs."""
        cfg = model.config
        self.model = model
        self.images = bool(images)
        self.spec_tokens = int(spec_tokens)
        self.draft_q = bool(draft_q) and self.spec_tokens > 0
        if self.spec_tokens < 0:
            raise ValueError(f"spec_tokens must be >= 0, got {spec_tokens}")
        self.D = cfg.hidden_size
        self.mesh = getattr(model, "mesh", None)
        # on CPU, wait for a result every few programs: XLA's CPU client deadlocks with too many in flight
        self._inflight = InflightBound.for_mesh(self.mesh)
        self.B = int(max_num_seqs)
        self.L = int(max_model_len)
        self.V = cfg.vocab_size
        self.chunk_sizes = tuple(sorted({int(c) for c in prefill_chunk_sizes}, reverse=True))
        self.buckets = tuple(sorted({int(b) for b in decode_buckets}))
        self.plain_sampling = bool(plain_sampling)
        if self.buckets and not 1 <= self.buckets[0] <= self.buckets[-1] < self.B:
            raise ValueError(f"decode buckets must lie in [1, max_num_seqs={self.B}), got {list(decode_buckets)}")
        if not self.chunk_sizes or self.chunk_sizes[-1] < 1:
            raise ValueError(f"prefill chunk sizes must be positive integers, got {prefill_chunk_sizes}")
        self.kv_dtype = resolve_kv_dtype(kv_dtype, model.dtype) or resolve_kv_dtype("auto", model.dtype)
        self.index_dtype = index_dtype or default_index_dtype(self.kv_dtype)
        # what every program's forward runs with: the model's mesh, axis roles and kernels, and this engine's DCP
        self.ctx = ctx = model.ctx.replace(dcp=int(dcp))
        self.dcp = ctx.dcp
        if token_split_min_tokens < 0:
            raise ValueError(f"token_split_min_tokens must be >= 0 (0: no token-split prefill), got "
                             f"{token_split_min_tokens}")
        self.token_split_min_tokens = int(token_split_min_tokens)
        # the chunk sizes that prefill split by tokens over the DCP axis: a context axis only (over the tensor axis
        # a plain chunk already splits its work by heads; `kimi_jax.parallel.token_split_context`)
        over_context = self.dcp > 1 and ctx.dcp_axis == ctx.axes.context
        self.token_split_sizes = tuple(c for c in self.chunk_sizes if over_context and self.token_split_min_tokens
                                       and c >= self.token_split_min_tokens)
        for c in self.token_split_sizes:
            try:
                check_token_split_chunk(cfg, self.dcp, c)
            except ValueError as e:
                raise ValueError(f"{e} (or raise the token-split threshold above {c}, or set it to 0 to turn the "
                                 "token split off)") from None
        self.block_tokens = PAGE_TOKENS * self.dcp  # positions one block-table entry covers
        self.max_blocks = -(-self.L // self.block_tokens)
        if num_blocks is None:
            num_blocks = 1 + self.B * self.max_blocks
        self.spec = PagedCacheSpec.create(cfg, num_blocks=int(num_blocks), kv_dtype=self.kv_dtype,
                                          index_dtype=self.index_dtype)
        if self.spec.usable_blocks < self.max_blocks:
            raise ValueError(f"a pool of {num_blocks} blocks ({self.spec.usable_blocks} usable, {self.block_tokens} "
                             f"positions each) cannot hold one sequence of max_model_len {self.L} "
                             f"({self.max_blocks} blocks)")
        graphdef, act_dtype, spec = model.graphdef, model.dtype, self.spec
        B, V, NB = self.B, self.V, self.max_blocks
        replicated = None
        if self.mesh is not None:  # the batch inputs and sampling state live replicated on the mesh
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._replicated = replicated

        def zeros_cache(batch, with_pools):
            c = PagedModelCache.zeros(cfg, spec, batch, NB, act_dtype, latent_scales, ranks=self.dcp)
            if not with_pools:  # the per-sequence part only: MLA rows live in the batch state's pools
                c = c.replace(layers=tuple(None if isinstance(x, LayerPool) else x for x in c.layers))
            return c

        def same_dtypes(new, old):
            return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)

        def zeros_state():
            return DeviceState(zeros_cache(B, True), jnp.zeros((B, V), jnp.int32), jnp.zeros((B, V), bool))

        def zeros_cache1():
            return zeros_cache(1, False)

        def copy_cache1(c):
            return jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), c)

        def plain(params, ids, full, mm=None):  # the plain chunk: every token on every device
            _, new = nnx.merge(graphdef, params).hidden_states(ids, full, ctx=ctx, mm=mm)
            return new

        def prefill(params, ids, cache1, state, table1, forward=plain):
            """The chunk `ids` of one sequence, run by `forward(params, ids, full cache) -> full cache`."""
            pools = state.cache.layers
            full = cache1.replace(block_tables=table1,
                                  layers=tuple(p if c is None else c for c, p in zip(cache1.layers, pools)))
            new = same_dtypes(forward(params, ids, full), full)
            cache1 = new.replace(block_tables=cache1.block_tables,
                                 layers=tuple(None if c is None else n for c, n in zip(cache1.layers, new.layers)))
            layers = tuple(n if isinstance(p, LayerPool) else p for p, n in zip(pools, new.layers))
            return cache1, state._replace(cache=state.cache.replace(layers=layers))

        def prefill_img(params, ids, feats, mask, cache1, state, table1):
            with_images = lambda params, ids, full: plain(params, ids, full, mm=(feats, mask))
            return prefill(params, ids, cache1, state, table1, forward=with_images)

        def prefill_split(params, ids, cache1, state, table1):
            return prefill(params, ids, cache1, state, table1, forward=token_split_chunk(model, ctx, ids.shape[1]))

        def insert(state, cache1, slot, prompt_mask_row, counts_row):
            put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src[0].astype(dst.dtype), slot, 0)
            c = state.cache
            layers = tuple(p if one is None else jax.tree.map(put, p, one) for p, one in zip(c.layers, cache1.layers))
            cache = c.replace(length=put(c.length, cache1.length), layers=layers)
            counts = jax.lax.dynamic_update_index_in_dim(state.counts, counts_row, slot, 0)
            mask = jax.lax.dynamic_update_index_in_dim(state.prompt_mask, prompt_mask_row, slot, 0)
            return DeviceState(cache, counts, mask)

        def take_cache1(state, slot):
            take = lambda a: jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=True)
            c = state.cache
            one = zeros_cache1()
            layers = tuple(None if o is None else jax.tree.map(lambda a, z: take(a).astype(z.dtype), p, o)
                           for p, o in zip(c.layers, one.layers))
            return one.replace(length=take(c.length).astype(one.length.dtype), layers=layers)

        def step(params, state, tokens, active, rows, ctl, tables, block_tables, plain=False):
            m = nnx.merge(graphdef, params)
            logits, cache = m(tokens[:, None], state.cache.replace(block_tables=block_tables), ctx=ctx)
            cache = cache.replace(length=jnp.where(active, cache.length, state.cache.length))
            cache = same_dtypes(cache, state.cache)
            out, counts = sample(logits[:, 0], rows, ctl, state.counts, state.prompt_mask, tables, plain)
            return DeviceState(cache, counts, state.prompt_mask), out

        def verify(params, state, tokens, n_draft, active, rows, ctl, tables, block_tables, q=None, has_q=None,
                   plain=False):
            m = nnx.merge(graphdef, params)
            old = state.cache
            logits, pending = m(tokens, old.replace(block_tables=block_tables), ctx=ctx, defer_kda=True)
            out, counts = verify_sample(logits, tokens[:, 1:], n_draft, rows, ctl, state.counts, state.prompt_mask,
                                        tables, q, has_q, plain)
            keep = jnp.where(active, out.n, 0)
            cache = m.commit_verify(pending, old.length, keep, ctx)
            cache = same_dtypes(cache, old)
            return DeviceState(cache, counts, state.prompt_mask), out

        def copy_blocks(state, src, dst):
            def copy_part(p):  # page src[i] -> dst[i] on every DCP rank (rank r's pages are rows r·nb … of dim 0)
                per_rank = p.reshape((self.dcp, -1) + p.shape[1:])
                return per_rank.at[:, dst].set(per_rank[:, src]).reshape(p.shape)

            def copy(pool):
                if not isinstance(pool, LayerPool):
                    return pool
                move = lambda parts: tuple(copy_part(p) for p in parts)
                return LayerPool(move(pool.latent), move(pool.index), pool.latent_scale)

            layers = tuple(copy(p) for p in state.cache.layers)
            return state._replace(cache=state.cache.replace(layers=layers))

        # a decode step over a bucket's slots runs KDA against those slots of the whole per-slot state (the kernel
        # updates them in place, `KDASlots`) rather than on a gathered copy written back after: unless the batch
        # splits over a data axis, where a slot's state lives on one device only
        kda_in_place = ctx.axis_size(ctx.axes.data) == 1

        def take_rows(state, slots, in_place=False):  # the slots' rows of every per-slot buffer (pools are shared)
            take = lambda a: a[slots]
            c = state.cache

            def view(p):
                if isinstance(p, LayerPool) or p is None:
                    return p
                return KDASlots(p, slots) if in_place else jax.tree.map(take, p)

            layers = tuple(view(p) for p in c.layers)
            return DeviceState(c.replace(length=c.length[slots], layers=layers), state.counts[slots],
                               state.prompt_mask[slots])

        def put_rows(state, slots, sub):  # `take_rows` undone: the rows written back, the pools as the step left them
            put = lambda dst, src: dst.at[slots].set(src)
            c, n = state.cache, sub.cache

            def back(p, q):
                if isinstance(q, LayerPool) or q is None:
                    return q
                return q.pool if isinstance(q, KDASlots) else jax.tree.map(put, p, q)

            layers = tuple(back(p, q) for p, q in zip(c.layers, n.layers))
            return DeviceState(c.replace(length=put(c.length, n.length), layers=layers), put(state.counts, sub.counts),
                               state.prompt_mask)

        def step_rows(params, state, slots, tokens, active, rows, ctl, tables, block_tables, plain=False):
            sub, out = step(params, take_rows(state, slots, kda_in_place), tokens, active,
                            jax.tree.map(lambda a: a[slots], rows), ctl, tables, block_tables, plain)
            return put_rows(state, slots, sub), out

        def verify_rows(params, state, slots, tokens, n_draft, active, rows, ctl, tables, block_tables, q=None,
                        has_q=None, plain=False):
            sub, out = verify(params, take_rows(state, slots), tokens, n_draft, active,
                              jax.tree.map(lambda a: a[slots], rows), ctl, tables, block_tables, q, has_q, plain)
            return put_rows(state, slots, sub), out

        def with_plain_sampler(fn):  # the same program without a lax.cond, named <fn>_plain (XLA: jit_<fn>_plain)
            plain_fn = functools.partial(fn, plain=True)
            plain_fn.__name__ = plain_fn.__qualname__ = fn.__name__ + "_plain"
            return plain_fn

        # where every buffer lives (`state_shardings`): KDA states and conv tails split by heads as the KDA entry
        # point splits them, the MLA pools split over the DCP axis (else whole on every device), the rest whole
        self._abstract_state = jax.eval_shape(zeros_state)
        self._abstract_cache1 = jax.eval_shape(zeros_cache1)
        st, c1 = self.state_shardings(self._abstract_state), self.state_shardings(self._abstract_cache1)
        out = (lambda sh: {}) if replicated is None else (lambda sh: {"out_shardings": sh})
        # the programs take the parameters as a flat list of arrays (`_param_leaves`), rebuilt into the model's
        # `nnx.State` when traced: calling a compiled program flattens a list in C++, but an `nnx.State` through
        # Python one Variable at a time, on every call (docs/performance.md, "host work per program call")
        flat_params = ParamLeaves(model.params)
        self._param_leaves = flat_params.leaves
        leaves_in = flat_params.taking

        self._fns = {
            "zeros_state": jax.jit(zeros_state, **out(st)),
            "zeros_cache1": jax.jit(zeros_cache1, **out(c1)),
            "copy_cache1": jax.jit(copy_cache1, **out(c1)),
            "prefill": jax.jit(leaves_in(prefill), donate_argnums=(2, 3), **out((c1, st))),
            "prefill_img": jax.jit(leaves_in(prefill_img), donate_argnums=(4, 5), **out((c1, st))),
            "prefill_split": jax.jit(leaves_in(prefill_split), donate_argnums=(2, 3), **out((c1, st))),
            "insert": jax.jit(insert, donate_argnums=(0,), **out(st)),
            "take_cache1": jax.jit(take_cache1, **out(c1)),
            "step": jax.jit(leaves_in(step), donate_argnums=(1,), **out((st, replicated))),
            "verify": jax.jit(leaves_in(verify), donate_argnums=(1,), **out((st, replicated))),
            "copy_blocks": jax.jit(copy_blocks, donate_argnums=(0,), **out(st)),
            "step_rows": jax.jit(leaves_in(step_rows), donate_argnums=(1,), **out((st, replicated))),
            "verify_rows": jax.jit(leaves_in(verify_rows), donate_argnums=(1,), **out((st, replicated))),
        }
        for fn in (step, verify, step_rows, verify_rows):
            self._fns[fn.__name__ + "_plain"] = jax.jit(leaves_in(with_plain_sampler(fn)), donate_argnums=(1,),
                                                        **out((st, replicated)))
        self._exe: dict = {}
        self._mask_uploads: dict = {}  # `update_class_masks` program per first row
        self.tables = Tables(jnp.asarray(class_masks), jnp.asarray(stop_mask))
        if replicated is not None:
            self.tables = jax.device_put(self.tables, replicated)
        self.compile_seconds: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ placement
    def state_shardings(self, abstract):
        """`NamedSharding` per leaf of a `DeviceState` or batch-1 cache (abstract or concrete), or None without a
        mesh. KDA states `[B, H, dk, dv]` and conv tails `[B, K−1, H·d]` split their heads over the tensor axis and
        rows over data (where they divide: as `sharding.kda` takes them; few heads split their value columns); MLA
        pool parts `[N·num_blocks, 64, w]` split dim 0 over the DCP axis; everything else is whole on every device."""
        if self.mesh is None:
            return None
        ctx, mesh = self.ctx, self.mesh
        d, t = ctx.axes.data, ctx.axes.tensor
        named = lambda spec: jax.sharding.NamedSharding(mesh, spec)
        rep = named(jax.sharding.PartitionSpec())
        pool_part = named(jax.sharding.PartitionSpec(ctx.dcp_axis) if self.dcp > 1 else jax.sharding.PartitionSpec())

        def layer(c):
            if c is None:
                return None
            if isinstance(c, LayerPool):
                return LayerPool(tuple(pool_part for _ in c.latent), tuple(pool_part for _ in c.index), rep)
            state = named(placement(ctx, kda_state_dims(ctx, *c.state_bhkv.shape[1:2], c.state_bhkv.shape[3]),
                                    c.state_bhkv.shape))
            tail = lambda a: named(placement(ctx, (d, None, t), a.shape))
            return type(c)(state, tail(c.q_tail_bkp), tail(c.k_tail_bkp), tail(c.v_tail_bkp))

        cache = abstract.cache if isinstance(abstract, DeviceState) else abstract
        placed = cache.replace(length=rep, block_tables=rep, layers=tuple(layer(c) for c in cache.layers))
        if isinstance(abstract, DeviceState):
            return DeviceState(placed, rep, rep)
        return placed

    def cache_bytes_per_device(self) -> int:
        """Bytes of every cache and state buffer of the model (KDA states and conv tails, MLA pools and their
        scales, lengths, block tables) on the most loaded device; the sampler's penalty rows aside."""
        return self._bytes_per_device(self._abstract_state.cache,
                                      None if self.mesh is None else self.state_shardings(self._abstract_state).cache)

    def cache1_bytes_per_device(self) -> int:
        """Bytes of one batch-1 per-sequence cache (a prefix-cache checkpoint: length, KDA states, conv tails) on the
        most loaded device."""
        return self._bytes_per_device(self._abstract_cache1, self.state_shardings(self._abstract_cache1))

    @staticmethod
    def _bytes_per_device(abstract, shardings) -> int:
        leaves = jax.tree.leaves(abstract)
        shardings = None if shardings is None else jax.tree.leaves(shardings)
        total = 0
        for i, a in enumerate(leaves):
            shape = a.shape if shardings is None else shardings[i].shard_shape(a.shape)
            total += int(np.prod(shape)) * jnp.dtype(a.dtype).itemsize
        return total

    @property
    def max_cached_tokens(self) -> int:
        """Sequence positions the pools hold across the DCP ranks (the null page aside)."""
        return self.spec.usable_blocks * self.block_tokens

    # ------------------------------------------------------------------------------------------------ compile
    @property
    def program_names(self) -> list[str]:
        return (["zeros_state", "zeros_cache1", "copy_cache1", "insert", "take_cache1", "copy_blocks"]
                + [self._prefill_name(c) for c in self.chunk_sizes]
                + [f"prefill_img_{c}" for c in self.chunk_sizes if self.images]
                + [self._decode_name(kind, plain, b) for kind in self._decode_kinds
                   for plain in (False, True)[:1 + self.plain_sampling] for b in (None,) + self.buckets])

    @property
    def _decode_kinds(self) -> tuple[str, ...]:
        """The decode programs' kinds: "step", and "verify" with speculative decoding."""
        return ("step", "verify")[:1 + bool(self.spec_tokens)]

    @staticmethod
    def _decode_name(kind: str, plain: bool, bucket: Optional[int]) -> str:
        """The program of a decode (`kind` "step") or verify ("verify") step: ``step``, ``step_plain``,
        ``step_8``, ``step_plain_8``, ..."""
        return kind + ("_plain" if plain else "") + ("" if bucket is None else f"_{bucket}")

    def program_args(self) -> dict:
        """Every program as (jitted function, abstract arguments): `ShapeDtypeStruct`s with their shardings, the
        parameters as the flat list of the model's arrays (concrete or abstract). `compile` lowers these;
        `kimi_jax.export` exports them for another platform."""
        rep = self._replicated
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
        like = lambda a: sds(a.shape, a.dtype)
        params = self._param_leaves

        def placed(abstract):
            shardings = self.state_shardings(abstract)
            if shardings is None:
                return jax.tree.map(like, abstract)
            return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

        state, cache1 = placed(self._abstract_state), placed(self._abstract_cache1)
        rows = jax.tree.map(like, RowParams(self.B, self.V).abstract())
        B, NB = self.B, self.max_blocks

        def controls(b, K1=None):  # a step's (K1 = None) or a verify step's per-position constraints, b rows
            per = (b,) if K1 is None else (b, K1)
            return Controls(sds((b,), jnp.int32), sds((b,), bool), sds(per, jnp.int32),
                            sds(per + (MAX_ALLOWED_IDS,), jnp.int32))

        ctl = controls(B)
        tables = jax.tree.map(like, self.tables)
        f = self._fns
        programs = {
            "zeros_state": (f["zeros_state"], ()),
            "zeros_cache1": (f["zeros_cache1"], ()),
            "copy_cache1": (f["copy_cache1"], (cache1,)),
            "insert": (f["insert"], (state, cache1, sds((), jnp.int32), sds((self.V,), bool),
                                     sds((self.V,), jnp.int32))),
            "take_cache1": (f["take_cache1"], (state, sds((), jnp.int32))),
            "step": (f["step"], (params, state, sds((B,), jnp.int32), sds((B,), bool), rows, ctl, tables,
                                 sds((B, NB), jnp.int32))),
            "copy_blocks": (f["copy_blocks"], (state, sds((NB,), jnp.int32), sds((NB,), jnp.int32))),
        }
        for b in self.buckets:  # the same step over b slots (`slots [b]` picks them)
            programs[f"step_{b}"] = (f["step_rows"], (params, state, sds((b,), jnp.int32), sds((b,), jnp.int32),
                                                      sds((b,), bool), rows, controls(b), tables,
                                                      sds((b, NB), jnp.int32)))
        if self.spec_tokens:
            K1 = self.spec_tokens + 1
            q = (sds((B, K1 - 1, self.V), jnp.float32), sds((B, K1 - 1), bool)) if self.draft_q else (None, None)
            programs["verify"] = (f["verify"], (params, state, sds((B, K1), jnp.int32), sds((B,), jnp.int32),
                                                sds((B,), bool), rows, controls(B, K1), tables,
                                                sds((B, NB), jnp.int32), *q))
            for b in self.buckets:
                qb = (sds((b, K1 - 1, self.V), jnp.float32), sds((b, K1 - 1), bool)) if self.draft_q else (None, None)
                programs[f"verify_{b}"] = (f["verify_rows"], (
                    params, state, sds((b,), jnp.int32), sds((b, K1), jnp.int32), sds((b,), jnp.int32),
                    sds((b,), bool), rows, controls(b, K1), tables, sds((b, NB), jnp.int32), *qb))
        if self.plain_sampling:  # each decode / verify program again with the plain sampler, on the same arguments
            for kind in self._decode_kinds:
                for b in (None,) + self.buckets:
                    fn = f[kind + ("" if b is None else "_rows") + "_plain"]
                    programs[self._decode_name(kind, True, b)] = (fn, programs[self._decode_name(kind, False, b)][1])
        for c in self.chunk_sizes:
            name = self._prefill_name(c)
            programs[name] = (f["prefill_split" if c in self.token_split_sizes else "prefill"],
                              (params, sds((1, c), jnp.int32), cache1, state, sds((1, NB), jnp.int32)))
            if self.images:
                programs[f"prefill_img_{c}"] = (f["prefill_img"], (
                    params, sds((1, c), jnp.int32), sds((1, c, self.D), self.model.dtype), sds((1, c), bool), cache1,
                    state, sds((1, NB), jnp.int32)))
        return programs

    def compile(self, parallel: bool = True) -> float:
        """Lower and compile every program; returns the wall time.  Idempotent.  In parallel, each program starts
        compiling (XLA, off the GIL) as soon as it is lowered (tracing, on this thread), the step programs first: a
        real-size model spends minutes in each of the two."""
        if self._exe:
            return 0.0
        t0 = time.perf_counter()
        programs = self.program_args()
        # the slowest to compile first, so that their compiles overlap the rest's lowering
        order = sorted(programs, key=lambda n: (n not in ("step", "verify"), not n.startswith(("step", "verify")),
                                                not n.startswith("prefill")))
        errors, threads = [], []

        def build(name, low):
            t = time.perf_counter()
            try:
                self._exe[name] = low.compile()
            except BaseException as e:  # reported below
                errors.append((name, e))
                return
            self.compile_seconds[name] = time.perf_counter() - t
            log.info("compiled %-14s in %5.1fs", name, self.compile_seconds[name])

        lowered = {}
        try:
            for i, name in enumerate(order):
                t = time.perf_counter()
                fn, args = programs[name]
                lowered[name] = fn.lower(*args)
                log.info("lowered  %-14s in %5.1fs (%d of %d)", name, time.perf_counter() - t, i + 1, len(order))
                if parallel:
                    threads.append(threading.Thread(target=build, args=(name, lowered[name]), daemon=True))
                    threads[-1].start()
        except BaseException:
            for t in threads:  # the compiles already started end before the error propagates: none is half-kept
                t.join()
            self._exe.clear()
            raise
        log.info("lowered %d programs in %.1fs; %s", len(lowered), time.perf_counter() - t0,
                 "compiling the rest" if parallel else "compiling one at a time")
        for t in threads:
            t.join()
        if not parallel:
            for n, low in lowered.items():
                build(n, low)
        if errors:
            self._exe.clear()
            name, e = errors[0]
            raise RuntimeError(f"compiling engine program {name} failed: {e}") from e
        return time.perf_counter() - t0

    def _call(self, name, *args):
        exe = self._exe.get(name)
        if exe is None:
            raise RuntimeError("ModelRunner.compile() must run before the engine programs are used")
        return self._inflight(exe(*args))

    # ------------------------------------------------------------------------------------------------ programs
    def new_state(self) -> DeviceState:
        return self._call("zeros_state")

    def new_cache1(self) -> PagedModelCache:
        return self._call("zeros_cache1")

    def take_cache1(self, state: DeviceState, slot: int) -> PagedModelCache:
        """A copy of slot ``slot``'s length and KDA state as a batch-1 cache (``state`` is not donated)."""
        return self._call("take_cache1", state, np.int32(slot))

    def copy_cache1(self, cache1: PagedModelCache) -> PagedModelCache:
        return self._call("copy_cache1", cache1)

    def _prefill_name(self, size: int) -> str:
        """The text prefill program of chunk size `size`: ``prefill_split_{size}`` (token split) or
        ``prefill_{size}``."""
        return f"prefill_split_{size}" if size in self.token_split_sizes else f"prefill_{size}"

    def token_split_summary(self) -> str:
        """One line for the start log: which prefill chunk sizes run token-split, or why none does."""
        if self.token_split_sizes:
            return (f"token-split prefill: chunk sizes {list(self.token_split_sizes)} split {self.dcp} ways over the "
                    f"{self.ctx.axes.context!r} axis (threshold {self.token_split_min_tokens} tokens)")
        if not self.token_split_min_tokens:
            why = "threshold 0"
        elif self.dcp < 2:
            why = "no --dcp"
        elif self.ctx.dcp_axis != self.ctx.axes.context:
            why = (f"DCP runs over the tensor axis, where a plain chunk already splits its work by heads; a context "
                   f"axis of size {self.dcp} would take it")
        else:
            why = f"no chunk size reaches the threshold of {self.token_split_min_tokens} tokens"
        return f"token-split prefill: off ({why})"

    def splits_tokens(self, size: int, images: bool = False) -> bool:
        """Whether a prefill chunk of `size` tokens (with image tokens: `images`) runs split by tokens over the
        DCP axis."""
        return not images and size in self.token_split_sizes

    def prefill(self, cache1: PagedModelCache, ids: np.ndarray, state: DeviceState, table1: np.ndarray, mm=None):
        """Run one sequence's chunk; returns (cache1, state) -- both passed in are donated.  ``mm``: None, or
        (features ``[1, C, D]`` in the model's dtype, mask bool ``[1, C]``) for a chunk with image tokens.  Text
        chunks of the ``token_split_sizes`` run split by tokens over the DCP axis (the same result)."""
        ids = np.asarray(ids, np.int32).reshape(1, -1)
        table1 = np.asarray(table1, np.int32).reshape(1, self.max_blocks)
        if mm is None:
            return self._call(self._prefill_name(ids.shape[1]), self._param_leaves, ids, cache1, state, table1)
        if not self.images:
            raise RuntimeError("this runner was built without image prefill programs (images=False)")
        feats, mask = mm
        return self._call(f"prefill_img_{ids.shape[1]}", self._param_leaves, ids,
                          np.asarray(feats).astype(self.model.dtype, copy=False), np.asarray(mask, bool), cache1,
                          state, table1)

    def insert(self, state: DeviceState, cache1: PagedModelCache, slot: int, prompt_mask_row: np.ndarray,
               counts_row: Optional[np.ndarray] = None) -> DeviceState:
        if counts_row is None:
            counts_row = np.zeros(self.V, np.int32)
        return self._call("insert", state, cache1, np.int32(slot), np.asarray(prompt_mask_row, bool),
                          np.asarray(counts_row, np.int32))

    def bucket_for(self, running: int) -> Optional[int]:
        """The fewest rows of a compiled bucket that hold ``running`` sequences; None: the full ``[B]`` step."""
        return next((b for b in self.buckets if b >= running), None)

    def _decode_program(self, kind: str, plain: bool, slots) -> str:
        if plain and not self.plain_sampling:
            raise ValueError("this runner was built without the plain-sampler programs (plain_sampling=False)")
        return self._decode_name(kind, plain, None if slots is None else len(slots))

    def step(self, state: DeviceState, tokens: np.ndarray, active: np.ndarray, rows, ctl: Controls,
             block_tables: np.ndarray, sampling_tables: Optional[Tables] = None, slots: Optional[np.ndarray] = None,
             plain: bool = False):
        """One decode token per row; ``sampling_tables``: the class table to sample with (None: the runner's own, as
        built; an engine passes its copy with its dynamic bitmask rows, `update_class_masks`). ``slots`` None: rows
        are the B slots; else int32 ``[b]`` distinct slots (b a bucket): tokens, active, ctl and block_tables then
        hold b rows, one per listed slot, and so does the result; ``rows`` stays the ``[B]`` upload. ``plain``: the
        program with the plain sampler (built with ``plain_sampling``), for steps where no row whose output is read
        uses the filter or top log-probs (`RowParams.needs_branches`): the same outputs for those rows."""
        tables = self.tables if sampling_tables is None else sampling_tables
        name = self._decode_program("step", plain, slots)
        if slots is None:
            return self._call(name, self._param_leaves, state, tokens, active, rows, ctl, tables,
                              np.asarray(block_tables, np.int32))
        return self._call(name, self._param_leaves, state, np.asarray(slots, np.int32), tokens,
                          active, rows, ctl, tables, np.asarray(block_tables, np.int32))

    def verify(self, state: DeviceState, tokens: np.ndarray, n_draft: np.ndarray, active: np.ndarray, rows,
               ctl: Controls, block_tables: np.ndarray, q=None, has_q=None, sampling_tables: Optional[Tables] = None,
               slots: Optional[np.ndarray] = None, plain: bool = False):
        """One speculative step: tokens ``[B, k+1]`` (next token, then the drafts), n_draft ``[B]`` valid drafts,
        ``ctl`` with per-position constraints (allow_class ``[B, k+1]``, allow_ids ``[B, k+1, MAX_ALLOWED_IDS]``);
        with ``draft_q``, ``q`` float32 ``[B, k, V]`` (device array) and ``has_q`` bool ``[B, k]``: where a draft was
        sampled from q (``spec_decode.verify_sample``).  ``slots``, ``plain``: as in `step`.  Returns (state,
        VerifyOut) -- the state passed in is donated."""
        if (q is not None) != self.draft_q:
            raise ValueError("this runner's verify program takes the drafts' q exactly when built with draft_q=True")
        if q is not None and self._replicated is not None:  # the draft model's device -> the mesh, replicated
            q = jax.device_put(q, self._replicated)
        extra = (None, None) if q is None else (q, np.asarray(has_q, bool))
        tables = self.tables if sampling_tables is None else sampling_tables
        picked = () if slots is None else (np.asarray(slots, np.int32),)
        return self._call(self._decode_program("verify", plain, slots), self._param_leaves, state, *picked,
                          np.asarray(tokens, np.int32), np.asarray(n_draft, np.int32), active, rows, ctl, tables,
                          np.asarray(block_tables, np.int32), *extra)

    def put_rows(self, rows_host: Rows) -> Rows:
        """The slots' sampling parameters (numpy `Rows`, `RowParams`' host copy) on the devices, replicated on the
        mesh: the ``rows`` argument of `step` / `verify`."""
        return jax.device_put(rows_host, self._replicated)

    def update_class_masks(self, tables: Tables, words: np.ndarray, base: int) -> Tables:
        """``tables`` with class-table rows ``base … base + R`` replaced by bitmask ``words`` int32 ``[R, ⌈V/32⌉]``
        (bit j of word w: token 32·w + j allowed), unpacked on device: one small upload per step for the guided rows
        whose grammar gives a bitmask. The table passed in is not donated (another engine may hold it).

        The unpacking program is compiled ahead of time at the first call for a (base, R) -- an engine makes that
        call at start -- and the runner keeps it, so no engine serving on this runner compiles it again."""
        words = np.asarray(words, np.int32)
        key = (int(base), words.shape)
        upload = self._mask_uploads.get(key)
        if upload is None:
            V = self.V

            def unpack(table, words):
                shifts = jnp.arange(32, dtype=jnp.int32)
                bits = (words[:, :, None] >> shifts) & 1  # [R, W, 32]
                rows = bits.reshape(words.shape[0], -1)[:, :V].astype(bool)
                return jax.lax.dynamic_update_slice_in_dim(table, rows, base, axis=0)

            where = tables.class_masks.sharding  # the words go where the table is (one device, or replicated)
            upload = jax.jit(unpack, in_shardings=(where, where), out_shardings=where)
            upload = self._mask_uploads[key] = upload.lower(tables.class_masks, words).compile()
        return tables._replace(class_masks=upload(tables.class_masks, words))

    def copy_blocks(self, state: DeviceState, src: Sequence[int], dst: Sequence[int]) -> DeviceState:
        """Copy pages src[i] -> dst[i] in every MLA pool (at most max_blocks pairs)."""
        if len(src) != len(dst) or len(src) > self.max_blocks:
            raise ValueError(f"copy_blocks takes up to {self.max_blocks} (src, dst) pairs, got {len(src)}/{len(dst)}")
        pad = lambda b: np.pad(np.asarray(b, np.int32), (0, self.max_blocks - len(b)))
        return self._call("copy_blocks", state, pad(src), pad(dst))

    def plan_chunks(self, n: int) -> tuple[list[int], int]:
        """Split ``n`` prompt tokens into chunk sizes (largest first); returns (chunks, leftover < smallest)."""
        chunks = []
        for c in self.chunk_sizes:
            k, n = divmod(n, c)
            chunks += [c] * k
        return chunks, n
