"""Conversion entries: how one checkpoint tensor (or one stack of per-expert tensors) becomes kimi_jax arrays.

An `Entry` names its Hugging Face source (`src`, a tensor name; for experts a pattern with `{e}`), the kimi_jax
parameter path(s) it produces (`targets`) and a `kind`, the layout change between the two:

| kind     | HF layout                     | kimi_jax layout                                   |
|----------|-------------------------------|---------------------------------------------------|
| copy     | any                           | same                                              |
| linear   | `[out, in]`                   | `[in, out]`                                       |
| conv     | `[P, 1, K]`                   | `[K, P]`                                          |
| reshape  | one of `allowed_shapes`       | the parameter's shape (e.g. AttnRes proj `[1, D]` -> `[D]`) |
| a_log    | `[H]`, `[1,1,H,1]` or zero-padded `[N]` | `[H]` (padding must be zero; N = the config's A_log size) |
| kv_b     | `[H*(nope+v), R]`             | `k_up_proj [R, H, nope]`, `v_up_proj [R, H, v]`   |
| experts  | E x `[out, in]`               | `[E, in, out]` (stacked)                          |
| extra    | any (vision tower, MTP layer) | carried through untouched under `extra.<name>`    |

Quantised sources (detected from the tensors present, not from `quantization_config`):
* `fp8`:   `X.weight` float8 + `X.weight_scale_inv` (block 128x128). Kinds linear, kv_b, experts.
* `mxfp4`: `X.weight_packed` + `X.weight_scale` instead of `X.weight`. Kind experts.
When kept quantised they are stored in the HF layout (`[out, in]`, stacked to `[E, out, in]` for experts) as
`<qbase>_fp8` + `<qbase>_scale_inv` or `<qbase>_packed` + `<qbase>_scale`; `qbase` is the parameter path
(e.g. `layers.3.block_sparse_moe.experts.gate`), or `layers.L.self_attn.kv_b_proj` for the fused kv_b.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from pallas_kernels import codec

from .errors import ConvertError
from .safetensors_io import DTYPES, SourceSet, dtype_name, read_array, row_blocks

FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_INV_DTYPES = ("F32", "BF16")
E8M0_DTYPES = ("U8", "F8_E8M0")
QUANT_SUFFIXES = {"fp8": ("", "_scale_inv"), "mxfp4": ("_packed", "_scale")}
STORED_SUFFIXES = {"fp8": ("_fp8", "_scale_inv"), "mxfp4": ("_packed", "_scale")}


@dataclass
class Entry:
    kind: str
    src: str
    targets: tuple
    qbase: str = ""
    num: int = 0  # number of experts (kind "experts")
    allowed_shapes: tuple = ()  # kinds reshape / a_log
    quantizable: bool = False  # `--dtype fp8` may requantise it
    # filled in by `resolve`
    form: str = "plain"
    src_shape: tuple = ()
    src_dtype: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.qbase:
            self.qbase = self.targets[0]

    def src_name(self, e: Optional[int] = None) -> str:
        return self.src.format(e=e) if self.kind == "experts" else self.src

    def all_src_names(self, form: Optional[str] = None) -> list[str]:
        form = form or self.form
        suffixes = QUANT_SUFFIXES.get(form, ("",))
        idx = range(self.num) if self.kind == "experts" else [None]
        return [self.src_name(e) + s for e in idx for s in suffixes]

    def stored_quant_names(self) -> tuple:
        return tuple(self.qbase + s for s in STORED_SUFFIXES[self.form])


# ---------------------------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------------------------

def expected_src_shapes(entry: Entry, tshapes: list) -> list:
    """Accepted HF shapes of the (per-expert) source weight, given the parameter shapes."""
    k = entry.kind
    t = tshapes[0] if tshapes else None
    if k == "copy":
        return [tuple(t)]
    if k == "linear":
        return [(t[1], t[0])]
    if k == "conv":
        return [(t[1], 1, t[0])]
    if k in ("reshape", "a_log"):
        return [tuple(s) for s in entry.allowed_shapes] or [tuple(t)]
    if k == "kv_b":
        (R, H, n), (_, _, v) = tshapes
        return [(H * (n + v), R)]
    if k == "experts":
        if t[0] != entry.num:
            raise ConvertError(f"internal: {entry.src} has {entry.num} experts, the parameter {t}")
        return [(t[2], t[1])]
    raise ConvertError(f"internal: unknown entry kind {k!r}")


def _fmt(shape) -> str:
    return str(list(shape))


def _check(name, info, dtypes, shapes):
    if info.dtype not in dtypes:
        raise ConvertError(f"dtype mismatch for {name}: expected {' or '.join(dtypes)}, found {info.dtype}")
    if shapes is not None and tuple(info.shape) not in [tuple(s) for s in shapes]:
        exp = " or ".join(_fmt(s) for s in shapes)
        raise ConvertError(f"shape mismatch for {name}: expected {exp}, found {_fmt(info.shape)}")


def resolve(entry: Entry, sources: SourceSet, tshapes: list, fp8_block=codec.FP8_BLOCK) -> list[str]:
    """Detect the entry's form and check every source tensor's shape and dtype. Returns the missing names."""
    if entry.kind == "extra":
        info = sources.info(entry.src)
        entry.src_shape, entry.src_dtype = tuple(info.shape), info.dtype
        return []
    first = entry.src_name(0)
    if first in sources:
        entry.form = "fp8" if first + "_scale_inv" in sources else "plain"
    elif first + "_packed" in sources or first + "_scale" in sources:
        entry.form = "mxfp4"
    else:
        entry.form = "plain"
    missing = [n for n in entry.all_src_names() if n not in sources]
    if missing:
        return missing
    if entry.form != "plain" and entry.kind not in ("linear", "kv_b", "experts"):
        raise ConvertError(f"{first} is quantised ({entry.form}), which is not supported for a {entry.kind} tensor")
    if entry.form == "mxfp4" and entry.kind != "experts":
        raise ConvertError(f"{first} is MXFP4-packed; only routed experts may be")
    shapes = expected_src_shapes(entry, tshapes)
    idx = range(entry.num) if entry.kind == "experts" else [None]
    for e in idx:
        name = entry.src_name(e)
        if entry.form == "plain":
            found = sources.info(name).dtype
            if found in FP8_DTYPES and name + "_scale_inv" not in sources:
                raise ConvertError(f"dtype mismatch for {name}: expected {' or '.join(FLOAT_DTYPES)}, found {found}, "
                                   f"and an FP8 weight needs its {name}_scale_inv, which is missing")
            _check(name, sources.info(name), FLOAT_DTYPES, shapes)
        elif entry.form == "fp8":
            _check(name, sources.info(name), FP8_DTYPES, shapes)
            _check(name + "_scale_inv", sources.info(name + "_scale_inv"), SCALE_INV_DTYPES,
                   [codec.fp8_block_scale_shape(shapes[0], fp8_block)])
        else:
            out, inn = shapes[0]
            if inn % codec.MXFP4_GROUP:
                raise ConvertError(f"{name}: input dim {inn} is not a multiple of the MXFP4 group "
                                   f"{codec.MXFP4_GROUP}")
            _check(name + "_packed", sources.info(name + "_packed"), ("U8",), [(out, inn // 2)])
            _check(name + "_scale", sources.info(name + "_scale"), E8M0_DTYPES, [(out, inn // codec.MXFP4_GROUP)])
    if entry.kind == "experts":  # stacked into one array each: a different dtype would be cast by value
        for s in QUANT_SUFFIXES.get(entry.form, ("",)):
            want = sources.info(entry.src_name(0) + s).dtype
            for e in range(1, entry.num):
                found = sources.info(entry.src_name(e) + s).dtype
                if found != want:
                    raise ConvertError(f"dtype mismatch for {entry.src_name(e) + s}: expected {want} like expert 0 "
                                       f"({entry.src_name(0) + s}), found {found}; experts are stacked, so all must "
                                       "share one dtype")
    main = first + ("_packed" if entry.form == "mxfp4" else "")
    entry.src_dtype = sources.info(main).dtype
    entry.src_shape = tuple(shapes[0]) if entry.form == "mxfp4" else tuple(sources.info(first).shape)
    if entry.kind == "a_log":
        _check_a_log_padding(entry, sources, tshapes[0][0])
    return []


def _check_a_log_padding(entry, sources, H):
    if entry.src_shape == (H,) or len(entry.src_shape) != 1:
        return
    a = read_array(sources.info(entry.src))
    tail = np.asarray(a[H:], np.float32)
    if np.any(tail != 0):
        raise ConvertError(f"{entry.src} is padded to {entry.src_shape[0]} entries for {H} heads, but entries "
                           f"{H}..{entry.src_shape[0] - 1} are not zero; refusing to drop them")


# ---------------------------------------------------------------------------------------------------------------
# HF layout (plain values) -> kimi_jax layout
# ---------------------------------------------------------------------------------------------------------------

def forward(entry: Entry, w: np.ndarray, tshapes: list) -> list[np.ndarray]:
    """Plain HF-layout values (stacked `[E, out, in]` for experts) -> the target arrays, contiguous."""
    k = entry.kind
    if k == "copy":
        out = [w]
    elif k == "linear":
        out = [w.T]
    elif k == "conv":
        out = [w[:, 0, :].T]
    elif k == "reshape":
        out = [w.reshape(tshapes[0])]
    elif k == "a_log":
        H = tshapes[0][0]
        out = [w[:H] if w.ndim == 1 else w.reshape(H)]
    elif k == "kv_b":
        (R, H, n), (_, _, v) = tshapes
        w3 = w.reshape(H, n + v, R)
        out = [w3[:, :n, :].transpose(2, 0, 1), w3[:, n:, :].transpose(2, 0, 1)]
    elif k == "experts":
        out = [w.transpose(0, 2, 1)]
    else:
        raise ConvertError(f"internal: no forward for kind {k!r}")
    return [np.ascontiguousarray(a) for a in out]


def inverse(entry: Entry, arrays: list[np.ndarray]) -> np.ndarray:
    """Target arrays (plain) -> the HF-layout tensor (stacked `[E, out, in]` for experts)."""
    k = entry.kind
    a = arrays[0]
    if k in ("copy", "extra"):
        w = a
    elif k == "linear":
        w = a.T
    elif k == "conv":
        w = a.T[:, None, :]
    elif k == "reshape":
        w = a.reshape(entry.src_shape)
    elif k == "a_log":
        if len(entry.src_shape) == 1 and entry.src_shape[0] > a.shape[0]:
            w = np.concatenate([a, np.zeros((entry.src_shape[0] - a.shape[0],), a.dtype)])
        else:
            w = a.reshape(entry.src_shape)
    elif k == "kv_b":
        kk, vv = arrays
        R, H, _ = kk.shape
        w = np.concatenate([kk, vv], axis=-1).transpose(1, 2, 0).reshape(H * (kk.shape[2] + vv.shape[2]), R)
    elif k == "experts":
        w = a.transpose(0, 2, 1)
    else:
        raise ConvertError(f"internal: no inverse for kind {k!r}")
    return np.ascontiguousarray(w)


# ---------------------------------------------------------------------------------------------------------------
# Building the stored arrays of one entry from the sources
# ---------------------------------------------------------------------------------------------------------------

def _read_plain(sources: SourceSet, name: str, dtype, form: str, fp8_block) -> np.ndarray:
    """One HF tensor as plain values (dequantised when quantised), in `dtype` (None: keep / float32 if quantised)."""
    if form == "fp8":
        return _fp8_dequant(read_array(sources.info(name)), read_array(sources.info(name + "_scale_inv")),
                            fp8_block, dtype or np.float32, name)
    if form == "mxfp4":
        return _mxfp4_dequant(read_array(sources.info(name + "_packed")), read_array(sources.info(name + "_scale")),
                              dtype or np.float32, name)
    info = sources.info(name)
    out = np.empty(info.shape, dtype or info.np_dtype)
    if not info.shape:
        out[...] = read_array(info)
        return out
    for r0, r1 in row_blocks(info):
        out[r0:r1] = read_array(info, r0, r1)
    return out


def build(entry: Entry, sources: SourceSet, tshapes: list, *, dtypes: list, keep_quant: bool,
          requant: bool = False, fp8_block=codec.FP8_BLOCK) -> tuple[dict[str, np.ndarray], str]:
    """The stored arrays of one entry and their form ("plain", "fp8" or "mxfp4").

    dtypes: per target, the numpy dtype of the plain result (None = the source dtype).
    keep_quant: keep fp8 / mxfp4 sources quantised (HF layout); otherwise dequantise.
    requant: quantise a plain source to FP8 blocks (HF layout) instead of storing it plain.
    """
    if entry.kind == "extra":
        return {entry.targets[0]: _read_plain(sources, entry.src, None, "plain", fp8_block)}, "plain"
    quantised = entry.form != "plain" and keep_quant
    if quantised or requant:
        form = entry.form if quantised else "fp8"
        if entry.kind == "experts":
            parts = _quant_stack(entry, sources, form, quantised, fp8_block)
        elif quantised:
            parts = [np.ascontiguousarray(read_array(sources.info(entry.src + s))) for s in QUANT_SUFFIXES[form]]
        else:
            plain = _read_plain(sources, entry.src, np.float32, "plain", fp8_block)
            parts = codec.fp8_block_quantize_np(plain, fp8_block)
        names = tuple(entry.qbase + s for s in STORED_SUFFIXES[form])
        return dict(zip(names, parts)), form
    if entry.kind == "experts":
        return {entry.targets[0]: _stack_experts(entry, sources, tshapes[0], dtypes[0], fp8_block)}, "plain"
    if entry.kind == "linear" and entry.form == "plain":  # stream big matrices (lm_head) in row blocks
        info = sources.info(entry.src)
        out = np.empty(tshapes[0], dtypes[0] or info.np_dtype)
        for r0, r1 in row_blocks(info):
            out[:, r0:r1] = read_array(info, r0, r1).T
        return {entry.targets[0]: out}, "plain"
    dt = dtypes[0] if entry.kind != "kv_b" else (dtypes[0] or dtypes[1])
    w = _read_plain(sources, entry.src, dt, entry.form, fp8_block)
    arrays = forward(entry, w, tshapes)
    return {t: (a if d is None or a.dtype == d else a.astype(d))
            for t, a, d in zip(entry.targets, arrays, dtypes)}, "plain"


def _stack_experts(entry, sources, tshape, dtype, fp8_block) -> np.ndarray:
    """Plain `[E, in, out]` written expert by expert into one preallocated array."""
    first = sources.info(entry.src_name(0) + ("_packed" if entry.form == "mxfp4" else ""))
    out = np.empty(tshape, dtype or (first.np_dtype if entry.form == "plain" else np.float32))
    for e in range(entry.num):
        out[e] = _read_plain(sources, entry.src_name(e), out.dtype, entry.form, fp8_block).T
    return out


def _quant_stack(entry, sources, form, quantised, fp8_block) -> list[np.ndarray]:
    """Stacked `[E, ...]` quantised arrays (weight/packed, scale) in HF layout, filled expert by expert."""
    outs = None
    for e in range(entry.num):
        if quantised:
            pair = [read_array(sources.info(entry.src_name(e) + s)) for s in QUANT_SUFFIXES[form]]
        else:
            plain = _read_plain(sources, entry.src_name(e), np.float32, "plain", fp8_block)
            pair = codec.fp8_block_quantize_np(plain, fp8_block)
        if outs is None:
            outs = [np.empty((entry.num,) + tuple(p.shape), p.dtype) for p in pair]
        outs[0][e], outs[1][e] = pair
    return outs


# ---------------------------------------------------------------------------------------------------------------
# Stored arrays -> plain parameters (loading) and -> HF tensors (export)
# ---------------------------------------------------------------------------------------------------------------

def to_params(entry: Entry, stored: dict, tshapes: list, dtypes: list, fp8_block=codec.FP8_BLOCK) -> dict:
    """Stored arrays of an entry -> {parameter path: array in dtype}, dequantising fp8 / mxfp4 (HF layout)."""
    if entry.form == "plain":
        return {t: np.asarray(stored[t]).astype(d, copy=False) for t, d in zip(entry.targets, dtypes)}
    a_name, s_name = entry.stored_quant_names()
    a, s = np.asarray(stored[a_name]), np.asarray(stored[s_name])
    if entry.kind == "experts":  # dequantise expert by expert into the stacked [E, in, out] result
        out = np.empty(tshapes[0], dtypes[0])
        for e in range(entry.num):
            out[e] = _dequant(entry.form, a[e], s[e], fp8_block, entry.qbase).T
        return {entry.targets[0]: out}
    w = _dequant(entry.form, a, s, fp8_block, entry.qbase)
    return {t: x.astype(d, copy=False) for t, x, d in zip(entry.targets, forward(entry, w, tshapes), dtypes)}


def _dequant(form, a, s, fp8_block, name):
    if form == "fp8":
        return _fp8_dequant(a, s, fp8_block, np.float32, name)
    return _mxfp4_dequant(a, s, np.float32, name)


def _fp8_dequant(weight, scale_inv, block, out_dtype, name: str) -> np.ndarray:
    """`codec.fp8_block_dequantize_np`, refusing a scale grid that does not fit the weight (checkpoint data)."""
    if tuple(scale_inv.shape) != codec.fp8_block_scale_shape(weight.shape, block):
        raise ConvertError(f"shape mismatch for {name or 'weight'}_scale_inv: expected "
                           f"{list(codec.fp8_block_scale_shape(weight.shape, block))} for a {list(weight.shape)} "
                           f"weight with {block[0]}x{block[1]} blocks, found {list(scale_inv.shape)}")
    return codec.fp8_block_dequantize_np(weight, scale_inv, block, out_dtype)


def _mxfp4_dequant(packed, scale, out_dtype, name: str) -> np.ndarray:
    """`codec.mxfp4_dequantize_np` of `[..., out, in/2]` codes and `[..., out, in/32]` E8M0 scales (uint8, or
    float8_e8m0fnu whose bits are kept), refusing arrays that do not fit together (checkpoint data)."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    if scale.dtype != np.uint8:
        scale = scale.view(np.uint8)
    cols = packed.shape[-1] * 2
    group = codec.MXFP4_GROUP
    if packed.dtype != np.uint8 or scale.shape != packed.shape[:-1] + (cols // group,) or cols % group:
        raise ConvertError(f"MXFP4 tensors of {name or 'weight'} do not fit: packed {packed.dtype} "
                           f"{list(packed.shape)}, scale {list(scale.shape)} (expected [..., in/2] uint8 and "
                           f"[..., in/{group}])")
    return codec.mxfp4_dequantize_np(packed, scale).astype(out_dtype, copy=False)


def _plain_export_dtype(entry: Entry, stored_dtype: str) -> str:
    """A plain tensor goes back in its source's float dtype (`--dtype bf16` stores some parameters in float32, e.g.
    A_log and norms, and keeps bf16 sources' values exactly); one dequantised from an fp8 source keeps the stored
    dtype (the quantised pair is not rebuilt)."""
    src_plain = (entry.extra or {}).get("src_form", "plain") == "plain"
    floats = entry.src_dtype in FLOAT_DTYPES and stored_dtype in FLOAT_DTYPES
    return entry.src_dtype if src_plain and floats else stored_dtype


def export_tensors(entry: Entry, stored: dict) -> list[tuple[str, np.ndarray]]:
    """Stored arrays of an entry -> [(HF name, tensor)] in HF order (expert by expert)."""
    if entry.kind == "extra":
        return [(entry.src, np.asarray(stored[entry.targets[0]]))]
    if entry.form == "plain":
        w = inverse(entry, [np.asarray(stored[t]) for t in entry.targets])
        w = w.astype(DTYPES[_plain_export_dtype(entry, dtype_name(w.dtype))], copy=False)
        if entry.kind == "experts":
            return [(entry.src_name(e), np.ascontiguousarray(w[e])) for e in range(entry.num)]
        return [(entry.src, w)]
    a, s = (np.asarray(stored[n]) for n in entry.stored_quant_names())
    sa, ss = QUANT_SUFFIXES[entry.form]
    if entry.kind == "experts":
        out = []
        for e in range(entry.num):
            out += [(entry.src_name(e) + sa, a[e]), (entry.src_name(e) + ss, s[e])]
        return out
    return [(entry.src + sa, a), (entry.src + ss, s)]


def export_specs(entry: Entry, stored_meta: dict) -> list[tuple[str, str, tuple]]:
    """(HF name, safetensors dtype, shape) of what `export_tensors` yields, from metadata only."""
    if entry.kind == "extra":
        return [(entry.src, entry.src_dtype, tuple(entry.src_shape))]
    if entry.form == "plain":
        dt = _plain_export_dtype(entry, stored_meta[entry.targets[0]][0])
        if entry.kind == "experts":
            return [(entry.src_name(e), dt, tuple(entry.src_shape)) for e in range(entry.num)]
        return [(entry.src, dt, tuple(entry.src_shape))]
    (adt, ashape), (sdt, sshape) = (stored_meta[n] for n in entry.stored_quant_names())
    sa, ss = QUANT_SUFFIXES[entry.form]
    if entry.kind == "experts":
        out = []
        for e in range(entry.num):
            out += [(entry.src_name(e) + sa, adt, tuple(ashape[1:])), (entry.src_name(e) + ss, sdt, tuple(sshape[1:]))]
        return out
    return [(entry.src + sa, adt, tuple(ashape)), (entry.src + ss, sdt, tuple(sshape))]


def to_json(entry: Entry) -> dict:
    d = dataclasses.asdict(entry)
    d["targets"] = list(entry.targets)
    d["allowed_shapes"] = [list(s) for s in entry.allowed_shapes]
    d["src_shape"] = list(entry.src_shape)
    return d


def from_json(d: dict) -> Entry:
    d = dict(d)
    d["targets"] = tuple(d["targets"])
    d["allowed_shapes"] = tuple(tuple(s) for s in d.get("allowed_shapes", ()))
    d["src_shape"] = tuple(d.get("src_shape", ()))
    return Entry(**d)
