"""Context parallelism on the expert overlay (`expert=8,tensor=1,context=8`, vLLM's K3.1 layout, and
`expert=8,tensor=2,context=4`): inside the token-split prefill and DCP decode programs (`kimi_jax.parallel`,
one shard_map manual over "context") the routed experts stay split over ("context", "model") and run
expert-parallel (`sharding.expert_parallel.ep_expert_ffn_manual`) instead of being gathered to every context shard.

* op level: `ep_expert_ffn_manual` inside a shard_map manual over ("data", "context") against the one-device
  reference, tokens split over "context" (prefill: all-gather and emulated ragged dispatch, rows that do not
  divide over "model") and replicated (decode: psum of each device's own experts).
* the tiny model: prefill / DCP decode logits within the CP tests' 1e-4, greedy tokens equal one device's; every
  MoE layer traced through `ep_expert_ffn_manual`; the compiled programs take 1/8 of the experts per device and
  contain no all-gather of expert weights.

The "model"-only layouts keep their programs (tests/test_context_parallel.py covers their results).
8 fake CPU devices, in subprocesses so the flag does not leak into other tests."""

import os
import subprocess
import sys
import textwrap

import pytest
from server_process import cpu_devices_env

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
OVERLAYS = (("expert=8,tensor=1,context=8", "contiguous"), ("expert=8,tensor=2,context=4", "round_robin"))


def _run(script: str, *args: str, timeout: int) -> str:
    env = cpu_devices_env(8,
               PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))  # ep_cases
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0 and "ALL DONE" in out.stdout, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


OP_SCRIPT = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from pallas_kernels.moe import reference
    from sharding import make_mesh
    from sharding.mesh import expert_axes
    from sharding.expert_parallel import ep_expert_ffn_manual
    assert len(jax.devices()) == 8
    import ep_cases
    from ep_cases import situ
    N, D, F, E, k = 64, 64, 24, 16, 4  # F unlike any token-row count: an expert array is recognisable in HLO
    rng, x, idx, wt, wg, wu, wd, ref = ep_cases.routed_case(N, D, F, E, k, gate_scale=8, down_scale=6)

    for spec in ("expert=8,tensor=1,context=8", "expert=8,tensor=2,context=4", "data=2,expert=4,tensor=2,context=2"):
        mesh = make_mesh(spec)
        axes = expert_axes(mesh)
        ws = [jax.device_put(w, NamedSharding(mesh, P(axes))) for w in (wg, wu, wd)]  # as sharding.rules places them
        # (tokens' in_spec, token_axis, method, rows): prefill-like (rows split over data x context, replicated
        # over model; 60 rows leave 15 per context shard, which "model" = 2 does not divide) and decode-like
        # (rows over data only, the same on every context device)
        for tok_spec, token_axis, method, n in ((P(("data", "context")), "context", "allgather", N),
                                                (P(("data", "context")), "context", "ragged", N),
                                                (P(("data", "context")), "context", "allgather", 60),
                                                (P("data"), None, "allgather", N)):
            if n % (mesh.shape["data"] * mesh.shape["context"]) and token_axis:
                continue
            body = lambda x, i, w, a, b, c: ep_expert_ffn_manual(x, i, w, a, b, c, situ, expert_axes=axes,
                                                                 token_axis=token_axis, method=method,
                                                                 backend="reference", emulate_a2a=True)
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok_spec,) * 3 + (P("context"),) * 3,
                                      out_specs=tok_spec, axis_names={"data", "context"}, check_vma=False))
            out = f(x[:n], idx[:n], wt[:n], *ws)
            err = float(np.abs(np.asarray(out) - ref[:n]).max() / np.abs(ref[:n]).max())
            assert err < 1e-5, (spec, token_axis, method, n, err)
            hlo = f.lower(x[:n], idx[:n], wt[:n], *ws).compile().as_text()
            gathered = [l for l in hlo.splitlines() if "all-gather" in l and (f",{D},{F}]" in l or f",{F},{D}]" in l)]
            assert not gathered, gathered  # the experts never move
            print(spec, token_axis, method, n, "ok", err)
    print("ALL DONE")
""")


def test_ep_expert_ffn_manual_inside_a_context_shard_map_matches_one_device():
    out = _run(OP_SCRIPT, timeout=600)
    assert out.count(" ok ") >= 11, out


MODEL_SCRIPT = textwrap.dedent(r"""
    import re, sys, numpy as np, jax, jax.numpy as jnp, kimi_jax
    import sharding.expert_parallel as ep
    from sharding import make_mesh
    from kimi_jax import parallel as mc
    from sharding.rules import path_name
    from kimi_jax.modules.moe import moe_layers
    spec, layout = sys.argv[1:3]
    assert len(jax.devices()) == 8

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    # one device: the tiny K3.1 model, a 29-token prompt (inert end padding over 8 / 4 devices), 3 greedy tokens
    B, T, N, S = 2, 29, 3, 32
    ids = np.random.RandomState(0).randint(0, 1000, (B, T))
    ref = kimi_jax.load_model("tiny")
    r_logits, r_cache = ref.prefill(ids, S)
    tok, r_steps = jnp.argmax(r_logits[:, -1], -1), []
    for _ in range(N):
        lg, r_cache = ref.decode_step(r_cache, tok)
        r_steps.append(np.asarray(lg))
        tok = jnp.argmax(lg, -1)
    r_gen = ref.generate(ids, N)
    moes = [m for _, m in moe_layers(ref.module)]
    E = ref.config.moe.num_experts

    traced = []  # (token_axis, local experts) of every expert-parallel call the CP programs trace
    plain = ep.ep_expert_ffn_manual
    def spy(x, i, w, wg, *a, token_axis=None, **kw):
        traced.append((token_axis, wg.shape[0]))
        return plain(x, i, w, wg, *a, token_axis=token_axis, **kw)
    ep.ep_expert_ffn_manual = spy

    mesh = make_mesh(spec)
    n, M = mesh.shape["context"], mesh.shape["model"]
    logits, cache = mc.prefill(ref, ids, mesh, mode="token", max_len=S, layout=layout)
    err = rel(logits, r_logits)
    assert err <= 1e-4 and (np.asarray(logits).argmax(-1) == np.asarray(r_logits).argmax(-1)).all(), err
    # every MoE layer ran expert-parallel, each context shard holding its E / context experts ("model" splits them
    # further inside)
    assert traced == [("context", E // n)] * len(moes), traced
    print("prefill ok", err)
    tok = jnp.argmax(logits[:, -1], -1)
    for i in range(N):
        traced.clear()
        lg, cache = mc.decode_step(ref, cache, tok, mesh, layout=layout)
        err = rel(lg, r_steps[i])
        assert err <= 1e-4, (i, err)
        assert i or traced == [(None, E // n)] * len(moes), traced  # traced once, on the first step
        tok = jnp.argmax(lg, -1)
        print("DCP step", i, "ok", err)
    assert (mc.generate(ref, ids, N, mesh, layout=layout) == r_gen).all()
    print("generate ok")

    # the compiled programs take 1/8 of the experts per device (the SPMD program's entry parameters are per-device
    # shapes: without expert parallelism each would be the whole [E, K, N]) and never all-gather them
    expert_leaf = lambda path: re.search(r"block_sparse_moe\.experts\.(gate|up|down)$", path_name(path)) is not None
    experts = [a.shape for path, a in jax.tree_util.tree_flatten_with_path(ref.params)[0] if expert_leaf(path)]
    assert len(experts) == 3 * len(moes)
    hlo_shape = lambda s: "f32[" + ",".join(map(str, s)) + "]"
    def check(compiled, name):
        hlo = compiled.as_text()
        entry = hlo[hlo.index("ENTRY"):]
        params = re.findall(r"= (f32\[[\d,]*\])\{[^}]*\} parameter\(", entry[:entry.index("\n}")])
        for shape in set(experts):
            local = hlo_shape((E // 8,) + shape[1:])
            assert params.count(local) == experts.count(shape), (name, local, params.count(local))
            assert hlo_shape(shape) not in params, (name, shape)
        # no all-gather yields [e, K, N] for any expert count e (K, N of w1 / w3: no activation has that shape here)
        kn = ",".join(map(str, experts[0][1:])) + "]"
        gathered = [l for l in hlo.splitlines() if "all-gather" in l and re.search(r"f32\[\d+," + kn, l)]
        assert not gathered, (name, gathered[:3])
        print(name, "experts stay split ok")

    plan = mc.prefill_plan(ref, (B, T), mesh, mode="token", max_len=S, layout=layout)
    check(plan.compiled, "prefill")
    _, cache = mc.prefill(ref, ids, mesh, mode="token", max_len=S, layout=layout)
    f, _ = mc._dcp_decode_fn(ref, mesh, "context", B, layout)
    check(f.lower(mc._placed_params(ref, mesh), jnp.zeros((B, 1), jnp.int32), cache).compile(), "DCP decode")

    # a model loaded on the overlay mesh (its MoE layers set up for ep_expert_ffn outside the CP programs): the CP
    # programs take its placed experts as they are and give the same tokens
    m = kimi_jax.load_model("tiny", mesh=spec)
    assert (mc.generate(m, ids, N, m.mesh, layout=layout) == r_gen).all()
    print("loaded on the mesh: generate ok")
    print("ALL DONE")
""")


@pytest.mark.slow
@pytest.mark.parametrize("spec,layout", OVERLAYS)
def test_tiny_model_context_parallel_on_the_expert_overlay(spec, layout):
    """Token-split prefill + DCP decode of the tiny model on an overlay mesh equal one device's (logits ≤ 1e-4,
    greedy tokens equal) with the experts split 8 ways inside the programs."""
    out = _run(MODEL_SCRIPT, spec, layout, timeout=1200)
    assert "prefill ok" in out and "generate ok" in out and "DCP decode experts stay split ok" in out, out
