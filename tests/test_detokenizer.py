"""Incremental detokenization: never a split UTF-8 character, stop strings cut and held back, constant window."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.node_daemon.text.detokenizer import IncrementalDetokenizer
from stallfree.node_daemon.text.tokenizer import byte_level_tokenizer

TK = byte_level_tokenizer(259)  # bytes and specials only: every multi-byte character arrives split


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add_tokens([i]) for i in ids]
    deltas.append(detok.finish())
    return deltas


def test_multibyte_characters_are_never_split() -> None:
    text = "héllo 日本 🙂 done"
    deltas = _stream(IncrementalDetokenizer(TK), TK.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The four bytes of the emoji produce nothing until the last one arrives.
    emoji_bytes = len("🙂".encode())
    start = len("héllo 日本 ".encode())
    assert deltas[start:start + emoji_bytes - 1] == [""] * (emoji_bytes - 1)
    assert deltas[start + emoji_bytes - 1] == "🙂"


def test_stop_string_is_cut_and_its_prefix_held_back() -> None:
    detok = IncrementalDetokenizer(TK, stop=["STOP"])
    deltas = _stream(detok, TK.encode("Hello STOP world"))
    assert "".join(deltas) == "Hello "
    assert detok.stopped and detok.stopped_by == "STOP"
    assert "S" not in "".join(deltas[: len("Hello S")])  # the S could have begun the stop string
    assert detok.add_tokens(TK.encode("more")) == ""  # nothing after a stop


def test_held_back_prefix_is_released_when_it_does_not_match() -> None:
    detok = IncrementalDetokenizer(TK, stop=["STOP"])
    deltas = [detok.add_tokens([i]) for i in TK.encode("a ST")]
    assert "".join(deltas) == "a "
    assert detok.add_tokens(TK.encode("x")) == "STx"  # "STx" can no longer become "STOP"
    assert detok.add_tokens(TK.encode("ST")) == ""
    assert detok.finish() == "ST" and not detok.stopped


def test_earliest_of_several_stop_strings_wins_even_inside_one_token() -> None:
    tk = byte_level_tokenizer(512)
    detok = IncrementalDetokenizer(tk, stop=["world", "lo w"])
    out = detok.add_tokens(tk.encode("hello world!"))  # all at once: both stops inside one update
    assert out + detok.finish() == "hel" and detok.stopped_by == "lo w"


def test_stop_string_with_multibyte_characters() -> None:
    detok = IncrementalDetokenizer(TK, stop=["日本"])
    assert "".join(_stream(detok, TK.encode("ok 日本語"))) == "ok "
    assert detok.stopped_by == "日本"


def test_invalid_bytes_are_emitted_once_the_stream_moves_on_or_ends() -> None:
    detok = IncrementalDetokenizer(TK)
    assert detok.add_tokens([0x80]) == ""  # a lone continuation byte: held back like a split character
    assert detok.add_tokens([ord("a")]) == "\ufffda"
    assert detok.add_tokens([0xE6, 0x97]) == ""  # the start of a 3-byte character, then the request ends
    assert detok.finish() == "\ufffd"


def test_special_tokens_are_skipped_and_prompt_context_is_not_emitted() -> None:
    eos = TK.eos_token_ids[0]
    prompt = TK.encode("prompt text")
    detok = IncrementalDetokenizer(TK, prompt_token_ids=prompt)
    assert "".join(_stream(detok, TK.encode("answer") + [eos])) == "answer"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=80),
       st.lists(st.integers(1, 5), min_size=1, max_size=40), st.sampled_from([[], ["\n"], ["é!", "zz"]]))
def test_streamed_text_equals_the_full_decode_cut_at_the_first_stop(text: str, sizes: list[int], stop: list[str]) -> None:
    ids = TK.encode(text)
    detok = IncrementalDetokenizer(TK, prompt_token_ids=TK.encode("ctx é"), stop=stop)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(detok.add_tokens(ids[i:i + n]))
        i, k = i + n, k + 1
    out.append(detok.finish())
    full = TK.decode(ids)
    cuts = [full.find(s) for s in stop if s in full]
    expected = full[: min(cuts)] if cuts else full
    assert "".join(out) == expected
    assert all("\ufffd" not in d for d in out[:-1])


def test_long_output_window_slides_and_stays_exact() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("abc é日🙂\n") for _ in range(600))
    detok = IncrementalDetokenizer(TK)
    assert "".join(_stream(detok, TK.encode(text))) == text
