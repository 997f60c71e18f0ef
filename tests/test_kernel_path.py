"""Model integration of the kernels: the tiny model's logits through the Pallas kernels (TPU kernels in interpret
mode on CPU: KDA chunked prefill and the MoE grouped matmul) equal the jnp-reference path."""

import numpy as np

import kimi_jax
from kimi_jax.kernels import KernelConfig


def test_tpu_kernel_path_logits_equal_reference_path(tiny_model):
    ids = np.random.RandomState(0).randint(0, 1000, (2, 20))
    reference = tiny_model.logits(ids)  # CPU: "auto" resolves to the jnp reference
    kernel_model = kimi_jax.load_model("tiny", kernels=KernelConfig(kda="tpu_interpret", moe="tpu",
                                                                     moe_interpret=True))
    kernels = kernel_model.logits(ids)
    assert np.abs(kernels - reference).max() <= 1e-4 * np.abs(reference).max()
    assert (kernels.argmax(-1) == reference.argmax(-1)).all()
