"""Session 16: the placed MXFP4 decode (`mxfp4.DECODE_PTX_PLACED`) alone on the GPU, through Triton's inline asm:
every output register against the exact e2m1 · 2^(S−127), for the whole PTX and for its parts (the bit placement
without the multiply; the multiply as an fma with −0), to tell a placement error from bf16 subnormal handling."""
import ml_dtypes
import numpy as np
import torch
import triton
import triton.language as tl
import jax.numpy as jnp

from pallas_kernels.moe import mxfp4 as mx


@triton.jit
def _k(w_ptr, h_ptr, o_ptr, n, ASM: tl.constexpr):
    i = tl.program_id(0) * 256 + tl.arange(0, 256)
    m = i < n
    w = tl.load(w_ptr + i, mask=m)
    h = tl.load(h_ptr + i, mask=m)
    a, b, c, d = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [w, h], dtype=(tl.int32,) * 4, is_pure=True,
                                           pack=1)
    tl.store(o_ptr + 4 * i, a, mask=m)
    tl.store(o_ptr + 4 * i + 1, b, mask=m)
    tl.store(o_ptr + 4 * i + 2, c, mask=m)
    tl.store(o_ptr + 4 * i + 3, d, mask=m)


rng = np.random.default_rng(0)
n = 1 << 16
natural = rng.integers(0, 256, (n, 4), dtype=np.uint8)
natural[:256, 0] = np.arange(256)  # every byte once in position 0
placed = np.asarray(mx.place_codes(jnp.asarray(natural))).view("<i4")[:, 0]
S = rng.integers(1, 129, n)
h = np.asarray(mx.scale_placed_bf16(jnp.asarray(S.astype(np.uint8)))).view(np.uint16).astype(np.int64)
h2 = (h | h << 16).astype(np.uint32).view(np.int32)
want = np.concatenate([mx.E2M1_VALUES[natural[:, :2] & 15], mx.E2M1_VALUES[natural[:, 2:] & 15],
                       mx.E2M1_VALUES[natural[:, :2] >> 4], mx.E2M1_VALUES[natural[:, 2:] >> 4]], axis=1)
want = want.astype(np.float64) * 2.0 ** (S[:, None] - 127)
variants = {"whole": mx.DECODE_PTX_PLACED,
            "no_mul": "\n".join(l for l in mx.DECODE_PTX_PLACED.split("\n") if not l.startswith("mul")),
            "fma_m0": mx.DECODE_PTX_PLACED.replace(".reg .b32 ", ".reg .b32 d4m0, ").replace(
                "shf.l", "mov.b32 d4m0, 0x80008000;\nshf.l", 1).replace("mul.rn.bf16x2", "fma.rn.bf16x2")
            .replace(", $5;", ", $5, d4m0;")}
wt, ht = torch.tensor(placed).cuda(), torch.tensor(h2).cuda()
for name, asm in variants.items():
    o = torch.empty(4 * n, dtype=torch.int32, device="cuda")
    _k[(n // 256,)](wt, ht, o, n, ASM=asm)
    got = o.cpu().numpy().view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64).reshape(n, 8)
    if name == "no_mul":
        ref = want / 2.0 ** (S[:, None] - 127) * 2.0 ** -126
    else:
        ref = want
    bad = got != ref
    print(f"{name}: {bad.sum()} of {bad.size} values differ", flush=True)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        print("  first: word", r, "lane", c, "natural", natural[r], "S", S[r], "got", got[r], "want", ref[r])
        codes = np.concatenate([natural[:, :2] & 15, natural[:, 2:] & 15, natural[:, :2] >> 4, natural[:, 2:] >> 4], 1)
        print("  wrong by code:", np.bincount(codes[bad], minlength=16))
