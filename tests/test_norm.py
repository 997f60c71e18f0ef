"""RMSNorm's GPU kernel (`pallas_kernels.norm`, run here in Triton's interpreter) is the definition: bf16 rows equal
bit for bit, float32 rows to the order of the sum of squares; the model routes its norms through it by
`KernelConfig(norm=...)` at decode sizes and keeps the definition for prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

from pallas_kernels import norm  # noqa: E402


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2304), (3, 2, 100), (5, 7168), (2, 512)])
def test_the_kernel_is_the_definition(dtype, shape):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype) * 3
    w = (1 + 0.1 * jax.random.normal(jax.random.key(1), shape[-1:])).astype(dtype)
    got = norm.rmsnorm(x, w, 1e-6, "gpu_interpret")
    want = norm.rmsnorm_reference(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == shape
    tol = 1e-6 if dtype == jnp.float32 else 0
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_prefill_sized_batches_and_unknown_backends():
    x = jnp.ones((norm.MAX_ROWS + 1, 64))
    np.testing.assert_array_equal(norm.rmsnorm(x, jnp.ones(64), 1e-6, "gpu_interpret"),
                                  norm.rmsnorm_reference(x, jnp.ones(64), 1e-6))
    assert norm.resolve_backend("auto", "cpu") == "reference"
    with pytest.raises(ValueError, match="unknown norm backend"):
        norm.resolve_backend("cuda")


def test_the_model_decodes_through_the_norm_kernel(tiny_model, monkeypatch):
    """The tiny model with `KernelConfig(norm="gpu_interpret")`: its prefill (40 rows) and decode steps run every norm
    through the kernel and give the reference path's logits."""
    import kimi_jax
    from kimi_jax.kernels import KernelConfig

    launched = []
    launch = norm.call

    def recorded(*args, **kw):
        launched.append(kw["D"])
        return launch(*args, **kw)

    monkeypatch.setattr(norm, "call", recorded)
    ids = np.random.RandomState(2).randint(0, 1000, (2, 22))
    model = kimi_jax.load_model("tiny", kernels=KernelConfig(norm="gpu_interpret"))
    out = []
    for m in (tiny_model, model):
        lg, cache = m.prefill(ids[:, :20], 22)
        steps = [np.asarray(lg)]
        for t in (20, 21):
            lg, cache = m.decode_step(cache, ids[:, t])
            steps.append(np.asarray(lg))
        out.append(steps)
    cfg = model.config
    norms_per_step = 2 * cfg.num_layers + 1 + sum(k == "mla" for k in cfg.layer_kinds) * (
        1 + (cfg.mla.q_lora_rank is not None))
    assert len(launched) >= norms_per_step
    for got, want in zip(out[1], out[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


MESH_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import norm
from sharding import make_mesh
from sharding import norm as sharded_norm
from sharding.context import ForwardContext, KernelConfig
x = jax.random.normal(jax.random.key(0), (8, 1, 512), jnp.float32).astype(jnp.bfloat16)
w = (1 + 0.1 * jax.random.normal(jax.random.key(1), (512,))).astype(jnp.bfloat16)
want = np.asarray(norm.rmsnorm_reference(x, w, 1e-6), np.float32)
for spec in ("4x2", "8x1"):
    ctx = ForwardContext(mesh=make_mesh(spec), kernels=KernelConfig(norm="gpu_interpret"))
    got = jax.jit(lambda x, w: sharded_norm.rmsnorm(ctx, x, w, 1e-6))(x, w)
    assert np.array_equal(np.asarray(got, np.float32), want), spec
print("ok")
"""


def test_the_norm_kernel_on_a_mesh_equals_one_device():
    """On 8 faked devices — the rows split over a data axis of 2 (4x2), or whole over 8 tensor ways (8x1) — the kernel
    runs per device on its rows under shard_map and gives one device's bits."""
    import subprocess
    import sys
    from pathlib import Path

    from server_process import cpu_devices_env

    out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=Path(__file__).resolve().parents[1],
                         env=cpu_devices_env(8), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]
