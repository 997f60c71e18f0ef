"""Registers, spills and shared memory of our GPU kernels (KDA prefill, MoE grouped matmul, DSA sparse MLA and
indexer), without a GPU.

    PYTHONPATH=<triton 3.x site-packages> python3 bench/triton_regs.py [--T 8192] [--tuning JSON] [--sass]
    PYTHONPATH=... python3 bench/triton_regs.py --op moe [--rows 8] [--weights mxfp4|bf16] [--config JSON] [--sass]
    PYTHONPATH=... python3 bench/triton_regs.py --op mla [--batch 32] [--H 12] [--latent fp8] [--config JSON]
    PYTHONPATH=... python3 bench/triton_regs.py --op indexer [--batch 32] [--ctx 131072] [--keys fp8] [--config JSON]

Lowers `pallas_kernels.kda.gpu.chunk` (or `pallas_kernels.moe.ops.grouped_matmul` at K3 shapes: 112 experts,
3584 → 3072) for CUDA, captures the Triton modules the Pallas Triton lowering produces, compiles each with the
`triton` package for sm_90 (TTIR → TTGIR → LLIR → PTX) and runs its `ptxas -v`. High register counts cap how many
programs an SM holds; spills to local memory cost DRAM/L1 traffic. `--sass` adds the static SASS instruction mix
(`cuobjdump -sass`), counting apart the two kinds of copies ptxas inserts (`IMAD.MOV` register moves and
`IMAD.U32 R, RZ, RZ, UR` copies of uniform-register constants): what an issue-bound kernel (the MXFP4 decode under
ncu) spends on moves rather than work. Every report also counts what Triton's pipeliner made of the
loads (`ttgir`: asynchronous global->shared copies vs plain `tt.load`s, wgmma vs mma.sync dots): a gather left as a
plain load inside a loop is waited for in every iteration (as the sparse-MLA latent rows once were).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def capture_modules(fn, *args):
    """(name, module text) for each Triton module that lowering `fn(*args)` for CUDA produces."""
    from pallas_kernels.triton_tools import lowered_triton_modules
    return [(name, m.operation.get_asm(enable_debug_info=False)) for name, m in lowered_triton_modules(fn, *args)]


def sass_mix(cubin_path, bindir, keep=None):
    """Static SASS opcode counts of a cubin (cuobjdump -sass), with register moves and uniform-constant copies
    counted apart from other IMADs; `loop`: the same counts over the largest backward-branch body (the main loop,
    whose instructions run once per step — the ones that matter for an issue-bound kernel)."""
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin_path], capture_output=True,
                          text=True).stdout
    if keep:  # the full listing, for reading the loop by eye
        open(keep, "w").write(sass)
    insts = []  # (address, opcode, operands)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?\s*([^;]*)", line)
        if not m:
            continue
        addr, op, mods, operands = int(m.group(1), 16), m.group(2), m.group(3) or "", m.group(4)
        if op == "IMAD" and mods.startswith(".MOV"):
            op = "IMAD.MOV"
        elif op == "IMAD" and re.search(r"RZ, RZ, UR\d+$", operands.strip()):
            op = "IMAD.U32 (UR copy)"
        insts.append((addr, op, operands))
    ops = collections.Counter(op for _, op, _ in insts)
    loop = (0, 0)
    for addr, op, operands in insts:
        t = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr and addr - int(t.group(1), 16) > loop[1] - loop[0]:
            loop = (int(t.group(1), 16), addr)
    body = collections.Counter(op for a, op, _ in insts if loop[0] <= a <= loop[1]) if loop[1] else None
    return dict(total=sum(ops.values()), top=dict(ops.most_common(12)),
                **({"loop": dict(total=sum(body.values()), top=dict(body.most_common(16)))} if body else {}))


def ptxas_report(text, num_warps, num_stages=1, arch=90, sass=False, keep=None):
    """Compile Triton IR text to PTX with the `triton` package and return ptxas -v's numbers (and with `sass` the
    static SASS instruction mix)."""
    import triton
    from triton._C.libtriton import ir as tir
    from triton.backends.compiler import GPUTarget, Language
    from triton.backends.nvidia.compiler import CUDABackend
    backend = CUDABackend(GPUTarget("cuda", arch, 32))
    opts = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    ctx = tir.context()
    tir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ttir")
        open(src, "w").write(text)
        mod = tir.parse_mlir_module(src, ctx)
        mod.context = ctx
        stages = {}
        backend.add_stages(stages, opts, Language.TRITON)
        meta = {}
        x = mod
        for name in ("ttir", "ttgir", "llir", "ptx"):
            x = stages[name](x, meta)
            if name == "ttgir":
                ttgir = str(x)
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(x)
        ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))[0]
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        mix = sass_mix(os.path.join(d, "k.cubin"), os.path.dirname(ptxas), keep) if sass and r.returncode == 0 else None
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill_st = re.search(r"(\d+) bytes spill stores", log)
    spill_ld = re.search(r"(\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_store_B=int(spill_st.group(1)) if spill_st else None,
                spill_load_B=int(spill_ld.group(1)) if spill_ld else None,
                stack_B=int(stack.group(1)) if stack else None,
                shared_B=meta.get("shared"), ok=r.returncode == 0, **({"sass": mix} if mix else {}),
                ttgir=ttgir_ops(ttgir))


def ttgir_ops(text):
    """What Triton's pipeliner and MMA passes made of the kernel: asynchronous global->shared copies (the loads it
    software-pipelined), their waits, wgmma (warp_group_dot) vs mma.sync dots, shared-memory allocations, and the
    pipelined buffers (`buffers`: the mutable allocations' shapes; the leading number is how many copies of the tile
    are in flight — 1 means the next tile's copy waits for this tile's use, as Triton 3.6 does below 5 stages for a
    gather whose addresses come from another load)."""
    names = ("ttg.async_copy_global_to_local", "ttg.async_wait", "ttng.warp_group_dot", "tt.dot", "ttg.local_alloc",
             "ttng.async_tma_copy_global_to_local", "tt.load")
    out = {n.split(".", 1)[1]: len(re.findall(re.escape(n) + r"\b", text)) for n in names}
    out["buffers"] = sorted(m.group(1) for m in re.finditer(r"local_alloc[^\n]*?memdesc<([^,>]+),[^>]*mutable>", text))
    return out


def kda_modules(a):
    """(name, module text, warps, stages) of the KDA prefill kernels for B=1, T, H, d bf16 with `--tuning`."""
    from pallas_kernels.kda import gpu
    tn = json.loads(a.tuning)
    tune = dict(gpu.TUNING, **tn)
    T, H, d = a.T, a.H, a.d
    sds = jax.ShapeDtypeStruct
    args = (sds((1, T, H, d), jnp.bfloat16),) * 3 + (sds((1, T, H, d), jnp.float32), sds((1, T, H), jnp.float32))
    cu = jnp.array([0, T], jnp.int32)
    launch = gpu.prefill_launch(tune)
    return [(name, text) + tuple(launch[name])
            for name, text in capture_modules(lambda *x: gpu.chunk(*x, cu, None, tuning=tn), *args)]


def moe_modules(a):
    """(name, module text, warps, stages) of the MoE grouped matmul at K3 shapes (112 experts, 3584 -> 3072) with
    `--rows` rows per expert, `--weights` bf16 or MXFP4, and `--config` overrides of the default GpuConfig."""
    import dataclasses

    from pallas_kernels.moe import gpu as moe_gpu
    from pallas_kernels.moe import ops
    E, K, N = 112, 3584, 3072
    m = E * a.rows
    quantized = a.weights == "mxfp4"
    cfg = dataclasses.replace(moe_gpu.default_config(m, E, K, N, quantized), **json.loads(a.config))
    sds = jax.ShapeDtypeStruct
    if quantized:
        w = (sds((E, N, K // 2), jnp.uint8), sds((E, N, K // 32), jnp.uint8))
        fn = lambda x, p, s, g: ops.grouped_matmul(x, p, g, w_scale=s, backend="gpu", out_dtype=jnp.bfloat16,  # noqa
                                                   config=cfg)
    else:
        w = (sds((E, K, N), jnp.bfloat16),)
        fn = lambda x, ww, g: ops.grouped_matmul(x, ww, g, backend="gpu", out_dtype=jnp.bfloat16, config=cfg)  # noqa
    args = (sds((m, K), jnp.bfloat16),) + w + (sds((E,), jnp.int32),)
    print(json.dumps(dict(config=str(cfg))), flush=True)
    return [(name, text, cfg.num_warps, cfg.num_stages) for name, text in capture_modules(fn, *args)]


def mla_modules(a):
    """(name, module text, warps, stages) of the sparse MLA decode at K3.1 (latent 512 + rope 64, top-2048, 64-token
    pages) for `--batch` sequences and `--H` heads, `--latent` fp8 / nvfp4 / bf16 rows, `--config`: decode kwargs."""
    from kimi_jax import quant as Q
    from pallas_kernels.mla import sparse_gpu
    kw = json.loads(a.config)
    fmt = Q.LatentFormat(a.latent, 512, 64)
    B, k, nb = a.batch, 2048, 4096
    sds = jax.ShapeDtypeStruct
    parts = tuple(sds((nb, 64, part.width), part.dtype) for part in fmt.parts)
    args = (sds((B, a.H, fmt.width), jnp.float32), parts, sds((B, 512), jnp.int32), sds((B, k), jnp.int32))
    fn = lambda q, p, bt, idx: sparse_gpu.decode(q, p, bt, idx, fmt=fmt, scale=192 ** -0.5, value_dim=512,  # noqa
                                                  **kw)
    return [(name, text, kw.get("num_warps", 4), kw.get("num_stages", 2)) for name, text in capture_modules(fn, *args)
            if "merge" not in name or a.all]


def indexer_modules(a):
    """(name, module text, warps, stages) of the DSA indexer's decode score kernel at K3.1 (32 heads × 128, 64-token
    pages) for `--batch` sequences of `--ctx` tokens, fp8 / mxfp4 keys (`--keys`), `--config`: scores kwargs."""
    from kimi_jax import quant as Q
    from pallas_kernels.indexer import gpu as igpu
    kw = json.loads(a.config)
    fmt = Q.IndexKeyFormat(a.keys, 128)
    B, nb, mb = a.batch, 4096, a.ctx // 64
    sds = jax.ShapeDtypeStruct
    parts = tuple(sds((nb, 64, part.width), part.dtype) for part in fmt.parts)
    args = (sds((B, 32, 128), jnp.float32), sds((B, 32), jnp.float32), parts, sds((B, mb), jnp.int32),
            sds((B,), jnp.int32))
    fn = lambda q, w, p, bt, pos: igpu.scores(q, w, p, bt, pos, fmt=fmt, **kw)  # noqa: E731
    return [(name, text, kw.get("num_warps", 4), kw.get("num_stages", 3)) for name, text in capture_modules(fn, *args)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("kda", "moe", "mla", "indexer"), default="kda")
    ap.add_argument("--T", type=int, default=8192, help="kda: tokens")
    ap.add_argument("--H", type=int, default=96, help="kda: heads")
    ap.add_argument("--d", type=int, default=128, help="kda: head dim")
    ap.add_argument("--tuning", default="{}", help="kda: JSON dict of gpu.TUNING overrides")
    ap.add_argument("--rows", type=int, default=8, help="moe: rows per expert")
    ap.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4", help="moe: weight format")
    ap.add_argument("--config", default="{}", help="moe: JSON dict of GpuConfig field overrides; mla: decode kwargs")
    ap.add_argument("--batch", type=int, default=32, help="mla / indexer: sequences")
    ap.add_argument("--latent", choices=("fp8", "nvfp4", "bf16"), default="fp8", help="mla: latent row format")
    ap.add_argument("--all", action="store_true", help="mla: also the split-k merge kernel")
    ap.add_argument("--keys", choices=("fp8", "mxfp4"), default="fp8", help="indexer: key format")
    ap.add_argument("--ctx", type=int, default=131072, help="indexer: tokens per sequence")
    ap.add_argument("--sass", action="store_true", help="also print each kernel's static SASS instruction mix")
    ap.add_argument("--sass-dir", default=None, help="with --sass: write each kernel's full listing to DIR/NAME.sass")
    a = ap.parse_args()
    modules = {"kda": kda_modules, "moe": moe_modules, "mla": mla_modules, "indexer": indexer_modules}[a.op](a)
    for name, text, warps, stages in modules:
        keep = os.path.join(a.sass_dir, f"{name}.sass") if a.sass_dir else None
        if keep:
            os.makedirs(a.sass_dir, exist_ok=True)
        rep = ptxas_report(text, warps, stages, sass=a.sass, keep=keep)
        print(json.dumps(dict(kernel=name, warps=warps, stages=stages, **rep)), flush=True)


if __name__ == "__main__":
    main()
