"""The physical KV blocks: reference counts, the content-hash index of cached full blocks, LRU eviction.

A block is free when no request references it. A free block may still hold a cached full block (its
hash stays in the index) until it is handed out again: the free queue is the LRU order, front first.
Free blocks without content go to the front so they are reused before any cached block is evicted;
cached blocks go to the back, so the least recently released cached block is evicted first.

Pure Python, no torch: the model runner owns the tensors, this file owns which block holds what.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Callable

# A block's content hash: sha256 over its parent's hash and its token ids, so equal hashes mean the
# same whole prefix. A cryptographic hash because a collision would serve one tenant another's KV.
BlockHash = bytes
ROOT_HASH: BlockHash = b""


_PACKERS: dict[int, Callable[..., bytes]] = {}


def hash_block_tokens(parent_hash: BlockHash, token_ids: list[int]) -> BlockHash:
    """Chained content hash of one full block (token ids packed as little-endian int64)."""
    pack = _PACKERS.get(len(token_ids))
    if pack is None:
        pack = _PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q").pack
    return hashlib.sha256(parent_hash + pack(*token_ids)).digest()


class KVBlock:
    """One block of `block_size` KV slots."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix-cache index

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns the blocks and the prefix-cache index: callers cache and look up through its verbs."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> None, in LRU order (front = next handed out). OrderedDict: O(1) removal on a hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # content hash -> block_id
        self.num_evictions = 0  # cached blocks handed out again (their cached content lost)

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index, referenced or not."""
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def get_cached_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """Block ids of the longest run of cached blocks at the start of `block_hashes[:max_blocks]`."""
        cached = self._cached
        hits: list[int] = []
        for i in range(min(max_blocks, len(block_hashes))):
            block_id = cached.get(block_hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_unreferenced(self, block_ids: list[int]) -> int:
        """How many of these blocks are free (cached but unused): taking them shrinks the free pool."""
        blocks = self.blocks
        return sum(1 for block_id in block_ids if blocks[block_id].ref_cnt == 0)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, n: int) -> list[int]:
        """Hand out n blocks with ref_cnt 1, evicting cached ones from the LRU front. Caller checks room."""
        free = self._free
        if n > len(free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(free)} free")
        popitem, blocks, cached = free.popitem, self.blocks, self._cached
        out = []
        evicted = 0
        for _ in range(n):
            block_id = popitem(False)[0]
            block = blocks[block_id]
            if block.block_hash is not None:
                del cached[block.block_hash]  # a block carries a hash only while the index points at it
                block.block_hash = None
                evicted += 1
            block.ref_cnt = 1
            out.append(block_id)
        self.num_evictions += evicted
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit); a free one leaves the free queue."""
        free, blocks = self._free, self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_cnt == 0:
                del free[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference per block; pass a block table tail-first so its tail is evicted first."""
        free, blocks = self._free, self.blocks
        for block_id in block_ids:
            block = blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block_id] = None
                if block.block_hash is None:
                    free.move_to_end(block_id, last=False)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block_id} released more often than referenced")

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Index a full block by content. A duplicate of an already cached block stays unindexed."""
        cached = self._cached
        if block_hash in cached:
            return
        self.blocks[block_id].block_hash = block_hash
        cached[block_hash] = block_id
