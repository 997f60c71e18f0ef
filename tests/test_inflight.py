"""`kimi_jax.inflight`: on JAX's CPU backend a loop waits for one result every `CPU_SYNC_EVERY` programs, so that
XLA's CPU client (at most 32 computations in flight per device, admitted on a shared worker pool) cannot deadlock a
multi-device program with a collective. Without the bound the chain below hung in 3 runs of 3."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
from server_process import ROOT, cpu_devices_env

from kimi_jax.inflight import CPU_SYNC_EVERY, InflightBound

CHAIN = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from kimi_jax.inflight import InflightBound

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    replicated = NamedSharding(mesh, P())
    w = jax.device_put(np.full((256, 256), 1e-3, np.float32), NamedSharding(mesh, P(None, "tensor")))
    step = jax.jit(lambda s, w: jax.lax.with_sharding_constraint(jnp.tanh(s @ w), replicated))  # an all-gather
    state = jax.device_put(np.ones((64, 256), np.float32), replicated)
    bound = InflightBound.for_mesh(mesh)
    for _ in range(2000):
        state = bound(step(state, w))
    print("done", float(state[0, 0]))
""")


def test_a_long_chain_of_collective_programs_on_8_cpu_devices_finishes():
    out = subprocess.run([sys.executable, "-c", CHAIN], cwd=ROOT, env=cpu_devices_env(8), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("done"), out.stderr[-3000:]


def test_the_bound_waits_on_cpu_only():
    assert InflightBound("cpu").every == CPU_SYNC_EVERY
    assert InflightBound("gpu").every == 0 and InflightBound("tpu").every == 0
    waits = InflightBound("cpu", every=3)
    outs = [waits(i) for i in range(7)]  # plain values pass through unchanged
    assert outs == list(range(7)) and waits._dispatched == 1


def test_the_engine_runner_and_model_loops_are_bounded(tiny_model):
    from kimi_jax.engine.guide import NUM_VOCAB_CLASSES
    from kimi_jax.engine.runner import ModelRunner

    assert tiny_model._inflight.every == CPU_SYNC_EVERY
    vocab = tiny_model.config.vocab_size
    runner = ModelRunner(tiny_model, max_num_seqs=2, max_model_len=64, prefill_chunk_sizes=(16,),
                         class_masks=np.zeros((NUM_VOCAB_CLASSES, vocab), bool), stop_mask=np.zeros(vocab, bool))
    assert runner._inflight.every == CPU_SYNC_EVERY
