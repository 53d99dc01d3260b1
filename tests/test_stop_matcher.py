"""Stop strings: the first to complete wins, across token boundaries, never emitted unless asked; the work per token
is bounded by the longest stop string and the new text, whatever their number."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.node_daemon.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from stallfree.node_daemon.text.detokenizer import IncrementalDetokenizer
from stallfree.node_daemon.text.stop_matcher import StopMatcher
from stallfree.node_daemon.text.tokenizer import byte_level_tokenizer

TK = byte_level_tokenizer(259)


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text up to the stop that completes first (the longest of those completing at the same character)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


def _run(text: str, stops: list[str], sizes: list[int], include_stop: bool = False) -> tuple[str, IncrementalDetokenizer]:
    ids = TK.encode(text)
    detok = IncrementalDetokenizer(TK, stop=stops, include_stop=include_stop)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(detok.add_tokens(ids[i:i + n]))
        i, k = i + n, k + 1
    out.append(detok.finish())
    return "".join(out), detok


def test_stop_split_across_tokens_is_cut_and_not_emitted() -> None:
    out, detok = _run("say <|end|> then more", ["<|end|>"], [1])
    assert out == "say " and detok.stopped_by == "<|end|>"
    out, detok = _run("say <|end|> then more", ["<|end|>"], [3, 2, 5])
    assert out == "say " and detok.stopped_by == "<|end|>"


def test_the_first_stop_to_complete_wins_whatever_the_token_split() -> None:
    # "bc" completes before "abcd" does; "xyz" and "yz" complete together: the longer one is cut.
    for sizes in ([1], [2], [4], [100]):
        assert _run("xabcd", ["abcd", "bc"], sizes)[0] == "xa"
        out, detok = _run("..xyz..", ["yz", "xyz"], sizes)
        assert out == ".." and detok.stopped_by == "xyz"


def test_include_stop_str_in_output_keeps_the_stop_and_nothing_after() -> None:
    for sizes in ([1], [3], [100]):
        out, detok = _run("answer: 42\n\nnext", ["\n\n"], sizes, include_stop=True)
        assert out == "answer: 42\n\n" and detok.stopped_by == "\n\n"


def test_a_held_prefix_that_does_not_finish_the_stop_is_released() -> None:
    out, detok = _run("a <|en|> b <|e", ["<|end|>"], [1])
    assert out == "a <|en|> b <|e" and not detok.stopped


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="abc", max_size=40), st.lists(st.text(alphabet="abc", max_size=4), max_size=6),
       st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_streamed_output_equals_the_reference(text: str, stops: list[str], sizes: list[int]) -> None:
    expected, stop = _reference(text, stops)
    out, detok = _run(text, stops, sizes)
    assert out == expected and detok.stopped_by == stop


def _worst_stops(count: int) -> list[str]:
    """Long stops that share a long prefix with the text fed below: every character extends a partial match."""
    return ["a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(count)]


def test_work_per_token_is_bounded_by_the_longest_stop_not_their_number() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("aaaaaaab") for _ in range(20_000))
    totals = {}
    for count in (1, MAX_STOP_STRINGS):
        matcher = StopMatcher(_worst_stops(count))
        fed = 0
        while fed < len(text):
            new = text[fed:fed + rng.randint(1, 8)]  # a token's worth of characters
            before, held = matcher.steps, matcher.held
            assert matcher.feed(new) is None
            # One transition per character, plus failure links that can only undo what was held or added.
            assert matcher.steps - before <= 2 * len(new) + held
            assert held <= MAX_STOP_CHARS
            fed += len(new)
        totals[count] = matcher.steps
    assert totals[MAX_STOP_STRINGS] <= 2 * len(text)
    assert totals[MAX_STOP_STRINGS] == totals[1]  # the same walk: their number adds nothing


def test_the_detokenizer_feeds_each_character_once() -> None:
    text = "a" * 3000
    detok = IncrementalDetokenizer(TK, stop=_worst_stops(MAX_STOP_STRINGS))
    out = [detok.add_tokens([token]) for token in TK.encode(text)]
    assert detok._stops.steps <= 2 * len(text)  # no re-scan of a tail per token
    assert "".join(out) == text[:-(MAX_STOP_CHARS - 1)]  # the tail that could still become a stop is held
    assert detok.finish() == "a" * (MAX_STOP_CHARS - 1)


class _CountingStr(str):
    """A stop string that counts how often it is sliced or walked."""

    touches = 0

    def __getitem__(self, key):
        _CountingStr.touches += 1
        return str.__getitem__(self, key)

    def __iter__(self):
        _CountingStr.touches += 1
        return str.__iter__(self)


def test_no_stop_string_is_walked_again_once_the_request_started() -> None:
    # The old matcher compared every stop string's prefixes with the text's tail at every token.
    stops = [_CountingStr(s) for s in _worst_stops(MAX_STOP_STRINGS)]
    detok = IncrementalDetokenizer(TK, stop=stops)
    _CountingStr.touches = 0
    for token in TK.encode("a" * 500 + "b"):
        detok.add_tokens([token])
    assert _CountingStr.touches == 0
    assert detok.stopped_by == "a" * (MAX_STOP_CHARS - 1) + "b"
