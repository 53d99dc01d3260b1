"""Which KV blocks each request holds: block tables, prefix-cache lookups and caching of full blocks.

The scheduler speaks to this file in its own verbs: look up a waiting request's cached prefix
(`get_computed_blocks`), ask what admitting it would take from the free pool (`blocks_to_admit`), give a
request room for its next tokens (`allocate_slots`), index blocks the model just filled
(`cache_full_blocks`) and give everything back (`free`). `request.block_ids` is the block table the model
runner reads: token position p of a request lives in slot block_ids[p // block_size] * block_size +
p % block_size.

Content hashes are chained over full blocks of the request's tokens (prompt, then outputs, so a
request preempted by recompute finds its own blocks again). A hit never covers the last token: the
model must run at least one position to produce logits. Blocks are indexed only after the model has
written them (from update_from_output), so a hit never reads KV that a step has yet to compute, and an
aborted step leaves nothing wrong in the index. A prompt's hashes are computed once, on arrival.
"""
from __future__ import annotations

from stallfree.node_daemon.engine.block_pool import ROOT_HASH, BlockHash, BlockPool, hash_block_tokens
from stallfree.node_daemon.engine.request import Request, RequestStatus


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        # Per live request: content hashes of its full blocks computed so far (kept across preemption),
        # and how many leading blocks of its current block table are already in the prefix-cache index.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters in tokens, counted once per admission (a retried lookup is not a query).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix-cache index (referenced or not)."""
        return len(self.pool.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached full-block prefix of the request's tokens: (block ids, number of tokens)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size  # never the last token
        if max_blocks <= 0:
            return [], 0
        hashes = self._hashes_up_to(request, max_blocks)
        cached = self.pool.cached
        hits: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def blocks_to_admit(self, computed_blocks: list[int], num_tokens: int) -> int:
        """Blocks that holding `num_tokens` would take out of the free pool, given these prefix hits.

        A hit on an unreferenced cached block takes that block out of the free pool too.
        """
        blocks = self.pool.blocks
        num_hits_free = sum(1 for block_id in computed_blocks if blocks[block_id].ref_cnt == 0)
        return max(0, self.blocks_for(num_tokens) - len(computed_blocks)) + num_hits_free

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (and nothing changed) if KV is short.

        `computed_blocks` (prefix hits from get_computed_blocks) only on admission, when the request holds
        no blocks; the caller then sets num_computed_tokens to their token count.
        """
        block_ids = request.block_ids
        pool = self.pool
        admitting = not block_ids and not request.num_computed_tokens
        num_hits = len(computed_blocks) if computed_blocks else 0
        num_tokens = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // self.block_size) - len(block_ids) - num_hits
        if num_hits:
            if not admitting:
                raise RuntimeError(f"prefix hits for {request.request_id!r}, which already holds KV blocks")
            blocks = pool.blocks
            num_hits_free = sum(1 for block_id in computed_blocks if blocks[block_id].ref_cnt == 0)
            if max(0, num_new_blocks) + num_hits_free > pool.num_free_blocks:
                return False
            pool.touch(computed_blocks)  # before allocating, so eviction cannot take a hit
            block_ids.extend(computed_blocks)
            self._num_cached_blocks[request.request_id] = num_hits
        elif num_new_blocks > pool.num_free_blocks:
            return False
        if admitting and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hits * self.block_size
        if num_new_blocks > 0:
            block_ids.extend(pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's blocks that are now full of computed KV (call after the model ran).

        Per decode this runs once every block_size tokens, so it is written flat.
        """
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        request_id = request.request_id
        num_cached = self._num_cached_blocks
        done = num_cached.get(request_id, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes.get(request_id)
        if hashes is None or len(hashes) < num_full:
            hashes = self._hashes_up_to(request, num_full)
        block_ids = request.block_ids
        cached = self.pool.cached
        blocks = self.pool.blocks
        for i in range(done, num_full):
            block_hash = hashes[i]
            if block_hash not in cached:  # a duplicate of a cached block stays unindexed
                block_id = block_ids[i]
                blocks[block_id].block_hash = block_hash
                cached[block_hash] = block_id
        num_cached[request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its tail is evicted first) and clear its block table.

        A preempted request keeps its content hashes: it will look its own blocks up again on resume.
        """
        if request.block_ids:
            self.pool.release(request.block_ids[::-1])
            request.block_ids = []
        request_id = request.request_id
        self._num_cached_blocks.pop(request_id, None)
        if request.status is not RequestStatus.PREEMPTED:
            self._block_hashes.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (e.g. after new weights); False while any block is in use."""
        return self.pool.reset_prefix_cache()

    def _hashes_up_to(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Content hashes of the request's first `num_blocks` full blocks, extending the per-request memo."""
        hashes = self._block_hashes.get(request.request_id)
        if hashes is None:
            hashes = self._block_hashes[request.request_id] = []
        if len(hashes) < num_blocks:
            size = self.block_size
            prompt = request.prompt_token_ids
            outputs = request.output_token_ids
            num_prompt = len(prompt)
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), num_blocks):
                start, end = i * size, (i + 1) * size
                if end <= num_prompt:
                    tokens = prompt[start:end]
                elif start >= num_prompt:
                    tokens = outputs[start - num_prompt:end - num_prompt]
                else:
                    tokens = prompt[start:] + outputs[:end - num_prompt]
                parent = hash_block_tokens(parent, tokens)
                hashes.append(parent)
        return hashes

    def hash_prompt(self, request: Request) -> None:
        """Hash the prompt's full blocks once, on arrival, so lookups in the scheduling step are cheap."""
        if self.enable_prefix_caching:
            self._hashes_up_to(request, (request.num_prompt_tokens - 1) // self.block_size)
