"""kimi_jax checkpoint -> Hugging Face safetensors (`python -m convert --export DST OUT`).

Every HF tensor is rebuilt from the stored arrays by the inverse of its entry's layout change, under its original
name (dense-MLP spelling, A_log padding, fused kv_b_proj, per-expert tensors, MXFP4 / FP8 pairs), and written in
shards of at most `shard_bytes` with a `model.safetensors.index.json`. A checkpoint converted with `--dtype keep` (the
default) exports bit-identical tensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from . import interrupt, store
from .entries import export_specs, export_tensors, from_json
from .errors import ConvertError
from .safetensors_io import DTYPES, INDEX_NAME, StreamingWriter

DEFAULT_SHARD_BYTES = 5 * (1 << 30)
log = logging.getLogger("convert")


def export(ckpt: str, out: str, *, overwrite: bool = False, shard_bytes: int = DEFAULT_SHARD_BYTES,
           progress: bool = True) -> dict:
    ckpt, out = os.path.abspath(ckpt), os.path.abspath(out)
    meta = store.read_meta(ckpt)
    store.check_destination(out, overwrite, sources=[ckpt])
    t0 = time.time()
    entries = [from_json(e) for e in meta["entries"]]
    specs = [(e, export_specs(e, e.extra["arrays"])) for e in entries]
    # assign tensors to shards in writing order
    shards: list[list] = [[]]
    size = 0
    weight_map = {}
    total = 0
    for _, sp in specs:
        for name, dt, shape in sp:
            nbytes = DTYPES[dt].itemsize * _prod(shape)
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, dt, shape))
            size += nbytes
            total += nbytes
    n = len(shards)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for f, shard in zip(files, shards):
        for name, _, _ in shard:
            if name in weight_map:
                raise ConvertError(f"{ckpt}: tensor {name} would be exported twice")
            weight_map[name] = f
    from tqdm import tqdm

    with store.atomic_directory(out, overwrite) as tmp:
        reader = store.PartReader(ckpt, meta["parts"])
        shard_i = 0
        writer = StreamingWriter(os.path.join(tmp, files[0]), shards[0], {"format": "pt"})
        left = len(shards[0])
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=not progress,
                   dynamic_ncols=True)
        try:
            for entry, _ in specs:
                interrupt.check()
                part = reader.get(entry.extra["part"])
                stored = {k: part[k] for k in entry.extra["arrays"]}
                for name, arr in export_tensors(entry, stored):
                    while left == 0:
                        writer.close()
                        shard_i += 1
                        writer = StreamingWriter(os.path.join(tmp, files[shard_i]), shards[shard_i], {"format": "pt"})
                        left = len(shards[shard_i])
                    writer.write(name, arr)
                    left -= 1
                    bar.update(arr.nbytes)
            writer.close()
            while shard_i + 1 < n:  # shards can only be empty if there is nothing at all
                shard_i += 1
                StreamingWriter(os.path.join(tmp, files[shard_i]), shards[shard_i], {"format": "pt"}).close()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        with open(os.path.join(tmp, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        for name in meta.get("hf_files", []):
            src = os.path.join(ckpt, name)
            if name == "config.json":
                _write_config(src, os.path.join(tmp, name), meta, entries)
            elif os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, name))
    summary = {"tensors": len(weight_map), "bytes": total, "shards": n, "seconds": time.time() - t0, "out": out}
    log.info("exported %d tensors (%.2f GiB) in %d shard(s) to %s", len(weight_map), total / 2**30, n, out)
    return summary


def _prod(shape) -> int:
    p = 1
    for s in shape:
        p *= int(s)
    return p


def _write_config(src: str, dst: str, meta: dict, entries) -> None:
    """The original config.json, adjusted when conversion changed what the weights are (FP8 quantisation). Its
    dtype stays the source's: plain tensors are exported in their source dtype under every `--dtype` policy."""
    with open(src) as f:
        hf = json.load(f)
    dequantised = any(e.extra.get("src_form") == "fp8" and e.form == "plain" for e in entries)
    requantised = any(e.extra.get("src_form") == "plain" and e.form == "fp8" for e in entries)
    for d in (hf, hf.get("text_config") if isinstance(hf.get("text_config"), dict) else None):
        if d is None:
            continue
        qc = d.get("quantization_config")
        if dequantised and isinstance(qc, dict) and qc.get("quant_method") == "fp8":
            del d["quantization_config"]
    if requantised and "quantization_config" not in hf:
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(meta.get("fp8_block", [128, 128]))}
    with open(dst, "w") as f:
        json.dump(hf, f, indent=2)
