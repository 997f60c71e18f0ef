"""The device programs of the engine, compiled ahead of time for a fixed set of shapes.

* ``prefill[C](params, ids [1, C], cache1) -> cache1`` for each prefill chunk size C: runs C prompt tokens into a
  batch-1 cache at its current length (exact tokens, no padding -- padding would enter the KDA recurrent state).
* ``insert(state, cache1, slot, prompt_mask_row) -> state``: copies a prefilled batch-1 cache into one slot of the
  batch cache and resets that slot's penalty counts.
* ``step(params, state, tokens [B], active [B], rows, controls, tables) -> (state, SampleOut)``: one decode token for
  every slot plus sampling, fused.  Inactive slots get a dummy token; their cache length is held, so they never
  write past the end, and their outputs are ignored.
* small helpers: zero state, zero batch-1 cache, copy of a batch-1 cache (prefix-cache snapshots).

All of them are lowered and compiled once in ``compile()`` (in parallel threads; XLA compilation releases the GIL) and
then called as ``Compiled`` executables: a call with any other shape is an error, not a silent recompile.  So the set
of XLA programs is exactly ``len(prefill_chunk_sizes) + 5``, independent of traffic.

The batch cache and the penalty counts are donated to every step and insert (updated in place).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..modules.decoder import ModelCache
from ..modules.mla import MLACache
from .guide import MAX_ALLOWED_IDS
from .sampler import Controls, RowParams, Tables, sample

log = logging.getLogger("kimi_jax.engine")


class DeviceState(NamedTuple):
    cache: ModelCache  # batch cache, B = max_num_seqs
    counts: jax.Array  # i32 [B, V]: generated-token counts (frequency / presence penalties)
    prompt_mask: jax.Array  # bool [B, V]: tokens of the prompt (repetition penalty)


KV_DTYPES = {"auto": None, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32,
             "float32": jnp.float32}


def resolve_kv_dtype(name: Optional[str]):
    if name is None:
        return None
    key = str(name).lower()
    if key in ("fp8", "nvfp4"):
        raise ValueError(f"kv dtype {name!r}: quantised cache storage is not implemented in the engine yet "
                         "(the planner already accounts for it); use auto, bf16 or fp32")
    if key not in KV_DTYPES:
        raise ValueError(f"unknown kv dtype {name!r}; choose one of auto, bf16, fp32")
    return KV_DTYPES[key]


class ModelRunner:
    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, prefill_chunk_sizes: Sequence[int],
                 kv_dtype=None, class_masks: np.ndarray, stop_mask: np.ndarray):
        cfg = model.config
        self.model = model
        self.B = int(max_num_seqs)
        self.L = int(max_model_len)
        self.V = cfg.vocab_size
        self.chunk_sizes = tuple(sorted({int(c) for c in prefill_chunk_sizes}, reverse=True))
        if not self.chunk_sizes or self.chunk_sizes[-1] < 1:
            raise ValueError(f"prefill chunk sizes must be positive integers, got {prefill_chunk_sizes}")
        self.kv_dtype = kv_dtype
        graphdef, act_dtype = model.graphdef, model.dtype
        B, L, V = self.B, self.L, self.V

        def zeros_cache(batch):
            c = ModelCache.zeros(cfg, batch, L, act_dtype)
            if kv_dtype is not None:
                c = c._replace(layers=tuple(
                    MLACache(*(a.astype(kv_dtype) for a in layer)) if isinstance(layer, MLACache) else layer
                    for layer in c.layers))
            return c

        def same_dtypes(new, old):
            return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)

        def zeros_state():
            return DeviceState(zeros_cache(B), jnp.zeros((B, V), jnp.int32), jnp.zeros((B, V), bool))

        def zeros_cache1():
            return zeros_cache(1)

        def copy_cache1(c):
            return jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), c)

        def prefill(params, ids, cache1):
            m = nnx.merge(graphdef, params)
            _, new = m.hidden_states(ids, cache1)
            return same_dtypes(new, cache1)

        def insert(state, cache1, slot, prompt_mask_row):
            cache = state.cache.insert(slot, cache1)
            counts = jax.lax.dynamic_update_index_in_dim(state.counts, jnp.zeros((V,), jnp.int32), slot, 0)
            mask = jax.lax.dynamic_update_index_in_dim(state.prompt_mask, prompt_mask_row, slot, 0)
            return DeviceState(cache, counts, mask)

        def step(params, state, tokens, active, rows, ctl, tables):
            m = nnx.merge(graphdef, params)
            logits, cache = m(tokens[:, None], state.cache)
            cache = cache._replace(length=jnp.where(active, cache.length, state.cache.length))
            cache = same_dtypes(cache, state.cache)
            out, counts = sample(logits[:, 0], rows, ctl, state.counts, state.prompt_mask, tables)
            return DeviceState(cache, counts, state.prompt_mask), out

        self._fns = {
            "zeros_state": jax.jit(zeros_state),
            "zeros_cache1": jax.jit(zeros_cache1),
            "copy_cache1": jax.jit(copy_cache1),
            "prefill": jax.jit(prefill, donate_argnums=(2,)),
            "insert": jax.jit(insert, donate_argnums=(0,)),
            "step": jax.jit(step, donate_argnums=(1,)),
        }
        self._exe: dict = {}
        self.tables = Tables(jnp.asarray(class_masks), jnp.asarray(stop_mask))
        self.compile_seconds: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------------ compile
    @property
    def program_names(self) -> list[str]:
        return ["zeros_state", "zeros_cache1", "copy_cache1", "insert", "step"] + [
            f"prefill_{c}" for c in self.chunk_sizes]

    def compile(self, parallel: bool = True) -> float:
        """Lower and compile every program; returns the wall time.  Idempotent."""
        if self._exe:
            return 0.0
        t0 = time.perf_counter()
        sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
        params = self.model.params
        state = jax.eval_shape(self._fns["zeros_state"])
        cache1 = jax.eval_shape(self._fns["zeros_cache1"])
        rows = RowParams(self.B, self.V).abstract()
        B = self.B
        ctl = Controls(jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), bool),
                       jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, MAX_ALLOWED_IDS), jnp.int32))
        tables = jax.tree.map(sds, self.tables)
        lowered = {
            "zeros_state": self._fns["zeros_state"].lower(),
            "zeros_cache1": self._fns["zeros_cache1"].lower(),
            "copy_cache1": self._fns["copy_cache1"].lower(cache1),
            "insert": self._fns["insert"].lower(state, cache1, jax.ShapeDtypeStruct((), jnp.int32),
                                                jax.ShapeDtypeStruct((self.V,), bool)),
            "step": self._fns["step"].lower(params, state, jax.ShapeDtypeStruct((B,), jnp.int32),
                                            jax.ShapeDtypeStruct((B,), bool), rows, ctl, tables),
        }
        for c in self.chunk_sizes:
            lowered[f"prefill_{c}"] = self._fns["prefill"].lower(params, jax.ShapeDtypeStruct((1, c), jnp.int32),
                                                                 cache1)
        log.info("lowered %d programs in %.1fs; compiling (%s)", len(lowered), time.perf_counter() - t0,
                 "parallel" if parallel else "serial")
        errors = []

        def build(name, low):
            t = time.perf_counter()
            try:
                self._exe[name] = low.compile()
            except BaseException as e:  # reported below
                errors.append((name, e))
                return
            self.compile_seconds[name] = time.perf_counter() - t
            log.info("compiled %-14s in %5.1fs", name, self.compile_seconds[name])

        if parallel:
            # biggest first so the long ones overlap
            order = sorted(lowered, key=lambda n: (n != "step", not n.startswith("prefill")))
            threads = [threading.Thread(target=build, args=(n, lowered[n]), daemon=True) for n in order]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
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
        return exe(*args)

    # ------------------------------------------------------------------------------------------------ programs
    def new_state(self) -> DeviceState:
        return self._call("zeros_state")

    def new_cache1(self) -> ModelCache:
        return self._call("zeros_cache1")

    def copy_cache1(self, cache1: ModelCache) -> ModelCache:
        return self._call("copy_cache1", cache1)

    def prefill(self, cache1: ModelCache, ids: np.ndarray) -> ModelCache:
        ids = np.asarray(ids, np.int32).reshape(1, -1)
        return self._call(f"prefill_{ids.shape[1]}", self.model.params, ids, cache1)

    def insert(self, state: DeviceState, cache1: ModelCache, slot: int, prompt_mask_row: np.ndarray) -> DeviceState:
        return self._call("insert", state, cache1, np.int32(slot), np.asarray(prompt_mask_row, bool))

    def step(self, state: DeviceState, tokens: np.ndarray, active: np.ndarray, rows, ctl: Controls):
        return self._call("step", self.model.params, state, tokens, active, rows, ctl, self.tables)

    def plan_chunks(self, n: int) -> tuple[list[int], int]:
        """Split ``n`` prompt tokens into chunk sizes (largest first); returns (chunks, leftover < smallest)."""
        chunks = []
        for c in self.chunk_sizes:
            k, n = divmod(n, c)
            chunks += [c] * k
        return chunks, n
