"""What a request must meet to be served, stated once (engine/request_rules.py): the server's 400s and the engine's
ValueErrors are the same rule."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.engine.request_rules import (InvalidRequest, RequestLimits, check_prompt_tokens,
                                                        check_request, kv_footprint)
from stallfree.node_daemon.engine.sampling_params import SamplingParams

LIMITS = RequestLimits(max_model_len=256, vocab_size=100, num_kv_blocks=16, block_size=4)


@pytest.mark.parametrize("ids, message, code", [
    ([], "empty", "invalid_value"),
    ([1] * 300, "it may have at most 255", "context_length_exceeded"),
    ([1, 100], r"outside the vocabulary \[0, 100\)", "invalid_value"),
    ([1, True], "outside the vocabulary", "invalid_value"),
])
def test_prompt_tokens(ids, message, code) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        check_prompt_tokens(ids, LIMITS)
    assert caught.value.code == code and caught.value.param == "prompt"
    check_prompt_tokens([0, 99], LIMITS)


@pytest.mark.parametrize("num_prompt, sampling, message, param", [
    (0, SamplingParams(), "empty", "prompt"),
    (256, SamplingParams(), "maximum context length is 256", "prompt"),
    (10, SamplingParams(max_tokens=0), "max_tokens must be at least 1", "max_tokens"),
    (10, SamplingParams(temperature=-1.0), "temperature", "temperature"),
    (10, SamplingParams(temperature=2.5), r"temperature must be in \[0, 2\]", "temperature"),
    (10, SamplingParams(stop=["x"] * 17), "at most 16 strings", "stop"),
    (60, SamplingParams(max_tokens=50), "whole cache holds 16 blocks of 4", "max_tokens"),
])
def test_the_request(num_prompt, sampling, message, param) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        check_request(num_prompt, sampling, LIMITS)
    assert caught.value.param == param
    assert isinstance(caught.value, ValueError)  # direct callers of the engine catch ValueError


def test_the_length_rule_leaves_room_for_one_output_token_and_max_tokens_may_pass_the_context() -> None:
    check_request(11, SamplingParams(max_tokens=50), RequestLimits(12, None, 16, 4))
    with pytest.raises(InvalidRequest, match="at most 11"):
        check_request(12, SamplingParams(), RequestLimits(12, None, 16, 4))
    # The KV a request holds at its end: the context caps it, and the last token's KV is never written.
    assert kv_footprint(11, 50, 12) == 11 and kv_footprint(10, 4, 256) == 13 and kv_footprint(10, 1, 256) == 10


@pytest.mark.parametrize("stop", [["x"] * 17, ["y" * 257]])
def test_stop_strings_past_the_bound_are_refused_naming_stop(stop: list[str]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_request(4, SamplingParams(stop=stop), LIMITS)
    assert caught.value.param == "stop"
    check_request(4, SamplingParams(stop=["y" * 256] * 16, max_tokens=4), LIMITS)  # at the bound: served
