"""Session 16: read back the weight the Mosaic kernel decodes (x = unit rows, one expert), placed vs natural, and
say which elements differ from the exact dequantisation (by code, by byte / nibble of the word, by scale)."""
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import mgpu_mxfp4 as mm
from pallas_kernels.moe import mxfp4 as mx

K, N = 256, 64
w = mx.random_weight(jax.random.key(1), 1, K, N)
x = jnp.eye(K, dtype=jnp.bfloat16)  # row k = e_k: out[k, n] = W[n, k]
gs = jnp.asarray([K], jnp.int32)
want = np.asarray(mx.dequantize(w, jnp.float32))[0].T  # [N, K]
codes = np.zeros((N, K), np.int64)
packed = np.asarray(w.packed)[0]
codes[:, 0::2], codes[:, 1::2] = packed & 15, packed >> 4
for layout in (("placed",) if os.environ.get("PLACED_ONLY") else ("natural", "placed")):
    for rows in ((8,) if os.environ.get("PLACED_ONLY") else (8, 16)):
        got = np.asarray(mm.grouped_matmul(x, mm.prepare_weight(w, layout), gs,
                                           config=mm.MgpuConfig(rows=rows, kh=128, steps=3, ctas_per_sm=2))).T
        bad = got != want
        print(f"{layout} rows={rows}: {bad.sum()} of {bad.size} differ", flush=True)
        if bad.any():
            n, k = np.nonzero(bad)
            print("  wrong by code:", np.bincount(codes[bad], minlength=16))
            print("  wrong by k % 8 (byte in word*2 + nibble):", np.bincount(k % 8, minlength=8))
            print("  wrong by (k // 8) % 8:", np.bincount((k // 8) % 8, minlength=8))
            print("  wrong by n % 16:", np.bincount(n % 16, minlength=16))
            for i in range(3):
                print("   n", n[i], "k", k[i], "code", codes[n[i], k[i]], "got", got[n[i], k[i]], "want", want[n[i], k[i]],
                      "ratio", got[n[i], k[i]] / want[n[i], k[i]] if want[n[i], k[i]] else None)
