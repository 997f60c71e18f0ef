"""MXFP4 grouped matmul for decode-sized expert groups on Hopper, in Pallas Mosaic GPU (GPU only).

Why a second kernel: the Pallas Triton kernel (`gpu.grouped_matmul`, `dequant="asm_sign"`) is issue-bound at 0.46 of
copy bandwidth at 8 rows per expert. Its e2m1 decode (`mxfp4.DECODE_PTX_SIGN`, ~20 instructions per 8 weights) is
only half of its loop; the rest is Triton's operand shuffles, register moves and address arithmetic (0.14–0.15 warp
instructions per weight for every tile shape, `bench/triton_regs.py --op moe --sass`). Here the decode writes its
bf16 pairs straight into the registers of the wgmma A operand (`inline_mgpu`), the weights stream through a TMA
pipeline, and the tensor cores take the weights as the M side (64 output columns per warpgroup) and a tile of 16, 32
or 64 rows of x as the N side (the swap_ab form of the Triton kernel; one tile per decode-sized group).

Layout trick: wgmma only needs A and B to agree on the order of the contraction, so the order is chosen to make the
loads trivial. A thread's A-operand fragment for one 16-wide k slab is the pairs (r, 2q..2q+1) and (r, 2q+8..2q+9)
of rows r and r + 8 (q = lane % 4). For each 64-byte block of a packed weight row, thread q loads the 16 contiguous
bytes [16q, 16q + 16) (one `ld.shared.v4`, one E8M0 scale: they are one 32-element group) and word s of them (4
bytes) becomes logical slab s: bytes t = 0..3 are logical columns 16s + (2q, 2q+1, 2q+8, 2q+9)[t]. x's even and odd
planes are permuted the same way in XLA (`x_permutation`), so the products are unchanged. Each word goes through a
tested PTX decode into two lo-plane and two hi-plane registers, with the group's scale: by default the table-free
`mxfp4.DECODE_PTX_PLACED` over codes whose bits `prepare_weight` permuted once (`layout="placed"`: shifts, masks
and one bf16 multiply, 15 instructions per 8 weights), else the byte-permute table `mxfp4.DECODE_PTX_SIGN_OPERANDS`
over the stored codes (`layout="natural"`, 20; the fp8 path's layout).

Groups, two plans (`MgpuConfig.plan`). "xla": rows are padded per expert to multiples of the tile's rows in XLA (a
tile never holds two experts, no masked stores); the output `[padded rows, N]` fp32 (`MgpuConfig.store`) is gathered
back by row. "kernel" (`kernel_call_grouped`, the default at <= 8 rows per expert): work items are (expert, column
block); the kernel reads the expert's row bounds, fetches R + 8 x rows by offset from an 8-aligned row (TMA into
the tiled smem operand needs the alignment) and stores each of its rows in place with predicated global stores —
no padding, no gathers, only x's plane transpose and the bounds in XLA. Scales are read transposed, `[E, K/32, N]`
(`prepare_weight`, once per weight), so a TMA box of them is 64 bytes wide.

Measured (H200, `bench/moe.py --mgpu-configs`, E = 112, 3584 -> 3072, copy 4.24-4.28 TB/s; bench/RESULTS.md,
sessions 16-17): at 8 rows per expert the kernel alone streams **3.17-3.30 TB/s of weights (0.74-0.77 of copy)**
with the placed decode and the XLA plan (5 CTAs per SM; 2.26 with the table decode), the whole op 2.73-2.79
(0.64-0.656; the Triton kernel's op 1.93-1.96). The in-kernel plan cuts the XLA around the kernel from ~30 to
~12 µs, but its kernel needs 127 registers per thread (the R + 8 = 16-row MMA; the XLA plan's 95), so 4 CTAs fit
per SM instead of 5 and the kernel alone runs 2.88-2.94 TB/s: the op is 2.75-2.86, equal to the XLA plan's within
the runs' spread. At 32 and 64 rows the in-kernel plan is slower (up to 254 registers); there the XLA plan is the
default: 2.49-2.58 alone, 1.89-2.01 as an op (Triton 1.24), at 64 rows 1.50 / 1.13 (Triton 1.19). How the decode
got there: the table decode's loop was 31.7 SASS instructions per 8 weights (session 11); the placed decode with
rotations made it ~21 (2.67-2.94 TB/s), and ncu then showed "math pipe throttle": the integer ALU pipe (half the
issue rate) carried the rotations and masks. With plain shifts, four of them multiplies by 2^k, ptxas puts those on
the FMA pipe (IMAD.SHL) and half the bf16 multiplies on the MMA pipe (HFMA2.MMA), leaving 8 ALU instructions per 8
weights. "fp8" (session 11: 1.79-1.91 TB/s alone) holds 154 registers and stalls on shared-memory loads. Leaving a
step's MMAs running into the next step (wgmma_wait(1) with x released a step late) gave wrong results in sessions
11 and 16. What stands between the op and the 0.7 bar: the in-kernel plan's registers (back to <= 96 for 5 CTAs
per SM would put the op near 215 µs) and the x plane transpose (a byte order chosen in `prepare_weight` so natural
x rows are the MMA's B operand).
The expert FFN in one tile layout (`expert_ffn_tiled`, session 18): the padding around each matmul is the XLA cost
of the padded plan, so the FFN pads x once (one gather, as the dispatch already does), runs gate, up and down on
the padded rows (the activation and each matmul's x plane transpose fuse into the neighbouring XLA work) and
gathers the rows back once. At 8 rows per expert with a router's group sizes (multinomial; up to 16 rows) it
takes 16-row tiles (`tiled_config`: one tile per expert, each expert's weights stream once): kernel alone 200-211
µs per matmul (3.10-3.27 TB/s, 0.72-0.77 of copy), **the whole FFN 647-672 µs = 2.93-3.04 TB/s of weights
(0.68-0.72 of copy)** against 749-762 µs with each matmul padded on its own (H200, bench/moe.py's FFN section,
bench/RESULTS.md). `ops.expert_ffn_sorted` takes it for three prepared weights on a GPU, and a model loaded on a
GPU re-lays its MXFP4 experts into this layout once (`kimi_jax.modules.moe.MoE.use_mosaic_experts`).
Warp-specialised (sessions 21–22, `MgpuConfig(warpgroups=2)`, `kernel_call_ws`, `kernel_call_gated_ws`): at 32
and 64 rows per expert the one-warpgroup kernel reaches only 0.41 / 0.25 of copy — each CTA waits for its own MMAs
before its next decode, large tiles leave room for one or two CTAs per SM, and every 64-column block re-reads its x
tile from L2 (rows / 16 times its weight bytes). The variant runs one CTA per SM with two compute warpgroups on 64
columns each of a 128-column item, sharing the x stage, and a memory warpgroup issuing the TMA copies; a CTA's items
form one chain of pipelines, so the next item's copies start under this item's last steps. With
`gate_up="fused"` each compute warpgroup holds gate's and up's accumulators and applies the activation in its
epilogue, so gate and up are never written to memory. On the H200 (session 22, bench/RESULTS.md) it is correct and
`tiled_config`'s default at 32 and 64 rows per expert: the FFN 969 µs (0.47 of copy) and 1413 µs (0.32) against
1120 and 1817 with one warpgroup per CTA; at 8 rows it is slower (727 against 664). Session 23: the fused kernel
writes h in bf16 itself; `MgpuConfig(down_rows="in_place")` (opt-in: each tile's valid rows stored straight into
the FFN's sorted rows) is correct but slower. W = 4 hung in session 22 because JAX's register split oversubscribes
a 5-warpgroup CTA's register pool (`ws_compute_registers`); with the split fixed it is correct, and a 40-row
64-byte-step matmul takes 289 µs alone against 332 at W = 2 — but the fused kernel at W = 4 (104 registers for two
weights' accumulators) is slower, so `MgpuConfig.down_config` lets down alone take W = 4 (opt-in; the whole FFN
with it is not yet timed). Nsight Compute (session 23, 32 rows per expert): both W = 2 kernels latency-bound — 3
warps per scheduler, < 1 eligible, issue slots 47-50% busy, DRAM 52-57%, L2 65-72%.
`MgpuConfig(gate_up="fused")` with one warpgroup per CTA (`kernel_call_gated`): the same fusion, one weight after
the other in each step; two weights' stages need twice the shared memory: 128-byte steps, or 2 CTAs per SM at
256-byte steps.
Session 26: h goes from the fused kernel to down without XLA in between. A model prepares gate and up with their
output columns permuted (`prepare_ffn_weights`, `PreparedWeight.out_order="planes"`, `planes_column_order`) so
that each 64-column tile the fused kernel stores is a 64-column block of down's x planes, and it stores them there
(`_store_tile(store="planes")`); that removed the planes transpose of h (36 µs at 32 rows per expert). And at
<= 32 rows the fused kernel runs on three compute warpgroups (192-column items) with down on two. H200, routed
sizes, whole FFN: 8 rows 645 µs (0.72 of copy), 32 rows 872 µs (0.53; was 962–986), 64 rows 1248 µs (0.37; was
1378–1440), 146 rows 2613 µs. Nsight Compute at 32 rows: fused gate / up 497 µs (was 559), down 270, x gather +
planes 44, gather back 29, plan fusions ≈ 27.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py
import pallas_kernels.moe.schedule as schedule

COLS = 64  # output columns per warpgroup: the wgmma M side
BLOCK = 64  # packed bytes per (thread quad) load block: 4 threads x 16 bytes
ROW_ALIGN = 8  # x's TMA row offset must be a multiple of its smem tile's 8 rows
# compute warpgroups the warp-specialised kernel (`kernel_call_ws`) takes, 64 columns each (W = 3: K3's gate / up,
# 3072 = 16 items of 192 columns, not its down's 3584). W = 4 ran past a 200 s limit in session 22 with JAX's
# register split (`ws_compute_registers`: it deadlocked); session 23 gives it the split its CTA can hold.
WS_WARPGROUPS = (2, 3, 4)
WS_MEMORY_REGISTERS = 40  # registers per thread left to its memory warpgroup (it only issues TMA copies)


def ws_compute_registers(warpgroups: int, memory_registers: int = WS_MEMORY_REGISTERS) -> int:
    """Registers per compute thread that a CTA of `warpgroups` compute warpgroups + one memory warpgroup can hold.

    A CTA of 128·(W + 1) threads launches with floor8(65536 / threads) registers each, and `setmaxnreg` only moves
    registers within that allocation: an increase that the CTA's pool cannot cover waits forever. JAX's
    `emit_pipeline_warp_specialized` splits 512 per warpgroup slot ((512 − memory) / W), which is what a CTA of 3
    warpgroups holds (168 · 3 = 504 ≥ 2 · 232 + 40) but not one of 5: W = 4 asked for 4 · 112 + 40 = 488 of the
    96 · 5 = 480 it launched with — the session-22 hang. Here: floor8((floor8(512 / (W + 1)) · (W + 1) − memory) / W)
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
    # the kernel's output: "rows" = `[padded rows, N]` (each thread writes its accumulator transposed into the
    # staging tile, `_store_transposed_fn`), gathered back as whole rows; "cols" = outᵀ `[N, padded rows]` (the
    # staging tile as the accumulator holds it), gathered back column by column — op 2.63 vs 2.78 TB/s at 8 rows
    # per expert, 1.70 vs 1.94 at 32 (H200, session 16)
    store: str = "rows"
    # where the group plan lives (bf16 path): "xla" = rows padded per expert to whole tiles in XLA (`prepare_rows`,
    # `kernel_call`, `unpad_output`; the fp8 path's only plan); "kernel" = each work item is (expert, 64-column
    # block), the kernel reads the expert's row bounds, fetches its x rows by offset and stores each output row in
    # place (`kernel_call_grouped`: no padding, no gathers; `default_config` at <= 8 rows per expert)
    plan: str = "xla"
    # the tile-layout FFN's gate and up (`expert_ffn_tiled`): "separate" — two kernels, the activation in XLA;
    # "fused" — one kernel computing both products of each x tile and the activation in its epilogue
    # (`kernel_call_gated`: each x tile fetched once, no fp32 gate / up outputs written and read back)
    gate_up: str = "separate"
    # compute warpgroups per CTA: 1 — one warpgroup per CTA, `ctas_per_sm` CTAs per SM, each issuing its own TMA
    # copies and waiting for its MMAs every step (`kernel_call`); W = 2 or 4 (`WS_WARPGROUPS`) — warp-specialised
    # (`kernel_call_ws`, the padded plan with store="rows" and the bf16 decode only): per SM one CTA of W compute
    # warpgroups, each decoding 64 of a work item's 64·W columns, and a memory warpgroup issuing the copies, so one
    # warpgroup's decode runs while another's MMAs do and each x tile read from L2 serves 64·W columns instead of
    # 64. The CTA's register pool is shared: `ws_compute_registers` per compute thread (232 at W = 2, 104 at W = 4);
    # with gate_up="fused" each compute warpgroup holds gate's and up's accumulators and runs the activation
    warpgroups: int = 1
    # the tile-layout FFN's down matmul (`expert_ffn_tiled`): "gather" — it writes every padded row and one XLA
    # gather brings the rows back (with the placed layout's expert scale); "in_place" — the kernel scales each tile
    # by its expert's factor and stores its valid rows straight into their rows of the `[M, D]` result (a TMA copy
    # per set bit of the row count), so the padded result is never written nor read back; the rows past Σ sizes
    # are zeroed by an XLA scatter that touches only them
    down_rows: str = "gather"
    # False: each weight's step decoded whole, then its MMAs, then a wait (the next decode reuses the A registers);
    # True: decoded in 64-byte pieces (`BLOCK`), each piece's MMAs issued as soon as it is decoded, one wait after
    # the weight's last piece, so a piece's decode overlaps the previous pieces' MMAs. H200, session 23: one weight's
    # kernel alone 1-5% faster (326–330 / 379–384 / 730–743 µs against 330–335 / 395–402 / 764–783 at 32 / 64 /
    # 146 rows per expert), the fused gate / up kernel slower, the whole FFN 1-2% slower (999 / 1422 / 2772 against
    # 984 / 1400 / 2758): off by default. Waiting once per step instead (up's decode over gate's MMAs too, its A
    # registers held meanwhile) was worse still (FFN +2% / +7% / +6%)
    decode_pieces: bool = False
    # the tile-layout FFN's down matmul on a kernel config of its own (same `rows`: one tile plan); None: this one.
    # It reads h [m_pad, F] and writes [m_pad, D] with one weight, so it can take W = 4 compute warpgroups where the
    # fused gate / up kernel (two weights' accumulators) cannot fit their 104 registers
    down_config: "MgpuConfig | None" = None
    # the tile-layout FFN's x for gate / up (`expert_ffn_tiled`): "padded" — gathered into the padded rows (every
    # tile's rows written, dead tiles' zeros too: t_max · rows rows, 2.25× the sorted rows at 32 per expert);
    # "aligned" — each group's rows padded only to a multiple of 8 (`ROW_ALIGN`, where a TMA copy may start), plus
    # `rows` zero rows, each tile's copy starting at its first row there: a tile's rows past its group's are the
    # next group's (or zeros), whose products land in padding rows nothing reads back. ~1.2× the sorted rows.
    # H200, session 27, the FFN from the tokens: no gain measured (32 rows per expert 871–881 µs against 874–911
    # padded; 64 rows 1306 / 1385 against 1294 / 1273; 8 rows 673 against 663), so "padded" stays the default
    x_rows: str = "padded"

    def __post_init__(self):
        if self.store not in ("cols", "rows"):
            raise ValueError(f"MgpuConfig.store must be 'cols' or 'rows', got {self.store!r}")
        if self.plan not in ("kernel", "xla"):
            raise ValueError(f"MgpuConfig.plan must be 'kernel' or 'xla', got {self.plan!r}")
        if self.gate_up not in ("separate", "fused"):
            raise ValueError(f"MgpuConfig.gate_up must be 'separate' or 'fused', got {self.gate_up!r}")
        if self.x_rows not in ("padded", "aligned"):
            raise ValueError(f"MgpuConfig.x_rows must be 'padded' or 'aligned', got {self.x_rows!r}")
        if self.x_rows == "aligned" and self.rows % ROW_ALIGN:
            raise ValueError(f"MgpuConfig: x_rows='aligned' starts tiles on {ROW_ALIGN}-row boundaries, so rows must "
                             f"be a multiple of {ROW_ALIGN}, got {self.rows}")
        if self.down_rows not in ("gather", "in_place"):
            raise ValueError(f"MgpuConfig.down_rows must be 'gather' or 'in_place', got {self.down_rows!r}")
        if self.mma == "bf16" and self.plan != "xla" and self.store != "rows":
            raise ValueError("MgpuConfig: the in-kernel group plan stores rows; store='cols' needs plan='xla'")
        if self.down_config is not None and (self.down_config.rows != self.rows
                                             or self.down_config.down_config is not None):
            raise ValueError(f"MgpuConfig.down_config must tile rows as this config does (rows={self.rows}) and "
                             f"have no down_config of its own, got {self.down_config!r}")
        if self.warpgroups not in (1, *WS_WARPGROUPS):
            raise ValueError(f"MgpuConfig.warpgroups must be 1 or one of {WS_WARPGROUPS}, got {self.warpgroups!r}")
        if self.warpgroups > 1 and (self.mma, self.plan, self.store) != ("bf16", "xla", "rows"):
            raise ValueError("MgpuConfig: the warp-specialised kernel (warpgroups > 1) takes mma='bf16', plan='xla', "
                             f"store='rows'; got {self.mma!r}, {self.plan!r}, {self.store!r}")


def default_config(rows_per_group: float) -> MgpuConfig:
    """One row tile per decode-sized group, so each expert's weights stream once (8, 16, 32 or 64 rows); shapes from
    the H200 runs of sessions 16-17 with the placed decode (bench/RESULTS.md). At <= 8 rows per expert the in-kernel
    plan with 4 CTAs per SM (its 127 registers fit 4): op 2.75-2.86 TB/s against the XLA plan's 2.73-2.79 (8-row
    tiles, 5 CTAs: kernel alone 3.17-3.30); at 32 rows the XLA plan with 256-byte steps, 2 stages, 2 CTAs (2.49-2.58
    alone; 3 CTAs: 2.05; the in-kernel plan 1.6), at 64 the same with 1 CTA (1.50)."""
    if rows_per_group <= 8:
        return MgpuConfig(rows=8, kh=128, steps=3, ctas_per_sm=4, plan="kernel")
    if rows_per_group <= 16:
        return MgpuConfig(rows=16, kh=256, steps=3, ctas_per_sm=2)
    if rows_per_group <= 32:
        return MgpuConfig(rows=32, kh=256, steps=2, ctas_per_sm=2)
    return MgpuConfig(rows=64, kh=256, steps=2, ctas_per_sm=1)


LAYOUTS = ("natural", "placed")
OUT_ORDERS = ("natural", "planes")


@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """MXFP4 weight in the kernel's layout: codes `[E, N, K/2]` uint8, scales transposed `[E, K/32, N]`.

    `layout` "natural": codes as stored, decoded through the byte-permute table (`mxfp4.DECODE_PTX_SIGN_OPERANDS`).
    "placed": each 32-bit word's bits permuted (`mxfp4.place_codes`) for the table-free decode
    (`mxfp4.DECODE_PTX_PLACED`, 15 instead of 20 instructions per 8 weights); its multiplier 2^(S−1) must fit
    bf16, so an expert whose largest scale code exceeds 128 has all its codes lowered by `exp_offset[e]` (their
    excess) and its output multiplied back by 2^exp_offset[e] in fp32. Real checkpoints have exp_offset 0.

    `out_order` "natural": output column n is the checkpoint's column n. "planes" (an FFN's gate and up,
    `prepare_ffn_weights`): the output columns are stored permuted by `planes_column_order(N)`, so the kernel's
    64-column blocks of h are, as they are, 64-column blocks of the down matmul's x planes
    (`_planes_in_contraction_order`) — the fused gate / up kernel writes those planes itself and h needs no
    transpose between the two kernels."""
    codes: jax.Array
    scales_t: jax.Array
    exp_offset: jax.Array | None = None  # [E] int32, "placed" only
    layout: str = "natural"
    out_order: str = "natural"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"PreparedWeight.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.out_order not in OUT_ORDERS:
            raise ValueError(f"PreparedWeight.out_order must be one of {OUT_ORDERS}, got {self.out_order!r}")

    @property
    def num_experts(self):
        return self.codes.shape[0]

    @property
    def out_features(self):
        return self.codes.shape[1]

    @property
    def in_features(self):
        return self.codes.shape[2] * 2


jax.tree_util.register_dataclass(PreparedWeight, data_fields=["codes", "scales_t", "exp_offset"],
                                 meta_fields=["layout", "out_order"])

PLACED_MAX_SCALE = 128  # largest E8M0 code whose placed-decode multiplier 2^(S−1) is a finite bf16


def prepare_weight(w: mx.MXFP4Weight, layout: str = "placed", out_order: str = "natural") -> PreparedWeight:
    """`MXFP4Weight` (packed `[E, N, K/2]`, scales `[E, N, K/32]`) -> the kernel's layout (scales transposed, so a
    step's TMA box of them is 64 columns wide; codes bit-placed for `layout="placed"`; output columns permuted by
    `planes_column_order(N)` for `out_order="planes"`). Once per weight, not per call. Under "placed", an expert
    whose scale codes exceed 128 is lowered as a whole (`PreparedWeight`); a code that would fall to 0 or below
    then reads as a zero scale — only an expert whose scales span more than 2^127 could lose anything that way."""
    if out_order not in OUT_ORDERS:
        raise ValueError(f"prepare_weight: out_order must be one of {OUT_ORDERS}, got {out_order!r}")
    packed, scale = w.packed, w.scale
    if out_order == "planes":
        order = planes_column_order(packed.shape[1])
        packed, scale = packed[:, order], scale[:, order]
    scales_t = jnp.swapaxes(scale, 1, 2)
    if layout == "natural":
        return PreparedWeight(packed, scales_t, layout="natural", out_order=out_order)
    if layout != "placed":
        raise ValueError(f"prepare_weight: layout must be one of {LAYOUTS}, got {layout!r}")
    s = scales_t.astype(jnp.int32)
    offset = jnp.maximum(jnp.max(s, axis=(1, 2)) - PLACED_MAX_SCALE, 0)  # [E]
    lowered = jnp.where(s == 0, 0, jnp.maximum(s - offset[:, None, None], 0)).astype(jnp.uint8)
    return PreparedWeight(mx.place_codes(packed), lowered, offset.astype(jnp.int32), layout="placed",
                          out_order=out_order)


def ffn_out_orders(F: int) -> tuple[str, str, str]:
    """The output orders `prepare_ffn_weights` gives (gate, up, down) for an FFN of width F: gate and up in the down
    matmul's plane order when F is whole 128-column blocks, down natural."""
    order = "planes" if F % (2 * COLS) == 0 else "natural"
    return order, order, "natural"


def prepare_ffn_weights(w_gate: mx.MXFP4Weight, w_up: mx.MXFP4Weight, w_down: mx.MXFP4Weight,
                        layout: str = "placed") -> tuple[PreparedWeight, PreparedWeight, PreparedWeight]:
    """An expert FFN's three weights for `expert_ffn_tiled`, in `ffn_out_orders`' output orders."""
    orders = ffn_out_orders(w_gate.packed.shape[1])
    return tuple(prepare_weight(w, layout, o) for w, o in zip((w_gate, w_up, w_down), orders))


def unprepare_weight(p: PreparedWeight) -> mx.MXFP4Weight:
    """The inverse of `prepare_weight`: the checkpoint's layout (natural codes `[E, N, K/2]`, scales `[E, N, K/32]`,
    natural output columns), bit for bit (except scale codes that `prepare_weight` had to flush to zero, see there).
    For the backends that take `MXFP4Weight`s (the reference, Triton, TPU) when handed a prepared weight."""
    s = p.scales_t
    codes = p.codes
    if p.layout == "placed":
        s32 = s.astype(jnp.int32)
        s = jnp.where(s32 == 0, 0, s32 + p.exp_offset[:, None, None]).astype(jnp.uint8)
        codes = mx.unplace_codes(codes)
    packed, scale = codes, jnp.swapaxes(s, 1, 2)
    if p.out_order == "planes":
        back = np.argsort(planes_column_order(packed.shape[1]))
        packed, scale = packed[:, back], scale[:, back]
    return mx.MXFP4Weight(packed, scale)


def planes_column_order(n: int) -> np.ndarray:
    """order `[n]` (n a multiple of 128): stored column j of a weight prepared with out_order="planes" is its
    natural column order[j]. Column j = 64·b + i of the output is then element (b mod 2, i) of 64-column block
    b // 2 of the next matmul's x planes: h[:, order] viewed as `[m, n/128, 2, 64]` and transposed to
    `[2, m, n/128, 64]` is `_planes_in_contraction_order(h)` (plane e, column L holds h[:, 2·perm[L] + e]), so
    `columns_as_planes` is a copy of whole 64-column blocks and a kernel storing 64-column tiles can write the
    planes directly."""
    if n % (2 * COLS):
        raise ValueError(f"planes_column_order: {n} columns are not whole blocks of {2 * COLS}")
    perm = x_permutation(n // 2)
    b, i = np.divmod(np.arange(n), COLS)
    return 2 * perm[COLS * (b // 2) + i] + b % 2


def columns_as_planes(h_cols):
    """`[m, n]` whose columns are in `planes_column_order(n)` -> the x planes `[2, m, n/2]` of the next matmul
    (what `_planes_in_contraction_order` makes of the natural columns), moving whole 64-column blocks."""
    m, n = h_cols.shape
    return h_cols.reshape(m, n // (2 * COLS), 2, COLS).transpose(2, 0, 1, 3).reshape(2, m, n // 2)


def fit_config(config: MgpuConfig, in_features: int) -> MgpuConfig:
    """`config` with its step width halved (down to one 64-byte block) until it divides K/2 — for narrow weights
    the default steps would not tile."""
    kh = config.kh
    while kh > BLOCK and (in_features // 2) % kh:
        kh //= 2
    return dataclasses.replace(config, kh=kh) if kh != config.kh else config


def config_for(rows: int, w: PreparedWeight) -> MgpuConfig:
    """The config `grouped_matmul` uses when given none: `default_config` for `rows` rows over the weight's
    experts, its step width fitted to the weight (`fit_config`)."""
    return fit_config(default_config(rows / w.num_experts), w.in_features)


def supports(in_features: int, out_features: int, config: MgpuConfig) -> bool:
    """Whether `kernel_call` takes this weight shape with this config: K/2 a multiple of the step width kh (itself a
    multiple of 64 bytes), N a multiple of 64 output columns (with W compute warpgroups, N need not be whole
    64·W-column items: the last item's columns past N read zeros and are not stored)."""
    kh2 = in_features // 2
    return in_features % 2 == 0 and config.kh % BLOCK == 0 and kh2 % config.kh == 0 and out_features % COLS == 0


def x_permutation(kh_total: int) -> np.ndarray:
    """perm `[K/2]`: logical contraction column L reads physical packed column perm[L] (module docstring)."""
    perm = np.empty(kh_total, np.int32)
    for base in range(0, kh_total, BLOCK):
        for q in range(4):
            for s in range(4):
                for t, off in enumerate((2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9)):
                    perm[base + 16 * s + off] = base + 16 * q + 4 * s + t
    return perm


def _fragment_slots(layout, shape):
    """A WGMMA-family layout's registers for one thread: (registers shape, `reg(c, h)` -> the index of the register
    of column block c and row half h, this thread's rows (r, r + 8), the first column of its block-0 register)."""
    reg_shape = layout.registers_shape(shape)
    coords = dict(zip(np.ndindex(reg_shape), layout.thread_idxs(shape)))  # register -> (row, col) of its first element

    def reg(c, h):
        i = [0] * len(reg_shape)
        i[1], i[4] = c, h
        return tuple(i)

    return reg_shape, reg, [coords[reg(0, h)][0] for h in (0, 1)], coords[reg(0, 0)][1]


def _decode_fn(kh: int, code_layout: str = "natural"):
    """The inline Mosaic GPU body: (codes smem `[64, kh]` u8 in `code_layout` (`PreparedWeight.layout`), scales
    smem `[kh/16, 64]` u8) -> (lo, hi) bf16 `[64, kh]` in the WGMMA layout."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, codes_ref, scales_ref):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        index, bf16 = ir.IndexType.get(), ir.BF16Type.get()
        layout = fa.WGMMA_LAYOUT
        reg_shape, reg, rows, two_q = _fragment_slots(layout, (COLS, kh))  # reg(8-column block, row half); 2q
        assert reg_shape[1] == kh // 8 and reg_shape[4] == 2 and np.prod(reg_shape) == kh // 4, reg_shape
        q = arith.divui(two_q, mgu.c(2, index))
        q16 = arith.muli(two_q, mgu.c(8, index))
        v16i8 = ir.VectorType.get((16,), i8)
        v4i32 = ir.VectorType.get((4,), i32)
        v2bf16 = ir.VectorType.get((2,), bf16)
        out_ty = llvm.StructType.get_literal([i32] * 4)
        lo = np.empty(reg_shape, dtype=object)
        hi = np.empty(reg_shape, dtype=object)
        # the decode's constants as operands: materialised once, not once per word (`mx.DECODE_PTX_SIGN_OPERANDS`)
        pa, pb = mgu.c(mx.LUT_POS[0], i32), mgu.c(mx.LUT_POS[1], i32)
        c43 = mgu.c(0x43434343, i32)
        for h in (0, 1):
            for b in range(kh // BLOCK):
                col = arith.addi(q16, mgu.c(BLOCK * b, index))
                words = mgu.bitcast(vector.load(v16i8, codes_ref, [rows[h], col]), v4i32)
                grp = arith.addi(q, mgu.c(4 * b, index))
                s32 = arith.extui(i32, memref.load(scales_ref, [grp, rows[h]]))
                if code_layout == "placed":  # bf16x2 (h, h), h = 2^(S−1), S = 0 a zero scale (`scale_placed_bf16`)
                    h2 = arith.select(arith.cmpi(arith.CmpIPredicate.eq, s32, mgu.c(0, i32)), mgu.c(0, i32),
                                      arith.muli(arith.addi(s32, mgu.c(126, i32)), mgu.c(0x00800080, i32)))
                else:  # bf16x2 (h, h), h = 2^(S-128) (`mxfp4.scale_half_bf16`), and −192·h, once per group
                    e = arith.subi(arith.maxui(s32, mgu.c(1, i32)), mgu.c(1, i32))
                    h2 = arith.muli(e, mgu.c(0x00800080, i32))
                    c2 = llvm.inline_asm(i32, [h2], mx.NEG192_PTX, "=r,r")
                for s in range(4):
                    w = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([s]))
                    if code_layout == "placed":
                        out = llvm.inline_asm(out_ty, [w, h2], mx.DECODE_PTX_PLACED, "=r,=r,=r,=r,r,r")
                    else:
                        out = llvm.inline_asm(out_ty, [w, h2, c2, pa, pb, c43], mx.DECODE_PTX_SIGN_OPERANDS,
                                              "=r,=r,=r,=r,r,r,r,r,r,r")
                    regs = [mgu.bitcast(llvm.extractvalue(i32, out, [k]), v2bf16) for k in range(4)]
                    slab = 4 * b + s
                    lo[reg(2 * slab, h)], lo[reg(2 * slab + 1, h)] = regs[0], regs[1]
                    hi[reg(2 * slab, h)], hi[reg(2 * slab + 1, h)] = regs[2], regs[3]
        return (fa.FragmentedArray(_registers=lo, _layout=layout, _is_signed=None),
                fa.FragmentedArray(_registers=hi, _layout=layout, _is_signed=None))

    return fn


def _decode_fp8_fn(kh: int):
    """The inline Mosaic GPU body of the fp8 path: codes smem `[64, kh]` u8 -> one e4m3 array `[64, 32]` per
    32-element group (WGMMA_8BIT layout: thread q holds columns 4q..4q+3 and 16+4q..16+4q+3 of rows r, r + 8).
    Columns 0..15 are the group's even elements (low nibbles), 16..31 its odd ones; thread q's word is the 4 bytes
    [4q, 4q + 4) of the group's 16 — the natural order, so x needs only its [even | odd] split per group."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, codes_ref):
        del ctx
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        index, f8 = ir.IndexType.get(), ir.Float8E4M3FNType.get()
        layout = fa.WGMMA_LAYOUT_8BIT
        reg_shape, reg, rows, four_q = _fragment_slots(layout, (COLS, mx.GROUP))  # reg(16-column block, half); 4q
        assert reg_shape[1] == 2 and reg_shape[4] == 2 and np.prod(reg_shape) == 4, reg_shape
        v4i8, v4f8 = ir.VectorType.get((4,), i8), ir.VectorType.get((4,), f8)
        out_ty = llvm.StructType.get_literal([i32] * 2)
        planes = []
        for grp in range(kh // (mx.GROUP // 2)):
            regs = np.empty(reg_shape, dtype=object)
            col = arith.addi(four_q, mgu.c(grp * (mx.GROUP // 2), index))
            for h in (0, 1):
                word = mgu.bitcast(vector.load(v4i8, codes_ref, [rows[h], col]), i32)
                out = llvm.inline_asm(out_ty, [word], mx.DECODE_E4M3_PTX, "=r,=r,r")
                regs[reg(0, h)] = mgu.bitcast(llvm.extractvalue(i32, out, [0]), v4f8)  # low nibbles: even elements
                regs[reg(1, h)] = mgu.bitcast(llvm.extractvalue(i32, out, [1]), v4f8)  # high nibbles: odd elements
            planes.append(fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None))
        return tuple(planes)

    return fn


def _fold_fn(ng: int):
    """The inline Mosaic GPU body that folds a step's per-group partials: (out, part_0 … part_{ng−1} `[64, R]` f32,
    scales smem `[ng, 64]` u8) -> out + Σ_g part_g · 2^(S[g, row] − 127 + 6), the scale per output column (row of
    the transposed product)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, out, *args):
        del ctx
        *parts, scales_ref = args
        i32, f32, index = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
        layout = out.layout
        rows = [idx[0] for idx in layout.thread_idxs(out.shape)]
        regs = out.registers.copy()
        flat = list(np.ndindex(regs.shape))
        for j, part in enumerate(parts):
            assert part.layout == layout, (part.layout, layout)
            for k, ri in enumerate(flat):
                s32 = arith.extui(i32, memref.load(scales_ref, [mgu.c(j, index), rows[k]]))
                e = arith.shli(arith.addi(s32, mgu.c(mx.E4M3_DECODE_EXP, i32)), mgu.c(23, i32))
                sc = arith.bitcast(f32, e)
                vt = regs[ri].type
                sc_v = vector.broadcast(vt, sc) if isinstance(vt, ir.VectorType) else sc
                regs[ri] = arith.addf(regs[ri], arith.mulf(part.registers[ri], sc_v))
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


def _group_of(ends, idx):
    """Group of each index for sorted group ends: a count of the ends ≤ idx (a compare-all, no search loop: XLA's
    `searchsorted` scan costs tens of µs of small kernels on the GPU)."""
    return jnp.sum(idx[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def _tiles(group_sizes, E: int, t_max: int, rows: int):
    """Per-group padding to `rows`: (tile -> group `[t_max]`, live tiles `[1]`, padded row start per group)."""
    sizes = group_sizes.astype(jnp.int32)
    tiles_g = (sizes + rows - 1) // rows
    tile_end = jnp.cumsum(tiles_g)
    tile_start = tile_end - tiles_g
    tile_group = jnp.minimum(_group_of(tile_end, jnp.arange(t_max, dtype=jnp.int32)), E - 1)
    return tile_group, tile_end[-1:], tile_start * rows


def _pad_plan(group_sizes, M: int, num_experts: int, rows: int):
    """Rows padded per group to multiples of `rows`, as gathers only (no scatter) -> (source row of each padded row
    `[m_pad]` (M: a zero row), tile -> group `[t_max]`, live tiles `[1]`, padded row of each input row `[M]`, live
    row mask `[M]`)."""
    E = num_experts
    t_max = -(-M // rows) + E
    m_pad = t_max * rows
    tile_group, num_tiles, pad_start = _tiles(group_sizes, E, t_max, rows)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # padded row p: tile p // rows of group g, k-th padded row of g; a real row while k < the group's size
    p = jnp.arange(m_pad, dtype=jnp.int32)
    g = tile_group[p // rows]
    k = p - pad_start[g]
    src = jnp.where((p // rows < num_tiles[0]) & (k < sizes[g]), starts[g] + k, M)
    # padded row of each sorted row; rows past Σ sizes go to the last padded row (never a live tile's) and are zeroed
    row = jnp.arange(M, dtype=jnp.int32)
    g_of_row = jnp.minimum(_group_of(ends, row), E - 1)
    live = row < ends[-1]
    pad_row = jnp.where(live, pad_start[g_of_row] + row - starts[g_of_row], m_pad - 1)
    return src, tile_group, num_tiles, pad_row, live


def _pad_rows(x, group_sizes, num_experts: int, rows: int):
    """Rows padded per group to multiples of `rows` -> (x's rows in padded order `[m_pad, K]` (zeros between
    groups), tile -> group `[t_max]`, live tiles `[1]`, padded row of each input row `[M]`, live row mask `[M]`)."""
    src, *plan = _pad_plan(group_sizes, x.shape[0], num_experts, rows)
    return (x.at[src].get(mode="fill", fill_value=0), *plan)


def _store_transposed_fn():
    """The inline Mosaic GPU body that writes a WGMMA-layout `[64, R]` fp32 accumulator transposed into a `[R, 64]`
    shared-memory tile of fp32 or a 16-bit float (rounded to nearest even): each thread stores its own registers'
    elements (R·64 scalar stores per item)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, acc, o_ref):
        del ctx
        index = ir.IndexType.get()
        regs = acc.registers
        elt = ir.MemRefType(o_ref.type).element_type
        narrow = str(elt) != "f32"
        for (row, col), ri in zip(acc.layout.thread_idxs(acc.shape), np.ndindex(regs.shape)):
            reg = regs[ri]  # vector<2xf32>: columns col, col + 1 of row `row`
            for j in range(ir.VectorType(reg.type).shape[0]):
                v = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([j]))
                memref.store(arith.truncf(elt, v) if narrow else v, o_ref, [arith.addi(col, mgu.c(j, index)), row])

    return fn


def _store_tile(acc, o_smem, out_ref, nb, t, store: str):
    """A work item's `[64, rows]` fp32 result -> outᵀ[64·nb …, rows·t …] ("cols") or out[rows·t …, 64·nb …] ("rows")
    through shared memory and a TMA copy, once the previous item's copy has read the staging buffer. "planes": out
    is the next matmul's x planes `[2, m_pad, N/2]` and block nb of the (`planes_column_order`) columns goes to
    plane nb mod 2, columns 64·(nb // 2) … (the rows' tile as for "rows")."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if store in ("rows", "planes"):
        R = o_smem.shape[0]
        plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(_store_transposed_fn())(acc, o_smem)
        plgpu.commit_smem()
        if store == "rows":
            dst = out_ref.at[pl.ds(t * R, R), pl.ds(nb * COLS, COLS)]
        else:
            dst = out_ref.at[nb % 2, pl.ds(t * R, R), pl.ds(nb // 2 * COLS, COLS)]
        plgpu.copy_smem_to_gmem(o_smem, dst)
    else:
        R = o_smem.shape[1]
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[pl.ds(nb * COLS, COLS), pl.ds(t * R, R)])


def _store_rows_in_place(acc, o_smem, out_ref, nb, row0, n):
    """A work item's `[64, R]` fp32 result -> its first `n` rows (0 ≤ n ≤ R, dynamic) stored at out[row0 …
    row0 + n, 64·nb …]: the tile goes through the `[R, 64]` staging buffer as in `_store_tile`, then one TMA copy
    per set bit b of n moves rows [n & ~(2b − 1), +b) — copies need static sizes, and a row of 64 fp32 or bf16 is
    a multiple of the 128 bytes a copy's shared-memory start must align to."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    R = o_smem.shape[0]
    plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))(_store_transposed_fn())(acc, o_smem)
    plgpu.commit_smem()
    b = 1 << (R.bit_length() - 1)  # the largest power of two ≤ R
    while b:
        @pl.when((n & b) != 0)
        def _copy(b=b):
            off = n & ~(2 * b - 1)
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(off, b)],
                                    out_ref.at[pl.ds(row0 + off, b), pl.ds(nb * COLS, COLS)])
        b //= 2


def _for_each_item(t_max: int, n_blocks: int, tile_group_ref, num_ref, item):
    """The CTAs' loop over work items (row tile t, 64-column block nb), column blocks innermost (the CTAs in flight
    share the x tile): `item(t, nb, g)` for each live tile, g its expert."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    @plgpu.nd_loop((t_max * n_blocks,), collective_axes="sm")
    def _item(info):
        (i,) = info.index
        t = i // n_blocks

        @pl.when(t < num_ref[0])
        def _live():
            item(t, i % n_blocks, tile_group_ref[t])


def _cta_grid(cfg: MgpuConfig) -> tuple[int]:
    """`ctas_per_sm` CTAs per SM of the default device (132 SMs, an H100/H200, when lowering without a GPU)."""
    num_sms = jax.devices()[0].core_count if jax.devices()[0].platform == "gpu" else 132
    return (num_sms * cfg.ctas_per_sm,)


def _launch(body, N: int, m_pad: int, cfg: MgpuConfig, out_dtype=jnp.float32, planes: bool = False):
    """`body` as a Mosaic GPU kernel: one warpgroup per CTA, `ctas_per_sm` CTAs per SM looping over the work items
    (`nd_loop` over the "sm" axis), outᵀ `[N, m_pad]` fp32 and a `[64, rows]` staging buffer (`store="rows"`: out
    `[m_pad, N]` in `out_dtype` (fp32 or bf16), staging `[rows, 64]`; `planes`: out is the next matmul's x planes
    `[2, m_pad, N/2]`, stored as for "rows" by `_store_tile(store="planes")`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rows_major = cfg.store == "rows" or planes
    if not rows_major and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(f"mgpu MXFP4: store='cols' writes fp32 only, got out_dtype={jnp.dtype(out_dtype)}")
    out_shape = (2, m_pad, N // 2) if planes else (m_pad, N) if rows_major else (N, m_pad)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=_cta_grid(cfg),
        grid_names=("sm",),
        scratch_types=dict(o_smem=plgpu.SMEM((cfg.rows, COLS) if rows_major else (COLS, cfg.rows), out_dtype)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def _planes_in_contraction_order(x_rows):
    """`[m, K]` -> the even / odd element planes in the kernel's contraction order `[2, m, K/2]`: plane e, column L
    holds x[:, 2·perm[L] + e] (`x_permutation`). perm is a digit permutation — within each 64-byte block the
    physical byte 16q + 4s + 2t₁ + t₀ is logical column 16s + 8t₁ + 2q + t₀ — so this is a reshape and a transpose
    (one fused copy), not an element gather (whose index array is 16 bytes per element of x)."""
    m, K = x_rows.shape
    # x column 2·P + e with P = 64·b + 16q + 4s + 2t₁ + t₀
    x7 = x_rows.reshape(m, K // (2 * BLOCK), 4, 4, 2, 2, 2)  # [m, b, q, s, t1, t0, e]
    return x7.transpose(6, 0, 1, 3, 4, 2, 5).reshape(2, m, K // 2)  # [e, m, b, s, t1, q, t0]


def prepare_rows(x, group_sizes, num_experts: int, rows: int = 16):
    """XLA side of the bf16 path: `_pad_rows`, x split into even / odd elements in the kernel's contraction order
    -> (x planes `[2, m_pad, K/2]` bf16 (even, odd: one copy per step brings both), tile -> group, live tiles, padded
    row of each input row, live row mask)."""
    x_rows, tile_group, num_tiles, pad_row, live = _pad_rows(x.astype(jnp.bfloat16), group_sizes, num_experts, rows)
    return _planes_in_contraction_order(x_rows), tile_group, num_tiles, pad_row, live


def prepare_rows_fp8(x, group_sizes, num_experts: int, rows: int = 16):
    """XLA side of the fp8 path: `_pad_rows`, each 32-element group's even elements then its odd ones (the order of
    the decoded codes), as two e4m3 planes -> (x_hi, x_lo `[m_pad, K]`, 1/row scale `[m_pad]`, tile -> group, live
    tiles, padded row of each input row, live row mask). x ≈ (x_hi + x_lo)·inv (`mxfp4.split_e4m3_planes`)."""
    x_rows, tile_group, num_tiles, pad_row, live = _pad_rows(x, group_sizes, num_experts, rows)
    m_pad, K = x_rows.shape
    g = mx.GROUP
    x_rows = x_rows.reshape(m_pad, K // g, g // 2, 2).transpose(0, 1, 3, 2).reshape(m_pad, K)
    x_hi, x_lo, inv = mx.split_e4m3_planes(x_rows)
    return x_hi, x_lo, inv, tile_group, num_tiles, pad_row, live


def _bf16_decode(kh: int, code_layout: str):
    """The inline decode of a step's codes and scales into the (lo, hi) bf16 WGMMA operands (`_decode_fn`)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType()),
        return_type=(plgpu.ShapeDtypeStruct((COLS, kh), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
                     plgpu.ShapeDtypeStruct((COLS, kh), jnp.bfloat16, layout=plgpu.Layout.WGMMA)),
    )(_decode_fn(kh, code_layout))


def _decode_and_mma(decode_fns, acc_refs, w_bufs, xs_s, kh: int, pieces: bool):
    """One pipeline step: for each (accumulator `[64, rows]`, codes `[64, kh]` and scales `[kh/16, 64]` in shared
    memory), the codes decoded and multiplied with the x planes' tile `xs_s [2, rows, kh]` (bf16), then a wait for
    those MMAs: the next decode reuses the A registers, and the step's buffers are released only after it (leaving
    one group in flight — wgmma_wait(1), x released a step late — gave wrong results and NaNs on the H200 for
    3-stage pipelines in session 11, and again in session 16 with the pipeline's own delay_release=1 on x).
    `decode_fns`: (decode of kh bytes, decode of one `BLOCK`); `pieces` (`MgpuConfig.decode_pieces`): each weight
    decoded one BLOCK at a time, each piece's MMAs issued as soon as it is decoded."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    whole, piece = decode_fns
    for i, acc_ref in enumerate(acc_refs):
        codes, scales = w_bufs[2 * i], w_bufs[2 * i + 1]
        if not pieces:
            lo, hi = whole(codes, scales)
            plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xs_s.at[0], (1, 0)))
            plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xs_s.at[1], (1, 0)))
        else:
            for p in range(kh // BLOCK):
                k_bytes = pl.ds(p * BLOCK, BLOCK)
                lo, hi = piece(codes.at[:, k_bytes], scales.at[pl.ds(p * BLOCK // 16, BLOCK // 16)])
                plgpu.wgmma(acc_ref, lo, plgpu.transpose_ref(xs_s.at[0, :, k_bytes], (1, 0)))
                plgpu.wgmma(acc_ref, hi, plgpu.transpose_ref(xs_s.at[1, :, k_bytes], (1, 0)))
        plgpu.wgmma_wait(0)


def _bf16_decodes(kh: int, code_layout: str):
    """(decode of a whole kh-byte step, decode of one `BLOCK`-byte piece): `_decode_and_mma`'s two forms."""
    return _bf16_decode(kh, code_layout), _bf16_decode(BLOCK, code_layout)


def _mma_over_k(decode, acc_refs, weight_refs, xs_ref, nb, x_rows, x_index, cfg: MgpuConfig):
    """One tile's loop over K: per step, for each (accumulator `[64, rows]`, (codes `[N, K/2]`, scales `[K/32, N]`)
    of one expert's weight), the 64-column block nb's codes and scales decoded and multiplied with the x planes'
    tile (`BlockSpec` row dimension `x_rows` — a block size or `pl.Element` — at index `x_index`), through a TMA
    pipeline of `cfg.steps` stages. One weight: a grouped matmul; two (gate, up): both products of the same x tile,
    one weight after the other (each waits for its MMAs before the next decode reuses the registers)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    kh = cfg.kh

    def step(_, *bufs):
        *w_bufs, xs_s = bufs
        _decode_and_mma(decode, acc_refs, w_bufs, xs_s, kh, cfg.decode_pieces)

    weight_specs = [plgpu.BlockSpec((COLS, kh), lambda kk: (nb, kk)),
                    plgpu.BlockSpec((kh // 16, COLS), lambda kk: (kk, nb))]
    plgpu.emit_pipeline(
        step,
        grid=(xs_ref.shape[-1] // kh,),
        in_specs=weight_specs * len(acc_refs) + [plgpu.BlockSpec((2, x_rows, kh), lambda kk: (0, x_index, kk))],
        max_concurrent_steps=cfg.steps,
    )(*[r for pair in weight_refs for r in pair], xs_ref)


def kernel_call(xs, tile_group, num_tiles, w: PreparedWeight, config: MgpuConfig = MgpuConfig(),
                out_dtype=jnp.float32, *, place=None, x_row0=None, scale=None):
    """The Mosaic GPU kernel alone: `prepare_rows`' outputs and the weight -> outᵀ `[N, m_pad]` fp32 (`store="rows"`:
    out `[m_pad, N]` in `out_dtype`, fp32 or bf16 — fp32 accumulation either way).

    `place` (store="rows"): (first output row `[t_max]`, valid rows `[t_max]` int32 of each tile, M) — each live
    tile's first valid-rows rows go straight to their rows of out `[M, N]`, times the expert's scale for the placed
    layout (`_store_rows_in_place`); rows no tile covers are left unwritten.
    `x_row0` `[t_max]` int32 (`MgpuConfig.x_rows="aligned"`, multiples of `ROW_ALIGN`): tile t reads x rows
    x_row0[t] … x_row0[t] + rows − 1 of planes `[2, any rows, K/2]` instead of its own padded rows; m_pad =
    t_max · rows either way.
    `scale` `[E]` fp32 (not with `place`, which brings its own): each expert's output factor (the placed layout's
    2^exp_offset, `expert_scale`), applied to the fp32 accumulator before the store, so no XLA pass over the
    output is needed for it."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if place is not None and scale is not None:
        raise ValueError("mgpu MXFP4: rows stored in place carry the expert scales already; pass scale=None")
    if config.warpgroups > 1:
        return kernel_call_ws(xs, tile_group, num_tiles, w, config, out_dtype, place=place, x_row0=x_row0,
                              scale=scale)
    cfg = config
    R, kh = cfg.rows, cfg.kh
    t_max = tile_group.shape[0]
    m_pad = t_max * R
    _check_kernel_shapes(xs, w, cfg, tile_group, x_row0)
    n_blocks = w.out_features // COLS
    decode = _bf16_decodes(kh, w.layout)
    inputs = _placement_inputs(place, w, cfg) + _row0_inputs(x_row0)
    extra = () if scale is None else (scale,)

    def body(tile_group_ref, num_ref, *refs, o_smem):
        place_refs, refs = refs[:len(inputs)], refs[len(inputs):]
        extra_refs, (xs_ref, codes_ref, scales_ref, out_ref) = refs[:len(extra)], refs[len(extra):]
        place_refs, x_rows, x_index = _split_row0(place_refs, x_row0, R)

        def item(t, nb, g):
            def acc_scope(acc_ref):
                _mma_over_k(decode, (acc_ref,), ((codes_ref.at[g], scales_ref.at[g]),), xs_ref, nb, x_rows,
                            x_index(t), cfg)
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((COLS, R), jnp.float32))
            if extra_refs:
                acc = acc * extra_refs[0][g]
            if place_refs:
                _store_placed(acc, o_smem, out_ref, nb, t, g, place_refs)
            else:
                _store_tile(acc, o_smem, out_ref, nb, t, cfg.store)

        _for_each_item(t_max, n_blocks, tile_group_ref, num_ref, item)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_rows = m_pad if place is None else place[2]
    return _launch(body, w.out_features, out_rows, cfg, out_dtype)(tile_group, num_tiles, *inputs, *extra, xs,
                                                                  w.codes, w.scales_t)


def _placement_inputs(place, w: PreparedWeight, cfg: MgpuConfig) -> tuple:
    """The kernel inputs of `place`: first row and valid rows per tile, then the expert scales for the placed
    layout (none for the natural layout)."""
    if place is None:
        return ()
    if cfg.store != "rows":
        raise ValueError("mgpu MXFP4: rows stored in place need store='rows'")
    scale = expert_scale(w)
    return (place[0], place[1]) + (() if scale is None else (scale,))


def _store_placed(acc, o_smem, out_ref, nb, t, g, place_refs):
    """`_store_rows_in_place` of tile t (expert g) at column block nb, times the expert's factor where `place_refs`
    (`_placement_inputs`) carry the scales."""
    row0_ref, n_ref, *scale_ref = place_refs
    if scale_ref:
        acc = acc * scale_ref[0][g]
    _store_rows_in_place(acc, o_smem, out_ref, nb, row0_ref[t], n_ref[t])


def _check_kernel_shapes(xs, w: PreparedWeight, cfg: MgpuConfig, tile_group, x_row0=None):
    """x planes `[2, m_pad, K/2]` (with `x_row0`: `[2, any rows ≥ rows, K/2]`) and weight `[E, N, K/2]` as the
    padded-plan kernels take them, m_pad = t_max · rows for `tile_group [t_max]`."""
    _, x_rows, KH = xs.shape
    KH2, N = w.codes.shape[2], w.out_features
    m_pad = tile_group.shape[0] * cfg.rows
    bad_rows = x_rows < cfg.rows if x_row0 is not None else x_rows != m_pad
    if KH2 != KH or KH % cfg.kh or cfg.kh % BLOCK or N % COLS or bad_rows:
        raise ValueError(f"mgpu MXFP4: packed K/2={KH2} (x: {KH}) must be a multiple of kh={cfg.kh} (a multiple of "
                         f"{BLOCK}), N={N} of {COLS}; x rows {x_rows} for {tile_group.shape[0]} tiles of {cfg.rows}"
                         + (" (at least one tile's)" if x_row0 is not None else ""))
    if x_row0 is not None and x_row0.shape != tile_group.shape:
        raise ValueError(f"mgpu MXFP4: x_row0 {x_row0.shape} needs one row per tile, {tile_group.shape}")


def _row0_inputs(x_row0) -> tuple:
    """The kernel input of `x_row0` (each tile's first x row, `MgpuConfig.x_rows="aligned"`), if any."""
    return () if x_row0 is None else (x_row0,)


def _split_row0(refs, x_row0, R: int):
    """The refs after the placement inputs -> (placement refs, the x tile's `BlockSpec` row dimension, tile t -> its
    index there): rows from x_row0[t] (`pl.Element`) with `x_row0`, else padded tile t (block R). The offset is
    rounded down to `ROW_ALIGN` where the lowering can see it (the copy's tiled source needs that); `x_row0`'s
    values are multiples of it already."""
    import jax.experimental.pallas as pl

    if x_row0 is None:
        return refs, R, lambda t: t
    *refs, row0_ref = refs
    return tuple(refs), pl.Element(R), lambda t: jax.lax.div(row0_ref[t], ROW_ALIGN) * ROW_ALIGN


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


def kernel_call_ws(xs, tile_group, num_tiles, w: PreparedWeight, config: MgpuConfig, out_dtype=jnp.float32, *,
                   place=None, x_row0=None, scale=None):
    """The padded-plan kernel, warp-specialised (`MgpuConfig(warpgroups=2)`): the same operands and result as
    `kernel_call` with store="rows" (out `[m_pad, N]` in `out_dtype`, rows of dead tiles unwritten).

    One CTA per SM (W + 1 warpgroups take the register file: W compute warpgroups at (512 − 40) / W registers, the
    memory warpgroup at 40). A work item is (row tile t, block of C = 64·W columns); its K loop is one
    `emit_pipeline_warp_specialized` whose memory warpgroup copies each step's codes `[C, kh]`, scales
    `[kh/16, C]` and x planes `[2, R, kh]`; compute warpgroup w decodes columns 64w … 64w + 63 of the step into
    its wgmma A registers and multiplies them with the shared x tile, waiting for its own MMAs before the next
    decode (the registers are reused). The CTA's items form one chain of pipelines (`pipeline_state` START /
    STEADY / STOP), so the memory warpgroup fetches the next item's first steps while the last ones compute; the
    chain needs the K loop's steps to be a whole number of rounds of the stages (`ws_stages`). `place`, `x_row0`,
    `scale`: as in `kernel_call`."""
    if place is not None and scale is not None:
        raise ValueError("mgpu MXFP4: rows stored in place carry the expert scales already; pass scale=None")

    def epilogue(accs, g, *scale_ref):
        return accs[0] * scale_ref[0][g] if scale_ref else accs[0]

    return _ws_call(xs, tile_group, num_tiles, (w,), config, out_dtype, epilogue, () if scale is None else (scale,),
                    place=place, x_row0=x_row0)


def kernel_call_gated_ws(xs, tile_group, num_tiles, w_gate: PreparedWeight, w_up: PreparedWeight, activation,
                         config: MgpuConfig, gate_scale=None, up_scale=None, out_dtype=jnp.float32, x_row0=None):
    """`kernel_call_gated` warp-specialised (`MgpuConfig(warpgroups=2, gate_up="fused")`): h `[m_pad, F]`
    `out_dtype` = activation(x·Wgᵀ·sg, x·Wuᵀ·su) (weights with out_order="planes": the down matmul's x planes
    `[2, m_pad, F/2]`). As `kernel_call_ws`, with each step's stage holding both weights' blocks beside the one x
    tile, and each compute warpgroup two accumulators (gate, up) for its 64 columns; the activation runs on them in
    the epilogue, so gate and up are never written to memory."""
    def epilogue(accs, g, *scale_refs):
        gate, up = accs
        if scale_refs:
            gate, up = gate * scale_refs[0][g], up * scale_refs[1][g]
        return activation(gate, up)

    scales = () if gate_scale is None else (gate_scale, up_scale)
    return _ws_call(xs, tile_group, num_tiles, (w_gate, w_up), config, out_dtype, epilogue, scales, x_row0=x_row0)


def _ws_call(xs, tile_group, num_tiles, weights: tuple, config: MgpuConfig, out_dtype, epilogue, extra, place=None,
             x_row0=None):
    """The warp-specialised kernel over one weight or a (gate, up) pair of one shape and layout: each work item's
    accumulators `[64, R]` fp32 (one per weight) -> `epilogue(accs, g, *extra_refs)` (g the item's expert, `extra`
    kernel inputs such as per-expert scales) -> out rows `[R, 64]` of its tile and column block (or, with `place`,
    its valid rows in place: `kernel_call`). `x_row0`: each tile's first x row (`kernel_call`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax
    from jax._src.pallas.mosaic_gpu.pipeline import PipelinePipeline

    if config.store != "rows" or config.mma != "bf16":
        raise ValueError("mgpu MXFP4: the warp-specialised kernel stores rows and decodes to bf16")
    w = weights[0]
    _check_same_form(weights)
    # a fused gate / up pair whose columns are in the down matmul's plane order writes those planes
    planes = len(weights) == 2 and w.out_order == "planes"
    _check_kernel_shapes(xs, w, config, tile_group, x_row0)
    KH = xs.shape[2]
    R, kh, N = config.rows, config.kh, w.out_features
    m_pad = tile_group.shape[0] * R
    wgs, n_w = config.warpgroups, len(weights)
    cols = COLS * wgs
    # work items per row tile; when N is not whole items, the last one's columns past N are read as zeros (TMA
    # fills what lies outside the weight) and its warpgroups past N store nothing
    blocks = -(-N // cols)
    ragged = N % cols != 0
    steps = KH // kh
    out_bytes = wgs * R * COLS * jnp.dtype(out_dtype).itemsize  # the compute warpgroups' staging tiles
    stages = ws_stages(steps, config.steps, stage_bytes=n_w * (cols * kh + kh // 16 * cols) + 2 * R * kh * 2,
                       fixed_bytes=out_bytes + 1024)  # + barriers
    decode = _bf16_decodes(kh, w.layout)
    num_sms = _cta_grid(dataclasses.replace(config, ctas_per_sm=1))[0]
    if place is not None and n_w != 1:
        raise ValueError("mgpu MXFP4: rows stored in place take one weight")
    place_inputs = _placement_inputs(place, w, config) + _row0_inputs(x_row0)

    def kernel(tile_group_ref, num_ref, *refs, o_smem):
        n_place = len(place_inputs)
        place_refs, refs = refs[:n_place], refs[n_place:]
        place_refs, _, x_index = _split_row0(place_refs, x_row0, R)
        x_start = x_index if x_row0 is not None else (lambda t: t * R)  # element offsets into x's rows
        extra_refs, (xs_ref, *w_refs, out_ref) = refs[:len(extra)], refs[len(extra):]
        wg = lax.axis_index("wg")
        my_cols = pl.ds(wg * COLS, COLS)

        def mma_step(_, *bufs):
            *w_bufs, xs_s, acc_refs = bufs
            mine = [b.at[my_cols] if j % 2 == 0 else b.at[:, my_cols] for j, b in enumerate(w_bufs)]
            _decode_and_mma(decode, acc_refs, mine, xs_s, kh, config.decode_pieces)
            return acc_refs

        def pipeline(body, compute_context, state):
            weight_specs = [plgpu.BlockSpec((cols, kh), lambda kk: (0, kk)),
                            plgpu.BlockSpec((kh // 16, cols), lambda kk: (kk, 0))]
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=WS_MEMORY_REGISTERS, wg_axis="wg",
                num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=compute_context,
                pipeline_state=state,
                in_specs=weight_specs * n_w + [plgpu.BlockSpec((2, R, kh), lambda kk: (0, 0, kk))])

        def operands(t, nb):
            g = tile_group_ref[t]
            per_weight = [(codes.at[g, pl.ds(nb * cols, cols)], scales.at[g, :, pl.ds(nb * cols, cols)])
                          for codes, scales in zip(w_refs[0::2], w_refs[1::2])]
            return (*[r for pair in per_weight for r in pair], xs_ref.at[:, pl.ds(x_start(t), R)])

        ignore = lambda *_, **__: None  # noqa: E731 — the allocations depend on the specs and shapes only

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore, None).get_allocations(*operands(0, 0)),
                           collective_axes="wg")
        def _scope(allocs):
            @plgpu.nd_loop((num_ref[0] * blocks,), collective_axes="sm")
            def _item(info):
                (i,) = info.index
                t, nb = i // blocks, i % blocks

                def compute_context(eval_pipeline):
                    def acc_scope(*acc_refs):
                        eval_pipeline(acc_refs)
                        return tuple(a[...] for a in acc_refs)

                    accs = pl.run_scoped(acc_scope, *[plgpu.ACC((COLS, R), jnp.float32)] * n_w)
                    g = tile_group_ref[t]
                    out = epilogue(accs, g, *extra_refs)
                    block = nb * wgs + wg  # this warpgroup's 64-column block of the output

                    def store():
                        if place_refs:
                            _store_placed(out, o_smem.at[wg], out_ref, block, t, g, place_refs)
                        else:
                            _store_tile(out, o_smem.at[wg], out_ref, block, t, "planes" if planes else "rows")

                    if ragged:
                        pl.when(block < N // COLS)(store)
                    else:
                        store()

                first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
                state = jnp.where(first, int(PipelinePipeline.START),
                                  jnp.where(last, int(PipelinePipeline.STOP), int(PipelinePipeline.STEADY)))

                @pl.when(first & last)  # the CTA's only item: a pipeline of its own
                def _alone():
                    pipeline(mma_step, compute_context, None)(*operands(t, nb), allocations=allocs)

                @pl.when(jnp.logical_not(first & last))
                def _chained():
                    pipeline(mma_step, compute_context, state)(*operands(t, nb), allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    w_operands = [a for v in weights for a in (v.codes, v.scales_t)]
    with _PoolRegisterSplit():  # the pipeline's setmaxnreg is emitted while the kernel is traced, here
        return plgpu.kernel(
            kernel,
            out_type=jax.ShapeDtypeStruct((2, m_pad, N // 2) if planes else (m_pad if place is None else place[2], N),
                                          out_dtype),
            grid=(num_sms,),
            grid_names=("sm",),
            num_threads=wgs + 1,
            thread_name="wg",
            scratch_types=dict(o_smem=plgpu.SMEM((wgs, R, COLS), out_dtype)),
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        )(tile_group, num_tiles, *place_inputs, *extra, xs, *w_operands)


def _check_same_form(weights) -> None:
    """Fused gate / up read one x tile for both weights and write one h: they need one shape, layout and output
    order."""
    forms = [(v.codes.shape, v.layout, v.out_order) for v in weights]
    if any(f != forms[0] for f in forms):
        raise ValueError(f"mgpu MXFP4: fused gate / up need one shape, layout and output order, got {forms}")


def kernel_call_gated(xs, tile_group, num_tiles, w_gate: PreparedWeight, w_up: PreparedWeight, activation,
                      config: MgpuConfig, gate_scale=None, up_scale=None, out_dtype=jnp.float32, x_row0=None):
    """Gate and up in one kernel (`MgpuConfig.gate_up="fused"`): `prepare_rows`' x planes, two weights of one
    shape, layout and output order -> h `[m_pad, F]` `out_dtype` (fp32 or bf16, rounded to nearest even from the
    fp32 epilogue; out_order="planes": the down matmul's x planes `[2, m_pad, F/2]`) = activation(x·Wgᵀ·sg,
    x·Wuᵀ·su) per padded row of a live tile, with
    `gate_scale` / `up_scale` `[E]` each expert's fp32 output factor (the placed layout's 2^exp_offset) or None.
    `activation(g, u)` runs in the epilogue on the fp32 accumulators (it must lower in Mosaic GPU: elementwise
    arithmetic, tanh, logistic, exp). Each work item (row tile, 64-column block) streams both weights' blocks and
    the x tile once; the two products run one after the other in each pipeline step (`_mma_over_k`). `x_row0`:
    each tile's first x row (`kernel_call`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if config.warpgroups > 1:
        return kernel_call_gated_ws(xs, tile_group, num_tiles, w_gate, w_up, activation, config, gate_scale, up_scale,
                                    out_dtype, x_row0)
    cfg = dataclasses.replace(config, store="rows")
    R, kh = cfg.rows, cfg.kh
    t_max = tile_group.shape[0]
    m_pad = t_max * R
    N = w_gate.out_features
    _check_same_form((w_gate, w_up))
    _check_kernel_shapes(xs, w_gate, cfg, tile_group, x_row0)
    planes = w_gate.out_order == "planes"
    n_blocks = N // COLS
    decode = _bf16_decodes(kh, w_gate.layout)
    scaled = gate_scale is not None

    def body(tile_group_ref, num_ref, *refs, o_smem):
        row0_refs, refs = refs[:len(_row0_inputs(x_row0))], refs[len(_row0_inputs(x_row0)):]
        _, x_rows, x_index = _split_row0(row0_refs, x_row0, R)
        if scaled:
            sg_ref, su_ref, xs_ref, cg_ref, scg_ref, cu_ref, scu_ref, out_ref = refs
        else:
            xs_ref, cg_ref, scg_ref, cu_ref, scu_ref, out_ref = refs

        def item(t, nb, g):
            def acc_scope(acc_g, acc_u):
                _mma_over_k(decode, (acc_g, acc_u), ((cg_ref.at[g], scg_ref.at[g]), (cu_ref.at[g], scu_ref.at[g])),
                            xs_ref, nb, x_rows, x_index(t), cfg)
                return acc_g[...], acc_u[...]

            acc = plgpu.ACC((COLS, R), jnp.float32)
            gate, up = pl.run_scoped(acc_scope, acc, acc)
            if scaled:
                gate, up = gate * sg_ref[g], up * su_ref[g]
            _store_tile(activation(gate, up), o_smem, out_ref, nb, t, "planes" if planes else "rows")

        _for_each_item(t_max, n_blocks, tile_group_ref, num_ref, item)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scales = (gate_scale, up_scale) if scaled else ()
    return _launch(body, N, m_pad, cfg, out_dtype, planes)(tile_group, num_tiles, *_row0_inputs(x_row0), *scales, xs,
                                                           w_gate.codes, w_gate.scales_t, w_up.codes, w_up.scales_t)


def kernel_call_fp8(x_hi, x_lo, tile_group, num_tiles, w: PreparedWeight, config: MgpuConfig):
    """The fp8 path's kernel: `prepare_rows_fp8`' planes and the weight -> outᵀ `[N, m_pad]` fp32, still to be
    multiplied by each row's `inv`. Per step and 32-element group g: acc_g = W_g(e4m3, 2^-6·e2m1) · (x_hi + x_lo)_g
    on fresh accumulators, then out += acc_g · 2^(S_g − 127 + 6) per output column (the scale is per weight row)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m_pad, K = x_hi.shape
    cfg = config
    R, kh = cfg.rows, cfg.kh
    t_max = m_pad // R
    E, N, KH = w.codes.shape
    if w.layout != "natural":
        raise ValueError(f"the fp8 path decodes natural codes: prepare the weight with layout='natural', not "
                         f"{w.layout!r}")
    if 2 * KH != K or KH % kh or kh % 16 or N % COLS or m_pad % R or R % 8:
        raise ValueError(f"mgpu MXFP4 fp8: packed K/2={KH} (x: K={K}) must be a multiple of kh={kh} (a multiple of "
                         f"16), N={N} of {COLS}, padded rows {m_pad} of rows={R} (a multiple of 8)")
    G = mx.GROUP
    ng = kh // (G // 2)
    n_blocks = N // COLS
    k_steps = KH // kh
    decode = plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=tuple(plgpu.ShapeDtypeStruct((COLS, G), jnp.float8_e4m3fn, layout=plgpu.Layout.WGMMA_8BIT)
                          for _ in range(ng)),
    )(_decode_fp8_fn(kh))
    acc_ty = plgpu.ShapeDtypeStruct((COLS, R), jnp.float32, layout=plgpu.Layout.WGMMA)
    fold = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, *[plgpu.Layout.WGMMA] * ng, plgpu.RefType()),
                             return_type=acc_ty)(_fold_fn(ng))
    # 32-byte rows of x per group: the wgmma's K (32 e4m3) must be one swizzle width
    x_transforms = (plgpu.TilingTransform((8, G)), plgpu.SwizzleTransform(G))

    def body(tile_group_ref, num_ref, xh_ref, xl_ref, codes_ref, scales_ref, out_ref, o_smem):
        def item(t, nb, g):
            def step(_, codes_s, scales_s, xh_s, xl_s, out):
                w_groups = decode(codes_s)

                def mma(*acc_refs):
                    for j, acc_ref in enumerate(acc_refs):
                        xk = pl.ds(j * G, G)
                        plgpu.wgmma(acc_ref, w_groups[j], plgpu.transpose_ref(xh_s.at[:, xk], (1, 0)))
                        plgpu.wgmma(acc_ref, w_groups[j], plgpu.transpose_ref(xl_s.at[:, xk], (1, 0)))
                    return [a[...] for a in acc_refs]

                parts = pl.run_scoped(mma, *[plgpu.ACC((COLS, R), jnp.float32) for _ in range(ng)])
                return fold(out, *parts, scales_s)

            zeros = plgpu.layout_cast(jnp.zeros((COLS, R), jnp.float32), plgpu.Layout.WGMMA)
            acc = plgpu.emit_pipeline(
                step,
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((COLS, kh), lambda kk: (nb, kk)),
                    plgpu.BlockSpec((ng, COLS), lambda kk: (kk, nb)),
                    plgpu.BlockSpec((R, 2 * kh), lambda kk: (t, kk), transforms=x_transforms),
                    plgpu.BlockSpec((R, 2 * kh), lambda kk: (t, kk), transforms=x_transforms),
                ],
                max_concurrent_steps=cfg.steps,
                init_carry=zeros,
            )(codes_ref.at[g], scales_ref.at[g], xh_ref, xl_ref)
            _store_tile(acc, o_smem, out_ref, nb, t, cfg.store)

        _for_each_item(t_max, n_blocks, tile_group_ref, num_ref, item)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _launch(body, N, m_pad, cfg)(tile_group, num_tiles, x_hi, x_lo, w.codes, w.scales_t)


def expert_scale(w: PreparedWeight):
    """Each expert's fp32 output factor 2^exp_offset `[E]` for the placed layout (1 for real checkpoints), None for
    the natural layout, which needs none."""
    return jnp.ldexp(jnp.float32(1), w.exp_offset) if w.layout == "placed" else None


def group_bounds(group_sizes, M: int):
    """`group_sizes [E]` -> row bounds `[E + 2]` int32: expert e's rows are [b[e], b[e + 1]) (sizes clipped so that
    every bound lies in [0, M]); the rows [b[E], b[E + 1] = M) past Σ sizes, which the kernel zeroes."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), M)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends, jnp.full((1,), M, jnp.int32)])


def _store_direct_fn():
    """The inline Mosaic GPU body that stores a WGMMA-layout `[64, RX]` fp32 tile straight from registers: element
    (c, r) -> out[base + r, col0 + c] where lo ≤ r < hi, else nothing (a predicated 4-byte global store; a warp's
    store covers 4 rows × 32 contiguous bytes). base, lo, hi and col0 come as int32 splats in the same layout (each
    thread reads its own register: no shared scratch to race on between work items)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, scf, vector
    from jax.experimental.mosaic.gpu import utils as mgu

    def fn(ctx, acc, base_a, lo_a, hi_a, col0_a, out_ref):
        del ctx
        index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
        first = tuple(0 for _ in base_a.registers.shape)

        def scalar(a):
            reg = a.registers[first]
            if isinstance(reg.type, ir.VectorType):
                reg = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
            return reg

        base, lo, hi, col0 = (scalar(a) for a in (base_a, lo_a, hi_a, col0_a))
        base_i, col0_i = arith.index_cast(index, base), arith.index_cast(index, col0)
        regs = acc.registers
        for (c, r), ri in zip(acc.layout.thread_idxs(acc.shape), np.ndindex(regs.shape)):
            reg = regs[ri]  # vector<2xf32>: N-side positions r, r + 1 of M-side position c
            out_c = arith.addi(col0_i, c)
            for k in range(ir.VectorType(reg.type).shape[0]):
                rk = arith.addi(r, mgu.c(k, index))
                rk32 = arith.index_cast(i32, rk)
                ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, rk32, lo),
                                arith.cmpi(arith.CmpIPredicate.slt, rk32, hi))
                v = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([k]))
                if_op = scf.IfOp(ok)
                with ir.InsertionPoint(if_op.then_block):
                    memref.store(v, out_ref, [arith.addi(base_i, rk), out_c])
                    scf.yield_([])

    return fn


def prepare_grouped(x, group_sizes, config: MgpuConfig):
    """XLA side of plan "kernel": `x [M, K]` -> (x planes in the contraction order `[2, max(M, R + 8), K/2]` bf16,
    `group_bounds` `[E + 2]`)."""
    M, R = x.shape[0], config.rows
    x = x.astype(jnp.bfloat16)
    if M < R + ROW_ALIGN:  # one x tile (R + 8 rows) fits the array
        x = jnp.pad(x, ((0, R + ROW_ALIGN - M), (0, 0)))
    return _planes_in_contraction_order(x), group_bounds(group_sizes, M)


def kernel_call_grouped(xs, bounds, w: PreparedWeight, config: MgpuConfig, row_scale=None, *, out_rows=None):
    """The kernel with its group plan inside (`MgpuConfig.plan="kernel"`): x planes `[2, M, K/2]` bf16 in the
    contraction order (`prepare_grouped`, rows as sorted), `group_bounds` `[E + 2]`, the weight, and for the placed
    layout each expert's fp32 output factor `row_scale [E]` (2^exp_offset) -> out `[out_rows, N]` fp32 (default M).

    Work item (expert e, 64-column block nb), looping over e's rows: each tile fetches R + 8 x rows from its first
    row rounded down to a multiple of 8 (TMA into the 8-row-tiled smem operand needs that; the MMA's N side is
    R + 8) and takes as many of the group's rows as they hold (R + 1 … R + 8, so fewer passes over the expert's
    weights than R-row tiles); rows of other groups or past M ride along (TMA reads zeros past M) and are never
    stored. Each thread then stores its own elements of the tile's rows in place (`_store_direct_fn`). Item (E, nb)
    zeroes the rows past Σ sizes. No padding and no gathers outside the kernel; the items are as uneven as the
    groups."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _, M, KH = xs.shape
    cfg = config
    R, kh = cfg.rows, cfg.kh
    E, N, KH2 = w.codes.shape
    RX = R + ROW_ALIGN  # x rows per tile: the MMA's N side
    if R % ROW_ALIGN:
        raise ValueError(f"the in-kernel group plan takes row tiles of a multiple of {ROW_ALIGN} (got rows={R})")
    if KH2 != KH or KH % kh or kh % BLOCK or N % COLS or bounds.shape != (E + 2,):
        raise ValueError(f"mgpu MXFP4: packed K/2={KH2} (x: {KH}) must be a multiple of kh={kh} (a multiple of "
                         f"{BLOCK}), N={N} of {COLS}; bounds {bounds.shape} must be [E + 2 = {E + 2}]")
    n_blocks = N // COLS
    decode = _bf16_decodes(kh, w.layout)
    store = plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 5 + (plgpu.RefType(),))(_store_direct_fn())
    scaled = row_scale is not None

    def splat(v):
        return plgpu.layout_cast(jnp.full((COLS, RX), v, jnp.int32), plgpu.Layout.WGMMA)

    def body(bounds_ref, *refs):
        if scaled:
            scale_ref, xs_ref, codes_ref, scales_ref, out_ref = refs
        else:
            xs_ref, codes_ref, scales_ref, out_ref = refs

        def tile(g, nb, x_row, lo, hi):
            """Group g's (g = E: zeros) tile at column block nb: x rows [x_row, x_row + RX) -> acc row r is out row
            x_row + r, stored where lo ≤ r < hi."""
            def store_tile(acc):  # the splats made here, after the pipeline: not live (registers) across it
                store(acc, splat(x_row), splat(lo), splat(hi), splat(nb * COLS), out_ref)

            @pl.when(g < E)
            def _matmul():
                def acc_scope(acc_ref):
                    _mma_over_k(decode, (acc_ref,), ((codes_ref.at[g], scales_ref.at[g]),), xs_ref, nb,
                                pl.Element(RX), x_row, cfg)
                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((COLS, RX), jnp.float32))
                store_tile(acc * scale_ref[g] if scaled else acc)

            @pl.when(g == E)
            def _zeros():
                store_tile(plgpu.layout_cast(jnp.zeros((COLS, RX), jnp.float32), plgpu.Layout.WGMMA))

        @plgpu.nd_loop(((E + 1) * n_blocks,), collective_axes="sm")
        def _item(info):
            (i,) = info.index
            g = i // n_blocks
            start, end = bounds_ref[g], bounds_ref[g + 1]

            def next_tile(row0):  # a tile takes as many of the group's rows as its R + 8 fetched rows hold
                x_row = jax.lax.div(row0, ROW_ALIGN) * ROW_ALIGN  # a multiple of 8 the lowering can see
                first = row0 - x_row
                hi = jnp.minimum(end - x_row, RX)
                tile(g, i % n_blocks, x_row, first, hi)
                return x_row + hi

            jax.lax.while_loop(lambda row0: row0 < end, next_tile, start)

    args = (bounds, *((row_scale,) if scaled else ()), xs, w.codes, w.scales_t)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((out_rows or M, N), jnp.float32),
        grid=_cta_grid(cfg),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(*args)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype"))
def grouped_matmul(x, w: PreparedWeight, group_sizes, *, config: MgpuConfig | None = None, out_dtype=jnp.float32):
    """`x [M, K]` bf16 rows sorted by group, MXFP4 weight (`prepare_weight`), `group_sizes [E]` -> `[M, N]`:
    x @ W[g]ᵀ per row with fp32 accumulation (the decoded weights are `mxfp4.decode_lo_hi_bf16_ref`'s bits), in
    natural column order whatever the weight's `out_order`. Rows past Σ group_sizes are zeros."""
    if x.shape[1] != w.in_features:
        raise ValueError(f"MXFP4 weight has K={w.in_features}, x has K={x.shape[1]}")
    if w.out_order == "planes":  # the kernel writes the stored column order: put the natural one back
        out = grouped_matmul(x, dataclasses.replace(w, out_order="natural"), group_sizes, config=config,
                             out_dtype=out_dtype)
        return out[:, np.argsort(planes_column_order(w.out_features))]
    config = config or config_for(x.shape[0], w)
    if config.mma == "fp8":
        x_hi, x_lo, inv, tile_group, num_tiles, pad_row, live = prepare_rows_fp8(x, group_sizes, w.num_experts,
                                                                                 config.rows)
        out_t = kernel_call_fp8(x_hi, x_lo, tile_group, num_tiles, w, config)
        return unpad_output(out_t, pad_row, live, out_dtype, row_scale=inv, store=config.store)
    elif config.mma == "bf16" and config.plan == "kernel":
        xs, bounds = prepare_grouped(x, group_sizes, config)
        return kernel_call_grouped(xs, bounds, w, config, expert_scale(w), out_rows=x.shape[0]).astype(out_dtype)
    elif config.mma == "bf16":
        xs, tile_group, num_tiles, pad_row, live = prepare_rows(x, group_sizes, w.num_experts, config.rows)
        out_t = kernel_call(xs, tile_group, num_tiles, w, config)
        row_scale = None
        if w.layout == "placed":  # each padded row's expert's 2^exp_offset (1 for real checkpoints)
            row_scale = jnp.repeat(expert_scale(w)[tile_group], config.rows)
        return unpad_output(out_t, pad_row, live, out_dtype, row_scale=row_scale, store=config.store)
    raise ValueError(f"MgpuConfig.mma must be 'bf16' or 'fp8', got {config.mma!r}")


class TilePlan(NamedTuple):
    """Rows padded per expert to whole tiles of `rows` (`tile_plan`): the layout `expert_ffn_tiled` keeps x, the
    gate / up outputs, h and the down output in, so the padding happens once per FFN instead of around each matmul."""
    src: jax.Array  # [m_pad] int32: the sorted row each padded row holds (M: none, a zero row)
    tile_group: jax.Array  # [t_max] int32: each tile's expert (dead tiles: clamped, never computed)
    num_tiles: jax.Array  # [1] int32: live tiles
    pad_row: jax.Array  # [M] int32: each sorted row's padded row
    live: jax.Array  # [M] bool: rows inside Σ group_sizes


def tile_plan(group_sizes, M: int, num_experts: int, rows: int) -> TilePlan:
    """The padded-row plan of `M` sorted rows over `group_sizes [E]` for `rows`-row tiles (`_pad_plan`)."""
    return TilePlan(*_pad_plan(group_sizes, M, num_experts, rows))


def slot_tile_plan(expert_idx_nk, num_experts: int, rows: int) -> TilePlan:
    """The tile layout of routed (token, slot) pairs planned from the routing itself, `expert_idx_nk [N, k]` int.
    The plan's rows are the pairs in (token, slot) order (row i = pair i: token i // k, slot i % k), not sorted by
    expert: `src [m_pad]` holds each padded row's pair (N·k: none), `pad_row [N·k]` each pair's padded row and
    `live` is all true. Each expert's pairs fill its tiles in pair order, so the padded rows hold exactly what
    `tile_plan` of the sorted pairs puts there (`ops.dispatch_plan`'s stable sort) — without the sorted rows:
    no order scatter, no per-row group search, no index composed for the combine. `expert_ffn_tiled(plan=…)`
    runs the FFN on it and returns the pairs' rows in (token, slot) order, which is what the combine reads."""
    expert = expert_idx_nk.reshape(-1).astype(jnp.int32)
    pairs = expert.shape[0]
    rank, sizes = schedule.expert_ranks(expert, num_experts)
    t_max = -(-pairs // rows) + num_experts
    tile_group, num_tiles, pad_start = _tiles(sizes, num_experts, t_max, rows)
    pad_row = pad_start[expert] + rank
    src = jnp.full((t_max * rows,), pairs, jnp.int32).at[pad_row].set(jnp.arange(pairs, dtype=jnp.int32),
                                                                       unique_indices=True)
    return TilePlan(src, tile_group, num_tiles, pad_row, jnp.ones((pairs,), bool))


def tiled_config(rows_per_group: float, out_features: tuple[int, ...] = ()) -> MgpuConfig:
    """The kernel's config for rows already in the tile layout (the padded plan at every size); `out_features`: the
    FFN's weight widths (F, D), if known — widths the warp-specialised kernel cannot split into 128-column items get
    one warpgroup per CTA. At <= 8 rows per expert on average: 16-row tiles, 256-byte steps, 2 stages, 3 CTAs per
    SM — with a router's group sizes (about 8 ± 3, up to 16) one tile holds every expert's rows, so each expert's
    weights stream once (8-row tiles stream them 1.4 times: 161 tiles for 112 experts). H200, session 18, routed
    sizes, 3584 -> 3072: kernel alone 200 µs (3.27 TB/s, 0.77 of copy), the whole FFN 647 µs (0.72) against 875 with
    8-row tiles and 5 CTAs per SM, 690 with 16-row tiles, 128-byte steps and 4 CTAs; the warp-specialised kernel
    there: 727 against 664 (session 22).

    Above 16 rows the tile is sized to hold most of a router's groups (about 1.25× the mean: 40 rows at 32 ± 6,
    80 at 64 ± 8), so few experts stream their weights twice (session 21: 40-row tiles 305 / 1112 µs kernel alone /
    FFN against 32-row tiles' 335 / 1130; 80-row tiles 500 / 1841 against 64-row tiles' 607–685 / 2073). With one
    warpgroup per CTA those were 0.40 and 0.25 of copy: a CTA waits for its own MMAs each step, and a 64-column block
    re-reads rows × K of x from L2 (rows / 16 times its weight bytes). So these sizes take the warp-specialised
    kernel (two compute warpgroups sharing each x stage, 128-byte steps) with gate, up and SiTU fused into one of
    its kernels (`kernel_call_gated_ws`: gate and up never written). H200, session 22, routed sizes, FFN µs in one
    run each: at 32 rows per expert 969 fused against 1101 separate and 1120 for one warpgroup per CTA (0.47 of
    copy); at 64 rows 1413 fused against 1539 separate (1567, 1583 and 1540 in three runs) and 1817 for one
    warpgroup per CTA (0.32 of copy); session 23 (h written in bf16 by the fused kernel): 986 and 1378 µs.

    Above 64 rows (a prefill's load: 16K routed rows over 112 experts is 146 per expert) the same 80-row fused tiles:
    H200, session 23, FFN 2733 µs against 4015–4072 for `default_config`'s 64-row tiles with one warpgroup per CTA,
    3306 for 128-row tiles with 64-byte steps (separate) and 3213 for those fused with 3 stages — a 128-row tile's
    fp32 accumulators leave too few of the 232 registers for the decode. Other sizes (8 < rows <= 16, or widths the
    warp-specialised kernel cannot split): `default_config`'s padded-plan shapes. Down alone on four compute
    warpgroups (`down_config`, 80 rows, 64-byte steps) measured −2% at 146 rows in one run (2672 / 2685 against
    2729 µs) and ±0 in the next (2782 both), +2% at 32 rows, ±0 at 64 (H200, session 24): not a default.

    At 16 < rows <= 32, when the widths are known and F is whole 192-column items (K3: 3072 = 16 of them), the
    fused gate / up kernel runs on THREE compute warpgroups (152 registers each: 12 compute warps per SM instead of
    8, and each x tile read from L2 serves 192 columns) and down, whose 3584 columns are not whole 192-column
    items, on its own two-warpgroup config (`down_config`). H200, session 26, routed sizes, gate / up in plane order:
    FFN 889 / 896 / 906 µs in three runs against 959 / 963 / 965 for the two-warpgroup default (0.52 of copy
    against 0.49); at 64 rows per expert it gained nothing (1313 against 1311), 32- and 48-row tiles lost."""
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


def _tile_layout_operands(x_pad, w: PreparedWeight, config: MgpuConfig):
    """x planes of padded rows and the kernel's config for weight `w` (rows stored in place, step width fitted).
    `x_pad`: `[m_pad, K]` rows, or already the planes `[2, m_pad, K/2]` (what a fused gate / up kernel with
    out_order="planes" writes), taken as they are."""
    cfg = fit_config(dataclasses.replace(config, store="rows", plan="xla"), w.in_features)
    if x_pad.ndim == 3:
        return x_pad.astype(jnp.bfloat16), cfg
    return _planes_in_contraction_order(x_pad.astype(jnp.bfloat16)), cfg


def tiled_matmul(x_pad, plan: TilePlan, w: PreparedWeight, config: MgpuConfig, out_dtype=jnp.float32, *,
                 x_row0=None, scale_in_kernel: bool = True):
    """One grouped matmul in the tile layout: `x_pad [m_pad, K]` (rows as `plan` pads them; or their planes
    `[2, m_pad, K/2]`) -> `[m_pad, N]` (columns in `w`'s output order), each live tile's rows times its expert's
    weight (placed layout: times 2^exp_offset, in fp32), accumulated in fp32 and written by the kernel in
    `out_dtype` (fp32 or bf16). Rows of dead tiles are left unwritten (never read back). The x plane transpose
    here is elementwise XLA work that fuses into whatever produced x_pad (the dispatch gather, the activation).
    `x_row0 [t_max]` (`MgpuConfig.x_rows="aligned"`, multiples of `ROW_ALIGN`): x is any number of rows and tile t
    reads rows x_row0[t] … x_row0[t] + rows − 1 of it (padded row t·rows + r holds x row x_row0[t] + r).
    `scale_in_kernel`: the placed layout's expert factor applied by the kernel to its fp32 accumulators (default),
    or by an XLA multiply of the output (fp32) that its consumer may fuse (what sessions before 32 ran)."""
    xs, cfg = _tile_layout_operands(x_pad, w, config)
    if scale_in_kernel:
        return kernel_call(xs, plan.tile_group, plan.num_tiles, w, cfg, out_dtype, x_row0=x_row0,
                           scale=expert_scale(w))
    out = kernel_call(xs, plan.tile_group, plan.num_tiles, w, cfg, out_dtype, x_row0=x_row0)
    if w.layout == "placed":
        out = out.astype(jnp.float32) * jnp.repeat(expert_scale(w)[plan.tile_group], cfg.rows)[:, None]
    return out


def tiled_matmul_in_place(x_pad, plan: TilePlan, w: PreparedWeight, config: MgpuConfig, num_rows: int):
    """One grouped matmul from the tile layout back to sorted rows: `x_pad [m_pad, K]` (rows as `plan` pads them)
    -> `[num_rows, N]` fp32, each live tile's valid rows (its expert's rows, times the expert's scale) stored by the
    kernel straight into their sorted rows. Rows past Σ group_sizes are left unwritten (`expert_ffn_tiled` zeroes
    them)."""
    xs, cfg = _tile_layout_operands(x_pad, w, config)
    first_row, valid_rows = tile_rows(plan, cfg.rows, num_rows)
    return kernel_call(xs, plan.tile_group, plan.num_tiles, w, cfg, place=(first_row, valid_rows, num_rows))


def aligned_rows(group_sizes, plan: TilePlan, rows: int, M: int):
    """`MgpuConfig.x_rows="aligned"` for `M` sorted rows -> (the sorted row each aligned row holds `[m8 + rows]`
    int32 (M: none, a zero row) — each group's rows padded to a multiple of `ROW_ALIGN`, then `rows` zero rows;
    the aligned row where each tile of `plan` starts `[t_max]` int32, a multiple of `ROW_ALIGN`). A group's last
    tile reads up to rows − 1 rows past the group: the next group's, or the zero rows; dead tiles start at the
    zero rows."""
    plan8 = tile_plan(group_sizes, M, group_sizes.shape[0], ROW_ALIGN)  # the same plan, in 8-row tiles
    m8 = plan8.src.shape[0]
    src = jnp.concatenate([plan8.src, jnp.full((rows,), M, jnp.int32)])
    # tile t of `plan` starts at sorted row first[t], a multiple of rows into its group; dead tiles (first = M)
    # at the zero rows
    first, _ = tile_rows(plan, rows, M)
    x_row0 = jnp.concatenate([plan8.pad_row, jnp.full((1,), m8, jnp.int32)])[first]
    return src, x_row0


def gather_x(x, src, token_of_row=None):
    """x's rows in a tile layout: `x [M, K]` sorted rows -> `x[src]` `[len(src), K]` bf16 (src = M: a zero row), whose
    planes the kernel's wrapper makes (`_tile_layout_operands`: a transpose XLA fuses into this gather). With
    `token_of_row [M]`, `x [N, K]` is the tokens the sorted rows come from (sorted row i = x[token_of_row[i]]): the
    planes are made on the N tokens (k times fewer rows) and the gather moves contiguous half-rows -> planes
    `[2, len(src), K/2]`, and the sorted rows `[M, K]` are never materialised. H200, session 27, K3's x (3584
    wide), the gather alone in a chain that reads each output back once: 19 / 27 / 53 µs into the padded tile rows
    against 24 / 55 / 76 for the dispatch gather followed by the padding gather (32 / 64 / 146 rows per expert); in
    the whole FFN the two were within the runs' ±20 µs spread (880 / 874, 1285 / 1294, 1274 / 1273 µs)."""
    if token_of_row is None:
        return x.astype(jnp.bfloat16).at[src].get(mode="fill", fill_value=0)
    tok = token_of_row.at[src].get(mode="fill", fill_value=x.shape[0])
    return _planes_in_contraction_order(x.astype(jnp.bfloat16)).at[:, tok].get(mode="fill", fill_value=0)


def tile_rows(plan: TilePlan, rows: int, num_rows: int):
    """Where each tile's rows go back in sorted order: (first sorted row `[t_max]`, valid rows `[t_max]` int32) —
    a tile's padded rows hold consecutive sorted rows of one expert, then padding, so its valid rows are a prefix
    (padded row t·rows + r holds sorted row first + r for r < valid)."""
    src_tiles = plan.src.reshape(-1, rows)
    return src_tiles[:, 0], jnp.sum(src_tiles < num_rows, axis=1, dtype=jnp.int32)


def tiled_gated_matmul(x_pad, plan: TilePlan, w_gate: PreparedWeight, w_up: PreparedWeight, activation,
                       config: MgpuConfig, out_dtype=jnp.float32, *, x_row0=None):
    """Gate, up and the activation in the tile layout, one kernel (`kernel_call_gated`): `x_pad [m_pad, K]` ->
    h `[m_pad, F]` in `out_dtype` (fp32 or bf16; rows of dead tiles unwritten) — for weights with
    out_order="planes", h as the down matmul's x planes `[2, m_pad, F/2]`. `x_row0`: as in `tiled_matmul`."""
    xs, cfg = _tile_layout_operands(x_pad, w_gate, config)
    return kernel_call_gated(xs, plan.tile_group, plan.num_tiles, w_gate, w_up, activation, cfg, expert_scale(w_gate),
                             expert_scale(w_up), out_dtype, x_row0=x_row0)


def expert_ffn_tiled(x_rows, group_sizes, w_gate: PreparedWeight, w_up: PreparedWeight, w_down: PreparedWeight,
                     activation, *, h_dtype=jnp.bfloat16, config: MgpuConfig | None = None, matmul=None,
                     gated_matmul=None, gate_up_dtype=jnp.float32, down_matmul=None, token_of_row=None,
                     out_rows=None, plan: TilePlan | None = None):
    """The expert FFN on rows sorted by expert, `down(act(gate x, up x))` -> `[M, D]` fp32, with all three matmuls
    in one tile layout: x is gathered into padded rows once (`tile_plan`), gate and up write `[m_pad, F]`, the
    activation runs on those rows, down reads them as they are, and one gather brings the rows back — instead of a
    pad gather and an unpad gather around each of the three matmuls (`grouped_matmul`). Rows past Σ group_sizes
    are zeros. Padded rows carry zeros (or, in dead tiles, whatever memory held); each output row depends only on
    its own input row, so none of that reaches a real row.

    `token_of_row [M]`: x_rows is then the `[N, K]` tokens the sorted rows come from (sorted row i =
    x_rows[token_of_row[i]]), and x's planes are made on them before the gather (`gather_x`).
    `out_rows [R]` int32: the result is those sorted rows, in that order (`y[out_rows]` `[R, D]`), gathered from the
    padded rows in one step (`ops.expert_ffn` asks for (token, slot) order, so its combine gathers nothing).

    `config`: the kernel's tile shape and the FFN's plumbing (default `tiled_config(M / E, (F, D))`;
    `gate_up="fused"` runs gate, up and the activation as one kernel; `down_rows="in_place"` has down store its
    rows where they belong instead of a gather back; `x_rows="aligned"` gathers x into groups padded to 8 rows
    instead of the padded tile rows); `matmul` / `gated_matmul` / `down_matmul`: the tile-layout
    matmul, fused gate / up and in-place down (default `tiled_matmul` / `tiled_gated_matmul` /
    `tiled_matmul_in_place`, the Mosaic GPU kernels; tests pass reference ones to check the plumbing on CPU).
    `plan`: a tile plan made elsewhere (`slot_tile_plan`: the rows are routed pairs in (token, slot) order, each
    row's token in `token_of_row`); `group_sizes` is then unused and `config.rows` must be the plan's tile rows.
    `gate_up_dtype`: what the separate gate and up kernels write for the activation to read (fp32 accumulation
    either way). bf16 halves those two arrays' traffic ([m_pad, F] each, written by the kernel and read by the
    activation's XLA fusion) but rounds each product before the activation: on the H200 (session 20, 8 rows per
    expert) the FFN took 663 µs against 670 with fp32, inside the runs' spread (its error against the reference FFN
    1.8e-3; session 18 measured 1.7–2.5e-4 with fp32), so fp32 stays the default."""
    M = x_rows.shape[0] if token_of_row is None else token_of_row.shape[0]
    E = w_gate.num_experts
    if w_up.out_order != w_gate.out_order or w_down.out_order != "natural":
        raise ValueError("expert_ffn_tiled: gate and up need one output order and down the natural one "
                         f"(`prepare_ffn_weights`), got {w_gate.out_order}, {w_up.out_order}, {w_down.out_order}")
    cfg = config or tiled_config(M / E, (w_gate.out_features, w_down.out_features))
    matmul = matmul or tiled_matmul
    gated_matmul = gated_matmul or tiled_gated_matmul
    given_plan = plan is not None
    if not given_plan:
        plan = tile_plan(group_sizes, M, E, cfg.rows)
    elif plan.tile_group.shape[0] * cfg.rows != plan.src.shape[0] or plan.pad_row.shape[0] != M:
        raise ValueError(f"expert_ffn_tiled: a plan of {plan.tile_group.shape[0]} tiles, {plan.src.shape[0]} padded "
                         f"rows for {plan.pad_row.shape[0]} rows does not fit {cfg.rows}-row tiles over {M} rows")
    elif cfg.x_rows == "aligned" or cfg.down_rows == "in_place":
        raise ValueError("expert_ffn_tiled: a plan given from outside runs padded x rows and down gathered back "
                         "(x_rows='padded', down_rows='gather'); both others need rows sorted by expert")
    src, x_row0 = aligned_rows(group_sizes, plan, cfg.rows, M) if cfg.x_rows == "aligned" else (plan.src, None)
    x_in = gather_x(x_rows, src, token_of_row)
    if cfg.gate_up == "fused":
        # the kernel rounds h to h_dtype itself (as XLA's convert would: to nearest even), so h is written and
        # read back at half the bytes of fp32; with out_order="planes" it writes down's x planes
        written = h_dtype if jnp.dtype(h_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) else jnp.float32
        h = gated_matmul(x_in, plan, w_gate, w_up, activation, cfg, out_dtype=written, x_row0=x_row0).astype(h_dtype)
    else:
        gate, up = (matmul(x_in, plan, w, cfg, gate_up_dtype, x_row0=x_row0).astype(jnp.float32)
                    for w in (w_gate, w_up))
        h = activation(gate, up).astype(h_dtype)
        if w_gate.out_order == "planes":  # columns in plane order: the planes are whole 64-column blocks of h
            h = columns_as_planes(h)
    down_cfg = cfg.down_config or cfg
    if cfg.down_rows == "in_place":  # down stores each row where it belongs; `down_matmul`: tests' stand-in
        y = (down_matmul or tiled_matmul_in_place)(h, plan, w_down, down_cfg, M)
        # rows past Σ group_sizes are in no tile: zeroed by a scatter that writes those rows only (the live rows'
        # indices are out of bounds and dropped)
        y = y.at[jnp.where(plan.live, M, jnp.arange(M))].set(0.0, mode="drop")
        return y if out_rows is None else y[out_rows]
    y_pad = matmul(h, plan, w_down, down_cfg)
    pad_row, live = plan.pad_row, plan.live
    if given_plan and out_rows is None:
        # materialised for the reason given below: the gather back (fused into the combine) reads each row's index
        # directly instead of recomputing it from the expert ranks inside its reduction
        pad_row = jax.lax.optimization_barrier(pad_row)
    if out_rows is not None:  # the rows asked for, straight from their padded rows
        # composed and materialised here (the barrier): left to XLA, the index chain out_rows -> pad_row / live
        # fuses into the consumer (the combine's reduction), which then waits on three dependent loads per row
        # (H200, session 31: 106 µs for that reduction at 32 rows per expert)
        pad_row, live = jax.lax.optimization_barrier((pad_row[out_rows], live[out_rows]))
    return jnp.where(live[:, None], y_pad[pad_row], 0.0)


def unpad_output(out_t, pad_row, live, out_dtype, row_scale=None, *, store: str):
    """The kernel's outᵀ `[N, m_pad]` fp32 (`store="rows"`: out `[m_pad, N]`) -> `[M, N]` `out_dtype`: each input
    row's padded row (`pad_row [M]`), times `row_scale[padded row]` if given (the fp8 path's 1/row scale, the placed
    layout's 2^exp_offset), zeros where `live [M]` is false."""
    out = out_t[pad_row] if store == "rows" else out_t[:, pad_row].T
    if row_scale is not None:
        out = out * row_scale[pad_row][:, None]
    return jnp.where(live[:, None], out, 0).astype(out_dtype)
