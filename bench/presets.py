#!/usr/bin/env python3
"""Named presets: the exact bench commands behind every figure in docs/performance.md.

    python3 bench/presets.py                 # list the presets
    python3 bench/presets.py NAME [NAME ...] # run them one after the other (from the repository root)
    python3 bench/presets.py --dry-run NAME  # print the commands only
    python3 bench/presets.py NAME --lines 2,3  # only some of its command lines (1-based, in order)

Each preset is one or more command lines of the scripts in bench/; their options select the shapes, so a measurement
is repeated by name rather than by a copied script. On a GPU host `source bench/device_env.sh` first (it installs the
wheels carried in `.whl/` and sets PYTHONPATH / OUT). Extra arguments after `--` are appended to every command of a
single preset, e.g. `python3 bench/presets.py moe-ffn -- --ffn-rows 32`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# the real-size model's decode line (serve-48b's second; the other serve-48b-* presets vary it) and XLA's default
# command-buffer ops plus conditionals
_SERVE_48B_DECODE = ("bench/serve.py --launch kimi-linear-48b --dtype bfloat16 --server-arg=--random-experts=mxfp4 "
                     "--max-num-seqs 32 --max-model-len 512 --prefill-chunk-sizes 128 --prompt-tokens 129 "
                     "--max-tokens 256 --clients 1,32 --requests-per-client 1 --startup-timeout 900")
_CB_COND = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL"

# name -> (what it measures, card, the command lines)
PRESETS: dict[str, tuple[str, str, list[str]]] = {
    "kda": ("KDA prefill vs fla chunk_kda and decode state bytes vs copy (H=96, d=128, bf16)", "1 GPU",
            ["bench/kda.py --budget 320"]),
    "moe-grouped": ("MoE bf16 grouped matmul vs dense / batched dense / torch._grouped_mm; MXFP4 matmul sweep",
                    "1 GPU", ["bench/moe.py --sweep --no-ep --budget 210"]),
    "moe-ep": ("expert-parallel FFN over 2 GPUs: ragged all-to-all vs all-gather + psum_scatter", "2 GPUs",
               ["bench/moe.py --sweep --budget 175"]),
    "moe-ffn": ("MXFP4 expert FFN at 8 / 32 / 64 rows per expert, its dense-MMA ceiling, the model's MoE path",
                "1 GPU", ["bench/moe.py --no-ep --ffn-only --ffn-sizes routed --ffn-no-peers --ffn-rows 8,32,64 "
                          "--ffn-from-tokens"]),
    "moe-parts": ("the MXFP4 FFN's two kernels with one part taken out at a time", "1 GPU",
                  ["bench/moe_parts.py --rows 32", "bench/moe_parts.py --rows 64"]),
    "moe-tokamax": ("tokamax ragged_dot (bf16, 4-bit) beside ours", "1 GPU", ["bench/moe_tokamax.py"]),
    "dsa-indexer": ("DSA indexer key bytes vs copy at 32K / 128K / 1M x 32 (storage presets)", "1 GPU",
                    ["bench/dsa.py --batches 32 --heads 12 --contexts 32768,131072,1048576 --ix-storage --no-tune"]),
    "sparse-mla": ("Mosaic sparse MLA decode op at B=32, H=12, 32K, beside the timing chain's own floor", "1 GPU",
                   ["bench/mla_mgpu.py --ops floor,op --batches 32 --no-triton --configs '[{}]'"]),
    "gather-ceiling": ("the best read-only gather of sparse MLA's rows (torch, Triton, our LSU / TMA gather)",
                       "1 GPU", ["bench/gather_ceiling.py --batches 32 --ctx 32768,131072 --triton",
                                 "bench/mla_gather_probe.py"]),
    "cp": ("context parallelism on 2 GPUs: token- vs head-split prefill, DCP2 vs TP2 decode, capacity", "2 GPUs",
           ["bench/cp.py --reps 2 --budget 155",
            "bench/cp.py --tokens 131072 --skip decode,capacity --reps 2 --budget 280 --grace 20"]),
    "dense-mla-decode": ("dense (no indexer) MLA decode at Kimi-Linear-48B's widths: the GPU kernel walking each "
                         "sequence's own positions beside the sparse kernel over the whole block table, 1 and 32 "
                         "sequences at 8K in tables of 16K and 128K positions", "1 GPU",
                         ["bench/dense_mla.py --decode --batches 1,32 --start 8192 --widths 16384,131072 --heads 32 "
                          "--latent 512 --rope 64"]),
    "serve-gpu": ("the real server, kimi-k3.1-reduced bf16, 1 and 32 clients, decode vs bytes roofline", "1 GPU",
                  ["bench/serve.py --gpu"]),
    "serve-profile": ("a device trace of steady decode at 1 and 32 clients, summarised per step (top kernels)",
                      "1 GPU", ["bench/serve.py --gpu --clients 1,32 --profile 1"]),
    "serve-buckets": ("decode batch buckets vs every step over all slots, kimi-k3.1-reduced bf16, 1 and 4 clients",
                      "1 GPU", ["bench/serve.py --gpu --clients 1,4 --max-tokens 128 --server-arg=--decode-buckets=1,2,4",
                                "bench/serve.py --gpu --clients 1,4 --max-tokens 128 --server-arg=--decode-buckets=none"]),
    "serve-async": ("overlapped decode steps (async scheduling, the default) vs one step at a time, kimi-k3.1-reduced "
                    "bf16, 1 and 32 clients", "1 GPU",
                    ["bench/serve.py --gpu --clients 1,32 --max-tokens 128",
                     "bench/serve.py --gpu --clients 1,32 --max-tokens 128 --server-arg=--no-async-scheduling"]),
    "serve-multiturn": ("prefix caching on vs off: conversations of 4 turns over a shared 2,000-token system prompt, "
                        "kimi-k3.1-reduced bf16, 1 and 8 clients", "1 GPU",
                        ["bench/serve.py --gpu --scenario multi-turn",
                         "bench/serve.py --gpu --scenario multi-turn --server-arg=--no-enable-prefix-caching"]),
    "serve-long": ("long context: TTFT against the prefill FLOP roofline and decode TPOT against the bytes roofline for "
                   "prompts of 8K to 1.04M tokens, kimi-k3.1-reduced bf16, fp8 latents and index keys", "1 GPU",
                   ["bench/serve.py --gpu --scenario long"]),
    "serve-48b": ("a real-size model on one GPU: Kimi-Linear-48B-A3B at full depth, random weights with MXFP4 routed "
                  "experts (29 GB), bf16 elsewhere: TTFT at 8K and 32K tokens, decode at 1 and 32 streams against "
                  "the roofline", "1 GPU",
                  ["bench/serve.py --launch kimi-linear-48b --dtype bfloat16 --server-arg=--random-experts=mxfp4 "
                   "--scenario long --long-lengths 8193,32769 --prefill-chunk-sizes 4096 --max-tokens 32 --startup-timeout 900",
                   _SERVE_48B_DECODE]),
    "serve-48b-branches": ("the real-size model's decode at 1 and 32 streams: with the plain sampler (no lax.cond, "
                           "the default on a GPU), with the sampler's two branches as XLA runs them by default (on "
                           "the host, which waits for the device), and with the branches inside XLA's command "
                           "buffers (CUDA conditional nodes); what each step program launches from the host "
                           "(bench/hlo_summary.py on the first run's XLA dump). $OUT/serve_<label>.json", "1 GPU",
                           [_SERVE_48B_DECODE + " --label plain '--xla-flags=--xla_dump_to=/tmp/kimi_jax_hlo "
                            "--xla_dump_hlo_module_re=jit_step.*'",
                            "bench/hlo_summary.py /tmp/kimi_jax_hlo",
                            _SERVE_48B_DECODE + " --label branches --server-arg=--no-plain-sampling",
                            _SERVE_48B_DECODE + " --label branches_in_graphs --server-arg=--no-plain-sampling "
                            f"--xla-flags=--xla_gpu_enable_command_buffer={_CB_COND}"]),
    "serve-48b-graphs": ("the real-size model's decode at 1 and 32 streams under XLA's command-buffer VA remapping: "
                         "with async scheduling two steps are in flight, 12 of the step's buffers change address "
                         "from one step to the next, and XLA re-records every command of the step's command buffer "
                         "(1,581 at one stream) on the host each step (TF_CPP_VMODULE=command_buffer_thunk=3 shows "
                         "it); VA remapping maps those buffers at fixed virtual addresses so the recorded graph can "
                         "stay (SKIP_TEMP: the temp buffer; SKIP_PROFILED: the buffers a few profiling runs see "
                         "move). Each line prints the host's dispatch / wait ms per step. $OUT/serve_<label>.json",
                         "1 GPU",
                         [_SERVE_48B_DECODE + " --label graphs_default",
                          _SERVE_48B_DECODE + " --label graphs_va_skip_temp '--xla-flags="
                          "--xla_gpu_enable_command_buffer_va_remapping=true "
                          "--xla_gpu_command_buffer_update_mode=SKIP_TEMP'",
                          _SERVE_48B_DECODE + " --label graphs_va_skip_profiled '--xla-flags="
                          "--xla_gpu_enable_command_buffer_va_remapping=true "
                          "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED'"]),
    "serve-48b-profile": ("a device trace of the real-size model's steady decode at 1 and 32 streams, summarised per "
                          "step (top kernels): where its steps spend the time its bytes do not explain", "1 GPU",
                          [_SERVE_48B_DECODE + " --profile 1"]),
    "serve-48b-long-profile": ("device traces of the real-size model on an 8K prompt: its prefill per chunk and its "
                               "one-stream decode per step at that context (bench/trace_summary.py)", "1 GPU",
                               ["bench/serve.py --launch kimi-linear-48b --dtype bfloat16 "
                                "--server-arg=--random-experts=mxfp4 --scenario long --long-lengths 8193 "
                                "--prefill-chunk-sizes 4096 --max-tokens 32 --startup-timeout 900 --profile 1"]),
    "serve-cpu": ("the real server, tiny float32, 1 / 8 / 32 clients", "CPU", ["bench/serve.py"]),
    "spec-decode": ("speculative decoding, adaptive policy vs always, repetitive and rejected drafts", "1 GPU",
                    ["bench/spec_decode.py --gpu --max-tokens 96 --scenarios repeat,reject"]),
    "spec-draft": ("a draft model (the target itself), greedy and sampled drafts, 1 and 4 requests", "1 GPU",
                   ["bench/spec_decode.py --gpu --max-tokens 96 --max-num-seqs 4 --scenarios draft,draft-sampled "
                    "--temperature 1"]),
    "gemv": ("decode-size projections (1-32 rows x a weight) against the copy rate in the forms XLA can take and "
             "cuBLAS: what one-stream decode's dense layers run at", "1 GPU", ["bench/gemv.py"]),
    "dense-mla": ("dense paged MLA (no indexer) on a prefill chunk against the width of its block table", "CPU",
                  ["bench/dense_mla.py"]),
    "draft-batch": ("the batched draft proposal against one sequence per call", "CPU", ["bench/draft_batch.py"]),
    "host-step": ("host work between decode steps: the kept block table vs built fresh, parameters passed as a "
                  "flat list vs an nnx.State", "CPU", ["bench/host_step.py --contexts 8192,131072,1040000 --steps 100"]),
    "vision": ("the vision tower: exact, bucketed and batched paths, cuDNN attention", "1 GPU",
               ["bench/vision.py --path all --attention fused --sides 448,1000,1792 --reps 3"]),
    "convert": ("checkpoint conversion: peak RSS and throughput on a synthetic K3.1 checkpoint", "CPU",
                ["bench/convert.py"]),
}


def commands(name: str, extra: list[str]) -> list[list[str]]:
    return [[sys.executable, *shlex.split(line), *extra] for line in PRESETS[name][2]]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="presets to run (none: list them)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--lines", default=None,
                    help="run only these command lines of a single preset, 1-based and comma-separated (e.g. 2,3: "
                         "a long preset split across GPU calls)")
    args = ap.parse_args(argv)
    if not args.names:
        for name, (what, card, lines) in PRESETS.items():
            print(f"{name:15s} [{card}] {what}")
            for line in lines:
                print(f"{'':15s}   python3 {line}")
        return 0
    unknown = [n for n in args.names if n not in PRESETS]
    if unknown:
        ap.error(f"unknown preset(s) {', '.join(unknown)}; known: {', '.join(PRESETS)}")
    if (extra or args.lines) and len(args.names) > 1:
        ap.error("arguments after -- and --lines apply to a single preset")
    rc = 0
    for name in args.names:
        cmds = commands(name, extra)
        if args.lines:
            keep = [int(i) for i in args.lines.split(",")]
            if not all(1 <= i <= len(cmds) for i in keep):
                ap.error(f"--lines {args.lines}: {name} has lines 1 … {len(cmds)}")
            cmds = [cmds[i - 1] for i in keep]
        for cmd in cmds:
            print("+ " + shlex.join(["python3", *cmd[1:]]), flush=True)
            if not args.dry_run:
                rc = subprocess.call(cmd, cwd=ROOT) or rc
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
