"""One call of the Mosaic GPU sparse MLA op at B = 32, H = 12, ctx 32K (for PTX dumps and ncu; session 12)."""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from kimi_jax import quant as Q
from pallas_kernels.mla import sparse_mgpu as sm
cfg = sm.MgpuSparseConfig(**(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
B, H, ctx, page = 32, 12, 32768, 64
fmt = Q.LatentFormat("fp8", 512, 64)
nb = B * ctx // page
key = jax.random.PRNGKey(0)
pool = jax.lax.bitcast_convert_type(jax.random.bits(key, (nb, page, 576), jnp.uint8) & jnp.uint8(0xBF), jnp.float8_e4m3fn)
bt = jax.random.permutation(key, jnp.arange(nb, dtype=jnp.int32)).reshape(B, ctx // page)
rng = np.random.default_rng(0)
idx = jnp.asarray(np.stack([np.sort(rng.choice(ctx, 2048, replace=False)) for _ in range(B)]), jnp.int32)
q = jnp.asarray(rng.standard_normal((B, H, 576)), jnp.float32)
f = jax.jit(lambda q, bt, idx: sm.decode(q, (pool,), bt, idx, fmt=fmt, scale=192 ** -0.5, value_dim=512, config=cfg))
for _ in range(3):
    o, lse = f(q, bt, idx)
print("ok", float(jnp.sum(o)), float(jnp.max(lse)))
