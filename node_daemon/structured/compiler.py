"""Grammars bound to the served model's tokenizer, compiled once per grammar and shared by every request.

Building the library's view of a vocabulary takes about a second, so it happens once, on first use. A
compiled grammar is a ready matcher kept as a template; each request gets a copy of it (matcher.Matcher).
compile() is thread-safe and drops the GIL inside the library; the server calls compile_async() so the
event loop never waits on it.
"""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict

import llguidance
import torch

from stallfree.node_daemon.structured.grammar import Grammar
from stallfree.node_daemon.structured.matcher import Matcher, bitmask_words
from stallfree.node_daemon.structured.vocabulary import grammar_vocabulary
from stallfree.node_daemon.text.tokenizer import Tokenizer


class CompiledGrammar:
    """A grammar ready for one tokenizer: new_matcher() for each sequence that must follow it."""

    def __init__(self, grammar: Grammar, template: llguidance.LLMatcher, vocab_size: int) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self._template = template
        self._lock = threading.Lock()
        self.first_mask_s = 0.0  # how long the first token's mask took at compile (a hint of the masks to come)

    def new_matcher(self) -> Matcher:
        with self._lock:
            matcher = Matcher(self._template.deep_copy(), self.vocab_size, self.grammar.origin)
        matcher.last_mask_s = self.first_mask_s
        return matcher


class GrammarCompiler:
    """Compiles Grammars for one tokenizer, keeping the most recent `max_cached` (keyed by the grammar text).

    `vocab_size` is the model's logits width, which may exceed the tokenizer's (padded embeddings): the
    padding ids are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, max_cached: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self.max_cached = max_cached
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self.compiles = 0  # library compiles so far (cache misses), for metrics and tests

    @property
    def has_vocabulary(self) -> bool:
        """The library's view of the vocabulary is built (ll_tokenizer() returns at once)."""
        return self._ll_tokenizer is not None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = grammar_vocabulary(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The compiled grammar (from the cache when it was compiled before); ValueError when the library refuses it."""
        with self._lock:
            hit = self._cache.get(grammar.text)
            if hit is not None:
                self._cache.move_to_end(grammar.text)
                return hit
        template = llguidance.LLMatcher(self.ll_tokenizer(), grammar.text, log_level=0)
        if template.is_error():
            raise ValueError(f"{grammar.origin}: {template.get_error()}")
        compiled = CompiledGrammar(grammar, template, self.vocab_size)
        first = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        probe = compiled.new_matcher()
        if not probe.fill_mask(first):
            raise ValueError(f"{grammar.origin}: no token of this model's vocabulary can begin an output it allows")
        compiled.first_mask_s = probe.last_mask_s
        with self._lock:
            self.compiles += 1
            self._cache[grammar.text] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    async def compile_async(self, grammar: Grammar) -> CompiledGrammar:
        """compile() on a worker thread: the first call builds the vocabulary (about a second)."""
        return await asyncio.to_thread(self.compile, grammar)
