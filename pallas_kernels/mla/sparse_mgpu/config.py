"""Configuration and layout contracts of the Mosaic GPU sparse MLA decode kernel: `MgpuSparseConfig` (frozen
data), `supports`, and the fixed operand orders (`KAPPA`, `value_dim_of_row`, `pv_key_of`, `q_column_of`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


KEYS = 64  # keys per block: the M side of the logits wgmma
HEADS = 16  # heads per CTA (the N side), zero-padded
CHUNK = 64  # latent columns per 16-byte load of a thread quad (4 threads x 16 bytes)


# key order inside each group of 8 (fragment row / column position g -> key 8·(g // 8) + KAPPA[g % 8]) and the
# shared-memory row stride c + 32: with both, every 16-byte load of either operand is free of bank conflicts (found by
# search; the plain order and stride c gave the PV loads 4-way conflicts)
KAPPA = (0, 2, 1, 3, 6, 4, 7, 5)  # bits: k0 = g1, k1 = g0 ^ g2, k2 = g2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class MgpuSparseConfig:
    """The kernel's shape and variants (frozen data). Defaults: the fastest measured at B = 32, H = 12, 32K on an
    H200 — 2 warpgroups × 4 splits, q prepared and the splits merged in the kernel (the whole op in one launch),
    wgmmas waited for chunk by chunk (docs/performance.md, `python3 bench/presets.py sparse-mla`)."""
    splits: int = 4  # CTAs per sequence, each over k / splits slots (a multiple of 64)
    stages: int = 2  # gathered blocks in flight per warpgroup (64 rows · (c + 32) B: 38 KB each at K3)
    logits_chunk: int = 192  # latent columns converted per logits wgmma call (a multiple of 64 dividing c)
    value_keys: int = 32  # keys converted per PV wgmma call (16, 32 or 64)
    # independent logits accumulators (the chunks dealt round-robin, summed after): one accumulator makes the
    # block's c/16 wgmmas one dependent chain on the tensor core (36 at K3)
    logits_accs: int = 1
    # warpgroups per CTA, each walking every warpgroups-th block of the CTA's split with its own stages, softmax and
    # accumulator, combined in shared memory at the end (`_combine_fn`). 2: 255 registers, ≈ 184 KB, one CTA of 8
    # warps per SM, 128 CTAs at B = 32 (one wave); 4 caps ptxas at 128 registers (16 warps per SM) but was slower
    # (34.9 µs with one stage)
    warpgroups: int = 2
    # how the splits' partials meet: "kernel" — written to gmem and merged by `sparse_gpu_triton.merge_splits` (a
    # second launch); "last" — the same partials, merged in this kernel by the sequence's last CTA to finish (a
    # global atomic counter per sequence, `_last_merge_fn`; the partials come back from L2), which writes the final
    # o `[B, H, R]` itself: one launch fewer (faster with prep="kernel")
    merge: str = "last"
    # where q is prepared (scaled, normalised per head by a power of two, permuted into the contraction order, f16):
    # "xla" — `prepare_q`, a separate XLA op; "kernel" — each CTA from the raw q row of its sequence (`_prep_q_fn`,
    # the same bits), so with merge="last" the whole op is one launch
    prep: str = "kernel"
    # the logits' tensor-core type: "f16" — each stored e4m3 byte converted into the A registers (`cvt`), q in f16;
    # "fp8" — the stored bytes ARE the A registers (no conversion), q as two e4m3 planes (hi + lo ≈ 8 significant
    # bits, `moe.mxfp4.split_e4m3_planes`), two e4m3 wgmmas per 32 columns (`prepare_q_fp8`; prep="xla" only).
    # Slower as a whole op (the q planes are XLA work); not a default
    logits_mma: str = "f16"
    # the PV product's tensor-core type: "f16" — key pairs `prmt`ed and converted into f16 A registers, P in f16;
    # "fp8" — 4×4 byte transposes (8 `prmt` per 16 bytes, no conversion) make e4m3 A registers of 4 keys per dim,
    # P · 2^8 as two e4m3 planes in shared memory (`_store_p_fp8_fn`), two wgmmas per 32 keys (value_keys ignored).
    # No gain measured over fp8 logits alone; not a default
    value_mma: str = "f16"
    # how a block's 64 rows reach shared memory: "tma" — one `cp.async.bulk` per 576-byte row by threads 0..63;
    # "lsu" — all 128 threads copy 16-byte `cp.async` chunks (coalesced 512 B per warp). Gather alone (no maths,
    # bench/mla_gather_probe.py): lsu is the faster gather alone, tma the faster inside the kernel
    gather: str = "tma"
    # when a warpgroup waits for its wgmmas: "block" — once after the block's logits and once after its PV product,
    # so every chunk's A operand stays live until then (255 registers and spills); "chunk" — after each logits
    # chunk and each PV call, so one chunk's A is live at a time (220 registers, no spills; faster)
    mma_wait: str = "chunk"

    def __post_init__(self):
        if self.gather not in ("tma", "lsu"):
            raise ValueError(f"gather must be 'tma' or 'lsu', not {self.gather!r}")
        if self.mma_wait not in ("block", "chunk"):
            raise ValueError(f"mma_wait must be 'block' or 'chunk', not {self.mma_wait!r}")


def supports(fmt, config: MgpuSparseConfig | None = None) -> bool:
    """fp8 rows whose latent width R is 128, 256 or 512 and whose row width c = R + rope is 64 more than a multiple
    of 128 (K3: 576; the conflict-free shared-memory stride `row_stride` assumes it); with a `config`, also that
    config's shape rules (merge="last" needs the CTA's 128 · warpgroups threads to divide R)."""
    R, rope = getattr(fmt, "latent", 0), getattr(fmt, "rope", 0)
    ok = getattr(fmt, "kv_dtype", None) == "fp8" and R in (128, 256, 512) and (R + rope) % 128 == 64
    if ok and config is not None and config.merge == "last":
        ok = R % (128 * config.warpgroups) == 0
    return ok


def row_stride(c: int) -> int:
    """Bytes between gathered rows in shared memory (c + 32, see KAPPA)."""
    return c + 32


def value_dim_of_row(R: int) -> np.ndarray:
    """dims `[R]`: row r of the kernel's outᵀ holds latent dim dims[r] (module docstring, PV order)."""
    T = R // 64
    r = np.arange(R)
    i, w, h, g = r // 64, (r % 64) // 16, (r % 16) // 8, r % 8
    return (2 * T * (8 * w + g) + 2 * i + h).astype(np.int32)


def q_column_of(i: int, lane):
    """In-kernel q preparation: lane `lane` of a warp reads q's physical column 32·i + lane and writes it to this
    column of the kernel's contraction order (the inverse of `x_permutation`): 64·(i // 2) + 4·(i % 2) plus a
    lane-only part. Works on ints and numpy arrays (tests); `_prep_q_fn` builds the same sum in MLIR."""
    return 64 * (i // 2) + 4 * (i % 2) + _q_lane_part(lane)


def _q_lane_part(lane):
    """The lane-only part of `q_column_of`: with quad q = lane // 16, s = (lane // 4) % 4, t = lane % 4 of the
    physical column 16q + 4s + t of a 64-column block, the logical column is 16s + 2q + (t & 1) + 8 (t >> 1)."""
    return 16 * ((lane // 4) % 4) + 2 * (lane // 16) + (lane % 2) + 8 * ((lane % 4) // 2)


P_SCALE = 256.0  # fp8 PV: P · 2^8 in the e4m3 planes (probabilities down to 2^-17 survive), o · 2^-8 at the end


def pv_key_of(p):
    """fp8 PV: contraction position p (0..63) -> key: inside each 16, (4a + b) -> 4b + a (an involution). Thread q
    of a quad then loads keys 4e + q for its 4 positions 4q + e: the 8 lanes of a load phase hit 8 bank groups."""
    return (p // 16) * 16 + 4 * (p % 4) + (p % 16) // 4
