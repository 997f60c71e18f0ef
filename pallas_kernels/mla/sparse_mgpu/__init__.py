"""Sparse MLA decode on Hopper in Pallas Mosaic GPU: fp8 latent rows, wgmma, one gathered load feeding both dots.

`decode(q, pool, slots, ...)`: q `[B, H, R + rope]`, a paged fp8 latent pool of c-byte rows, top-k slots `[B, k]`
-> o `[B, H, R]` (f32) and, unmerged, per-split lse. One CTA (`warpgroups` warpgroups) takes one sequence and one of
`splits` slices of its slots: it translates them to pool rows once, then per block of 64 keys gathers the rows
into a shared-memory stage (`stages` in flight), computes Sᵀ = rows · qᵀ on wgmma (keys as the M side), a softmax
over the block in fp32, and outᵀ += Vᵀ · Pᵀ (latent dims as the M side) from the same shared-memory bytes.
Partial (o, lse) per split are merged exactly in the kernel (`merge="last"`) or by `sparse_gpu_triton.merge_splits`.
Precision is the storage formats' (`precision="storage"`): q and P in f16, fp32 accumulation and softmax.
Reached through `sparse.sparse_mla(..., backend="gpu")`; GPU only (the body lowers on CPU in the tests).

One module per job: config (`MgpuSparseConfig`, operand orders), prep (q and slots, XLA side), gather (slots
-> rows, copies, barriers), operands (wgmma A operands from the fp8 rows), softmax (softmax, finish, merges), kernel
(`kernel_call`, `decode`, `merge`). Every name stays importable from here; the trace readers are in bench/mla_trace.py.
"""

from .config import (  # noqa: F401
    CHUNK, HEADS, KAPPA, KEYS, LN2, LOG2E, MgpuSparseConfig, P_SCALE, pv_key_of, q_column_of, row_stride, supports,
    value_dim_of_row, _q_lane_part
)
from .prep import (  # noqa: F401
    fp8_q_permutation, prepare_q, prepare_q_fp8, prepare_slots, _q_fp8_transforms, _q_transforms
)
from .gather import (  # noqa: F401
    issue_fn, _arrive_once, _asm, _copy_types, _init_barriers_fn, _issue_fn, _issue_lsu_fn, _kappa, _key_of, _mlir,
    _scalar, _stamp_fn, _thread_in_cta, _thread_in_wg, _translate_fn, _wait_fn
)
from .operands import (  # noqa: F401
    _PAIR_CVT, _SPLIT_E4M3, _TRANSPOSE4, _first_dim, _logits_operand_fn, _logits_operand_fp8_fn, _logits_words,
    _operand_types, _row_load, _store_p_fp8_fn, _value_operand_fn, _value_operand_fp8_fn, _value_slots
)
from .softmax import (  # noqa: F401
    _approx, _combine_fn, _finish_fn, _init_stats_fn, _last_merge_fn, _merge_coefs, _prep_q_fn, _softmax_fn,
    _warpgroup_reduce
)
from .kernel import (  # noqa: F401
    decode, kernel_call, merge
)
