"""Configuration of the Mosaic GPU MXFP4 kernels: tile constants, `MgpuConfig` (frozen data: tile rows, step width,
pipeline depth, CTAs per SM, group plan, warpgroups, FFN plumbing) and the configs the shipped paths select.

`default_config(rows_per_group)` is `grouped_matmul`'s choice for rows sorted by expert; `tiled_config` the
tile-layout FFN's (`expert_ffn_tiled`). Both were chosen by measurement on an H200 (docs/performance.md,
`python3 bench/presets.py moe-ffn`). `ws_compute_registers` is the register split a warp-specialised CTA can hold.
"""

from __future__ import annotations

import dataclasses
import threading


COLS = 64  # output columns per warpgroup: the wgmma M side
BLOCK = 64  # packed bytes per (thread quad) load block: 4 threads x 16 bytes
ROW_ALIGN = 8  # x's TMA row offset must be a multiple of its smem tile's 8 rows


# compute warpgroups the warp-specialised kernel (`kernel_call_ws`) takes, 64 columns each (W = 3: K3's gate / up,
# 3072 = 16 items of 192 columns, not its down's 3584); W = 4 needs the register split of `ws_compute_registers`.
WS_WARPGROUPS = (2, 3, 4)
WS_MEMORY_REGISTERS = 40  # registers per thread left to its memory warpgroup (it only issues TMA copies)


def ws_compute_registers(warpgroups: int, memory_registers: int = WS_MEMORY_REGISTERS) -> int:
    """Registers per compute thread that a CTA of `warpgroups` compute warpgroups + one memory warpgroup can hold.

    A CTA of 128·(W + 1) threads launches with floor8(65536 / threads) registers each, and `setmaxnreg` only moves
    registers within that allocation: an increase that the CTA's pool cannot cover waits forever. JAX's
    `emit_pipeline_warp_specialized` splits 512 per warpgroup slot ((512 − memory) / W), which is what a CTA of 3
    warpgroups holds (168 · 3 = 504 ≥ 2 · 232 + 40) but not one of 5: W = 4 asked for 4 · 112 + 40 = 488 of the
    96 · 5 = 480 it launched with, and hangs. Here: floor8((floor8(512 / (W + 1)) · (W + 1) − memory) / W)
    (232 at W = 2, as JAX; 104 at W = 4)."""
    per_slot = (512 // (warpgroups + 1)) // 8 * 8
    return min(256, (per_slot * (warpgroups + 1) - memory_registers) // warpgroups) // 8 * 8


class _PoolRegisterSplit:
    """Within this context JAX's warp-specialised pipeline gives its compute warpgroups `ws_compute_registers`
    (its own split assumes the whole 64K register file is the CTA's pool; see there). It patches the private helper
    the pipeline reads when it emits `setmaxnreg`, for the duration of one kernel's tracing only, under a lock: the
    engine traces its programs in parallel threads, and a patch restored under another thread's trace would hand
    that kernel JAX's split again."""

    _lock = threading.Lock()

    def __enter__(self):
        from jax._src.pallas.mosaic_gpu import pipeline

        self._lock.acquire()
        self._module, self._saved = pipeline, pipeline._compute_registers
        pipeline._compute_registers = lambda memory, wgs: ws_compute_registers(wgs, memory)
        return self

    def __exit__(self, *exc):
        self._module._compute_registers = self._saved
        self._lock.release()


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    rows: int = 16  # x rows per tile (the wgmma N side): a group's rows are padded to a multiple of it
    kh: int = 128  # packed bytes of a weight row per pipeline step (2 * kh weights)
    steps: int = 4  # pipeline stages in flight
    ctas_per_sm: int = 2
    # "bf16": weights decoded to scaled bf16 (`_decode_fn`); "fp8": codes shifted into e4m3 (`_decode_fp8_fn`, 7
    # instructions per 8 weights instead of ~20), one wgmma pair (x as two e4m3 planes) per 32-element group into
    # that group's accumulator, scaled and summed after the step (`kernel_call_fp8`)
    mma: str = "bf16"
    # where the group plan lives (bf16 path): "xla" = rows padded per expert to whole tiles in XLA (`prepare_rows`,
    # `kernel_call`, `unpad_output`; the fp8 path's only plan); "kernel" = each work item is (expert, 64-column
    # block), the kernel reads the expert's row bounds, fetches its x rows by offset and stores each output row in
    # place (`kernel_call_grouped`: no padding, no gathers; `default_config` at <= 8 rows per expert)
    plan: str = "xla"
    # the tile-layout FFN's gate and up (`expert_ffn_tiled`): "separate" — two kernels, the activation in XLA;
    # "fused" — one warp-specialised kernel (warpgroups ≥ 2) computing both products of each x tile and the
    # activation in its epilogue (`kernel_call_gated_ws`: each x tile fetched once, no fp32 gate / up outputs
    # written and read back)
    gate_up: str = "separate"
    # compute warpgroups per CTA: 1 — one warpgroup per CTA, `ctas_per_sm` CTAs per SM, each issuing its own TMA
    # copies and waiting for its MMAs every step (`kernel_call`); W = 2, 3 or 4 (`WS_WARPGROUPS`) — warp-specialised
    # (`kernel_call_ws`, the padded plan and the bf16 decode only): per SM one CTA of W compute warpgroups, each
    # decoding 64 of a work item's 64·W columns, and a memory warpgroup issuing the copies, so one warpgroup's
    # decode runs while another's MMAs do and each x tile read from L2 serves 64·W columns instead of 64. The CTA's
    # register pool is shared: `ws_compute_registers` per compute thread (232 at W = 2, 104 at W = 4); with
    # gate_up="fused" each compute warpgroup holds gate's and up's accumulators and runs the activation
    warpgroups: int = 1
    # the tile-layout FFN's down matmul on a kernel config of its own (same `rows`: one tile plan); None: this one.
    # It reads h [m_pad, F] and writes [m_pad, D] with one weight, so it can take W = 4 compute warpgroups where the
    # fused gate / up kernel (two weights' accumulators) cannot fit their 104 registers
    down_config: "MgpuConfig | None" = None

    def __post_init__(self):
        if self.plan not in ("kernel", "xla"):
            raise ValueError(f"MgpuConfig.plan must be 'kernel' or 'xla', got {self.plan!r}")
        if self.gate_up not in ("separate", "fused"):
            raise ValueError(f"MgpuConfig.gate_up must be 'separate' or 'fused', got {self.gate_up!r}")
        if self.down_config is not None and (self.down_config.rows != self.rows
                                             or self.down_config.down_config is not None):
            raise ValueError(f"MgpuConfig.down_config must tile rows as this config does (rows={self.rows}) and "
                             f"have no down_config of its own, got {self.down_config!r}")
        if self.warpgroups not in (1, *WS_WARPGROUPS):
            raise ValueError(f"MgpuConfig.warpgroups must be 1 or one of {WS_WARPGROUPS}, got {self.warpgroups!r}")
        if self.gate_up == "fused" and self.warpgroups == 1:
            raise ValueError(f"MgpuConfig: gate_up='fused' runs on the warp-specialised kernel; it takes warpgroups "
                             f"in {WS_WARPGROUPS}, got warpgroups=1")
        if self.warpgroups > 1 and (self.mma, self.plan) != ("bf16", "xla"):
            raise ValueError("MgpuConfig: the warp-specialised kernel (warpgroups > 1) takes mma='bf16' and "
                             f"plan='xla'; got {self.mma!r}, {self.plan!r}")


def default_config(rows_per_group: float) -> MgpuConfig:
    """`grouped_matmul`'s config for rows sorted by expert: one row tile per decode-sized group, so each expert's
    weights stream once (8, 16, 32 or 64 rows). At <= 8 rows per expert the in-kernel group plan with 4 CTAs per SM
    (its 127 registers fit 4); above, the XLA plan with 256-byte steps."""
    if rows_per_group <= 8:
        return MgpuConfig(rows=8, kh=128, steps=3, ctas_per_sm=4, plan="kernel")
    if rows_per_group <= 16:
        return MgpuConfig(rows=16, kh=256, steps=3, ctas_per_sm=2)
    if rows_per_group <= 32:
        return MgpuConfig(rows=32, kh=256, steps=2, ctas_per_sm=2)
    return MgpuConfig(rows=64, kh=256, steps=2, ctas_per_sm=1)


def fit_config(config: MgpuConfig, in_features: int) -> MgpuConfig:
    """`config` with its step width halved (down to one 64-byte block) until it divides K/2 — for narrow weights
    the default steps would not tile."""
    kh = config.kh
    while kh > BLOCK and (in_features // 2) % kh:
        kh //= 2
    return dataclasses.replace(config, kh=kh) if kh != config.kh else config


def supports(in_features: int, out_features: int, config: MgpuConfig) -> bool:
    """Whether `kernel_call` takes this weight shape with this config: K/2 a multiple of the step width kh (itself a
    multiple of 64 bytes), N a multiple of 64 output columns (with W compute warpgroups, N need not be whole
    64·W-column items: the last item's columns past N read zeros and are not stored)."""
    kh2 = in_features // 2
    return in_features % 2 == 0 and config.kh % BLOCK == 0 and kh2 % config.kh == 0 and out_features % COLS == 0


SMEM_BYTES = 232448  # shared memory a CTA may take on an H100 / H200 (227 KB)


def ws_stages(steps: int, want: int, stage_bytes: int = 0, fixed_bytes: int = 0) -> int:
    """Pipeline stages of the warp-specialised kernel: the most that divide the K loop's `steps`, at most `want`,
    and fit shared memory (`stage_bytes` each beside `fixed_bytes`). Its work items run as one chain of pipelines
    (the next item's first copies issued while this item's last steps compute), which needs each item to fill the
    stages in whole rounds."""
    fits = [d for d in range(1, min(steps, want) + 1) if steps % d == 0 and d * stage_bytes + fixed_bytes <= SMEM_BYTES]
    if not fits:
        raise ValueError(f"mgpu MXFP4: one pipeline stage of {stage_bytes} bytes beside {fixed_bytes} does not fit "
                         f"{SMEM_BYTES} bytes of shared memory; take fewer rows or a narrower step (kh)")
    return max(fits)


def tiled_config(rows_per_group: float, out_features: tuple[int, ...] = ()) -> MgpuConfig:
    """The kernel's config for rows already in the tile layout (`expert_ffn_tiled`); `out_features`: the FFN's
    weight widths (F, D), if known — widths the warp-specialised kernel cannot split into 128-column items get one
    warpgroup per CTA.

    - <= 8 rows per expert: 16-row tiles (one tile holds a router's group of about 8 ± 3), 256-byte steps, 2
      stages, 3 CTAs per SM, one warpgroup per CTA.
    - 8 < rows <= 16: `default_config`'s padded-plan shape.
    - 16 < rows <= 32: 40-row tiles (about 1.25× the mean group); warp-specialised, gate / up / activation fused.
      When F is whole 192-column items (K3: 3072) the fused kernel runs three compute warpgroups and down its own
      two-warpgroup `down_config`.
    - above 32 rows (decode batches and prefill alike): 80-row tiles, two compute warpgroups, gate / up fused.
    Measured on an H200 (docs/performance.md, `python3 bench/presets.py moe-ffn`)."""
    if rows_per_group <= 8:
        return MgpuConfig(rows=16, kh=256, steps=2, ctas_per_sm=3, plan="xla")
    if rows_per_group > 16:
        rows = 40 if rows_per_group <= 32 else 80
        ws = MgpuConfig(rows=rows, kh=128, steps=4, ctas_per_sm=1, plan="xla", warpgroups=2, gate_up="fused")
        if (rows_per_group <= 32 and len(out_features) == 2 and out_features[0] % (3 * COLS) == 0
                and out_features[1] % (2 * COLS) == 0):
            return dataclasses.replace(ws, warpgroups=3, down_config=ws)
        if all(n % (COLS * ws.warpgroups) == 0 for n in out_features):
            return ws
        if rows_per_group <= 32:
            return MgpuConfig(rows=40, kh=128, steps=3, ctas_per_sm=2, plan="xla")
        if rows_per_group <= 64:
            return MgpuConfig(rows=80, kh=256, steps=2, ctas_per_sm=1, plan="xla")
    return dataclasses.replace(default_config(rows_per_group), plan="xla")
