"""Which KV blocks each request holds: block tables, prefix-cache lookups and caching of full blocks.

The scheduler speaks to this file in its own verbs: look up a waiting request's cached prefix
(`get_computed_blocks`), ask what admitting it would take from the free pool (`blocks_to_admit`), give a
request room for its next tokens (`allocate_slots`), index blocks the model just filled
(`cache_full_blocks`) and give everything back (`free`). `request.block_ids` is the block table the model
runner reads: token position p of a request lives in slot block_ids[p // block_size] * block_size +
p % block_size. The block pool owns the blocks and the index; this file only calls its verbs.

Content hashes are chained over full blocks of the request's tokens (prompt, then outputs, so a
request preempted by recompute finds its own blocks again); the request keeps them, extended as its
tokens arrive. A hit never covers the last token: the model must run at least one position to produce
logits. Blocks are indexed only after the model has written them (from update_from_output), so a hit
never reads KV that a step has yet to compute, and an aborted step leaves nothing wrong in the index.
"""
from __future__ import annotations

from stallfree.node_daemon.engine.block_pool import BlockPool
from stallfree.node_daemon.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Per running request: how many leading blocks of its block table are in the prefix-cache index.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests (0..1); cached but unreferenced blocks count as free."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far to make room (their prefix is computed again on its next use)."""
        return self.pool.num_evictions

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_prompt(self, request: Request) -> None:
        """On arrival: hash the prompt's full blocks, and the outputs' as they come (prefix caching only)."""
        if self.enable_prefix_caching and request.prefix_cache:
            request.hash_blocks(self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached full-block prefix of the request's tokens: (block ids, number of tokens)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size  # never the last token
        if max_blocks <= 0:
            return [], 0
        hits = self.pool.get_cached_prefix(request.block_hashes, max_blocks)
        return hits, len(hits) * self.block_size

    def blocks_to_admit(self, computed_blocks: list[int], num_tokens: int) -> int:
        """Blocks that holding `num_tokens` would take out of the free pool, given these prefix hits.

        A hit on an unreferenced cached block takes that block out of the free pool too.
        """
        num_hits_free = self.pool.num_unreferenced(computed_blocks)
        return max(0, self.blocks_for(num_tokens) - len(computed_blocks)) + num_hits_free

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (and nothing changed) if KV is short.

        `computed_blocks` (prefix hits from get_computed_blocks) only on admission, when the request holds
        no blocks; the caller then sets num_computed_tokens to their token count.
        """
        block_ids = request.block_ids
        pool = self.pool
        num_hits = len(computed_blocks) if computed_blocks else 0
        num_tokens = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // self.block_size) - len(block_ids) - num_hits
        if num_hits:
            if block_ids or request.num_computed_tokens:
                raise RuntimeError(f"prefix hits for {request.request_id!r}, which already holds KV blocks")
            if max(0, num_new_blocks) + pool.num_unreferenced(computed_blocks) > pool.num_free_blocks:
                return False
            pool.touch(computed_blocks)  # before allocating, so eviction cannot take a hit
            block_ids.extend(computed_blocks)
            self._num_cached_blocks[request.request_id] = num_hits
        elif num_new_blocks > pool.num_free_blocks:
            return False
        if num_new_blocks > 0:
            block_ids.extend(pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are now full of computed KV (call after the model ran).

        Per decode this runs once every block_size tokens, so it is written flat.
        """
        if not self.enable_prefix_caching or not request.prefix_cache:
            return
        num_full = request.num_computed_tokens // self.block_size
        request_id = request.request_id
        num_cached = self._num_cached_blocks
        done = num_cached.get(request_id, 0)
        if num_full <= done:
            return
        hashes = request.block_hashes  # complete: computed tokens are tokens, and each full block is hashed
        block_ids = request.block_ids
        cache_block = self.pool.cache_block
        for i in range(done, num_full):
            cache_block(block_ids[i], hashes[i])
        num_cached[request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (a verification's rejected draft slots). They hold no
        computed KV, so none is in the prefix-cache index."""
        keep = self.blocks_for(num_tokens)
        block_ids = request.block_ids
        if len(block_ids) > keep:
            self.pool.release(block_ids[keep:][::-1])
            del block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its tail is evicted first) and clear its block table.

        A preempted request keeps its content hashes: it will look its own blocks up again on resume.
        """
        if request.block_ids:
            self.pool.release(request.block_ids[::-1])
            request.block_ids = []
        self._num_cached_blocks.pop(request.request_id, None)
