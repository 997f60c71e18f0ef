"""Registers, spills and shared memory of our GPU kernels (KDA prefill, MoE grouped matmul), without a GPU.

    PYTHONPATH=<triton 3.x site-packages> python3 bench/triton_regs.py [--T 8192] [--tuning JSON] [--sass]
    PYTHONPATH=... python3 bench/triton_regs.py --op moe [--rows 8] [--weights mxfp4|bf16] [--config JSON] [--sass]

Lowers `pallas_kernels.kda.gpu.chunk` (or `pallas_kernels.moe.ops.grouped_matmul` at K3 shapes: 112 experts,
3584 → 3072) for CUDA, captures the Triton modules the Pallas Triton lowering produces, compiles each with the
`triton` package for sm_90 (TTIR → TTGIR → LLIR → PTX) and runs its `ptxas -v`. High register counts cap how many
programs an SM holds; spills to local memory cost DRAM/L1 traffic. `--sass` adds the static SASS instruction mix
(`cuobjdump -sass`), counting apart the two kinds of copies ptxas inserts (`IMAD.MOV` register moves and
`IMAD.U32 R, RZ, RZ, UR` copies of uniform-register constants): what an issue-bound kernel (the MXFP4 decode, session
5's ncu profile) spends on moves rather than work.
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


def sass_mix(cubin_path, bindir):
    """Static SASS opcode counts of a cubin (cuobjdump -sass), with register moves and uniform-constant copies
    counted apart from other IMADs."""
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin_path], capture_output=True,
                          text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?\s*([^;]*)", line)
        if not m:
            continue
        op, mods, operands = m.group(1), m.group(2) or "", m.group(3)
        if op == "IMAD" and mods.startswith(".MOV"):
            op = "IMAD.MOV"
        elif op == "IMAD" and re.search(r"RZ, RZ, UR\d+$", operands.strip()):
            op = "IMAD.U32 (UR copy)"
        ops[op] += 1
    return dict(total=sum(ops.values()), top=dict(ops.most_common(12)))


def ptxas_report(text, num_warps, num_stages=1, arch=90, sass=False):
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
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(x)
        ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))[0]
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        mix = sass_mix(os.path.join(d, "k.cubin"), os.path.dirname(ptxas)) if sass and r.returncode == 0 else None
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill_st = re.search(r"(\d+) bytes spill stores", log)
    spill_ld = re.search(r"(\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_store_B=int(spill_st.group(1)) if spill_st else None,
                spill_load_B=int(spill_ld.group(1)) if spill_ld else None,
                stack_B=int(stack.group(1)) if stack else None,
                shared_B=meta.get("shared"), ok=r.returncode == 0, **({"sass": mix} if mix else {}))


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("kda", "moe"), default="kda")
    ap.add_argument("--T", type=int, default=8192, help="kda: tokens")
    ap.add_argument("--H", type=int, default=96, help="kda: heads")
    ap.add_argument("--d", type=int, default=128, help="kda: head dim")
    ap.add_argument("--tuning", default="{}", help="kda: JSON dict of gpu.TUNING overrides")
    ap.add_argument("--rows", type=int, default=8, help="moe: rows per expert")
    ap.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4", help="moe: weight format")
    ap.add_argument("--config", default="{}", help="moe: JSON dict of GpuConfig field overrides")
    ap.add_argument("--sass", action="store_true", help="also print each kernel's static SASS instruction mix")
    a = ap.parse_args()
    for name, text, warps, stages in (kda_modules(a) if a.op == "kda" else moe_modules(a)):
        rep = ptxas_report(text, warps, stages, sass=a.sass)
        print(json.dumps(dict(kernel=name, warps=warps, stages=stages, **rep)), flush=True)


if __name__ == "__main__":
    main()
