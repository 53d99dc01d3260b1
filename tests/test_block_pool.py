"""BlockPool: reference counts, the content-hash index, LRU eviction of unreferenced cached blocks."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.engine.block_pool import ROOT_HASH, BlockPool, hash_block_tokens


def test_allocate_and_release_count_blocks():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert len(set(got)) == 3 and pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert all(pool.blocks[b].ref_cnt == 1 for b in got)
    pool.release(got)
    assert pool.num_free_blocks == 4


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_release_below_zero_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.release([block])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([block])


def test_hash_is_chained_over_the_parent():
    tokens = [1, 2, 3, 4]
    a = hash_block_tokens(ROOT_HASH, tokens)
    assert a == hash_block_tokens(ROOT_HASH, list(tokens))
    assert hash_block_tokens(a, tokens) != a  # same tokens after a different prefix
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 5]) != a


def test_uncached_free_blocks_are_reused_before_cached_ones_are_evicted():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"A")
    pool.release([a])  # cached, unreferenced: stays in the index
    pool.release([b])  # plain free block
    (got,) = pool.allocate(1)
    assert got == b
    assert pool.get_cached_block(b"A") == a and pool.num_evictions == 0


def test_lru_eviction_takes_the_least_recently_released_cached_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.release([a])
    pool.release([b])
    (got,) = pool.allocate(1)
    assert got == a and pool.get_cached_block(b"A") is None and pool.get_cached_block(b"B") == b
    assert pool.blocks[a].block_hash is None and pool.num_evictions == 1


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"A")
    pool.release([a])
    assert pool.is_free(a)
    pool.touch([a])
    assert not pool.is_free(a) and pool.blocks[a].ref_cnt == 1
    pool.touch([a])  # a second sharer
    pool.release([a])
    assert not pool.is_free(a)
    pool.release([a])
    assert pool.is_free(a) and pool.get_cached_block(b"A") == a


def test_duplicate_content_stays_unindexed():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"X")
    pool.cache_block(b, b"X")
    assert pool.get_cached_block(b"X") == a and pool.blocks[b].block_hash is None


def test_cached_prefix_is_the_longest_leading_run_of_hits():
    pool = BlockPool(4)
    a, b, c, _ = pool.allocate(4)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.cache_block(c, b"D")
    assert pool.get_cached_prefix([b"A", b"B", b"C", b"D"], 4) == [a, b]  # stops at the first miss
    assert pool.get_cached_prefix([b"A", b"B"], 1) == [a]
    assert pool.get_cached_prefix([b"X", b"A"], 2) == []


def test_unreferenced_hits_are_counted_as_taken_from_the_free_pool():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.release([a])
    assert pool.num_unreferenced([a, b]) == 1 and pool.num_cached_blocks == 2


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0)
