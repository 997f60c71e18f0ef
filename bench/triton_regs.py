"""Registers, spills and shared memory of the KDA GPU kernels, without a GPU.

    PYTHONPATH=<triton 3.x site-packages> python3 bench/triton_regs.py [--T 8192] [--tuning JSON]

Lowers `pallas_kernels.kda.gpu.chunk` / `recurrent` for CUDA, captures the Triton modules the Pallas Triton
lowering produces, compiles each with the `triton` package for sm_90 (TTIR → TTGIR → LLIR → PTX) and runs its
`ptxas -v`. High register counts cap how many programs an SM holds; spills to local memory cost DRAM/L1 traffic.
"""

from __future__ import annotations

import argparse
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


def ptxas_report(text, num_warps, num_stages=1, arch=90):
    """Compile Triton IR text to PTX with the `triton` package and return ptxas -v's numbers."""
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
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill_st = re.search(r"(\d+) bytes spill stores", log)
    spill_ld = re.search(r"(\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_store_B=int(spill_st.group(1)) if spill_st else None,
                spill_load_B=int(spill_ld.group(1)) if spill_ld else None,
                stack_B=int(stack.group(1)) if stack else None,
                shared_B=meta.get("shared"), ok=r.returncode == 0)


def main():
    from pallas_kernels.kda import gpu
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=96)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--tuning", default="{}", help="JSON dict of gpu.TUNING overrides")
    a = ap.parse_args()
    tn = json.loads(a.tuning)
    tune = dict(gpu.TUNING, **tn)
    T, H, d = a.T, a.H, a.d
    sds = jax.ShapeDtypeStruct
    args = (sds((1, T, H, d), jnp.bfloat16),) * 3 + (sds((1, T, H, d), jnp.float32), sds((1, T, H), jnp.float32))
    cu = jnp.array([0, T], jnp.int32)
    launch = gpu.prefill_launch(tune)
    for name, text in capture_modules(lambda *x: gpu.chunk(*x, cu, None, tuning=tn), *args):
        warps, stages = launch[name]
        rep = ptxas_report(text, warps, stages)
        print(json.dumps(dict(kernel=name, warps=warps, stages=stages, **rep)), flush=True)


if __name__ == "__main__":
    main()
