"""Images through the model (SPEC §9): the vision tower's features replace the embeddings of a prompt's expanded
`<|media_pad|>` tokens, in `Model.logits`, `prefill` / `decode_step` and `generate`; checkpoints bring their tower.

The tower itself is checked in test_vision.py (against transformers' Kimi-K2.5 tower and a float64 transcription).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kimi_jax
from kimi_jax.model import Model
from kimi_jax.modules.vision import VisionWeightsError, expand_image_pads, load_vision_tower, vision_features, \
    preprocess_image
from kimi_jax.modules.vision_buckets import image_features

BOS = 1000


def _image(seed: int, h: int = 40, w: int = 60) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def prompt(tiny_model):
    """[BOS] 5 6 <image: 2x3 merged tokens = 6 pads> 7 8, and the image."""
    img = _image(0)
    n = tiny_model.encode_images([img])[0].shape[0]
    assert n == 6  # 40x60 pixels -> padded 56x84 -> 4x6 patches -> 2x3 tokens
    ids = expand_image_pads([BOS, 5, 6, tiny_model.config.vision.image_token_id, 7, 8], [n], 1009)
    return ids, img


def test_image_tokens_change_only_what_follows_them(tiny_model, prompt):
    ids, img = prompt
    with_image = tiny_model.logits([ids], images=[img])[0]
    text_only = tiny_model.logits([ids])[0]
    first_pad = ids.index(1009)
    np.testing.assert_array_equal(with_image[:first_pad], text_only[:first_pad])  # causal: nothing before moves
    assert np.abs(with_image[first_pad:] - text_only[first_pad:]).max(axis=-1).min() > 1e-3
    other = tiny_model.logits([ids], images=[_image(1)])[0]
    assert np.abs(other[-1] - with_image[-1]).max() > 1e-3  # the pixels matter, not just the pads


DECODE_SCRIPT = """
import numpy as np, kimi_jax
from kimi_jax.modules.vision import expand_image_pads
m = kimi_jax.load_model("tiny")
img = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
ids = expand_image_pads([1000, 5, 6, 1009, 7, 8], [6], 1009)
full = m.logits([ids + [9]], images=[img])[0]
logits, cache = m.prefill([ids], len(ids) + 4, images=[img])
np.testing.assert_allclose(np.asarray(logits[0]), full[:-1], atol=2e-5, rtol=0)
step, _ = m.decode_step(cache, np.array([9]))
np.testing.assert_allclose(np.asarray(step[0]), full[-1], atol=2e-5, rtol=0)
out = m.generate([ids], 2, images=[img])
assert out[0, len(ids)] == int(np.argmax(m.logits([ids], images=[img])[0, -1]))
print("OK")
"""


def test_prefill_and_decode_with_an_image_equal_the_full_forward():
    """In its own process: compiling this decode step late in the full suite's process crashed XLA:CPU (a segfault
    in backend_compile, twice; alone it passes) -- not understood yet."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", DECODE_SCRIPT], capture_output=True, text=True, timeout=600, cwd=root,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_two_images_in_two_rows(tiny_model, prompt):
    ids, img = prompt
    img2 = _image(2)
    both = tiny_model.logits([ids, ids], images=[img, img2])
    np.testing.assert_allclose(both[0], tiny_model.logits([ids], images=[img])[0], atol=2e-5, rtol=0)
    np.testing.assert_allclose(both[1], tiny_model.logits([ids], images=[img2])[0], atol=2e-5, rtol=0)


def test_pad_count_and_placement_errors(tiny_model, prompt):
    ids, img = prompt
    with pytest.raises(ValueError, match="hold 5 <\\|media_pad\\|> tokens .* need 6 .*expand_image_pads"):
        tiny_model.logits([ids[:4] + ids[5:]], images=[img])
    pads = [1009] * 6
    with pytest.raises(ValueError, match="image 0's 6 tokens span two rows"):  # 2 + 4 pads over two rows
        tiny_model.logits([[BOS, 5, 6, 7] + pads[:2], [BOS, 5] + pads[2:]], images=[img])
    with pytest.raises(ValueError, match="uint8 RGB image"):
        tiny_model.logits([ids], images=[np.zeros((28, 28), np.uint8)])


def test_a_model_without_a_tower_says_why(tiny_model, prompt):
    ids, img = prompt
    text_only = Model(tiny_model.module, tiny_model.dtype)
    with pytest.raises(ValueError, match="cannot take images: the checkpoint holds no vision_tower"):
        text_only.logits([ids], images=[img])


def test_expand_image_pads():
    assert expand_image_pads([1, 9, 2, 9, 3], [2, 3], 9) == [1, 9, 9, 2, 9, 9, 9, 3]
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_image_pads([1, 9, 2, 9], [2], 9)


# --- checkpoints ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    from convert.synthetic import write_k3_checkpoint

    d = tmp_path_factory.mktemp("k3v") / "hf"
    write_k3_checkpoint(str(d), kimi_jax.get_preset("tiny"), seed=3, dtype="F32")
    return d


def _tensors(directory) -> dict:
    from ckpt_helpers import read_all

    return read_all(directory)


def test_checkpoints_bring_their_vision_tower(k3_dir, tmp_path):
    """The HF directory (converted on the fly) and its converted copy both load the tower whose features equal the
    tower built straight from the safetensors' own tensors."""
    from kimi_jax.checkpoint import convert_checkpoint as convert

    hf = kimi_jax.load_model(str(k3_dir))
    assert hf.vision is not None and hf.config.vision.hidden_size == 8
    img = _image(4, 30, 30)
    want_tower = load_vision_tower(_tensors(k3_dir), hf.config.vision)
    patches, grid = preprocess_image(img, hf.config.vision)
    want = image_features(want_tower, patches, grid)  # the model's path: the tower padded to its patch bucket
    np.testing.assert_array_equal(np.asarray(hf.encode_images([img])[0]), want)
    np.testing.assert_allclose(want, np.asarray(vision_features(want_tower, patches, (grid,))), atol=1e-5, rtol=0)
    dst = tmp_path / "converted"
    convert(str(k3_dir), str(dst))
    ours = kimi_jax.load_model(str(dst))
    np.testing.assert_array_equal(np.asarray(ours.encode_images([img])[0]), want)


def test_a_checkpoint_missing_a_vision_tensor_is_refused(k3_dir, tmp_path):
    from ckpt_helpers import rewrite_dir
    from convert import ConvertError

    bad = tmp_path / "bad"
    rewrite_dir(k3_dir, bad, lambda t: {n: a for n, a in t.items() if n != "vision_tower.encoder.blocks.0.wo.weight"})
    with pytest.raises(ConvertError, match="missing vision tensor.*blocks.0.wo.weight"):  # the plan checks it
        kimi_jax.load_model(str(bad))
    tensors = {n: a for n, a in _tensors(k3_dir).items() if n != "vision_tower.encoder.blocks.0.wo.weight"}
    with pytest.raises(VisionWeightsError, match="blocks.0.wo.weight is missing"):  # the loader's own check
        load_vision_tower(tensors, kimi_jax.load_config(str(k3_dir)).vision)
    assert os.path.isdir(k3_dir)


def test_vision_config_from_a_k3_config_json():
    from kimi_jax.config import ConfigError, VisionConfig, vision_from_hf

    assert vision_from_hf({}, {}, 7168) == VisionConfig()  # nothing given: SPEC §9's tower
    vc = vision_from_hf({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
                         "intermediate_size": 96, "pos_emb_height": 8, "merge_kernel_size": [2, 2]},
                        {"media_placeholder_token_id": 77}, 32)
    assert (vc.hidden_size, vc.num_layers, vc.qkv_width, vc.pos_table, vc.projector_hidden, vc.text_hidden,
            vc.image_token_id) == (64, 2, 64, 8, 256, 32, 77)
    with pytest.raises(ConfigError, match="only square merges"):
        vision_from_hf({"merge_kernel_size": [2, 1]}, {}, 32)
    with pytest.raises(ConfigError, match="must be an object"):
        vision_from_hf([1], {}, 32)


def test_convert_checks_the_vision_tower_before_converting(k3_dir, tmp_path):
    """A damaged tower fails at `python -m convert`'s plan (from the headers), not after the conversion at load."""
    from ckpt_helpers import leftovers, rewrite_dir
    from convert import ConvertError
    from kimi_jax.checkpoint import convert_checkpoint as convert

    name = "vision_tower.encoder.blocks.0.mlp.fc0.weight"
    bad = tmp_path / "bad"
    rewrite_dir(k3_dir, bad, lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(ConvertError, match=f"vision_config: shape mismatch for {name}"):
        convert(str(bad), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    dropped = tmp_path / "dropped"
    rewrite_dir(k3_dir, dropped, lambda t: {n: a for n, a in t.items() if n != name})
    with pytest.raises(ConvertError, match=f"missing vision tensor.*{name}"):
        convert(str(dropped), str(tmp_path / "out"), progress=False)
