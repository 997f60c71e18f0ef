"""Probe: how fast can ANY kernel gather sparse MLA's rows? The random-row read ceiling of the GPU, measured with
torch (nobody's kernel here), beside a plain copy of the same number of bytes and the large-copy anchor.

    python3 bench/gather_ceiling.py [--batches 32,128] [--ctx 32768,131072,1048576] [--triton] [--json OUT]

Why (issue #5): the bar for sparse MLA decode is latent bytes gathered per second ≥ 0.60 of copy bandwidth, with
2048 rows of 576 bytes per sequence (37.7 MB at B = 32). Our kernel's gather alone, without any arithmetic
(`bench/mla_gather_probe.py`), reached 0.51–0.59 of copy. This script asks whether that is our
gather's shortcoming or the memory system's: `torch.index_select` of the same rows (the selection drawn as
`bench/dsa.py` draws it: 2048 distinct sorted positions per sequence, pages of 64 tokens permuted over the pool)
against `copy_` of the same bytes, contiguous. Every timing chains `--chain` different selections so the rows come
from HBM, not from the 50 MB L2 (one selection at B = 32 is 37.7 MB). Rates count bytes read (as the bar does)
and bytes read + written (as the copy anchor does). GPU only (torch with CUDA).

`--triton` adds the best READ-ONLY gather a plain kernel can do (`_read_rows`, Triton, nobody's library): each
program loads `rows` whole rows with 16-byte vector loads and writes one 4-byte checksum per row (0.7% of the bytes
read), swept over rows per program and warps. Nothing is computed with the rows, so this is the random-row read
ceiling a sparse-MLA kernel, which must also do its maths, cannot beat.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import torch_copy_bandwidth, torch_event_seconds  # noqa: E402

PAGE, TOPK, ROW_BYTES = 64, 2048, 576
WORDS = ROW_BYTES // 8  # a row as int64 words: index_select moves 8-byte elements


def row_indices(batch: int, ctx: int, chain: int, seed: int = 0) -> np.ndarray:
    """`[chain, batch · 2048]` pool rows: per sequence 2048 distinct sorted token positions, each mapped through a
    block table of randomly permuted 64-token pages (page 0 left unused, as the engine's null page)."""
    rng = np.random.default_rng(seed)
    pages = ctx // PAGE
    table = (rng.permutation(batch * pages) + 1).reshape(batch, pages)
    out = np.empty((chain, batch * TOPK), np.int64)
    for c in range(chain):
        for b in range(batch):
            pos = np.sort(rng.choice(ctx, TOPK, replace=False))
            out[c, b * TOPK:(b + 1) * TOPK] = table[b, pos // PAGE] * PAGE + pos % PAGE
    return out


def _pool_and_selections(batch: int, ctx: int, chain: int, dtype):
    """A random pool of the sequences' pages as `dtype` words `[rows, 576 / itemsize]` on the GPU, and `chain`
    selections of its rows (`row_indices`)."""
    import torch

    n_rows = (batch * (ctx // PAGE) + 1) * PAGE
    info = torch.iinfo(dtype)
    pool = torch.empty((n_rows, ROW_BYTES // info.bits * 8), dtype=dtype, device="cuda").random_(0, info.max)
    return pool, torch.from_numpy(row_indices(batch, ctx, chain)).cuda()


def _rate_row(name: str, batch: int, ctx: int, t: float, copy_bw: float, checked: bool) -> dict:
    """One printed row: seconds per call of reading B × 2048 rows -> µs, TB/s and fractions of copy."""
    read_bytes = batch * TOPK * ROW_BYTES
    return dict(name=name, batch=batch, ctx=ctx, us=t * 1e6, read_tb_s=read_bytes / t / 1e12,
                read_of_copy=read_bytes / t / copy_bw, rw_of_copy=2 * read_bytes / t / copy_bw, checked=checked)


TRITON_SWEEP = ((8, 2), (16, 4), (32, 4), (32, 8), (64, 8), (128, 8))  # (rows per program, warps)


def _triton_reader():
    """The read-only gather kernel (built on first use: triton is a GPU-host import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_rows(pool_ptr, idx_ptr, out_ptr, ROWS: tl.constexpr):
        # pool: int32 [n_rows, 144] (576-byte rows, 16-byte aligned); out[r] = sum(cols 0..127) ^ sum(cols 128..143)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        base = tl.load(idx_ptr + r) * 144
        head = tl.load(pool_ptr + base[:, None] + tl.arange(0, 128)[None, :])
        tail = tl.load(pool_ptr + base[:, None] + 128 + tl.arange(0, 16)[None, :])
        tl.store(out_ptr + r, tl.sum(head, axis=1) ^ tl.sum(tail, axis=1))

    return _read_rows


def _checksum(pool_i32, idx):
    """`_read_rows`' checksum in torch (int32 wrap-around sums)."""
    import torch

    rows = pool_i32[idx].to(torch.int64)
    wrap = lambda v: ((v + 2**31) % 2**32 - 2**31).to(torch.int32)  # noqa: E731
    return wrap(rows[:, :128].sum(1)) ^ wrap(rows[:, 128:].sum(1))


def measure_triton(batch: int, ctx: int, chain: int, copy_bw: float) -> list[dict]:
    """`_read_rows` over the same selections as `measure`, for each (rows per program, warps) of TRITON_SWEEP."""
    import torch

    kernel = _triton_reader()
    pool, idx = _pool_and_selections(batch, ctx, chain, torch.int32)
    n = batch * TOPK
    out = torch.empty((n,), dtype=torch.int32, device="cuda")
    want = _checksum(pool, idx[0])
    rows = []
    for per, warps in TRITON_SWEEP:
        def run(i, per=per, warps=warps):
            kernel[(n // per,)](pool, idx[i], out, ROWS=per, num_warps=warps)

        run(0)
        ok = bool(torch.equal(out, want))
        t = torch_event_seconds(run, calls=chain, rounds=15)
        rows.append(_rate_row(f"triton read-only, {per} rows x {warps} warps", batch, ctx, t, copy_bw, ok))
    del pool, idx, out
    torch.cuda.empty_cache()
    return rows


def measure(batch: int, ctx: int, chain: int, copy_bw: float) -> list[dict]:
    import torch

    pool, idx = _pool_and_selections(batch, ctx, chain, torch.int64)
    out = torch.empty((batch * TOPK, WORDS), dtype=torch.int64, device="cuda")

    def gather(i):
        torch.index_select(pool, 0, idx[i], out=out)

    # the same number of bytes, contiguous: `chain` different source slices, as the gather reads different rows
    src = pool[: chain * batch * TOPK].view(chain, batch * TOPK, WORDS)

    def copy(i):
        out.copy_(src[i])

    ok = torch.equal(torch.index_select(pool, 0, idx[0]), pool[idx[0]])
    rows = []
    for name, fn in (("index_select (random rows)", gather), ("copy_ (same bytes, contiguous)", copy)):
        t = torch_event_seconds(fn, calls=chain, rounds=15)
        rows.append(_rate_row(name, batch, ctx, t, copy_bw, bool(ok)))
    del pool, idx, out
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--ctx", default="32768,131072,1048576")
    ap.add_argument("--chain", type=int, default=4, help="different selections per timing chain (out of L2)")
    ap.add_argument("--triton", action="store_true", help="also the read-only Triton gather sweep (TRITON_SWEEP)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    import torch

    copy_bw = torch_copy_bandwidth()
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}; copy (2 GiB, read + write) "
          f"{copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for ctx in (int(c) for c in args.ctx.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            if batch * ctx * ROW_BYTES > 40e9:  # pool over 40 GB: skip
                continue
            found = measure(batch, ctx, args.chain, copy_bw)
            if args.triton:
                found += measure_triton(batch, ctx, args.chain, copy_bw)
            for r in found:
                rows.append(r)
                print(f"{r['name']:40s} B={batch:4d} ctx={ctx:8d}: {r['us']:8.1f} µs  read {r['read_tb_s']:.2f} TB/s"
                      f" = {r['read_of_copy']:.3f} of copy (read+write {r['rw_of_copy']:.3f}) checked={r['checked']}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tb_s=copy_bw / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
