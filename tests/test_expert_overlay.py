"""The expert overlay (`expert=8,tensor=1,context=8`, vLLM's K3.1 layout: experts over ("context", "model") while
attention uses the axes differently) runs its routed experts expert-parallel, as the "model"-only layouts do
(tests/test_sharding.py, tests/test_moe_kernels.py): `ep_expert_ffn` over a tuple of mesh axes against the
one-device reference for both dispatch methods, and the tiny model's logits and greedy tokens on overlay meshes
against one device, with every MoE layer traced through `ep_expert_ffn`. Without it GSPMD gathers every layer's
experts to every device at every step (a Pallas custom call cannot be split).

8 fake CPU devices, in subprocesses so the flag does not leak into other tests."""

import os
import subprocess
import sys
import textwrap

import pytest
from server_process import cpu_devices_env

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

OVERLAYS = ("expert=8,tensor=1,context=8", "expert=8,tensor=2,context=4")


def _run(script: str, *args: str, timeout: int) -> str:
    env = cpu_devices_env(8,
               PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))  # ep_cases
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


OP_SCRIPT = textwrap.dedent("""
    import logging, numpy as np, jax, jax.numpy as jnp
    from pallas_kernels.moe import mxfp4 as mx, reference
    from sharding import make_mesh
    from sharding.expert_parallel import ep_expert_ffn, expert_group_axis
    assert len(jax.devices()) == 8
    import ep_cases
    from ep_cases import situ
    N, D, F, E, k = 64, 64, 32, 16, 4
    rng, x, idx, wt, wg, wu, wd, ref = ep_cases.routed_case(N, D, F, E, k, gate_scale=8, down_scale=6)
    check = lambda tag, out, want=ref, tol=1e-5: ep_cases.check(tag, out, want, tol)

    # the expert group's shard_map axis: "model" alone keeps the name (and programs) of the model-only layouts
    assert expert_group_axis(make_mesh("2x4")) == "model"
    assert expert_group_axis(make_mesh("tensor=2,context=4")) == "model"
    assert expert_group_axis(make_mesh("expert=8,tensor=1,context=8")) == "context"
    assert expert_group_axis(make_mesh("expert=8,tensor=2,context=4")) == ("context", "model")

    for spec in ("expert=8,tensor=1,context=8", "expert=8,tensor=2,context=4", "data=2,expert=4,tensor=2,context=2"):
        mesh = make_mesh(spec)
        for method in ("allgather", "ragged"):  # ragged through the all-gather emulation (XLA:CPU lacks the op)
            run = lambda: ep_expert_ffn(x, idx, wt, wg, wu, wd, situ, mesh=mesh, method=method,
                                        backend="reference", emulate_a2a=True)
            out = run()
            # tokens come back cut over ("data", <expert axes>): every device holds its own rows
            assert len(out.sharding.device_set) == 8 and out.sharding.shard_shape(out.shape)[0] == N // 8, spec
            check(f"{spec} {method}", out)
            assert np.array_equal(np.asarray(out), np.asarray(run())), "not deterministic"
        # tokens that do not split over data x expert axes stay replicated over the expert group (psum)
        check(f"{spec} replicated", ep_expert_ffn(x[:60], idx[:60], wt[:60], wg, wu, wd, situ, mesh=mesh,
                                                  backend="reference"), want=ref[:60])

    # the real ragged_all_to_all (GPU / TPU) over two expert axes: one exchange per data shard, among the 4 devices
    # of its (context, model) group (lowered only: XLA:CPU cannot compile it)
    mesh = make_mesh("data=2,expert=4,tensor=2,context=2")
    hlo = jax.jit(lambda *a: ep_expert_ffn(*a, situ, mesh=mesh, method="ragged", backend="reference")).lower(
        x, idx, wt, wg, wu, wd).as_text()
    a2a = [line for line in hlo.splitlines() if "@ragged_all_to_all" in line]
    assert len(a2a) == 2 and all("replica_groups = dense<[[0, 1, 2, 3], [4, 5, 6, 7]]>" in l for l in a2a), a2a
    print("ragged lowering ok")

    # MXFP4 experts (a pytree of packed codes and scales) split over both expert axes the same way
    mesh = make_mesh("expert=8,tensor=2,context=4")
    q = [mx.quantize(w) for w in (wg, wu, wd)]
    want = np.asarray(reference.expert_ffn(x, idx, wt, *(mx.dequantize(w) for w in q), situ))
    check("mxfp4 allgather", ep_expert_ffn(x, idx, wt, *q, situ, mesh=mesh, method="allgather", backend="reference"),
          want=want)
    try:
        ep_expert_ffn(x, idx, wt, wg[:12], wu[:12], wd[:12], situ, mesh=mesh, backend="reference")
        raise AssertionError("12 experts over 8 devices did not raise")
    except ValueError as e:
        assert "context=4 x model=2" in str(e), e

    # experts whose count does not divide the expert axes stay whole on every device (sharding.rules replicates
    # them too); 8 experts over an 8-way overlay split
    from sharding.context import context_for_mesh
    from sharding.moe import expert_ways
    assert expert_ways(context_for_mesh(make_mesh("expert=6,tensor=2,context=3")), 8) == 1
    assert expert_ways(context_for_mesh(make_mesh("expert=8,tensor=1,context=8")), 8) == 8
    print("use_expert_parallel ok")
""")


def test_ep_expert_ffn_over_the_expert_overlay_matches_one_device():
    out = _run(OP_SCRIPT, timeout=600)
    for spec in ("expert=8,tensor=1,context=8", "expert=8,tensor=2,context=4", "data=2,expert=4,tensor=2,context=2"):
        for tag in ("allgather", "ragged", "replicated"):
            assert f"{spec} {tag} ok" in out, out
    assert "mxfp4 allgather ok" in out and "use_expert_parallel ok" in out and "ragged lowering ok" in out, out


MODEL_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, kimi_jax
    import sharding.expert_parallel as ep
    from kimi_jax.modules.moe import moe_layers
    ids = np.random.RandomState(0).randint(0, 1000, (2, 20))
    ref = kimi_jax.load_model("tiny")
    r, g = ref.logits(ids), ref.generate(ids[:, :6], 3)
    traced = []  # the expert group axis of every ep_expert_ffn call the forwards trace
    plain = ep.ep_expert_ffn
    def spy(*a, mesh, **kw):
        traced.append(ep.expert_group_axis(mesh))
        return plain(*a, mesh=mesh, **kw)
    ep.ep_expert_ffn = spy
    for spec in sys.argv[1:]:
        m = kimi_jax.load_model("tiny", mesh=spec)
        moes = [x for _, x in moe_layers(m.module)]
        assert moes and m.ctx.mesh == m.mesh and m.ctx.axes.expert == ("context", "model"), spec
        w1 = moes[0].experts.gate[...]
        assert len(w1.sharding.device_set) == 8 and w1.sharding.shard_shape(w1.shape)[0] == 1, w1.sharding
        traced.clear()
        l = m.logits(ids)
        axis = "context" if "tensor=1" in spec else ("context", "model")
        assert traced == [axis] * len(moes), (spec, traced)  # every MoE layer ran expert-parallel
        err = float(np.abs(l - r).max() / r.std())
        assert err < 1e-4 and (l.argmax(-1) == r.argmax(-1)).all(), (spec, err)
        traced.clear()
        assert (m.generate(ids[:, :6], 3) == g).all(), spec
        assert traced and set(traced) == {axis}, (spec, traced)
        print(spec, "ok", err)
""")


@pytest.mark.slow
@pytest.mark.parametrize("spec", OVERLAYS)
def test_tiny_model_on_the_expert_overlay_matches_one_device(spec):
    """Logits (the same tolerance as tests/test_sharding.py's layouts) and greedy tokens equal one device's, every
    MoE layer traced through `ep_expert_ffn` over the overlay's expert axes, experts stored one per device."""
    out = _run(MODEL_SCRIPT, spec, timeout=900)
    assert f"{spec} ok" in out, out
