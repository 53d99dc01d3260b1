"""Request: one token list (prompt, then outputs); the prompt and output views are read-only copies of it."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams


def test_outputs_follow_the_prompt_in_the_one_token_list():
    request = Request("r", [5, 6, 7], SamplingParams())
    for token in (8, 9):
        request.append_output_token(token)
    assert request.token_ids == [5, 6, 7, 8, 9]
    assert request.prompt_token_ids == (5, 6, 7) and request.output_token_ids == (8, 9)
    assert request.num_prompt_tokens == 3 and request.num_output_tokens == 2 and request.num_tokens == 5


def test_the_views_cannot_change_the_request():
    request = Request("r", [5, 6, 7], SamplingParams())
    outputs = request.output_token_ids
    with pytest.raises(AttributeError):
        outputs.append(1)  # a copy: appending goes through append_output_token
    with pytest.raises(AttributeError):
        request.output_token_ids = (1, 2)
    request.append_output_token(4)
    assert outputs == () and request.output_token_ids == (4,)


def test_appended_tokens_extend_the_block_hashes_as_hashing_from_scratch_would():
    grown = Request("a", list(range(10)), SamplingParams())
    grown.hash_blocks(4)
    for token in range(10, 17):
        grown.append_output_token(token)
    fresh = Request("b", list(range(17)), SamplingParams())
    fresh.hash_blocks(4)
    assert len(grown.block_hashes) == 4 and grown.block_hashes == fresh.block_hashes
