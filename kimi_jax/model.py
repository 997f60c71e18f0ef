"""The public Python interface: `load_model`, `Model.logits`, `Model.generate` (README.md "Quickstart")."""

from __future__ import annotations

import copy
import logging
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sharding.context import ForwardContext, KernelConfig, context_for_mesh
from sharding.mesh import make_mesh
from sharding.rules import path_name, shard_params

from .cache import PAGE_TOKENS
from .config import ModelConfig
from .inflight import InflightBound
from .modules.decoder import DecoderLayer, KimiForCausalLM, ModelCache, PagedModelCache
from .modules.vision import VisionTower, preprocess_image
from .modules.vision_buckets import images_features
from .paged_cache import PagedCacheSpec

log = logging.getLogger("kimi_jax")

# Presets that are meant to be materialised with random weights on one host; the rest are abstract-only.
MAX_RANDOM_PARAMS = 2_000_000_000

# Prompts longer than this run in chunks of this many tokens (`prefill_chunks`): attention then holds chunk × context
# scores at a time, never T × T (at 8K tokens K3.1's 96 heads of float32 scores alone are 24 GiB), and a long prompt
# is prefilled as the serving engine prefills it. `Model.prefill_chunk_tokens` overrides it per model.
PREFILL_CHUNK_TOKENS = 2048


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Every parameter's `jax.ShapeDtypeStruct`, keyed by its path ("layers.3.self_attn.q_b_proj.kernel").

    Shapes come from `abstract_module` (the real modules under `nnx.eval_shape`); nothing is materialised.
    """
    return _flat(nnx.state(abstract_module(cfg, dtype), nnx.Param))


def is_routed_expert(name: str) -> bool:
    """Whether the parameter at path `name` belongs to the routed experts ("layers.3.block_sparse_moe.experts.gate",
    and an MXFP4 matrix's ".packed" / ".scale"); the shared experts' weights do not."""
    return ".block_sparse_moe.experts." in "." + name


def _flat(state) -> dict:
    """{parameter path: `jax.ShapeDtypeStruct`} of an NNX state."""
    return {path_name(path): jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def param_count(cfg: ModelConfig) -> int:
    """Total parameters (elements) from abstract shapes; nothing is materialised."""
    return sum(int(np.prod(x.shape)) for x in abstract_params(cfg).values())


def prefill_chunks(total: int, chunk: int) -> list[int]:
    """Chunk sizes for a prompt of `total` tokens: `[total]` when it fits one chunk, else whole chunks of `chunk`
    and then the rest as powers of two, largest first -- at most log2(chunk) + 1 distinct sizes, so long prompts of
    any length compile a bounded set of programs (no padding: it would enter the KDA state)."""
    if chunk < 1:
        raise ValueError(f"the prefill chunk must be >= 1 token, got {chunk}")
    if total <= chunk:
        return [total]
    sizes = [chunk] * (total // chunk)
    rest, piece = total % chunk, 1 << (chunk.bit_length() - 1)
    while rest:
        if piece <= rest:
            sizes.append(piece)
            rest -= piece
        piece >>= 1
    return sizes


def _sample(logits_bv, temperature, key):
    if temperature <= 0.0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_bv / temperature, axis=-1).astype(jnp.int32)


class Model:
    """A loaded model: config, parameters and jitted forward / prefill / decode functions."""

    def __init__(self, module: KimiForCausalLM, dtype=jnp.float32, mesh=None, vision=None,
                 kernels: KernelConfig = KernelConfig(), platform: Optional[str] = None):
        """`module` may be abstract (`nnx.eval_shape`): its parameters are then `ShapeDtypeStruct`s, placed on
        `mesh` by the partition rules without materialising anything (`abstract_model`; the programs can be
        lowered and exported, not run). `platform`: what "auto" kernels resolve against (None: this host's).

        Parameters are taken in the format they come in: laying routed experts out for a platform's kernels is the
        loader's job, once (`modules.moe.prepare_experts`). With `mesh`, a parameter not yet placed as the
        partition rules say (a freshly built module) is placed; the loader's, placed shard by shard as they were
        read, already are and stay where they are."""
        self.config: ModelConfig = module.cfg
        self.dtype = dtype
        self.mesh = mesh
        self.kernels = kernels
        # what every forward of this model runs with: its mesh and axis roles, its kernels (`sharding.context`)
        self.ctx: ForwardContext = context_for_mesh(mesh, kernels, platform=platform)
        # the MoonViT tower + projector (`modules.vision.VisionTower`), or None for a text-only model / checkpoint;
        # kept outside the text module: its ~0.4B parameters stay replicated and whole-image attention runs apart
        self.vision = vision
        self.graphdef, self.params = nnx.split(module)
        if mesh is not None:
            self.params = shard_params(self.params, mesh)
        self._jit_forward()
        self.prefill_chunk_tokens = PREFILL_CHUNK_TOKENS
        self._inflight = InflightBound.for_mesh(mesh)  # CPU: a wait every few programs of a loop (inflight.py)

    def _jit_forward(self):
        """The jitted forward of this model's graph under `self.ctx` (full / prefill and the donating step)."""
        graphdef, ctx = self.graphdef, self.ctx

        def forward(params, ids, cache, mla_form="absorbed", mm=None):
            m = nnx.merge(graphdef, params)
            return m(ids, cache, ctx=ctx, mla_form=mla_form, mm=mm)

        self._forward = jax.jit(forward, static_argnames=("mla_form",))
        self._step = jax.jit(forward, donate_argnums=(2,))

    def with_kernels(self, kernels: KernelConfig) -> "Model":
        """The same parameters (shared, not copied) run with other kernels / precisions (`KernelConfig`)."""
        other = copy.copy(self)
        other.kernels = kernels
        other.ctx = self.ctx.replace(kernels=kernels)
        other._jit_forward()
        return other

    @property
    def module(self) -> KimiForCausalLM:
        return nnx.merge(self.graphdef, self.params)

    def new_cache(self, batch: int, max_len: int) -> ModelCache:
        """Contiguous cache: `max_len` rows per sequence in every MLA layer, in the activation dtype."""
        return ModelCache.zeros(self.config, batch, max_len, self.dtype)

    def new_paged_cache(self, batch: int, max_len: int, *, num_blocks: Optional[int] = None, kv_dtype: str = "bf16",
                        index_dtype: Optional[str] = None, latent_scales=None) -> PagedModelCache:
        """Paged cache (docs/model.md §10): MLA rows in pages of 64 tokens, stored as `kv_dtype` (bf16 | fp8 | nvfp4;
        index keys as `index_dtype`, bf16 | fp8 | mxfp4, default bf16 with a bf16 latent else fp8), KDA state per row.

        Each sequence holds up to `max_len` tokens (`ceil(max_len / 64)` table entries). With `num_blocks=None`
        the pool has one page per table entry of every row and row b owns pages `1 + b·max_blocks …` (tables
        filled, ready for `prefill` / `decode_step`). With an explicit `num_blocks` the tables start empty (null):
        hand pages out with `kimi_jax.paged_cache.BlockAllocator` and set them with `cache.with_block_tables`.
        """
        max_blocks = -(-int(max_len) // PAGE_TOKENS)
        if index_dtype is None:
            index_dtype = "bf16" if kv_dtype == "bf16" else "fp8"
        fixed = num_blocks is None
        if fixed:
            num_blocks = 1 + batch * max_blocks
        spec = PagedCacheSpec.create(self.config, num_blocks=num_blocks, kv_dtype=kv_dtype, index_dtype=index_dtype)
        cache = PagedModelCache.zeros(self.config, spec, batch, max_blocks, self.dtype, latent_scales)
        if fixed:
            cache = cache.with_block_tables(1 + np.arange(batch * max_blocks, dtype=np.int32).reshape(batch, -1))
        return cache

    def encode_images(self, images) -> list:
        """The vision tower on each image: a list of features `[n_i, hidden]` (numpy, activation dtype), n_i =
        `image_token_count` of the image's patch grid = (H'/28)·(W'/28) after `preprocess_image`'s resize and
        padding. images: RGB uint8 arrays `[H, W, 3]` (e.g. `np.asarray(PIL.Image.open(f).convert("RGB"))`).
        Each image runs padded to a bucket of patch counts (`modules.vision_buckets`): the tower compiles once
        per bucket (18 over K3's image sizes), not once per image size; every image's run starts before the
        first's features are fetched."""
        if self.vision is None:
            why = ("its config has no vision tower" if self.config.vision is None
                   else "the checkpoint holds no vision_tower.* / mm_projector.* tensors")
            raise ValueError(f"this model cannot take images: {why}")
        inputs = [preprocess_image(image, self.config.vision) for image in images]  # (patches, grid) each
        return [f.astype(self.dtype) for f in images_features(self.vision, inputs)]

    def image_inputs(self, input_ids, images):
        """(features `[B, T, D]`, mask bool `[B, T]`) that put each image's features at its `<|media_pad|>` tokens,
        or None without images. The ids must already hold one pad token per image token (docs/model.md §9: the prompt's
        single `<|media_pad|>` expanded with `modules.vision.expand_image_pads`), images in order of their pads, row by
        row; an image's tokens may not span two rows."""
        if images is None or len(images) == 0:
            return None
        ids = np.asarray(input_ids)
        feats = self.encode_images(images)
        pad_id = self.config.vision.image_token_id
        mask_bt = ids == pad_id
        counts = [int(f.shape[0]) for f in feats]
        if int(mask_bt.sum()) != sum(counts):
            raise ValueError(f"input_ids hold {int(mask_bt.sum())} <|media_pad|> tokens (id {pad_id}) but the "
                             f"{len(counts)} image(s) need {sum(counts)} ({', '.join(map(str, counts))}): expand each "
                             "image's placeholder with kimi_jax.modules.vision.expand_image_pads")
        row_of_pad = np.nonzero(mask_bt)[0]
        ends = np.cumsum(counts)
        for i, (end, n) in enumerate(zip(ends, counts)):
            if row_of_pad[end - n] != row_of_pad[end - 1]:
                raise ValueError(f"image {i}'s {n} tokens span two rows of input_ids")
        D = self.config.hidden_size
        feats_btD = jnp.zeros(ids.shape + (D,), self.dtype)
        b_idx, t_idx = np.nonzero(mask_bt)
        feats_btD = feats_btD.at[b_idx, t_idx].set(jnp.concatenate(feats, axis=0).astype(self.dtype))
        return feats_btD, jnp.asarray(mask_bt)

    def logits(self, input_ids, *, images=None, mla_form: str = "absorbed") -> np.ndarray:
        """Full causal forward. input_ids int `[B, T]` -> float32 numpy `[B, T, vocab]`. `images`: RGB uint8
        `[H, W, 3]` arrays for the prompt's expanded `<|media_pad|>` tokens (see `image_inputs`). Longer than
        `prefill_chunk_tokens` (with the default absorbed MLA form), it runs in chunks through a paged cache."""
        ids = _as_ids(input_ids, self.config)
        B, T = ids.shape
        if T > self.config.max_position_embeddings:  # as generate and the engine refuse them
            raise ValueError(f"{T} tokens exceed max_position_embeddings {self.config.max_position_embeddings}")
        mm = self.image_inputs(ids, images)
        if T <= self.prefill_chunk_tokens or mla_form != "absorbed":
            out, _ = self._forward(self.params, ids, None, mla_form=mla_form, mm=mm)
            return np.asarray(out, np.float32)
        out, _ = self._prefill_chunked(ids, self._long_cache(B, T), mm, keep="host")
        return out

    def prefill(self, input_ids, max_len: Optional[int] = None, *, cache=None, images=None, logits: str = "all"):
        """Run the prompt into a fresh contiguous cache of `max_len` tokens, or — with `cache` (a `ModelCache` or a
        `PagedModelCache`, which is donated) — append it to that cache at each row's current length (a paged
        cache's tables must already cover the new positions). Returns (logits, cache): logits `[B, T, V]`, or with
        `logits="last"` only the last position's `[B, 1, V]` (a long prompt's full logits may not fit a device).
        `images` as in `logits`. Prompts longer than `prefill_chunk_tokens` run in chunks (`prefill_chunks`); for
        very long contexts pass a paged cache (`new_paged_cache`), whose attention reads pages as it goes."""
        ids = _as_ids(input_ids, self.config)
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        mm = self.image_inputs(ids, images)
        if cache is None:
            if max_len is None:
                raise ValueError("prefill needs max_len (a fresh contiguous cache) or cache=")
            if ids.shape[1] > max_len:
                raise ValueError(f"prompt of {ids.shape[1]} tokens does not fit a cache of {max_len}")
            cache = self.new_cache(ids.shape[0], max_len)
        return self._prefill_chunked(ids, cache, mm, keep=logits)

    def _prefill_chunked(self, ids, cache, mm, *, keep: str):
        """`ids` `[B, T]` into `cache` (donated) in chunks; returns (logits, cache): `keep` "all" `[B, T, V]` on the
        device, "last" `[B, 1, V]`, "host" `[B, T, V]` float32 numpy (each chunk's fetched as it ends)."""
        parts, start = [], 0
        for size in prefill_chunks(ids.shape[1], self.prefill_chunk_tokens):
            here = slice(start, start + size)
            out, cache = self._inflight(self._step(self.params, ids[:, here], cache,
                                                   mm=None if mm is None else (mm[0][:, here], mm[1][:, here])))
            parts.append(np.asarray(out, np.float32) if keep == "host" else out[:, -1:] if keep == "last" else out)
            start += size
        if keep == "last" or len(parts) == 1:
            return parts[-1], cache
        return (np.concatenate(parts, axis=1) if keep == "host" else jnp.concatenate(parts, axis=1)), cache

    def _long_cache(self, batch: int, max_len: int) -> PagedModelCache:
        """The cache a long `logits` / `generate` runs in: paged (the attention reads pages as it goes; a contiguous
        cache's scores would span every position), stored in the activation dtype."""
        name = "fp32" if jnp.dtype(self.dtype) == jnp.float32 else "bf16"
        return self.new_paged_cache(batch, max_len, kv_dtype=name, index_dtype=name)

    def decode_step(self, cache, token_ids_b):
        """One token per sequence (`ModelCache` or `PagedModelCache`). Returns (logits `[B, V]`, cache). The cache
        passed in is donated."""
        logits, cache = self._step(self.params, jnp.asarray(token_ids_b, jnp.int32)[:, None], cache)
        return logits[:, 0], cache

    def generate(self, input_ids, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 images=None) -> np.ndarray:
        """Greedy (temperature 0) or seeded sampling. input_ids int `[B, T]` -> numpy int `[B, T + n]`. `images` as
        in `logits`. Beyond `prefill_chunk_tokens` tokens in all it runs in a paged cache, the prompt in chunks."""
        if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)):
            raise ValueError(f"max_new_tokens must be an int ≥ 0, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
        if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.number)) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number ≥ 0 (0: greedy), got {temperature!r}")
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
                or not -2 ** 63 <= int(seed) < 2 ** 63:
            raise ValueError(f"seed must be an int in [-2**63, 2**63) (jax.random.PRNGKey's int64), got {seed!r}")
        ids = _as_ids(input_ids, self.config)
        B, T = ids.shape
        if max_new_tokens == 0:
            return np.asarray(ids)
        if T + max_new_tokens > self.config.max_position_embeddings:
            raise ValueError(f"{T} + {max_new_tokens} tokens exceed max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        key = jax.random.PRNGKey(seed)
        L = T + max_new_tokens
        cache = self.new_cache(B, L) if L <= self.prefill_chunk_tokens else self._long_cache(B, L)
        logits, cache = self._prefill_chunked(ids, cache, self.image_inputs(ids, images), keep="last")
        out = []
        tok = _sample(logits[:, -1], temperature, jax.random.fold_in(key, 0))
        out.append(tok)
        for step in range(1, max_new_tokens):
            logits_b, cache = self._inflight(self.decode_step(cache, tok))
            tok = self._inflight(_sample(logits_b, temperature, jax.random.fold_in(key, step)))
            out.append(tok)
        return np.concatenate([np.asarray(ids), np.stack([np.asarray(t) for t in out], axis=1)], axis=1)


def abstract_model(cfg: ModelConfig, *, dtype=jnp.bfloat16, mesh=None, kernels: Optional[KernelConfig] = None,
                   platform: Optional[str] = None) -> Model:
    """A `Model` of any size whose parameters are `jax.ShapeDtypeStruct`s placed on `mesh` by the partition rules:
    nothing is materialised. Its programs (the engine's `ModelRunner.program_args`) can be lowered or exported for
    `platform` ("tpu", "cuda", "cpu"), whose kernels "auto" then picks."""
    return Model(abstract_module(cfg, dtype), dtype, mesh=_mesh(mesh), kernels=kernels or KernelConfig(),
                 platform=platform)


def abstract_module(cfg: ModelConfig, dtype=jnp.float32) -> KimiForCausalLM:
    """`KimiForCausalLM` with `ShapeDtypeStruct` parameters, built as `abstract_params` counts them: each distinct
    (kind, FFN) layer is traced once and copied, since tracing the initialisers of all 93 layers of the full model
    in one graph takes minutes."""
    top = nnx.eval_shape(lambda: KimiForCausalLM(cfg.replace(layer_kinds=(), dense_layers=()), rngs=nnx.Rngs(0),
                                                 dtype=dtype))
    by_signature, layers = {}, []
    for i, kind in enumerate(cfg.layer_kinds):
        sig = (kind, cfg.is_moe_layer(i))
        if sig not in by_signature:
            by_signature[sig] = nnx.eval_shape(lambda: DecoderLayer(cfg, i, rngs=nnx.Rngs(0), dtype=dtype))
        layers.append(copy.deepcopy(by_signature[sig]))
    top.layers = nnx.List(layers)
    top.cfg = cfg
    return top


def _as_ids(input_ids, cfg: ModelConfig):
    try:
        ids = np.asarray(input_ids)
    except ValueError:  # numpy's "inhomogeneous shape": sequences of different lengths
        raise ValueError("input_ids must be a rectangular integer array [B, T]: pad the sequences to one length "
                         "or pass them one at a time") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0:
        raise ValueError(f"input_ids must hold at least one token per sequence and one sequence, got shape {ids.shape}")
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be an integer array [B, T], got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
    return jnp.asarray(ids, jnp.int32)


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype=jnp.float32, mesh=None,
                 kernels: Optional[KernelConfig] = None) -> Model:
    n = param_count(cfg)
    # under jax.eval_shape nothing is materialised: the full-size presets are built abstractly there
    if n > MAX_RANDOM_PARAMS and not isinstance(jnp.zeros(()), jax.core.Tracer):
        raise ValueError(
            f"{cfg.architecture} has {n / 1e9:.1f}B parameters: too large to materialise with random weights. "
            "Use `python -m kimi_jax.plan` or jax.eval_shape for the full-size presets, or load a checkpoint.")
    with jax.ensure_compile_time_eval():  # a concrete rng state even under eval_shape (see layers.param_key)
        rngs = nnx.Rngs(seed)
    module = KimiForCausalLM(cfg, rngs=rngs, dtype=dtype)
    vision = None
    if cfg.vision is not None:
        with jax.ensure_compile_time_eval():  # its own stream: the text weights stay those of a text-only build
            vision_rngs = nnx.Rngs(jax.random.fold_in(jax.random.key(seed), 1))
        vision = VisionTower(cfg.vision, rngs=vision_rngs, dtype=dtype)
    return Model(module, dtype, mesh=_mesh(mesh), vision=vision, kernels=kernels or KernelConfig())


def _mesh(mesh):
    """Accept a Mesh, a `--mesh` string such as "8x1", or None. A Mesh with Explicit axes (`jax.make_mesh`'s
    default) is re-made with Auto axes: the engine places its arrays with shardings and lets XLA propagate them."""
    if isinstance(mesh, jax.sharding.Mesh):
        auto = jax.sharding.AxisType.Auto
        if any(t != auto for t in mesh.axis_types):
            mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))
        return mesh
    if mesh is None or not isinstance(mesh, (str, dict)):
        return mesh
    return make_mesh(mesh)


_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16"}


def _parse_dtype(dtype):
    """None, a dtype, or a name with the command lines' short spellings (bf16, fp32) -> a jnp dtype or None."""
    if dtype is None:
        return None
    name = _DTYPE_NAMES.get(dtype.lower(), dtype) if isinstance(dtype, str) else dtype
    try:
        dt = jnp.dtype(name)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not a dtype; use bf16 / bfloat16 or fp32 / float32") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"dtype {dtype!r} is not a floating-point dtype; use bf16 / bfloat16 or fp32 / float32")
    if dt == jnp.float64 and not jax.config.jax_enable_x64:  # JAX would silently keep float32 parameters
        raise ValueError("dtype float64 needs 64-bit JAX (jax.config.update('jax_enable_x64', True) before loading); "
                         "use bf16 / bfloat16 or fp32 / float32")
    return dt

