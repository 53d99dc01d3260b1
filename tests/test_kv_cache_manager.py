"""KVCacheManager: block tables, slot growth, prefix-cache lookups and caching of full blocks."""
from __future__ import annotations

from scheduler_driver import make_request

from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.request import RequestStatus


def arrive(kv: KVCacheManager, request_id: str, prompt, **kwargs):
    """A request as the scheduler hands it over: its prompt's block hashes computed on arrival."""
    request = make_request(request_id, prompt, **kwargs)
    kv.hash_prompt(request)
    return request


def computed(kv: KVCacheManager, request, num_tokens: int) -> None:
    """What the scheduler and the model do together: room for the tokens, compute them, cache full blocks."""
    assert kv.allocate_slots(request, num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = num_tokens
    kv.cache_full_blocks(request)


def test_allocate_slots_grows_the_block_table_by_whole_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    request = arrive(kv, "a", 40)
    assert kv.allocate_slots(request, 33)
    assert len(request.block_ids) == 3 and kv.num_free_blocks == 5
    request.num_computed_tokens = 33
    assert kv.allocate_slots(request, 7)  # 40 tokens still fit 3 blocks
    assert len(request.block_ids) == 3
    request.num_computed_tokens = 48
    assert kv.allocate_slots(request, 1)  # position 48 opens a fourth block
    assert len(request.block_ids) == 4
    assert kv.usage == 0.5


def test_allocate_slots_refuses_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = arrive(kv, "a", 12)
    assert not kv.allocate_slots(request, 12)
    assert request.block_ids == [] and kv.num_free_blocks == 2


def test_full_blocks_are_found_again_by_content():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = arrive(kv, "a", list(range(1, 12)))  # 11 tokens: two full blocks
    computed(kv, first, 11)
    assert kv.pool.num_cached_blocks == 2
    same_prefix = arrive(kv, "b", list(range(1, 12)) + [99])
    hits, num_tokens = kv.get_computed_blocks(same_prefix)
    assert hits == first.block_ids[:2] and num_tokens == 8


def test_a_hit_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = arrive(kv, "a", list(range(1, 9)) + [50])
    computed(kv, first, 9)
    exact = arrive(kv, "b", list(range(1, 9)))  # 8 tokens, both blocks cached
    hits, num_tokens = kv.get_computed_blocks(exact)
    assert num_tokens == 4 and len(hits) == 1  # the last block is recomputed so there are logits


def test_a_different_token_breaks_the_chain():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    computed(kv, arrive(kv, "a", list(range(1, 14))), 13)
    other = arrive(kv, "b", [1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13])
    hits, num_tokens = kv.get_computed_blocks(other)
    assert num_tokens == 4  # blocks after the change do not match even if their own tokens do


def test_admission_with_hits_shares_blocks_and_counts_hit_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = arrive(kv, "a", list(range(1, 10)))
    assert kv.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    second = arrive(kv, "b", list(range(1, 10)))
    hits, num_tokens = kv.get_computed_blocks(second)
    used = kv.num_used_blocks
    assert kv.allocate_slots(second, 9 - num_tokens, hits)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert kv.num_used_blocks == used + 1  # only the last, partial block is new
    assert kv.pool.blocks[hits[0]].ref_cnt == 2


def test_freed_cached_blocks_serve_a_later_request_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = arrive(kv, "a", list(range(1, 10)))
    computed(kv, first, 9)
    first.status = RequestStatus.FINISHED_STOPPED
    kv.free(first)
    assert kv.num_free_blocks == 4 and first.block_ids == []
    later = arrive(kv, "b", list(range(1, 10)))
    hits, _ = kv.get_computed_blocks(later)
    assert len(hits) == 2
    assert kv.blocks_to_admit(hits, 9) == 3  # the hits leave the free pool too, plus one new block
    hog = arrive(kv, "c", 16)
    assert kv.allocate_slots(hog, 16)  # takes every block: the cached ones are evicted
    assert kv.get_computed_blocks(later) == ([], 0)


def test_a_preempted_request_finds_its_own_blocks_including_outputs():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    request = arrive(kv, "a", list(range(1, 7)), max_tokens=10)
    computed(kv, request, 6)
    for token in (40, 41, 42):  # 9 tokens; KV computed for the first 8 below
        request.append_output_token(token)
    computed(kv, request, 8)
    request.status = RequestStatus.PREEMPTED
    kv.free(request)
    request.num_computed_tokens = 0
    hits, num_tokens = kv.get_computed_blocks(request)
    assert num_tokens == 8 and len(hits) == 2


def test_without_prefix_caching_nothing_is_shared():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = arrive(kv, "a", list(range(1, 10)))
    computed(kv, first, 9)
    assert kv.pool.num_cached_blocks == 0 and first.block_hashes == []
    assert kv.get_computed_blocks(arrive(kv, "b", list(range(1, 10)))) == ([], 0)


def test_free_returns_every_block_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = arrive(kv, "a", 20)
    computed(kv, request, 20)
    first_block = request.block_ids[0]
    request.status = RequestStatus.FINISHED_ABORTED
    kv.free(request)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    # Never-used blocks go first, then the request's tail: its first block (the most shareable) outlives the rest.
    assert kv.allocate_slots(arrive(kv, "b", 28), 28)
    assert kv.pool.num_cached_blocks == 1 and kv.pool.get_cached_block(request.block_hashes[0]) == first_block


def test_a_request_kept_out_of_the_prefix_cache_neither_fills_nor_reads_it():
    """The start-up profile's random prompts: their blocks come back contentless, to the free front, so the next
    request writes into memory already resident instead of the profile's blocks staying at the LRU's back."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    profile = make_request("profile-1", list(range(1, 13)))
    profile.prefix_cache = False
    kv.hash_prompt(profile)
    computed(kv, profile, 12)
    used = list(profile.block_ids)
    assert kv.pool.num_cached_blocks == 0
    kv.free(profile)
    same = arrive(kv, "same-prompt", list(range(1, 13)))
    assert kv.get_computed_blocks(same) == ([], 0)
    assert kv.allocate_slots(same, 12) and sorted(same.block_ids) == sorted(used)
