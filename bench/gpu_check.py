"""GPU correctness pass in one go: the tiny model's logits and greedy tokens through the GPU kernels equal the
jnp-reference path. Run on a GPU host: `python3 bench/gpu_check.py` (prints one line per check)."""

import sys
import time

import jax
import numpy as np

import kimi_jax
from kimi_jax.kernels import KernelConfig


def main() -> int:
    print("devices:", jax.devices())
    ids = np.random.RandomState(0).randint(0, 1000, (2, 70))
    t = time.time()
    ref = kimi_jax.load_model("tiny", kernels=KernelConfig.reference())
    r = ref.logits(ids)
    g_ref = ref.generate(ids[:, :20], 8)
    ours = kimi_jax.load_model("tiny", kernels=KernelConfig(kda="gpu", moe="gpu"))
    o = ours.logits(ids)
    g = ours.generate(ids[:, :20], 8)
    err = float(np.abs(o - r).max() / np.abs(r).max())
    ok = err < 1e-3 and (o.argmax(-1) == r.argmax(-1)).mean() > 0.99 and (g == g_ref).all()
    print(f"tiny model GPU kernels vs reference: max rel err {err:.2e}, argmax agree "
          f"{(o.argmax(-1) == r.argmax(-1)).mean():.4f}, greedy equal {(g == g_ref).all()}, {time.time() - t:.1f}s")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
