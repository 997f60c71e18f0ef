"""Reading and writing safetensors files tensor by tensor.

Reading: every file is first opened with `safetensors.safe_open` (the library's own header validation: a truncated
or corrupt file fails here), and its header is parsed once more here to get each tensor's byte range. Tensors are
then read as memory maps of exactly their byte range (`np.memmap`), optionally in row blocks, so that no file is ever
mapped or read as a whole and pages are released as soon as a block has been copied (safetensors' own numpy backend
has no bfloat16 / float8, hence the byte-range maps with `ml_dtypes` dtypes).

Writing: `StreamingWriter` lays out the header for a known list of (name, dtype, shape) up front and then accepts
the tensors one at a time in that order, so a shard never has to be held in memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterator, Optional

import ml_dtypes
import numpy as np

from .errors import ConvertError, listing

# safetensors dtype name -> numpy dtype
DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


def dtype_name(dt) -> str:
    dt = np.dtype(dt)
    if dt not in DTYPE_NAMES:
        raise ConvertError(f"dtype {dt} has no safetensors name")
    return DTYPE_NAMES[dt]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def _corrupt(path, why) -> ConvertError:
    return ConvertError(f"truncated or corrupt safetensors file {path}: {why}")


def read_header(path: str) -> dict[str, TensorInfo]:
    """Validate a safetensors file and return its tensors. Raises ConvertError naming the file on any defect."""
    try:
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:  # the library's own validation (header, coverage)
            lib_keys = set(f.keys())
    except ConvertError:
        raise
    except Exception as e:  # SafetensorError, OSError
        raise _corrupt(path, str(e)) from None
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise _corrupt(path, f"only {size} bytes, no header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise _corrupt(path, f"header length {n} does not fit the file size {size}")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    spans = []
    for name, d in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b, e) = d["dtype"], tuple(int(s) for s in d["shape"]), d["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad header entry for {name!r}") from None
        if dt not in DTYPES:
            raise ConvertError(f"{path}: tensor {name} has dtype {dt}, which this converter does not handle "
                               f"(known: {', '.join(DTYPES)})")
        expect = math.prod(shape) * DTYPES[dt].itemsize
        if e - b != expect or b < 0:
            raise _corrupt(path, f"tensor {name} spans {e - b} bytes, its {dt} shape {list(shape)} needs {expect}")
        if base + e > size:
            raise _corrupt(path, f"tensor {name} ends at byte {base + e} but the file has {size} bytes")
        out[name] = TensorInfo(name, path, dt, shape, base + b, e - b)
        spans.append((b, e))
    spans.sort()
    pos = 0
    for b, e in spans:
        if b != pos:
            raise _corrupt(path, f"tensor data is not contiguous at byte offset {pos}")
        pos = e
    if base + pos != size:
        raise _corrupt(path, f"data ends at byte {base + pos} but the file has {size} bytes")
    if set(out) != lib_keys:
        raise _corrupt(path, "header parsed differently by safetensors")
    return out


def read_array(info: TensorInfo, row_start: int = 0, row_stop: Optional[int] = None) -> np.ndarray:
    """Memory-map rows [row_start, row_stop) of a tensor (its leading axis; the whole tensor by default).

    The result is a read-only view of the file: copy what you need and drop it, which unmaps the range.
    """
    shape = info.shape
    if shape:
        rows = shape[0]
        row_stop = rows if row_stop is None else row_stop
        row_bytes = info.nbytes // rows if rows else 0
        sub_shape = (row_stop - row_start,) + tuple(shape[1:])
        offset, nbytes = info.start + row_start * row_bytes, (row_stop - row_start) * row_bytes
    else:  # a scalar
        sub_shape, offset, nbytes = (), info.start, info.nbytes
    if nbytes == 0:
        return np.zeros(sub_shape, info.np_dtype)
    mm = np.memmap(info.file, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
    return mm.view(info.np_dtype).reshape(sub_shape)


def row_blocks(info: TensorInfo, block_bytes: int = 64 << 20, multiple: int = 1) -> Iterator[tuple[int, int]]:
    """Row ranges covering a tensor in pieces of about `block_bytes` (row counts a multiple of `multiple`)."""
    rows = info.shape[0] if info.shape else 1
    row_bytes = max(1, info.nbytes // max(rows, 1))
    step = max(multiple, (block_bytes // row_bytes) // multiple * multiple)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


class SourceSet:
    """All tensors of a Hugging Face checkpoint directory (sharded with an index, or plain `*.safetensors` files)."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_NAME)
        self.index_map: Optional[dict] = None
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    self.index_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConvertError(f"{index_path} is not a valid safetensors index ({e})") from None
            if not isinstance(self.index_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in self.index_map.items()):
                raise ConvertError(f"{index_path} is not a valid safetensors index (its weight_map must map tensor "
                                   "names to shard file names)")
            files = sorted(set(self.index_map.values()))
            missing = [f for f in files if not os.path.exists(os.path.join(directory, f))]
            if missing:
                raise ConvertError(f"{index_path} names shard file(s) that do not exist: {listing(missing)}")
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise ConvertError(f"{directory} holds no *.safetensors files")
        self.files = [os.path.join(directory, f) for f in files]
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise ConvertError(f"tensor {name} appears in both {self.tensors[name].file} and {path}")
                self.tensors[name] = info
        if self.index_map is not None:
            wrong = [n for n, f in self.index_map.items()
                     if n not in self.tensors or os.path.basename(self.tensors[n].file) != f]
            if wrong:
                raise ConvertError(f"{index_path} lists tensor(s) that are not in the named shard: {listing(wrong)}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self):
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ConvertError(f"missing tensor {name} in {self.directory}") from None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------

class StreamingWriter:
    """Write one safetensors file whose tensors arrive one at a time, in the order given up front."""

    def __init__(self, path: str, specs: list[tuple[str, str, tuple]], metadata: Optional[dict] = None):
        self.path = path
        self.specs = [(n, d, tuple(int(s) for s in shp)) for n, d, shp in specs]
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        pos = 0
        for name, dt, shape in self.specs:
            nbytes = math.prod(shape) * DTYPES[dt].itemsize
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self._fh = open(path, "wb")
        self._fh.write(struct.pack("<Q", len(blob)))
        self._fh.write(blob)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        exp_name, dt, shape = self.specs[self._next]
        array = np.asarray(array)
        if name != exp_name or array.dtype != DTYPES[dt] or tuple(array.shape) != shape:
            raise ConvertError(f"{self.path}: expected tensor {exp_name} {dt} {list(shape)} next, got {name} "
                               f"{array.dtype} {list(array.shape)}")
        self._fh.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.specs):
            missing = [n for n, _, _ in self.specs[self._next:]]
            self._fh.close()
            raise ConvertError(f"{self.path}: {len(missing)} tensor(s) never written: {listing(missing)}")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()

    def abort(self) -> None:
        self._fh.close()


def write_file(path: str, tensors: dict[str, np.ndarray], metadata: Optional[dict] = None) -> None:
    """Write a small dict of arrays as one safetensors file."""
    specs = [(n, dtype_name(a.dtype), a.shape) for n, a in tensors.items()]
    w = StreamingWriter(path, specs, metadata)
    for n, a in tensors.items():
        w.write(n, a)
    w.close()
