"""MoonViT3d vision tower + projector (kimi_jax/modules/vision.py, SPEC §9).

* Kimi-K2.5 variant against transformers 5.23 (`Kimi_K25ForConditionalGeneration.get_image_features`, tiny random
  config, float32, eager attention), weights taken from what `save_pretrained` writes (the original checkpoint names).
* K3 variant against a float64 NumPy transcription of SPEC §9 written here (bilinear table, complex-number RoPE,
  explicit loops for the merge).
* Weight errors, token counts, grid checks, preprocessing (patch order, normalisation, padding to 28), config I/O.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.config import ConfigError, ModelConfig, VisionConfig, get_preset
from kimi_jax.modules import vision as V

# ---------------------------------------------------------------------------------------------------------------------
# Kimi-K2.5 parity with transformers
# ---------------------------------------------------------------------------------------------------------------------

K25_TINY = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=48, pos_emb_height=8,
                pos_emb_width=8, pos_emb_time=4)
TEXT_TINY = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=24, intermediate_size=32, moe_intermediate_size=16,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                 num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, first_k_dense_replace=1)
# two images of different grids (one larger than the 8×8 table, one smaller) and a 2-frame clip, in one call
# of ours
GRID = ((1, 4, 6), (1, 10, 4), (2, 2, 4))


def _interleave_rows(w, heads: int):
    """transformers' rotate-half q/k rows -> the checkpoint's interleaved-pair rows (inverse of PermuteForRope)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def k25_reference(tmp_path_factory):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    cfg = tr.Kimi_K25Config(text_config=dict(TEXT_TINY), vision_config=dict(K25_TINY), projection_hidden_size=32)
    cfg._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tr.Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # default init leaves norms at 1/0 and biases at 0: randomise so every term counts
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (p[0].numel() ** -0.5))
    out = tmp_path_factory.mktemp("k25")
    model.save_pretrained(out)
    saved = load_file(str(out / "model.safetensors"))

    rng = np.random.default_rng(1)
    n = sum(t * h * w for t, h, w in GRID)
    patches = rng.standard_normal((n, 3, 14, 14)).astype(np.float32)
    n_img = sum(t * h * w for t, h, w in GRID[:2])
    with torch.no_grad():  # transformers cannot mix clips of different t in one call: images, then the video
        feats = list(model.get_image_features(torch.from_numpy(patches[:n_img]), torch.tensor(GRID[:2])).pooler_output)
        # (the video through the tower and projector directly: get_video_features splits its output by t·h·w/4
        # rows, but the time mean leaves h·w/4)
        pooled = model.model.vision_tower(torch.from_numpy(patches[n_img:]), grid_thw=torch.tensor(GRID[2:]))
        feats.append(model.model.mm_projector(pooled.pooler_output).squeeze(1))
    hf_state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return saved, hf_state, patches, np.concatenate([f.numpy() for f in feats])


def _original_names(saved: dict) -> dict:
    """save_pretrained's reverse rename gets two names of the original layout wrong in transformers 5.23
    (`vision_tower.encoder.patch_embed.*`, `model.mm_projector.pre_norm.*`); put them back."""
    out = {}
    for k, v in saved.items():
        k = k.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
        k = k.replace("model.mm_projector.", "mm_projector.")
        out[k] = v
    return out


def test_k25_saved_names_are_the_original_layout(k25_reference):
    """The wqkv that save_pretrained writes is transformers' q/k/v with q and k rows back in interleaved-pair order
    (so our module, which rotates interleaved pairs, reads the checkpoint as stored)."""
    saved, hf, _, _ = k25_reference
    w = _original_names(saved)
    heads = K25_TINY["num_attention_heads"]
    for part in ("weight", "bias"):
        q, k, v = (hf[f"model.vision_tower.layers.1.attn.{x}_proj.{part}"] for x in "qkv")
        want = np.concatenate([_interleave_rows(q, heads), _interleave_rows(k, heads), v])
        np.testing.assert_array_equal(w[f"vision_tower.encoder.blocks.1.wqkv.{part}"], want)
    np.testing.assert_array_equal(w["vision_tower.patch_embed.pos_emb.weight"],
                                  hf["model.vision_tower.patch_embed.pos_emb.position_embeddings"])


def test_k25_matches_transformers(k25_reference):
    saved, _, patches, want = k25_reference
    cfg = VisionConfig.kimi_k25(text_hidden=TEXT_TINY["hidden_size"], hidden_size=32, num_layers=2, num_heads=2,
                                head_dim=16, intermediate_size=48, pos_table=8)
    tower = V.load_vision_tower({"language_model.model.embed_tokens.weight": np.zeros(3), **_original_names(saved)},
                                cfg)
    got = np.asarray(V.vision_features(tower, patches, GRID))
    assert got.shape == (V.image_token_count(GRID), TEXT_TINY["hidden_size"]) == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# K3 against a float64 NumPy transcription of SPEC §9
# ---------------------------------------------------------------------------------------------------------------------

K3_TINY = VisionConfig(hidden_size=32, num_layers=2, num_heads=3, head_dim=16, intermediate_size=40, pos_table=6,
                       projector_hidden=128, text_hidden=20)


def k3_weights(cfg: VisionConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under the original K3 names (no biases, RMSNorm weights only, projector post_norm)."""
    rng = np.random.default_rng(seed)
    D, Q, I, W, T = cfg.hidden_size, cfg.qkv_width, cfg.intermediate_size, cfg.merged_width, cfg.text_hidden
    mat = lambda o, i: (rng.standard_normal((o, i)) * i ** -0.5).astype(np.float32)
    vec = lambda n: (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    w = {"vision_tower.patch_embed.proj.weight": (rng.standard_normal((D, 3, 14, 14)) / 24).astype(np.float32),
         "vision_tower.patch_embed.pos_emb.weight": rng.standard_normal((6, 6, D)).astype(np.float32),
         "vision_tower.encoder.final_layernorm.weight": vec(D),
         "mm_projector.proj.0.weight": mat(W, W), "mm_projector.proj.2.weight": mat(T, W),
         "mm_projector.post_norm.weight": vec(T)}
    for i in range(cfg.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        w.update({b + "norm0.weight": vec(D), b + "norm1.weight": vec(D), b + "wqkv.weight": mat(3 * Q, D),
                  b + "wo.weight": mat(D, Q), b + "mlp.fc0.weight": mat(I, D), b + "mlp.fc1.weight": mat(D, I)})
    return w


def np_k3_features(w: dict, cfg: VisionConfig, patches: np.ndarray, grid) -> np.ndarray:
    """SPEC §9 in float64, written out independently of the module."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    D, H, d, S, eps = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.pos_table, cfg.norm_eps
    rms = lambda x, g: g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    gelu_tanh = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    erf = np.vectorize(math.erf)
    x = patches.reshape(len(patches), -1).astype(np.float64) @ w["vision_tower.patch_embed.proj.weight"].reshape(D, -1).T

    def src_index(i, n):  # torch bilinear, align_corners=False: half-pixel centres, clamped at 0 and at the edge
        s = max((i + 0.5) * S / n - 0.5, 0.0)
        i0 = math.floor(s)
        return i0, min(i0 + 1, S - 1), s - i0

    table = w["vision_tower.patch_embed.pos_emb.weight"]
    pos, cis = [], []
    for t, h, wd in grid:
        p = np.zeros((h, wd, D))
        c = np.zeros((h, wd, d // 2), complex)
        for r in range(h):
            r0, r1, lr = src_index(r, h)
            for col in range(wd):
                c0, c1, lc = src_index(col, wd)
                p[r, col] = ((1 - lr) * (1 - lc) * table[r0, c0] + (1 - lr) * lc * table[r0, c1]
                             + lr * (1 - lc) * table[r1, c0] + lr * lc * table[r1, c1])
                for j in range(d // 4):
                    f = cfg.rope_theta ** (-4.0 * j / d)
                    c[r, col, 2 * j] = np.exp(1j * col * f)
                    c[r, col, 2 * j + 1] = np.exp(1j * r * f)
        pos += [p.reshape(h * wd, D)] * t
        cis += [c.reshape(h * wd, d // 2)] * t
    x = x + np.concatenate(pos)
    cis = np.concatenate(cis)[:, None, :]

    def rope(z):  # z [N, H, d]; pairs (2i, 2i+1) as complex numbers
        zc = (z[..., 0::2] + 1j * z[..., 1::2]) * cis
        return np.stack([zc.real, zc.imag], -1).reshape(z.shape)

    sizes = [t * h * wd for t, h, wd in grid]
    for i in range(cfg.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        qkv = (rms(x, w[b + "norm0.weight"]) @ w[b + "wqkv.weight"].T).reshape(len(x), 3, H, d)
        q, k, v = rope(qkv[:, 0]), rope(qkv[:, 1]), qkv[:, 2]
        o = np.zeros_like(q)
        start = 0
        for n in sizes:
            sl = slice(start, start + n)
            s = np.einsum("qhd,khd->hqk", q[sl], k[sl]) / math.sqrt(d)
            p = np.exp(s - s.max(-1, keepdims=True))
            o[sl] = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v[sl])
            start += n
        x = x + o.reshape(len(x), H * d) @ w[b + "wo.weight"].T
        x = x + gelu_tanh(rms(x, w[b + "norm1.weight"]) @ w[b + "mlp.fc0.weight"].T) @ w[b + "mlp.fc1.weight"].T
    x = rms(x, w["vision_tower.encoder.final_layernorm.weight"])
    tokens, start = [], 0
    for t, h, wd in grid:
        clip = x[start:start + t * h * wd].reshape(t, h, wd, D).mean(0)
        for r in range(0, h, 2):
            for col in range(0, wd, 2):
                tokens.append(np.concatenate([clip[r, col], clip[r, col + 1], clip[r + 1, col], clip[r + 1, col + 1]]))
        start += t * h * wd
    g = np.stack(tokens) @ w["mm_projector.proj.0.weight"].T
    g = 0.5 * g * (1 + erf(g / math.sqrt(2)))
    y = g @ w["mm_projector.proj.2.weight"].T
    return rms(y, w["mm_projector.post_norm.weight"])


def test_k3_matches_numpy_transcription():
    cfg, grid = K3_TINY, ((1, 4, 8), (1, 8, 2), (2, 2, 2))
    weights = k3_weights(cfg)
    n = sum(t * h * w for t, h, w in grid)
    patches = np.random.default_rng(2).standard_normal((n, 3 * 14 * 14)).astype(np.float32)
    tower = V.load_vision_tower({"extra." + k: v for k, v in weights.items()}, cfg)  # convert/'s stored names
    got = np.asarray(V.vision_features(tower, patches, grid))
    want = np_k3_features(weights, cfg, patches, grid)
    assert got.shape == want.shape == (V.image_token_count(grid), cfg.text_hidden)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_bf16_tower_stays_close_to_the_float64_transcription():
    """bf16 parameters and activations (how checkpoints load): softmax and norms in float32, the PV product in bf16
    with float32 accumulation; features within bf16's precision of the float64 transcription."""
    import jax.numpy as jnp

    cfg, grid = K3_TINY, ((1, 4, 8), (1, 8, 2))
    weights = k3_weights(cfg, seed=5)
    n = sum(t * h * w for t, h, w in grid)
    patches = np.random.default_rng(6).standard_normal((n, 3 * 14 * 14)).astype(np.float32)
    tower = V.load_vision_tower(weights, cfg, dtype=jnp.bfloat16)
    got = np.asarray(V.vision_features(tower, patches, grid), np.float32)
    want = np_k3_features(weights, cfg, patches, grid)
    rel_rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
    assert rel_rms < 3e-2, rel_rms
    # the engine's bucketed path sends a bf16 tower its patches already in bf16: the same rounding the exact path
    # does on the device, so the first image's features agree to bf16 rounding of the summation order
    from kimi_jax.modules.vision_buckets import image_features

    first = image_features(tower, patches[:32], (1, 4, 8))
    assert first.dtype == jnp.bfloat16
    np.testing.assert_allclose(first.astype(np.float32), got[:8], atol=2e-2, rtol=2e-2)


def test_one_image_alone_equals_its_slice_of_a_batch():
    """Attention stays inside each image: an image's features do not depend on the other images in the call."""
    cfg, grid = K3_TINY, ((1, 4, 4), (1, 2, 6))
    tower = V.load_vision_tower(k3_weights(cfg, seed=3), cfg)
    patches = np.random.default_rng(4).standard_normal((16 + 12, 3, 14, 14)).astype(np.float32)
    both = np.asarray(V.vision_features(tower, patches, grid))
    first = np.asarray(V.vision_features(tower, patches[:16], grid[:1]))
    np.testing.assert_allclose(both[:4], first, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Patch buckets: one compile per bucket, not per image size
# ---------------------------------------------------------------------------------------------------------------------

def test_patch_buckets_bound_the_padding_and_the_compiles():
    """An image of n patches runs padded to the smallest 2^k or 3·2^(k−1) ≥ n (≥ 64, a multiple of merge²): at
    most 1.5× its patches above 64, and K3's whole range of image sizes in 18 buckets."""
    from kimi_jax.modules.vision_buckets import bucket_for, patch_buckets

    cfg = VisionConfig()
    for n in range(1, 20000, 7):
        b = bucket_for(n, cfg)
        assert b >= n and b % 4 == 0 and (b <= max(64, 1.5 * n)), (n, b)
    assert [bucket_for(n, cfg) for n in (1, 64, 65, 97, 129, 16384)] == [64, 64, 96, 128, 192, 16384]
    buckets = patch_buckets(cfg)
    assert len(buckets) == 18 and buckets[-1] >= cfg.max_patches
    assert all(bucket_for(b, cfg) == b for b in buckets)


def test_bucketed_image_equals_the_exact_path_and_the_transcription():
    """One image padded to its bucket (masked keys, host-made table taps, angles and merge indices) gives the
    features of the exact static-grid path, and of the float64 transcription, for grids inside the 6×6 table,
    beyond it, one that fills its bucket exactly and one that crosses into the next."""
    from kimi_jax.modules.vision_buckets import bucket_for, image_features

    cfg = K3_TINY
    weights = k3_weights(cfg, seed=7)
    tower = V.load_vision_tower(weights, cfg)
    rng = np.random.default_rng(8)
    for h, w in ((2, 2), (4, 8), (8, 2), (8, 8), (10, 14)):
        patches = rng.standard_normal((h * w, 3, 14, 14)).astype(np.float32)
        got = image_features(tower, patches, (1, h, w))
        exact = np.asarray(V.vision_features(tower, patches, ((1, h, w),)))
        assert got.shape == exact.shape == ((h // 2) * (w // 2), cfg.text_hidden)
        np.testing.assert_allclose(got, exact, atol=1e-5, rtol=0, err_msg=f"{h}x{w}")
        want = np_k3_features(weights, cfg, patches.reshape(h * w, -1), ((1, h, w),))
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0, err_msg=f"{h}x{w}")
    assert bucket_for(8 * 8, cfg) == 64 and bucket_for(10 * 14, cfg) == 192
    # the Kimi-K2.5 variant (LayerNorm and biases, bicubic table, projector LayerNorm before the merge MLP)
    import dataclasses

    from flax import nnx

    k25 = dataclasses.replace(cfg, norm="layer", bias=True, pos_resize="bicubic", projector_norm="pre",
                              projector_gelu_tanh=True, pos_time=4)
    tower = V.VisionTower(k25, rngs=nnx.Rngs(11))
    patches = rng.standard_normal((6 * 10, 3 * 14 * 14)).astype(np.float32)
    np.testing.assert_allclose(image_features(tower, patches, (1, 6, 10)),
                               np.asarray(V.vision_features(tower, patches, ((1, 6, 10),))), atol=1e-5, rtol=0)


def test_several_images_equal_each_alone_and_a_bad_one_runs_none(monkeypatch):
    """`images_features` starts every image's program before fetching any: the results are each image's alone, and
    an image that does not fit its grid is refused before anything runs."""
    from kimi_jax.modules.vision_buckets import image_features, images_features, programs_for

    cfg = K3_TINY
    tower = V.load_vision_tower(k3_weights(cfg, seed=3), cfg)
    rng = np.random.default_rng(4)
    grids = ((1, 4, 8), (1, 10, 14), (1, 2, 2))  # three buckets: 64, 192, 64
    images = [(rng.standard_normal((h * w, 3 * 14 * 14)).astype(np.float32), (t, h, w)) for t, h, w in grids]
    got = images_features(tower, images)
    for (patches, grid), feats in zip(images, got):
        np.testing.assert_array_equal(feats, image_features(tower, patches, grid))
    calls = []
    programs = programs_for(tower)
    original = programs._call
    monkeypatch.setattr(programs, "_call", lambda *a: calls.append(a) or original(*a))
    with pytest.raises(V.VisionInputError, match="do not fit grid"):
        images_features(tower, [images[0], (images[1][0][:-2], images[1][1])])
    assert calls == []


def test_images_of_one_bucket_share_one_compile():
    """After the first image of a bucket, images of other sizes in it compile nothing (the engine thread would
    otherwise stall every stream for a whole tower compile per new image size)."""
    from kimi_jax.engine import compile_watch
    from kimi_jax.modules.vision_buckets import image_features

    cfg = K3_TINY
    tower = V.load_vision_tower(k3_weights(cfg, seed=9), cfg)
    rng = np.random.default_rng(10)

    def run(h, w):
        return image_features(tower, rng.standard_normal((h * w, 3 * 14 * 14)).astype(np.float32), (1, h, w))

    run(4, 4)  # 16 patches: the 64-patch bucket, compiled here
    before = compile_watch.compile_count()
    shapes = [run(h, w).shape for h, w in ((2, 6), (8, 8), (6, 10), (2, 2))]  # 12, 64, 60 and 4 patches
    assert compile_watch.compile_count() == before
    assert shapes == [(3, 20), (16, 20), (15, 20), (1, 20)]
    with pytest.raises(V.VisionInputError, match="one frame"):
        image_features(tower, np.zeros((8, 3 * 14 * 14), np.float32), (2, 2, 2))
    with pytest.raises(V.VisionInputError, match="do not fit grid"):
        image_features(tower, np.zeros((15, 3 * 14 * 14), np.float32), (1, 4, 4))


def test_warmup_compiles_every_bucket_in_the_background():
    """`BucketPrograms.prepare(patch_buckets(cfg))` (the engine's `vision_warmup`) compiles the tower for every
    bucket in a background thread, smallest first; afterwards an image of any size the processor makes compiles
    nothing."""
    import dataclasses
    import time

    from kimi_jax.engine import compile_watch
    from kimi_jax.modules.vision_buckets import BucketPrograms, patch_buckets

    cfg = dataclasses.replace(K3_TINY, max_patches=256, max_patches_per_side=16)  # buckets 64 .. 384
    buckets = patch_buckets(cfg)
    assert buckets == (64, 96, 128, 192, 256, 384)
    programs = BucketPrograms(V.load_vision_tower(k3_weights(cfg, seed=12), cfg))
    assert programs.prepare(buckets) is False  # started, not done
    deadline = time.monotonic() + 300
    while not programs.prepare(buckets):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = compile_watch.compile_count()
    rng = np.random.default_rng(13)
    for h, w in ((2, 2), (8, 12), (16, 16), (18, 18)):  # 4 .. 324 patches: every bucket size an image can take
        feats = programs.features(rng.standard_normal((h * w, 3 * 14 * 14)).astype(np.float32), (1, h, w))
        assert feats.shape == ((h // 2) * (w // 2), cfg.text_hidden)
    assert compile_watch.compile_count() == before


# ---------------------------------------------------------------------------------------------------------------------
# Bad weights and inputs
# ---------------------------------------------------------------------------------------------------------------------

def test_missing_tensor_is_named():
    w = k3_weights(K3_TINY)
    del w["vision_tower.encoder.blocks.1.mlp.fc0.weight"]
    with pytest.raises(V.VisionWeightsError, match=r"blocks\.1\.mlp\.fc0\.weight is missing \(expected shape \(40, 32\)\)"):
        V.load_vision_tower(w, K3_TINY)


def test_misshaped_tensor_names_both_shapes():
    w = k3_weights(K3_TINY)
    w["vision_tower.encoder.blocks.0.wqkv.weight"] = np.zeros((96, 32), np.float32)  # 3·width, not 3·heads·head_dim
    with pytest.raises(V.VisionWeightsError, match=r"blocks\.0\.wqkv\.weight has shape \(96, 32\), expected \(144, 32\)"):
        V.load_vision_tower(w, K3_TINY)


def test_tensor_of_another_variant_is_refused():
    w = k3_weights(K3_TINY)
    w["vision_tower.encoder.blocks.0.wo.bias"] = np.zeros(32, np.float32)  # a K2.5-style bias under a bias-free config
    with pytest.raises(V.VisionWeightsError, match=r"blocks\.0\.wo\.bias is not part of this vision config"):
        V.load_vision_tower(w, K3_TINY)


def test_bad_grid_and_patch_count():
    tower = V.load_vision_tower(k3_weights(K3_TINY), K3_TINY)
    with pytest.raises(V.VisionInputError, match="multiples of the merge size"):
        tower(np.zeros((12, 588), np.float32), ((1, 3, 4),))
    with pytest.raises(V.VisionInputError, match=r"do not fit grid"):
        tower(np.zeros((10, 588), np.float32), ((1, 2, 4),))
    k25 = VisionConfig.kimi_k25(hidden_size=32, num_heads=2, head_dim=16, num_layers=1, intermediate_size=8,
                                pos_table=4, text_hidden=8)
    with pytest.raises(V.VisionInputError, match="at most 4"):
        V.check_grid(k25, ((5, 2, 2),))


def test_image_token_count():
    assert V.image_token_count([(1, 4, 6)]) == 6
    assert V.image_token_count([(1, 4, 6), (3, 10, 2)]) == 6 + 5  # frames are averaged: t does not count
    # SPEC §9: a 280×420 image is 20×30 patches -> 150 tokens
    cfg = VisionConfig()
    patches, grid = V.preprocess_image(np.zeros((280, 420, 3), np.uint8), cfg)
    assert grid == (1, 20, 30) and V.image_token_count([grid]) == 150 == 20 * 30 // 4 and len(patches) == 600


# ---------------------------------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------------------------------

def test_preprocess_pads_to_28_normalises_and_orders_patches():
    cfg = VisionConfig()
    img = np.random.default_rng(5).integers(0, 256, (30, 45, 3), dtype=np.uint8)
    patches, grid = V.preprocess_image(img, cfg)
    assert grid == (1, 4, 4) and patches.shape == (16, 3, 14, 14) and patches.dtype == np.float32  # 56×56 canvas
    # float64 transcription: pad bottom/right with black, (x/255 - 0.5)/0.5, patch (r, c) = canvas rows 14r.., cols
    # 14c.., laid out [channel, row, col]; patches in row-major order
    canvas = np.zeros((56, 56, 3))
    canvas[:30, :45] = img
    norm = (canvas / 255.0 - 0.5) / 0.5
    for r in range(4):
        for c in range(4):
            want = norm[14 * r:14 * r + 14, 14 * c:14 * c + 14].transpose(2, 0, 1)
            np.testing.assert_allclose(patches[4 * r + c], want, atol=1e-6, rtol=0)
    assert np.all(patches[15] == -1.0)  # entirely padding


def test_preprocess_exact_multiple_is_untouched_and_batched():
    cfg = VisionConfig()
    a = np.full((28, 56, 3), 255, np.uint8)
    b = np.zeros((56, 28, 3), np.uint8)
    patches, grid = V.preprocess_images([a, b], cfg)
    assert grid == ((1, 2, 4), (1, 4, 2)) and patches.shape == (16, 3, 14, 14)
    assert np.all(patches[:8] == 1.0) and np.all(patches[8:] == -1.0)


def test_preprocess_downscales_past_the_patch_budget():
    cfg = VisionConfig(max_patches=64)
    (new_h, new_w), (pad_h, pad_w) = V.navit_size(300, 500, cfg)  # 21·35 patches > 64 -> scale sqrt(64/735)
    scale = math.sqrt(64 / (21 * 35))
    assert (new_h, new_w) == (int(300 * scale), int(500 * scale)) and pad_h % 28 == 0 and pad_w % 28 == 0
    img = np.full((300, 500, 3), 77, np.uint8)
    patches, grid = V.preprocess_image(img, cfg)
    assert grid == (1, pad_h // 14, pad_w // 14)
    inside = patches.reshape(grid[1], grid[2], 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(pad_h, pad_w, 3)
    np.testing.assert_allclose(inside[:new_h, :new_w], (77 / 255 - 0.5) / 0.5, atol=1e-6)  # a flat image stays flat
    assert np.all(inside[new_h:] == -1.0) and np.all(inside[:, new_w:] == -1.0)


def test_preprocess_rejects_non_uint8_rgb():
    with pytest.raises(V.VisionInputError, match="uint8 RGB"):
        V.preprocess_image(np.zeros((28, 28, 4), np.uint8), VisionConfig())


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------

def test_vision_config_presets_and_round_trip():
    k3 = get_preset("kimi-k3.1-pro")
    v = k3.vision
    assert (v.hidden_size, v.num_layers, v.num_heads, v.head_dim, v.intermediate_size) == (1024, 27, 12, 128, 4096)
    assert (v.qkv_width, v.merged_width, v.text_hidden) == (1536, 4096, 7168)
    assert (v.norm, v.bias, v.pos_resize, v.projector_norm, v.projector_gelu_tanh) == ("rms", False, "bilinear",
                                                                                         "post", False)
    k25 = VisionConfig.kimi_k25()
    assert (k25.hidden_size, k25.num_heads, k25.head_dim, k25.intermediate_size, k25.merged_width) == (
        1152, 16, 72, 4304, 4608)
    for cfg in (k3, k3.replace(vision=k25), get_preset("tiny")):
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
        assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    old = k3.to_dict()
    old["vision"] = {k: old["vision"][k] for k in ("patch_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                                                    "intermediate_size", "merge", "pos_table", "projector_hidden")}
    assert ModelConfig.from_dict(old) == k3  # a dict written before the new fields existed


def test_vision_config_refuses_inconsistent_sizes():
    with pytest.raises(ConfigError, match="projector_hidden"):
        VisionConfig(projector_hidden=4608)
    with pytest.raises(ConfigError, match="norm"):
        VisionConfig(norm="batch")
    with pytest.raises(ConfigError, match="unknown vision config keys: colour"):
        VisionConfig.from_dict({"colour": 1})


def test_query_chunks_do_not_change_attention(monkeypatch):
    cfg, grid = K3_TINY, ((1, 4, 4), (2, 2, 2))
    tower = V.load_vision_tower(k3_weights(cfg, seed=5), cfg)
    patches = np.random.default_rng(6).standard_normal((24, 588)).astype(np.float32)
    whole = np.asarray(tower(patches, grid))  # eager: the chunk size is read while tracing
    monkeypatch.setattr(V, "QUERY_CHUNK", 5)  # 16 and 8 queries -> uneven chunks
    np.testing.assert_allclose(np.asarray(tower(patches, grid)), whole, atol=1e-5, rtol=0)


def test_fused_attention_is_only_chosen_for_16_bit_towers_on_a_gpu():
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    assert V.fused_attention_available(jnp.bfloat16, 128) == on_gpu
    assert not V.fused_attention_available(jnp.float32, 128)
    assert not V.fused_attention_available(jnp.bfloat16, 136)


@pytest.mark.gpu
def test_fused_attention_equals_the_materialised_attention_on_a_gpu():
    """cuDNN's flash attention (the bf16 tower's path on a GPU) against the chunked float32-score path, on a clip
    whose length is no multiple of any tile (a 1036-patch clip, K3's 12 heads x 128)."""
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1036, 12, 128)), jnp.bfloat16) for _ in range(3))
    fused = np.asarray(jax.jit(functools.partial(V.attention, fused=True))(q, k, v), np.float32)
    plain = np.asarray(jax.jit(functools.partial(V.attention, fused=False))(q, k, v), np.float32)
    rel = np.sqrt(np.mean((fused - plain) ** 2) / np.mean(plain ** 2))
    assert rel < 1e-2, rel
