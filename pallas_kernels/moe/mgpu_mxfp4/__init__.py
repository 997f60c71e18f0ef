"""Mosaic GPU MXFP4 kernels for the MoE experts (Hopper, GPU only), one module per job:

config   `MgpuConfig`, `default_config`, `tiled_config`: tile shapes and the configs the shipped paths select
layout   `PreparedWeight`, `prepare_weight`: the weights' kernel layout (codes, transposed scales, bit placement)
rows     `tile_plan`, `slot_tile_plan`, `prepare_rows`: rows padded per expert to whole tiles (XLA side)
decode   the inline e2m1 decode into the wgmma A operand
kernels  `kernel_call` (one warpgroup per CTA), `kernel_call_ws` / `kernel_call_gated_ws` (warp-specialised)
grouped  `grouped_matmul`: rows sorted by expert -> `[M, N]` (the entry `moe.ops` calls)
ffn      `expert_ffn_tiled`: gate, up, activation and down in one tile layout

Every name stays importable from here (`pallas_kernels.moe.mgpu_mxfp4.NAME`). The fp8-MMA variant lives in
`pallas_kernels.experimental.mxfp4_fp8_mma`.
"""

from .config import (  # noqa: F401
    BLOCK, COLS, MgpuConfig, ROW_ALIGN, SMEM_BYTES, WS_MEMORY_REGISTERS, WS_WARPGROUPS, default_config, fit_config,
    supports, tiled_config, ws_compute_registers, ws_stages, _PoolRegisterSplit
)
from .layout import (  # noqa: F401
    LAYOUTS, OUT_ORDERS, PLACED_MAX_SCALE, PreparedWeight, columns_as_planes, config_for, expert_scale,
    ffn_out_orders, planes_column_order, prepare_ffn_weights, prepare_weight, unprepare_weight, x_permutation,
    _fragment_slots, _planes_in_contraction_order
)
from .rows import (  # noqa: F401
    TilePlan, gather_x, group_bounds, prepare_rows, slot_tile_plan, tile_plan, unpad_output, _group_of, _pad_plan,
    _pad_rows, _tiles
)
from .decode import (  # noqa: F401
    _bf16_decode, _decode_fn
)
from .kernels import (  # noqa: F401
    kernel_call, kernel_call_gated_ws, kernel_call_ws, _check_kernel_shapes, _check_same_form,
    _cta_grid, _decode_and_mma, _for_each_item, _launch, _mma_over_k, _store_tile, _store_transposed_fn, _ws_call
)
from .grouped import (  # noqa: F401
    grouped_matmul, kernel_call_grouped, prepare_grouped, _store_direct_fn
)
from .ffn import (  # noqa: F401
    expert_ffn_tiled, tiled_gated_matmul, tiled_matmul, _tile_layout_operands
)
