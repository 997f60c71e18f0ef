"""Paged MLA cache (kimi_jax.paged_cache): byte plan from cache.py, allocator, quantise-on-write, gather."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import quant as Q
from kimi_jax.cache import PAGE_TOKENS, CacheLayout
from kimi_jax.config import get_preset
from kimi_jax.paged_cache import NULL_BLOCK, BlockAllocator, BlockTable, OutOfBlocksError, PagedCacheSpec


def small_config():
    """The tiny preset (R = 32, rope 8, 2 MLA layers) with a 32-wide index key so every index format applies."""
    cfg = get_preset("tiny")
    return cfg.replace(indexer=dataclasses.replace(cfg.indexer, head_dim=32))


FORMATS = [("bf16", "bf16"), ("fp8", "fp8"), ("nvfp4", "mxfp4")]  # every latent and every index format


# ------------------------------------------------------------------------------------------------ the plan

@pytest.mark.parametrize("kv,ix,per_token", [("fp8", "fp8", 16_992), ("nvfp4", "mxfp4", 10_080),
                                             ("bf16", "bf16", 24 * (1152 + 256))])
def test_full_size_plan_reads_cache_py(kv, ix, per_token):
    cfg = get_preset("kimi-k3.1-pro")
    spec = PagedCacheSpec.create(cfg, num_blocks=1000, kv_dtype=kv, index_dtype=ix)
    layout = CacheLayout(cfg, kv_dtype=kv, index_dtype=ix)
    assert spec.bytes_per_token == layout.kv_bytes_per_token == per_token
    assert spec.block_bytes == PAGE_TOKENS * per_token
    # the arrays the pool allocates (abstractly: no memory) hold exactly the planned bytes
    pool = jax.eval_shape(spec.init_layer)
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in pool.latent + pool.index)
    assert nbytes == spec.num_blocks * PAGE_TOKENS * layout.layer_bytes_per_token
    assert nbytes * spec.num_layers == spec.pool_bytes
    one_m = 1 << 20
    assert spec.sequence_bytes(one_m) == (one_m // PAGE_TOKENS) * spec.block_bytes + layout.state_bytes_per_sequence
    assert spec.sequence_bytes(65) == 2 * spec.block_bytes + layout.state_bytes_per_sequence


def test_k3_without_indexer_has_no_index_pool():
    spec = PagedCacheSpec.create(get_preset("kimi-k3"), num_blocks=4, kv_dtype="fp8")
    assert spec.index_format is None and spec.bytes_per_token == 13_824
    pool = jax.eval_shape(spec.init_layer)
    assert pool.index == () and [a.shape for a in pool.latent] == [(4, 64, 576)]


def test_layer_pool_parts_and_summary():
    spec = PagedCacheSpec.create(get_preset("kimi-k3.1-pro"), num_blocks=10, kv_dtype="nvfp4", index_dtype="mxfp4")
    pool = jax.eval_shape(spec.init_layer)
    assert [(a.shape, a.dtype) for a in pool.latent] == [((10, 64, 256), jnp.uint8), ((10, 64, 32), jnp.float8_e4m3fn),
                                                         ((10, 64, 64), jnp.float8_e4m3fn)]
    assert [(a.shape, a.dtype) for a in pool.index] == [((10, 64, 64), jnp.uint8), ((10, 64, 4), jnp.uint8)]
    s = spec.summary(tokens_per_sequence=1000)
    assert s["latent_bytes_per_token_layer"] == 352 and s["index_bytes_per_token_layer"] == 68
    assert s["max_cached_tokens"] == 9 * 64 and s["max_sequences"] == 9 // 16


def test_for_budget_and_bad_sizes():
    cfg = small_config()
    spec = PagedCacheSpec.for_budget(cfg, 10 * CacheLayout(cfg).page_bytes + 5)
    assert spec.num_blocks == 10
    with pytest.raises(ValueError, match="at least 2"):
        PagedCacheSpec.create(cfg, num_blocks=1)
    tiny = get_preset("tiny")
    narrow = tiny.replace(indexer=dataclasses.replace(tiny.indexer, head_dim=16))  # 16-wide keys
    with pytest.raises(ValueError, match="multiple of 32"):
        PagedCacheSpec.create(narrow, num_blocks=4, index_dtype="mxfp4")
    assert PagedCacheSpec.create(tiny, num_blocks=4, index_dtype="mxfp4").num_blocks == 4  # tiny's keys: 32 wide


# ------------------------------------------------------------------------------------------------ allocator

def test_allocator_allocate_grow_free_stats():
    a = BlockAllocator(6)  # blocks 1..5 usable
    assert a.allocate("x", 1) == [1]
    assert a.allocate("x", 64) == []  # still one page
    assert a.allocate("y", 130) == [2, 3, 4]
    assert a.allocate("x", 65) == [5]
    assert a.blocks("x") == [1, 5] and a.tokens("x") == 65
    assert a.stats() == {"total_blocks": 5, "used_blocks": 5, "free_blocks": 0, "sequences": 2,
                         "cached_tokens": 195, "capacity_tokens": 320, "page_tokens": 64}
    with pytest.raises(OutOfBlocksError, match=r"sequence 'z' needs 1 more block.*only 0 of 5 are free"):
        a.allocate("z", 10)
    assert a.free("y") == 3 and a.free_blocks == 3
    assert a.allocate("z", 129) == [2, 3, 4]
    table = a.block_table(["x", "z", "gone"], max_blocks=4)
    np.testing.assert_array_equal(table, [[1, 5, 0, 0], [2, 3, 4, 0], [0, 0, 0, 0]])
    assert table.dtype == np.int32
    with pytest.raises(KeyError, match="holds no cache blocks"):
        a.free("gone")
    with pytest.raises(ValueError, match="more than max_blocks"):
        a.block_table(["z"], max_blocks=2)


def test_allocator_is_all_or_nothing_and_never_hands_out_the_null_block():
    a = BlockAllocator(4)
    a.allocate("x", 64)
    with pytest.raises(OutOfBlocksError):
        a.allocate("x", 64 * 4)  # needs 3 more, 2 free
    assert a.blocks("x") == [1] and a.free_blocks == 2 and a.tokens("x") == 64
    assert a.can_allocate("x", 64 * 3) and not a.can_allocate("x", 64 * 3 + 1)
    seen = set()
    for i in range(20):
        if a.can_allocate(i, 128):
            seen.update(a.allocate(i, 128))
        if i % 2 and a.blocks(i):
            a.free(i)
    assert NULL_BLOCK not in seen


# ------------------------------------------------------------------------------------------------ write / gather

def _rows(rng, n, c):
    return (rng.standard_normal((n, c)) * 2).astype(np.float32)


def test_the_kept_block_table_equals_one_built_fresh_every_step():
    """Slots are filled, grown a page at a time, handed pages another owner holds, preempted and readmitted with
    new pages, emptied and reused by another sequence: after every step the table updated in place equals the table
    built from scratch (free slots are null rows)."""
    rng = np.random.default_rng(0)
    slots, max_blocks = 4, 12
    alloc = BlockAllocator(200, block_tokens=4)
    table = BlockTable(slots, max_blocks)
    alloc.allocate("donor", 16)
    running = {}  # slot -> owner
    for step in range(300):
        slot = int(rng.integers(slots))
        op = rng.integers(4)
        owner = running.get(slot)
        if owner is None:  # a new sequence takes the slot, sometimes behind a cached prefix
            owner = running[slot] = f"seq{step}"
            if rng.integers(2):
                alloc.share(owner, alloc.blocks("donor")[: int(rng.integers(1, 4))])
            alloc.allocate(owner, alloc.tokens(owner) + int(rng.integers(1, 9)))
        elif op == 0:  # finished: the slot is free
            alloc.free(running.pop(slot))
        elif op == 1:  # preempted and readmitted into the same slot: same owner, other pages
            alloc.free(owner)
            alloc.allocate(owner, int(rng.integers(1, 20)))
        elif alloc.blocks_for_tokens(alloc.tokens(owner) + 4) <= max_blocks:  # decoding into its next page
            alloc.allocate(owner, alloc.tokens(owner) + 4)
        got = table.update({s: alloc.held(o) for s, o in running.items()})
        want = alloc.block_table([running.get(s, "free") for s in range(slots)], max_blocks)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")


def test_a_kept_block_table_refuses_a_row_longer_than_its_width():
    alloc = BlockAllocator(20, block_tokens=4)
    alloc.allocate("a", 4 * 5)
    with pytest.raises(ValueError, match="more than max_blocks=4"):
        BlockTable(2, 4).update({0: alloc.held("a")})


@pytest.mark.parametrize("kv,ix", FORMATS)
def test_write_then_gather_returns_the_quantised_rows(kv, ix):
    cfg = small_config()
    spec = PagedCacheSpec.create(cfg, num_blocks=8, kv_dtype=kv, index_dtype=ix)
    alloc = BlockAllocator.for_spec(spec)
    pool = spec.init_layer(latent_scale=0.5)
    rng = np.random.default_rng(0)
    C, d, T = 40, 32, 152  # writes are padded to T rows (one compiled shape); `lengths` says how many are real
    for seq, n in (("a", 64), ("b", 64), ("a", 150), ("b", 70)):  # pages interleave: a -> 1, 3, 4; b -> 2, 5
        alloc.allocate(seq, n)
    bt = alloc.block_table(["a", "b"], max_blocks=3)
    np.testing.assert_array_equal(bt, [[1, 3, 4], [2, 5, 0]])
    rows, keys = _rows(rng, 2 * T, C).reshape(2, T, C), _rows(rng, 2 * T, d).reshape(2, T, d)
    # a: a 149-token prefill, b: a 70-token prefill crossing its page boundary; then one decode token for a
    pool = spec.write(pool, bt, np.array([0, 0]), rows, keys, np.array([149, 70]))
    step_rows, step_keys = np.zeros_like(rows), np.zeros_like(keys)
    step_rows[0, 0], step_keys[0, 0] = rows[0, 149], keys[0, 149]
    pool = spec.write(pool, bt, np.array([149, 70]), step_rows, step_keys, np.array([1, 0]))

    lens = np.array([150, 70])
    pos = np.arange(T)[None].repeat(2, 0)
    pos[pos >= lens[:, None]] = -1
    real = pos >= 0
    got = np.asarray(spec.gather_latent(pool, bt, pos))
    want = np.asarray(Q.round_trip(spec.latent_format, rows, 0.5))
    np.testing.assert_array_equal(got[real], want[real])
    assert not got[~real].any()
    got_keys = np.asarray(spec.gather_index_keys(pool, bt))
    assert got_keys.shape == (2, 3 * 64, d)
    want_keys = np.asarray(Q.round_trip(spec.index_format, keys))
    np.testing.assert_array_equal(got_keys[:, :T][real], want_keys[real])
    # the stored bytes are the quantised parts, at block table[p // 64], slot p % 64 (a's 64..69: block 3)
    stored = spec.latent_format.quantize(rows, 0.5)
    for part, q in zip(pool.latent, stored):
        np.testing.assert_array_equal(np.asarray(part[3, :6]).view(np.uint8), np.asarray(q[0, 64:70]).view(np.uint8))
    # nothing else was written: the null block, a's slots past 150, b's past 70, blocks 6 and 7
    for part in pool.latent + pool.index:
        raw = np.asarray(part).view(np.uint8)
        assert raw[[1, 2, 3]].any() and not raw[0].any() and not raw[4, 22:].any() and not raw[5, 6:].any()
        assert not raw[6:].any()


def test_append_one_sequence():
    spec = PagedCacheSpec.create(small_config(), num_blocks=4, kv_dtype="fp8", index_dtype="fp8")
    rng = np.random.default_rng(2)
    rows, keys = _rows(rng, 3, 40), _rows(rng, 3, 32)
    pool = spec.append(spec.init_layer(), np.array([2, 1]), 63, rows, keys)  # positions 63 (block 2), 64, 65 (block 1)
    got = np.asarray(spec.gather_latent(pool, np.array([[2, 1]]), np.array([[63, 64, 65]])))[0]
    np.testing.assert_array_equal(got, np.asarray(Q.round_trip(spec.latent_format, rows)))
    raw = np.asarray(pool.latent[0]).view(np.uint8).any(-1)  # [block, slot] written?
    assert raw.sum() == 3 and raw[2, 63] and raw[1, 0] and raw[1, 1]


def test_batched_write_drops_padding_rows_and_runs_under_jit():
    cfg = small_config()
    spec = PagedCacheSpec.create(cfg, num_blocks=6, kv_dtype="fp8", index_dtype="fp8")
    pool = spec.init_layer()
    rng = np.random.default_rng(1)
    bt = np.array([[1, 2], [3, 0]], np.int32)
    rows = rng.standard_normal((2, 4, 40)).astype(np.float32)
    keys = rng.standard_normal((2, 4, 32)).astype(np.float32)
    write = jax.jit(spec.write, donate_argnums=0)
    pool = write(pool, bt, np.array([62, 5]), rows, keys, np.array([4, 2]))
    got = np.asarray(spec.gather_latent(pool, bt, np.array([[62, 63, 64, 65], [5, 6, 7, 8]])))
    ref = np.asarray(Q.round_trip(spec.latent_format, rows))
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1, :2], ref[1, :2])
    written = np.asarray(pool.latent[0]).view(np.uint8).any(axis=-1)  # [blocks, 64]
    assert written.sum() == 6 and written[1, 62:].all() and written[2, :2].all() and written[3, 5:7].all()
    # rows past a sequence's pages (its table is padded with the null block) are dropped, not written to block 0
    pool = write(pool, bt, np.array([62, 63]), rows, keys, np.array([0, 4]))
    written = np.asarray(pool.latent[0]).view(np.uint8).any(axis=-1)
    assert written.sum() == 7 and written[3, 63] and not written[0].any()


def test_write_needs_index_keys_with_an_indexer():
    spec = PagedCacheSpec.create(small_config(), num_blocks=3)
    with pytest.raises(ValueError, match="needs the index keys"):
        spec.append(spec.init_layer(), np.array([1]), 0, np.zeros((2, 40), np.float32))


def test_init_one_pool_per_mla_layer():
    spec = PagedCacheSpec.create(small_config(), num_blocks=3, kv_dtype="nvfp4", index_dtype="mxfp4")
    pools = spec.init(latent_scales=[1.0, 0.25])
    assert len(pools) == spec.num_layers == 2 and float(pools[1].latent_scale) == 0.25
    with pytest.raises(ValueError, match="need 2 latent scales"):
        spec.init(latent_scales=[1.0])
