"""Weight layout of the Mosaic GPU MXFP4 kernels: `PreparedWeight` (codes `[E, N, K/2]` uint8, scales transposed
`[E, K/32, N]`), made once per weight by `prepare_weight` and undone by `unprepare_weight`.

The contraction order is chosen so that loads are trivial: for each 64-byte block of a packed weight row, thread q
of a quad loads bytes [16q, 16q + 16) (one 32-element group, one E8M0 scale), and word s of them becomes logical
k slab s (bytes t = 0..3 are logical columns 16s + (2q, 2q+1, 2q+8, 2q+9)[t]). x's even / odd element planes are
permuted the same way (`x_permutation`, `_planes_in_contraction_order`), so the products are unchanged.
`layout="placed"` permutes each word's bits for the table-free decode (`mxfp4.DECODE_PTX_PLACED`);
`out_order="planes"` stores gate / up columns so that h comes out as the down matmul's x planes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.moe.mxfp4 as mx  # not `from . import`: see moe/ops.py
from .config import BLOCK, COLS, MgpuConfig, default_config, fit_config


LAYOUTS = ("natural", "placed")
OUT_ORDERS = ("natural", "planes")


@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """MXFP4 weight in the kernel's layout: codes `[E, N, K/2]` uint8, scales transposed `[E, K/32, N]`.

    `layout` "natural": codes as stored, decoded through the byte-permute table (`mxfp4.DECODE_PTX_SIGN_OPERANDS`).
    "placed": each 32-bit word's bits permuted (`mxfp4.place_codes`) for the table-free decode
    (`mxfp4.DECODE_PTX_PLACED`, 15 instead of 20 instructions per 8 weights); its multiplier 2^(S−1) must fit
    bf16, so an expert whose largest scale code exceeds 128 has all its codes lowered by their excess o[e] and its
    output multiplied back by `out_scale[e]` = 2^o[e] in fp32 (kept as that factor, so a step feeds it to the
    kernels as it is rather than computing it in a kernel of its own per weight and layer). Real checkpoints
    have o = 0, a factor of 1.

    `out_order` "natural": output column n is the checkpoint's column n. "planes" (an FFN's gate and up,
    `prepare_ffn_weights`): the output columns are stored permuted by `planes_column_order(N)`, so the kernel's
    64-column blocks of h are, as they are, 64-column blocks of the down matmul's x planes
    (`_planes_in_contraction_order`) — the fused gate / up kernel writes those planes itself and h needs no
    transpose between the two kernels."""
    codes: jax.Array
    scales_t: jax.Array
    out_scale: jax.Array | None = None  # [E] float32, powers of two, "placed" only
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


jax.tree_util.register_dataclass(PreparedWeight, data_fields=["codes", "scales_t", "out_scale"],
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
    return PreparedWeight(mx.place_codes(packed), lowered, jnp.ldexp(jnp.float32(1), offset), layout="placed",
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
        offset = jnp.frexp(p.out_scale)[1] - 1  # 2^o = 0.5 · 2^(o+1), exactly
        s = jnp.where(s32 == 0, 0, s32 + offset[:, None, None]).astype(jnp.uint8)
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


def config_for(rows: int, w: PreparedWeight) -> MgpuConfig:
    """The config `grouped_matmul` uses when given none: `default_config` for `rows` rows over the weight's
    experts, its step width fitted to the weight (`fit_config`)."""
    return fit_config(default_config(rows / w.num_experts), w.in_features)


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


def _planes_in_contraction_order(x_rows):
    """`[m, K]` -> the even / odd element planes in the kernel's contraction order `[2, m, K/2]`: plane e, column L
    holds x[:, 2·perm[L] + e] (`x_permutation`). perm is a digit permutation — within each 64-byte block the
    physical byte 16q + 4s + 2t₁ + t₀ is logical column 16s + 8t₁ + 2q + t₀ — so this is a reshape and a transpose
    (one fused copy), not an element gather (whose index array is 16 bytes per element of x)."""
    m, K = x_rows.shape
    # x column 2·P + e with P = 64·b + 16q + 4s + 2t₁ + t₀
    x7 = x_rows.reshape(m, K // (2 * BLOCK), 4, 4, 2, 2, 2)  # [m, b, q, s, t1, t0, e]
    return x7.transpose(6, 0, 1, 3, 4, 2, 5).reshape(2, m, K // 2)  # [e, m, b, s, t1, q, t0]


def expert_scale(w: PreparedWeight):
    """Each expert's fp32 output factor `[E]` for the placed layout (`PreparedWeight.out_scale`: 1 for real
    checkpoints), None for the natural layout, which needs none."""
    return w.out_scale if w.layout == "placed" else None
