"""Kernel-by-kernel view of one DSA decode call on a GPU, for Nsight Compute (issue #5).

Builds the bench's inputs (fp8 pools with shuffled pages, K3.1 shapes), runs each op once to compile it, then runs it
once more between cudaProfilerStart / Stop, so ncu sees only that call's kernels (on the H200, 2026-12-01, a
`--metrics` list over every kernel crashed the profiled process; sections worked):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight python3 bench/dsa_profile.py
    ncu --profile-from-start off --clock-control none -k regex:sparse_mla_decode --set full python3 bench/dsa_profile.py

The kernels are the GPU backend's (native Triton through jax-triton: `indexer.gpu_triton`, `mla.sparse_gpu_triton`).

With --time it also prints each op's device time per call (bench/_timing: a chain of 16 calls in one program, each on
pages / rows of its own), so the sum of the kernels' durations can be set against the op's time.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _timing import device_seconds  # noqa: E402
from kimi_jax import quant as Q  # noqa: E402
from pallas_kernels.indexer import gpu_triton as igpu  # noqa: E402
from pallas_kernels.mla import sparse_gpu_triton  # noqa: E402

PAGE = 64
CHAIN = 16


def _cudart():
    """libcudart from the CUDA install or the pip wheels jax brings (for cudaProfilerStart / Stop)."""
    for name in (ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                pass
    import glob
    for path in glob.glob(os.path.join(os.path.dirname(jax.__file__), "..", "nvidia", "cu*", "lib", "libcudart.so*")):
        return ctypes.CDLL(path)
    raise OSError("libcudart not found")


def random_fp8(key, shape):
    bits = jax.random.bits(key, shape, jnp.uint8) & jnp.uint8(0xBF)
    return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--ops", default="indexer,sparse", help="comma-separated: indexer, sparse")
    ap.add_argument("--ix-kw", default=json.dumps(igpu.FAST["sp128_qk_s5_pf"]))
    ap.add_argument("--mla-kw", default=json.dumps(dict(sparse_gpu_triton.WIDE["sr16_bk32_s5"], splits=8)))
    ap.add_argument("--time", action="store_true", help="also print each op's chained device time per call")
    a = ap.parse_args()
    B, ctx, H = a.batch, a.ctx, a.heads
    key = jax.random.PRNGKey(0)
    copies = CHAIN if a.time else 1  # the timing chain's calls each read pages / rows of their own
    nb = copies * B * ctx // PAGE + 1
    bt_all = jax.random.permutation(key, jnp.arange(1, nb, dtype=jnp.int32)).reshape(copies, B, ctx // PAGE)
    bt = bt_all[0]
    r = np.random.default_rng(0)
    calls = {}
    if "indexer" in a.ops:
        fmt = Q.IndexKeyFormat("fp8", 128)
        parts = (random_fp8(jax.random.fold_in(key, 1), (nb, PAGE, 128)),
                 jnp.exp2(jax.random.randint(key, (nb, PAGE, 1), -6, -1).astype(jnp.float32)))
        q = jnp.asarray(r.standard_normal((B, 32, 128)), jnp.float32)
        w = jnp.asarray(r.standard_normal((B, 32)) / 64, jnp.float32)
        pos = jnp.full((B,), ctx - 1, jnp.int32)
        kw = json.loads(a.ix_kw)
        calls["indexer"] = (jax.jit(lambda q, w, p, t, s, fmt=fmt, kw=kw: igpu.scores(q, w, p, t, s, fmt=fmt, **kw)),
                            (q, w, parts, bt, pos), (q, w, parts, bt_all, pos), B * ctx * fmt.bytes_per_token)
    if "sparse" in a.ops:
        fmt = Q.LatentFormat("fp8", 512, 64)
        # one copy of the latent pool (the timing chain's calls differ in their top-k rows, as in bench/dsa.py):
        # 16 copies at 32K × 32 are 9.7 GB, and the chained program ran out of memory on the H200
        nb1 = B * ctx // PAGE + 1
        bt = jax.random.permutation(jax.random.fold_in(key, 3), jnp.arange(1, nb1, dtype=jnp.int32)).reshape(B, -1)
        parts = (random_fp8(jax.random.fold_in(key, 2), (nb1, PAGE, fmt.width)),)
        q = jnp.asarray(r.standard_normal((B, H, fmt.width)), jnp.float32)
        k = min(2048, ctx)
        idx_all = jnp.asarray(np.stack([[np.sort(r.choice(ctx, k, replace=False)) for _ in range(B)]
                                        for _ in range(copies)]), jnp.int32)
        kw = json.loads(a.mla_kw)
        calls["sparse"] = (jax.jit(lambda q, p, t, i, fmt=fmt, kw=kw: sparse_gpu_triton.decode(
                               q, p, t, i, fmt=fmt, scale=192 ** -0.5, value_dim=512, layer_scale=0.5, **kw)),
                           (q, parts, bt, idx_all[0]), (q, parts, bt, idx_all), B * k * fmt.bytes_per_token)
    for fn, args, _, _ in calls.values():
        jax.block_until_ready(fn(*args))
    if jax.default_backend() == "gpu":
        rt = _cudart()
        rt.cudaProfilerStart()
        for fn, args, _, _ in calls.values():
            jax.block_until_ready(fn(*args))
        rt.cudaProfilerStop()
    if a.time:
        for name, (fn, _, args_all, nbytes) in calls.items():
            t, n = device_seconds(fn, *args_all, stacked=(3,))
            print(f"{name}: {t * 1e6:.1f} us per call (chain of {n} calls on distinct data), "
                  f"{nbytes / t / 1e12:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
