"""Prefix affinity: which replica recently took a prompt's leading blocks (so likely still caches them).

The router never tokenizes; it hashes the prompt's text in blocks of about `block_tokens` tokens
(`chars_per_token` characters each), chained so a block's hash stands for everything before it, as
the daemons' prefix cache hashes token blocks. Each replica's table forgets least-recently-sent blocks
beyond that replica's KV capacity, the way its cache evicts. Pure data structure: no I/O, no clock.
"""
from __future__ import annotations

from collections import OrderedDict

DEFAULT_BLOCK_TOKENS = 64
# Only the leading part of a prompt is worth remembering: a shared system prompt, a conversation's history.
DEFAULT_MAX_BLOCKS = 128


def prefix_hashes(text: str, block_chars: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[int]:
    """Chained hashes of the full leading blocks of `text` (a partial last block is not cacheable)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        previous = hash((previous, text[start:start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixTable:
    """Per replica, an LRU of block hashes it was sent, bounded by its KV capacity in blocks."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS, default_capacity_tokens: int = 1 << 20) -> None:
        self.block_tokens = block_tokens
        self.default_capacity_tokens = default_capacity_tokens
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity_blocks: dict[str, int] = {}

    def set_capacity(self, replica: str, kv_capacity_tokens: int) -> None:
        if kv_capacity_tokens > 0:
            self._capacity_blocks[replica] = max(1, kv_capacity_tokens // self.block_tokens)

    def cached_tokens(self, replica: str, hashes: list[int]) -> int:
        """Tokens of the longest leading run of `hashes` that `replica` still holds."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        matched = 0
        for h in hashes:
            if h not in blocks:
                break
            matched += 1
        return matched * self.block_tokens

    def record(self, replica: str, hashes: list[int], prompt_tokens: int) -> None:
        """`replica` was sent a prompt with these leading blocks; its other `prompt_tokens` take room too."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        capacity = self._capacity_blocks.get(replica, self.default_capacity_tokens // self.block_tokens)
        # The unshared rest of the prompt also occupies the cache (and evicts) while it runs.
        limit = max(len(hashes), capacity - max(0, prompt_tokens // self.block_tokens - len(hashes)))
        while len(blocks) > limit:
            blocks.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica restarted or left: its cache is gone."""
        self._blocks.pop(replica, None)
