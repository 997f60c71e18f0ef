"""Model integration of the kernels: the tiny model's logits through the kernels (run in interpret mode on CPU: Pallas
TPU interpret mode, Triton's interpreter for the GPU kernels) equal the jnp-reference path — prefill, prefill
continued from a cache (KDA initial state), and step-by-step decode (slot-addressed recurrent kernel, cache
donated)."""

import dataclasses

import jax
import numpy as np
import pytest

import kimi_jax
from kimi_jax.config import get_preset
from kimi_jax.kernels import KernelConfig
from kimi_jax.model import random_model

BAR = 1e-4  # max |Δlogit| relative to max |logit| (fp32 model)


def _close(kernels, reference):
    err = float(np.abs(kernels - reference).max() / np.abs(reference).max())
    assert err <= BAR, err
    assert (kernels.argmax(-1) == reference.argmax(-1)).all()


def test_tpu_kernel_path_logits_equal_reference_path(tiny_model):
    ids = np.random.RandomState(0).randint(0, 1000, (2, 20))
    reference = tiny_model.logits(ids)  # CPU: "auto" resolves to the jnp reference
    kernel_model = kimi_jax.load_model("tiny", kernels=KernelConfig(kda="tpu_interpret", moe="tpu",
                                                                     moe_interpret=True))
    _close(kernel_model.logits(ids), reference)


def _prefill_continue_decode(model, ids, n_first, n_second, n_decode):
    """Logits of: prefill ids[:, :n_first]; prefill the next n_second tokens onto that cache; then n_decode
    teacher-forced decode steps. Returns a list of float32 arrays."""
    out = []
    total = n_first + n_second + n_decode
    lg, cache = model.prefill(ids[:, :n_first], total)
    out.append(np.asarray(lg))
    lg, cache = model.prefill(ids[:, n_first:n_first + n_second], cache=cache)
    out.append(np.asarray(lg))
    for t in range(n_first + n_second, total):
        lg, cache = model.decode_step(cache, ids[:, t])
        out.append(np.asarray(lg))
    return out


@pytest.mark.parametrize("kda", ["gpu_interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_gpu_kda_kernel_path_equals_reference_path(tiny_model, kda):
    """GPU (native Triton) KDA kernels — in Triton's interpreter on CPU, compiled on a GPU: T = 70 (not a multiple of
    64, two chunks), a continued prefill (initial state from the cache) and decode steps.

    Both models run with every product in IEEE fp32 (`default_matmul_precision("highest")`; a no-op on CPU). Under
    the GPU's TF32 default the non-KDA layers round their inputs to 10 mantissa bits, and the tiny model's top-8 index
    selection and top-2 routing amplify the kernels' 1e-6 difference to 1e-2 of the logits."""
    ids = np.random.RandomState(1).randint(0, 1000, (2, 80))
    with jax.default_matmul_precision("highest"):
        reference_model = tiny_model if kda == "gpu_interpret" else kimi_jax.load_model(
            "tiny", kernels=KernelConfig(kda="reference", moe="reference"))
        kernel_model = kimi_jax.load_model("tiny", kernels=KernelConfig(kda=kda, moe="reference"))
        _close(kernel_model.logits(ids[:, :70]), reference_model.logits(ids[:, :70]))
        ref = _prefill_continue_decode(reference_model, ids, 11, 57, 3)
        ker = _prefill_continue_decode(kernel_model, ids, 11, 57, 3)
    for a, b in zip(ker, ref):
        _close(a, b)


def _paged_decode_step_logits(models, seed: int, batch: int = 2):
    """Each model prefills the same batch × 64 random ids into fp8 pages, then takes one decode step: its logits."""
    ids = np.random.RandomState(seed).randint(0, 1000, (batch, 64))
    out = []
    for m in models:
        cache = m.new_paged_cache(batch, 128, kv_dtype="fp8")
        _, cache = m.prefill(ids, cache=cache)
        logits, _ = m.decode_step(cache, 5 + 2 * np.arange(batch))  # next tokens 5, 7, 9, …
        out.append(np.asarray(logits))
    return out


def test_tpu_dsa_kernels_in_the_paged_decode_equal_reference_path(tiny_model):
    """KernelConfig(dsa=...) reaches the paged MLA path: a decode step through the TPU indexer and sparse-MLA
    kernels (interpret mode) gives the reference path's logits over the same fp8 pages (prefill chunks take the
    reference either way: the DSA kernels are decode kernels)."""
    ker = kimi_jax.load_model("tiny", kernels=KernelConfig(dsa="tpu_interpret"))
    ref, got = _paged_decode_step_logits((tiny_model, ker), seed=0)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def _tiny_with_gpu_dsa_shapes():
    """The tiny preset with shapes both GPU DSA kernels take: rope 16 (tiny's rope 8 sends sparse MLA to the
    reference) and 8 indexer heads (fewer than 16: the indexer kernel pads them, the case that was wrong on the
    H200 before it did)."""
    cfg = get_preset("tiny")
    return dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, qk_rope_head_dim=16),
                               indexer=dataclasses.replace(cfg.indexer, num_heads=8))


@pytest.mark.parametrize("dsa", ["gpu_interpret", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision,bound", [("exact", 1e-4), ("storage", 5e-3)])
def test_gpu_dsa_kernels_in_the_paged_decode_equal_reference_path(precision, bound, dsa, monkeypatch):
    """KernelConfig(dsa="gpu_interpret" | "gpu", dsa_precision=...) runs the GPU indexer and sparse-MLA kernels
    (interpret mode on CPU, compiled on a GPU) in every MLA layer's decode step: logits equal the reference path's
    over the same fp8 pages, to ≈ fp32 ("exact") or within the storage formats' bar ("storage": 8 sequences, so the
    sparse-MLA kernel takes its single-pass split preset). Both models run with IEEE fp32 products
    (`default_matmul_precision("highest")`, a no-op on CPU) so the bound measures the kernels, not TF32."""
    from pallas_kernels.indexer import gpu_triton as igpu
    from pallas_kernels.mla import sparse_gpu_triton

    launched = []
    for mod, name in ((sparse_gpu_triton, "decode"), (igpu, "scores")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: launched.append((_n, k)) or _real(*a, **k))
    cfg = _tiny_with_gpu_dsa_shapes()
    ref = random_model(cfg, kernels=KernelConfig.reference())
    # only the DSA ops differ: on a GPU "auto" would also put KDA and MoE on their (bf16-bar) kernels
    ker = random_model(cfg, kernels=dataclasses.replace(KernelConfig.reference(), dsa=dsa, dsa_precision=precision))
    assert ker.ctx.kernels.dsa == dsa and ker.ctx.kernels.dsa_precision == precision  # what every forward runs
    with jax.default_matmul_precision("highest"):
        want, got = _paged_decode_step_logits((ref, ker), seed=1, batch=8)
    assert {n for n, _ in launched} == {"decode", "scores"}
    assert all(k.get("exact", True) is (precision == "exact") for _, k in launched)
    assert np.abs(got - want).max() <= bound * np.abs(want).max()
    with pytest.raises(ValueError, match="precision"):
        KernelConfig(dsa_precision="fp16")


def test_storage_precision_sends_fp8_rows_with_few_heads_to_the_mosaic_gpu_kernel():
    """The sparse-MLA GPU dispatch (`sparse._gpu_impl`): fp8 rows, storage precision, ≤ 16 heads, one pool part ->
    the one-launch Mosaic kernel at any batch size; exact products, more heads, other row formats, interpret mode or
    Triton settings -> the Triton kernel; an explicit impl always wins."""
    from kimi_jax.quant import LatentFormat
    from pallas_kernels.mla import sparse

    fp8, nvfp4 = LatentFormat("fp8", 512, 64), LatentFormat("nvfp4", 512, 64)
    one = (object(),)
    assert sparse._gpu_impl("gpu", {}, "storage", fp8, 32, 12, one) == "mgpu"
    assert sparse._gpu_impl("gpu", {}, "storage", fp8, 1, 12, one) == "mgpu"  # one sequence too (H100)
    assert sparse._gpu_impl("gpu", {}, "exact", fp8, 32, 12, one) == "triton"
    assert sparse._gpu_impl("gpu", {}, "storage", fp8, 32, 96, one) == "triton"
    assert sparse._gpu_impl("gpu", {}, "storage", nvfp4, 32, 12, (object(),) * 3) == "triton"
    assert sparse._gpu_impl("gpu", {}, "storage", LatentFormat("fp8", 512, 8), 32, 12, one) == "triton"
    assert sparse._gpu_impl("gpu", {}, "storage", LatentFormat("fp8", 128, 64), 32, 12, one) == "triton"  # 2 wg ∤ R
    assert sparse._gpu_impl("gpu_interpret", {}, "storage", fp8, 32, 12, one) == "triton"
    assert sparse._gpu_impl("gpu", {"block_h": 16}, "storage", fp8, 32, 12, one) == "triton"
    assert sparse._gpu_impl("gpu", {"impl": "triton"}, "storage", fp8, 32, 12, one) == "triton"
    assert sparse._gpu_impl("gpu", {"impl": "mgpu"}, "exact", fp8, 32, 96, one) == "mgpu"


@pytest.mark.gpu
def test_mosaic_sparse_mla_in_the_paged_decode_equals_reference_path(monkeypatch):
    """On a GPU, KernelConfig(dsa="gpu", dsa_precision="storage") with fp8 pages and MLA rows the Mosaic kernel
    reads (K3's latent 512 + rope 64 = 576 bytes, 2 heads) runs `sparse_mgpu.decode` in every MLA layer's decode
    step (16 sequences: the dispatch's smallest batch for it); logits equal the reference path's within the storage
    formats' bar."""
    from pallas_kernels.mla import sparse_mgpu

    launched = []
    real = sparse_mgpu.decode
    monkeypatch.setattr(sparse_mgpu, "decode", lambda *a, **k: launched.append(k) or real(*a, **k))
    cfg = get_preset("tiny")
    cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, kv_lora_rank=512, qk_rope_head_dim=64),
                              indexer=dataclasses.replace(cfg.indexer, num_heads=8))
    ref = random_model(cfg, kernels=KernelConfig.reference())
    ker = random_model(cfg, kernels=dataclasses.replace(KernelConfig.reference(), dsa="gpu",
                                                        dsa_precision="storage"))
    with jax.default_matmul_precision("highest"):
        want, got = _paged_decode_step_logits((ref, ker), seed=2, batch=16)
    assert launched
    assert np.abs(got - want).max() <= 5e-3 * np.abs(want).max()
