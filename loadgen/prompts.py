"""Prompt text of an asked token length, for load against any OpenAI-compatible endpoint.

Built from plain words: exactly to the count with a tokenizer (a model folder, .gguf or shape name), else by
characters per token (about 4 for English BPE, 1 for the sim daemon's byte-level tokenizer).
"""
from __future__ import annotations

import random
from typing import Any

from stallfree.simulator.workload import RequestSpec

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "number group problem fact river mountain garden window engine cloud signal market music letter paper "
          "story light water table road voice field state city night heart power money table answer reason").split()



class PromptBuilder:
    """Text of a given token length: exact with a tokenizer, approximate by characters per token."""

    def __init__(self, tokenizer: Any | None = None, chars_per_token: float = 4.0) -> None:
        if tokenizer is None and not chars_per_token > 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token

    def text(self, num_tokens: int, seed: int, lead: str = "") -> str:
        rng = random.Random(seed)
        if self.tokenizer is None:
            chars = max(1, round(num_tokens * self.chars_per_token))
            parts, length = [lead] if lead else [], len(lead)
            while length < chars:
                word = (" " if parts else "") + rng.choice(_WORDS)
                parts.append(word)
                length += len(word)
            return "".join(parts)[:chars]
        words = [lead] if lead else []
        ids: list[int] = []
        while len(ids) < num_tokens:
            words += [rng.choice(_WORDS) for _ in range(max(8, num_tokens - len(ids)))]
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False)
        return self.tokenizer.decode(ids[:num_tokens])

    def prompt(self, request: RequestSpec, index: int) -> str:
        """The group's shared prefix, then text that opens with the request's index (no accidental cache hits)."""
        shared = self.text(request.shared_prefix_len, 1_000_003 + request.prefix_group) if request.shared_prefix_len else ""
        unique = self.text(request.prompt_len - request.shared_prefix_len, index, lead=f"{index}:")
        return shared + (" " if shared and unique else "") + unique


def load_prompt_tokenizer(source: str) -> Any:
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    return load_tokenizer(source)
