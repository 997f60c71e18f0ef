"""MoonViT3d vision tower and multimodal projector (docs/model.md §9), with the image preprocessing that feeds it.

Data flow for one call over several images / video clips, `grid_thw = ((t, h, w), ...)` in patches:

    patches [N, 3·14·14]  (N = Σ t·h·w; the processor's order: clip by clip, frame by frame, patch rows top to bottom)
      -> patch embedding (the 14×14 stride-14 conv == one Linear over a flattened patch)
      -> + learned 64×64 position table resized to each (h, w)   (+ a time sinusoid per frame, K2.5 video only)
      -> blocks: x += wo(attn(RoPE₂ᴅ(q), RoPE₂ᴅ(k), v) within each clip) ; x += fc1(gelu_tanh(fc0(norm1(x))))
                 (attention input is norm0(x); non-causal, a clip's t·h·w patches attend to each other only)
      -> final norm
      -> 2×2 merge: [t, h, w, D] -> mean over t -> [h/2 · w/2, 4, D]    (tokens in row-major order of the 2×2 blocks)
      -> projector -> features [Σ h/2 · w/2, text_hidden]

Two variants, one code path, chosen by `VisionConfig` fields (config.py): K3 (RMSNorm, no biases, bilinear table,
projector MLP then RMSNorm) and Kimi-K2.5 as transformers 5.23 builds it (LayerNorm, biases, bicubic table, time
sinusoid, projector LayerNorm on each of the 4 merged patches before the MLP).

RoPE layout: the original checkpoint's (interleaved pairs). Within a head, the pair (2i, 2i+1) of q and k is
rotated by angle pos · f_{i//2}, with pos = the patch's column w for even i and its row h for odd i, and
f_j = theta^(-4j / head_dim). transformers un-interleaves q/k rows when it loads (`PermuteForRope`) and rotates
halves instead; here the checkpoint's wqkv is used as stored.

Shapes use suffixes: N patches, L one clip's patches, D width, H heads, d head dim, M merged tokens, P patch pixels.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kimi_jax.config import VisionConfig
from kimi_jax.modules.layers import LayerNorm, RMSNorm, normal_init

Grid = tuple[tuple[int, int, int], ...]


class VisionInputError(ValueError):
    """Patches and grid that do not fit the vision tower (bad grid, wrong patch count, too many frames)."""


class VisionWeightsError(ValueError):
    """A vision checkpoint tensor that is missing, misshaped or unknown."""


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers (numpy at trace time: every shape is static)
# ---------------------------------------------------------------------------------------------------------------------

def expand_image_pads(ids: Sequence[int], counts: Sequence[int], pad_id: int) -> list[int]:
    """A prompt with one `<|media_pad|>` (`pad_id`) per image -> the same prompt with image i's pad repeated
    `counts[i]` times (its `image_token_count`), which is what the model reads (docs/model.md §9). The number of pads
    must equal the number of images."""
    ids = [int(t) for t in ids]
    where = [i for i, t in enumerate(ids) if t == pad_id]
    if len(where) != len(counts):
        raise VisionInputError(f"the prompt holds {len(where)} image placeholder(s) (id {pad_id}) for "
                               f"{len(counts)} image(s)")
    out, last = [], 0
    for i, n in zip(where, counts):
        out += ids[last:i] + [pad_id] * int(n)
        last = i + 1
    return out + ids[last:]


def check_grid(cfg: VisionConfig, grid_thw) -> Grid:
    """`grid_thw` as a tuple of int triples, validated: t, h, w ≥ 1, h and w multiples of `merge`, and at most
    `pos_time` frames per clip when the time sinusoid is on."""
    try:
        grid = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw)
    except (TypeError, ValueError):
        raise VisionInputError(f"grid_thw must be a sequence of (t, h, w) triples, got {grid_thw!r}") from None
    for i, (t, h, w) in enumerate(grid):
        if min(t, h, w) < 1:
            raise VisionInputError(f"image {i}: grid (t, h, w) = {(t, h, w)} must be positive")
        if h % cfg.merge or w % cfg.merge:
            raise VisionInputError(f"image {i}: grid h, w = {h}, {w} must be multiples of the merge size {cfg.merge} "
                                   f"(images are padded to multiples of {cfg.merge * cfg.patch_size} pixels)")
        if t > 1 and cfg.pos_time and t > cfg.pos_time:
            raise VisionInputError(f"image {i}: {t} frames, but the time embedding covers at most {cfg.pos_time}")
    return grid


def image_token_count(grid_thw, merge: int = 2) -> int:
    """Placeholder tokens the features of `grid_thw` fill: Σ (h/merge)·(w/merge) (frames are averaged, so t does
    not count). Per image: `image_token_count([(1, h, w)])`."""
    return sum((h // merge) * (w // merge) for _, h, w in grid_thw)


def axis_resize_taps(out_len: int, in_len: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """F.interpolate along one axis (align_corners=False, no antialias) as taps: (table index `[out_len, K]` int32,
    weight `[out_len, K]` float64), K = 2 (bilinear) or 4 (bicubic). Taps outside the table are clamped to its edge
    (so an index can repeat; the weights then add). Bicubic is Keys' kernel with a = -0.75, as torch."""
    src = (np.arange(out_len) + 0.5) * in_len / out_len - 0.5
    base = np.floor(src)
    offsets = np.arange(0, 2) if mode == "bilinear" else np.arange(-1, 3)
    taps = base[:, None] + offsets[None, :]
    dist = np.abs(src[:, None] - taps)
    if mode == "bilinear":
        weight = np.maximum(1.0 - dist, 0.0)
    else:
        a = -0.75
        near = ((a + 2) * dist - (a + 3)) * dist * dist + 1
        far = ((a * dist - 5 * a) * dist + 8 * a) * dist - 4 * a
        weight = np.where(dist <= 1, near, far)
    return np.clip(taps, 0, in_len - 1).astype(np.int32), weight


def _axis_resize_matrix(out_len: int, in_len: int, mode: str) -> np.ndarray:
    """[out_len, in_len] float64: `axis_resize_taps` as a dense matrix."""
    index, weight = axis_resize_taps(out_len, in_len, mode)
    out = np.zeros((out_len, in_len))
    np.add.at(out, (np.broadcast_to(np.arange(out_len)[:, None], index.shape), index), weight)
    return out


def gather_pos_table(table_ssD, row_index_LK, row_weight_LK, col_index_LK, col_weight_LK):
    """The learned [S, S, D] table resampled at L arbitrary patches given their taps (`axis_resize_taps` rows
    picked per patch, weights float32) -> `[L, D]` float32: Σ_a Σ_b rw[a]·cw[b]·table[ri[a], ci[b]]. K² row gathers
    of the table instead of a grid-shaped matmul, so the patch grid need not be static (`vision_buckets`)."""
    t = table_ssD.astype(jnp.float32)
    K = row_index_LK.shape[1]
    out_LD = jnp.zeros((row_index_LK.shape[0], t.shape[2]), jnp.float32)
    for a in range(K):
        row_LD = jnp.zeros_like(out_LD)
        for b in range(K):
            row_LD = row_LD + col_weight_LK[:, b, None] * t[row_index_LK[:, a], col_index_LK[:, b]]
        out_LD = out_LD + row_weight_LK[:, a, None] * row_LD
    return out_LD


def resize_pos_table(table_ssD, h: int, w: int, mode: str):
    """The learned [S, S, D] table resampled to [h, w, D] (float32; separable, so two small matmuls)."""
    s_h, s_w = table_ssD.shape[:2]
    a_hs = jnp.asarray(_axis_resize_matrix(h, s_h, mode), jnp.float32)
    a_ws = jnp.asarray(_axis_resize_matrix(w, s_w, mode), jnp.float32)
    t = table_ssD.astype(jnp.float32)
    return jnp.einsum("hi,wj,ijd->hwd", a_hs, a_ws, t, precision=jax.lax.Precision.HIGHEST)


def time_sinusoid(t: int, dim: int) -> np.ndarray:
    """[t, dim] float32 additive time embedding of a t-frame clip (K2.5): row f = [sin(f·ω), cos(f·ω)] with
    ω_i = 10000^(-2i/dim), i < dim/2."""
    omega = 1.0 / 10000.0 ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    phase = np.arange(t, dtype=np.float64)[:, None] * omega[None, :]
    return np.concatenate([np.sin(phase), np.cos(phase)], axis=1).astype(np.float32)


def rope_angles(h: int, w: int, head_dim: int, theta: float) -> np.ndarray:
    """[h·w, head_dim/2] float32 rotation angle of each interleaved (q, k) pair, patches in row-major order.
    Pair 2j turns by column·f_j, pair 2j+1 by row·f_j, f_j = theta^(-4j/head_dim)."""
    freq = 1.0 / theta ** (np.arange(0, head_dim, 4, dtype=np.float64) / head_dim)  # [d/4]
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    ang_Lf2 = np.stack([cols.reshape(-1)[:, None] * freq, rows.reshape(-1)[:, None] * freq], axis=-1)
    return ang_Lf2.reshape(h * w, head_dim // 2).astype(np.float32)  # pairs: (col·f0, row·f0, col·f1, row·f1, ...)


def apply_rope(x_LHd, angle_Lp):
    """Rotate interleaved pairs (x[2i], x[2i+1]) by angle[:, i] (float32 math, result in x.dtype)."""
    L, H, d = x_LHd.shape
    pairs = x_LHd.astype(jnp.float32).reshape(L, H, d // 2, 2)
    cos = jnp.cos(angle_Lp)[:, None, :]
    sin = jnp.sin(angle_Lp)[:, None, :]
    a, b = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(L, H, d).astype(x_LHd.dtype)


QUERY_CHUNK = 2048  # queries per score block: a 16384-patch image then holds [H, 2048, 16384] scores, not [H, L, L]


def fused_attention_available(dtype, head_dim: int) -> bool:
    """Whether `attention` hands a clip to cuDNN's fused flash attention: a CUDA default backend, a 16-bit tower and
    a head dim cuDNN takes (≤ 128, a multiple of 8). The materialised path below holds [H, 2048, L] float32 scores
    per query chunk and ran a 16384-patch image in 533 ms on an H200 (`bench/vision.py`)."""
    return (jax.default_backend() in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim <= 128 and head_dim % 8 == 0)


def attention(q_LHd, k_LHd, v_LHd, *, fused: bool | None = None, kv_len=None):
    """Non-causal softmax attention over one clip, scale d^-1/2, float32 scores and softmax. `kv_len` (int32
    scalar, optional): only the first kv_len keys are real, the rest padding that no query attends to
    (`vision_buckets`: an image padded to a bucket's patch count).

    `fused` (default: `fused_attention_available`): cuDNN's flash attention through `jax.nn.dot_product_attention`
    (float32 softmax, bf16 products with float32 accumulation; no score matrix in memory). Otherwise queries in
    static chunks with materialised float32 scores; the probabilities meet V in V's dtype with float32
    accumulation, as flash attention does: bf16 tensor cores for a bf16 tower (a float32 PV product ran at a
    fraction of their speed, bench/vision.py), unchanged float32 arithmetic for a float32 one."""
    if fused is None:
        fused = fused_attention_available(q_LHd.dtype, q_LHd.shape[-1])
    if fused:
        lengths = None if kv_len is None else jnp.reshape(kv_len, (1,)).astype(jnp.int32)
        return jax.nn.dot_product_attention(q_LHd[None], k_LHd[None], v_LHd[None], key_value_seq_lengths=lengths,
                                            implementation="cudnn")[0]
    scale = q_LHd.shape[-1] ** -0.5
    outs = []
    for q0 in range(0, q_LHd.shape[0], QUERY_CHUNK):
        q = q_LHd[q0:q0 + QUERY_CHUNK]
        s_HqL = jnp.einsum("qhd,khd->hqk", q, k_LHd, preferred_element_type=jnp.float32) * scale
        if kv_len is not None:
            s_HqL = jnp.where(jnp.arange(k_LHd.shape[0]) < kv_len, s_HqL, -jnp.inf)
        p_HqL = jax.nn.softmax(s_HqL, axis=-1).astype(v_LHd.dtype)
        outs.append(jnp.einsum("hqk,khd->qhd", p_HqL, v_LHd, preferred_element_type=jnp.float32))
    return jnp.concatenate(outs, axis=0).astype(q_LHd.dtype)


def merge_patches(x_ND, grid: Grid, merge: int):
    """[N, D] encoder output -> [M, merge², D]: each clip's [t, h, w] grid cut into merge×merge blocks (block rows
    top to bottom, inside a block row-major), frames averaged."""
    out, start = [], 0
    for t, h, w in grid:
        n = t * h * w
        x = x_ND[start:start + n].astype(jnp.float32).reshape(t, h // merge, merge, w // merge, merge, -1)
        x = x.mean(axis=0).transpose(0, 2, 1, 3, 4)  # [h/m, w/m, m, m, D]
        out.append(x.reshape((h // merge) * (w // merge), merge * merge, -1).astype(x_ND.dtype))
        start += n
    return jnp.concatenate(out, axis=0)


# ---------------------------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------------------------

class Dense(nnx.Module):
    """y = x @ kernel (+ bias); kernel `[in, out]` (torch stores `[out, in]`); float32 accumulation."""

    def __init__(self, d_in: int, d_out: int, bias: bool, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.kernel = nnx.Param(normal_init(rngs, (d_in, d_out), d_in ** -0.5, dtype))
        self.bias = nnx.Param(normal_init(rngs, (d_out,), 0.02, dtype)) if bias else None

    def __call__(self, x):
        y = jnp.dot(x.astype(self.kernel.dtype), self.kernel[...], preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def make_norm(kind: str, dim: int, eps: float, *, rngs: nnx.Rngs, dtype):
    return RMSNorm(dim, eps, rngs=rngs, dtype=dtype) if kind == "rms" else LayerNorm(dim, eps, rngs=rngs, dtype=dtype)


class VisionBlock(nnx.Module):
    """Pre-norm transformer block: fused qkv (q, k in interleaved-RoPE layout), per-clip attention, gelu-tanh MLP."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        D, Q = cfg.hidden_size, cfg.qkv_width
        self.cfg = cfg
        self.norm0 = make_norm(cfg.norm, D, cfg.norm_eps, rngs=rngs, dtype=dtype)
        self.wqkv = Dense(D, 3 * Q, cfg.bias, rngs=rngs, dtype=dtype)
        self.wo = Dense(Q, D, cfg.bias, rngs=rngs, dtype=dtype)
        self.norm1 = make_norm(cfg.norm, D, cfg.norm_eps, rngs=rngs, dtype=dtype)
        self.fc0 = Dense(D, cfg.intermediate_size, cfg.bias, rngs=rngs, dtype=dtype)
        self.fc1 = Dense(cfg.intermediate_size, D, cfg.bias, rngs=rngs, dtype=dtype)

    def __call__(self, x_ND, grid: Grid, angles: Sequence, kv_len=None):
        """`kv_len`: with one clip, how many of its patches are real (the rest padding no patch attends to)."""
        H, d = self.cfg.num_heads, self.cfg.head_dim
        qkv_N3Hd = self.wqkv(self.norm0(x_ND)).reshape(x_ND.shape[0], 3, H, d)
        outs, start = [], 0
        for (t, h, w), angle_Lp in zip(grid, angles):  # static shapes: one attention per clip
            L = t * h * w
            q, k, v = (qkv_N3Hd[start:start + L, i] for i in range(3))
            outs.append(attention(apply_rope(q, angle_Lp), apply_rope(k, angle_Lp), v, kv_len=kv_len))
            start += L
        x_ND = x_ND + self.wo(jnp.concatenate(outs, axis=0).reshape(x_ND.shape[0], H * d))
        h_NI = jax.nn.gelu(self.fc0(self.norm1(x_ND)).astype(jnp.float32), approximate=True).astype(x_ND.dtype)
        return x_ND + self.fc1(h_NI)


class Projector(nnx.Module):
    """Merged patches [M, merge², D] -> [M, text_hidden].

    "post" (K3): Linear(4D→4D), GELU, Linear(4D→text), RMSNorm(text).
    "pre" (K2.5): LayerNorm(D) on each of the merge² patches, then Linear, GELU, Linear.
    """

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        W = cfg.merged_width
        self.pre_norm = (LayerNorm(cfg.hidden_size, cfg.projector_eps, rngs=rngs, dtype=dtype)
                         if cfg.projector_norm == "pre" else None)
        self.proj0 = Dense(W, W, cfg.bias, rngs=rngs, dtype=dtype)
        self.proj2 = Dense(W, cfg.text_hidden, cfg.bias, rngs=rngs, dtype=dtype)
        self.post_norm = (RMSNorm(cfg.text_hidden, cfg.projector_eps, rngs=rngs, dtype=dtype)
                          if cfg.projector_norm == "post" else None)

    def __call__(self, x_MkD):
        if self.pre_norm is not None:
            x_MkD = self.pre_norm(x_MkD)
        x_MW = x_MkD.reshape(x_MkD.shape[0], -1)
        h = jax.nn.gelu(self.proj0(x_MW).astype(jnp.float32), approximate=self.cfg.projector_gelu_tanh)
        y_MT = self.proj2(h.astype(x_MW.dtype))
        return self.post_norm(y_MT) if self.post_norm is not None else y_MT


class VisionTower(nnx.Module):
    """MoonViT3d + projector. `tower(patches, grid_thw)` -> features [image_token_count(grid_thw), text_hidden].

    patches: [N, 3, p, p] or [N, 3·p·p] float (normalised pixels, `preprocess_image`'s layout), N = Σ t·h·w.
    grid_thw: static tuple of (t, h, w) per image / clip, h and w in patches (multiples of `merge`).
    Result dtype: the parameters' dtype.
    """

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        D, S = cfg.hidden_size, cfg.pos_table
        self.patch_embed = Dense(3 * cfg.patch_size ** 2, D, cfg.bias, rngs=rngs, dtype=dtype)
        self.pos_emb = nnx.Param(normal_init(rngs, (S, S, D), 0.02, dtype))
        self.blocks = nnx.List([VisionBlock(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_layers)])
        self.final_norm = make_norm(cfg.norm, D, cfg.norm_eps, rngs=rngs, dtype=dtype)
        self.projector = Projector(cfg, rngs=rngs, dtype=dtype)

    def positions(self, grid: Grid):
        """[N, D] float32 additive position embedding: resized table, repeated over frames, + time sinusoid."""
        cfg, out = self.cfg, []
        for t, h, w in grid:
            pos_LD = resize_pos_table(self.pos_emb[...], h, w, cfg.pos_resize).reshape(1, h * w, -1)
            if t > 1 and cfg.pos_time:
                pos_LD = pos_LD + jnp.asarray(time_sinusoid(t, cfg.hidden_size))[:, None, :]
            out.append(jnp.broadcast_to(pos_LD, (t, h * w, cfg.hidden_size)).reshape(t * h * w, -1))
        return jnp.concatenate(out, axis=0)

    def encode(self, patches, grid_thw):
        """The tower without the projector: merged patches [M, merge², D] (after the final norm and time mean)."""
        cfg = self.cfg
        grid = check_grid(cfg, grid_thw)
        n = sum(t * h * w for t, h, w in grid)
        P = 3 * cfg.patch_size ** 2
        if patches.shape[0] != n or math.prod(patches.shape[1:]) != P:
            raise VisionInputError(f"patches of shape {tuple(patches.shape)} do not fit grid {grid}: expected "
                                   f"[{n}, 3, {cfg.patch_size}, {cfg.patch_size}] or [{n}, {P}]")
        dtype = self.patch_embed.kernel.dtype
        x_NP = jnp.asarray(patches).reshape(n, P).astype(dtype)
        x_ND = (self.patch_embed(x_NP).astype(jnp.float32) + self.positions(grid)).astype(dtype)
        angles = [jnp.asarray(np.tile(rope_angles(h, w, cfg.head_dim, cfg.rope_theta), (t, 1))) for t, h, w in grid]
        for block in self.blocks:
            x_ND = block(x_ND, grid, angles)
        return merge_patches(self.final_norm(x_ND), grid, cfg.merge)

    def __call__(self, patches, grid_thw):
        return self.projector(self.encode(patches, grid_thw))

    def features_padded(self, x_LP, pos_taps, angle_Lp, kv_len, merge_Mk):
        """One image padded to L patches (`vision_buckets`): patches `[L, 3·p·p]` (the first kv_len real, the rest
        anything finite), each patch's position-table taps `pos_taps` = (row index, row weight, column index,
        column weight), each `[L, K]` (int32 / float32; `gather_pos_table`), RoPE angles `[L, head_dim/2]`, and
        for each merged token its merge² patch indices `[M, merge²]` int32 -> features `[M, text_hidden]` (rows
        past the image's own token count are padding). Only shapes are static: one compile per (L, M)."""
        dtype = self.patch_embed.kernel.dtype
        pos_LD = gather_pos_table(self.pos_emb[...], *pos_taps)
        x_LD = (self.patch_embed(x_LP.astype(dtype)).astype(jnp.float32) + pos_LD).astype(dtype)
        grid = ((1, 1, x_LP.shape[0]),)  # one clip of L patches; the real (h, w) live in the inputs only
        for block in self.blocks:
            x_LD = block(x_LD, grid, [angle_Lp], kv_len=kv_len)
        return self.projector(self.final_norm(x_LD)[merge_Mk])


@functools.partial(nnx.jit, static_argnames=("grid_thw",))
def _features_jit(tower: VisionTower, patches, grid_thw: Grid):
    return tower(patches, grid_thw)


def vision_features(tower: VisionTower, patches, grid_thw) -> jax.Array:
    """`tower(patches, grid_thw)` compiled: [image_token_count(grid_thw), text_hidden] in the parameters' dtype.
    One compile per distinct grid_thw (any sequence of (t, h, w); it becomes a static tuple)."""
    return _features_jit(tower, patches, check_grid(tower.cfg, grid_thw))


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint tensors (original Moonshot names) -> module
# ---------------------------------------------------------------------------------------------------------------------

def checkpoint_layout(cfg: VisionConfig) -> dict[str, tuple[str, tuple, object]]:
    """{checkpoint name: (parameter path in VisionTower, checkpoint shape, checkpoint -> parameter transform)} for
    every tensor the tower reads, in the original checkpoint's naming (`vision_tower.encoder.blocks.N.wqkv.weight`
    fused [3·H·d, D] with q and k rows in interleaved-RoPE order, `mm_projector.proj.0`, ...)."""
    D, Q, I, p, S = cfg.hidden_size, cfg.qkv_width, cfg.intermediate_size, cfg.patch_size, cfg.pos_table
    W, T = cfg.merged_width, cfg.text_hidden
    ident = np.asarray
    transpose = lambda w: np.asarray(w).T  # torch [out, in] -> our [in, out]
    out: dict[str, tuple[str, tuple, object]] = {}

    def linear(src: str, dst: str, d_in: int, d_out: int, bias: bool):
        out[src + ".weight"] = (dst + ".kernel", (d_out, d_in), transpose)
        if bias:
            out[src + ".bias"] = (dst + ".bias", (d_out,), ident)

    def norm(src: str, dst: str, dim: int, kind: str):
        out[src + ".weight"] = (dst + ".weight", (dim,), ident)
        if kind == "layer":
            out[src + ".bias"] = (dst + ".bias", (dim,), ident)

    out["vision_tower.patch_embed.proj.weight"] = (
        "patch_embed.kernel", (D, 3, p, p), lambda w: np.asarray(w).reshape(D, 3 * p * p).T)
    if cfg.bias:
        out["vision_tower.patch_embed.proj.bias"] = ("patch_embed.bias", (D,), ident)
    out["vision_tower.patch_embed.pos_emb.weight"] = ("pos_emb", (S, S, D), ident)
    for i in range(cfg.num_layers):
        src, dst = f"vision_tower.encoder.blocks.{i}", f"blocks.{i}"
        norm(src + ".norm0", dst + ".norm0", D, cfg.norm)
        linear(src + ".wqkv", dst + ".wqkv", D, 3 * Q, cfg.bias)
        linear(src + ".wo", dst + ".wo", Q, D, cfg.bias)
        norm(src + ".norm1", dst + ".norm1", D, cfg.norm)
        linear(src + ".mlp.fc0", dst + ".fc0", D, I, cfg.bias)
        linear(src + ".mlp.fc1", dst + ".fc1", I, D, cfg.bias)
    norm("vision_tower.encoder.final_layernorm", "final_norm", D, cfg.norm)
    if cfg.projector_norm == "pre":
        norm("mm_projector.pre_norm", "projector.pre_norm", D, "layer")
    linear("mm_projector.proj.0", "projector.proj0", W, W, cfg.bias)
    linear("mm_projector.proj.2", "projector.proj2", W, T, cfg.bias)
    if cfg.projector_norm == "post":
        norm("mm_projector.post_norm", "projector.post_norm", T, "rms")
    return out


VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def vision_tensors(tensors: Mapping[str, object]) -> dict[str, object]:
    """The vision tensors of a checkpoint's tensor dict, keyed by their original names: accepts the HF names as
    they are and the `extra.<name>` form under which `convert/` carries them into a kimi_jax checkpoint."""
    out = {}
    for name, value in tensors.items():
        bare = name.removeprefix("extra.")
        if bare.startswith(VISION_PREFIXES):
            if bare in out:
                raise VisionWeightsError(f"vision tensor {bare} is given twice (with and without the extra. prefix)")
            out[bare] = value
    return out


def load_vision_tower(tensors: Mapping[str, object], cfg: VisionConfig, *, dtype=jnp.float32) -> VisionTower:
    """A VisionTower whose parameters come from `tensors` (name -> numpy-compatible array, original checkpoint
    names, optionally `extra.`-prefixed; non-vision names are ignored). Every tensor the config needs must be
    present with its checkpoint shape, and no other `vision_tower.*` / `mm_projector.*` tensor may be: either is a
    VisionWeightsError naming the tensor (and both shapes). Parameters are cast to `dtype`."""
    found = vision_tensors(tensors)
    layout = checkpoint_layout(cfg)
    missing = [n for n in layout if n not in found]
    if missing:
        n = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise VisionWeightsError(f"vision tensor {n} is missing (expected shape {layout[n][1]}){more}")
    unknown = sorted(set(found) - set(layout))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise VisionWeightsError(f"vision tensor {unknown[0]} is not part of this vision config "
                                 f"(norm={cfg.norm}, bias={cfg.bias}, projector_norm={cfg.projector_norm}){more}")
    tower = nnx.eval_shape(lambda: VisionTower(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    for name, (path, shape, transform) in layout.items():
        src = found[name]
        if tuple(src.shape) != shape:
            raise VisionWeightsError(f"vision tensor {name} has shape {tuple(src.shape)}, expected {shape}")
        _param(tower, path).set_value(jnp.asarray(transform(np.asarray(src, dtype=np.float32)), dtype=dtype))
    abstract = [p for p in jax.tree.leaves(nnx.state(tower, nnx.Param)) if isinstance(p, jax.ShapeDtypeStruct)]
    assert not abstract, f"checkpoint_layout left {len(abstract)} vision parameters unset"  # a bug here, not in the data
    return tower


def _param(module, path: str):
    node = module
    for key in path.split("."):
        node = node[int(key)] if key.isdigit() else getattr(node, key)
    return node


# ---------------------------------------------------------------------------------------------------------------------
# Image preprocessing (numpy, no Pillow)
# ---------------------------------------------------------------------------------------------------------------------

def navit_size(height: int, width: int, cfg: VisionConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized (h, w), padded (h, w)) in pixels, as the K2.5 processor (`navit_resize`) computes them: scale down
    (never up) so the image holds at most `max_patches` patches and `max_patches_per_side` per side, truncate to
    ints, then pad up to multiples of merge·patch (28)."""
    p = cfg.patch_size
    n_h, n_w = max(1.0, height // p), max(1.0, width // p)
    side = cfg.max_patches_per_side * p
    scale = min(1.0, math.sqrt(cfg.max_patches / (n_h * n_w)), side / height, side / width)
    new_h, new_w = min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side)
    f = cfg.merge * p
    return (new_h, new_w), (-(-new_h // f) * f, -(-new_w // f) * f)


def _resize_weights(out_len: int, in_len: int) -> np.ndarray:
    """[out_len, in_len] antialiased bicubic (a = -0.5, kernel widened by the downscale factor, weights
    renormalised, out-of-range taps dropped): the PIL / torchvision-antialias scheme, not bit-exact with either."""
    scale = in_len / out_len
    support = 2.0 * max(scale, 1.0)
    centre = (np.arange(out_len) + 0.5) * scale
    src = np.arange(in_len) + 0.5
    x = np.abs(src[None, :] - centre[:, None]) / max(scale, 1.0)
    a = -0.5
    k = np.where(x <= 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                 np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))
    k = np.where(np.abs(src[None, :] - centre[:, None]) < support, k, 0.0)
    return k / k.sum(axis=1, keepdims=True)


def resize_image(image_hw3: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [height, width, 3] by separable antialiased bicubic (see `_resize_weights`),
    rounded and clipped. An approximation of the HF processor's torchvision resize (same kernel family, not the
    same bits); an image that needs no resize never comes here."""
    x = image_hw3.astype(np.float64)
    x = np.einsum("oh,hwc->owc", _resize_weights(height, x.shape[0]), x)
    x = np.einsum("ow,hwc->hoc", _resize_weights(width, x.shape[1]), x)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def preprocess_image(image_hw3: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB uint8 image [H, W, 3] -> (patches float32 [gh·gw, 3, p, p], grid (1, gh, gw)).

    1. Size: `navit_size` (the K2.5 processor's rule). Images within the patch budget keep their size exactly;
       larger ones are downscaled by `resize_image` (approximate, see there).
    2. Pad with black (0) at the bottom and right to multiples of merge·patch = 28 pixels (docs/model.md §9).
    3. Normalise: (x / 255 - mean) / std per channel (K3 / K2.5: mean = std = 0.5, so pads become -1).
    4. Patches in row-major patch order, each laid out [channel, row, col]: the processor's `pixel_values`.
    """
    img = np.asarray(image_hw3)
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8 or min(img.shape[:2]) < 1:
        raise VisionInputError(f"expected a uint8 RGB image [H, W, 3] with H, W ≥ 1, got {img.dtype} "
                               f"{tuple(img.shape)}")
    (new_h, new_w), (pad_h, pad_w) = navit_size(img.shape[0], img.shape[1], cfg)
    if (new_h, new_w) != img.shape[:2]:
        img = resize_image(img, new_h, new_w)
    canvas = np.zeros((pad_h, pad_w, 3), np.uint8)
    canvas[:new_h, :new_w] = img
    mean = np.asarray(cfg.image_mean, np.float32)
    std = np.asarray(cfg.image_std, np.float32)
    x_hw3 = (canvas.astype(np.float32) / np.float32(255.0) - mean) / std
    p = cfg.patch_size
    gh, gw = pad_h // p, pad_w // p
    patches = x_hw3.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    return np.ascontiguousarray(patches), (1, gh, gw)


def preprocess_images(images: Sequence[np.ndarray], cfg: VisionConfig) -> tuple[np.ndarray, Grid]:
    """Several images -> (patches concatenated [N, 3, p, p], grid_thw) ready for `VisionTower`."""
    outs = [preprocess_image(im, cfg) for im in images]
    return np.concatenate([o[0] for o in outs], axis=0), tuple(o[1] for o in outs)
