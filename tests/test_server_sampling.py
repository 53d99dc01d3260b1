"""logprobs, n > 1, penalties, min_p, logit_bias and echo through the real `openai` client (tiny random model).

The values themselves are checked against the model's logits in test_engine_logprobs.py and test_sampler.py;
here: OpenAI's response shapes, streamed and not, the validation errors, and that n > 1 shares the prompt's KV.
"""
from __future__ import annotations

import random

import openai
import pytest

from server_helpers import LiveDaemon, running_daemon

MODEL = "tiny"
BLOCK_SIZE = 16  # the daemon's default


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon(["--no-profile"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(live: LiveDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Say something about paged attention."}]
GREEDY = dict(model=MODEL, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


def test_chat_logprobs_streamed_and_not_agree(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True,
                                                 **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(messages=MESSAGES, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completion_logprobs_shape_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(prompt="The block table maps", logprobs=2, **GREEDY)
    r = client.completions.create(**kwargs)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    chunks = list(client.completions.create(stream=True, **kwargs))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def _fresh_prompt(length: int) -> list[int]:
    """Token ids no other test sent, so the prefix cache holds nothing of them yet."""
    rng = random.Random(length * 7919)
    return [rng.randrange(3, 500) for _ in range(length)]


def test_n2_seeded_gives_two_different_reproducible_samples_sharing_the_prompt(client: openai.OpenAI) -> None:
    prompt = _fresh_prompt(3 * BLOCK_SIZE + 5)
    kwargs = dict(model=MODEL, prompt=prompt, n=2, temperature=1.0, seed=7, max_tokens=12,
                  extra_body={"ignore_eos": True})
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.text for c in r.choices]
    assert texts[0] != texts[1]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 24
    # Choice 1 started after choice 0's prompt was cached: its full blocks came from the prefix cache.
    assert r.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK_SIZE
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == texts
    # Choice 0 alone with the same seed is the n=1 answer.
    single = client.completions.create(**{**kwargs, "n": 1})
    assert single.choices[0].text == texts[0]


def test_n3_chat_stream_names_each_choice_and_counts_usage_once(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(messages=MESSAGES, n=3, stream=True, temperature=1.0, seed=3,
                                                 max_tokens=5, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, model=MODEL))
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [0, 1, 2]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 15
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert len(set(texts.values())) > 1


def test_logit_bias_forces_a_token_and_penalties_are_accepted(client: openai.OpenAI, live: LiveDaemon) -> None:
    r = client.completions.create(model=MODEL, prompt="bias", max_tokens=5, temperature=1.0,
                                  logit_bias={"65": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == live.daemon.engine.decode([65] * 5)
    r = client.chat.completions.create(messages=MESSAGES, presence_penalty=1.5, frequency_penalty=-0.5,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1},
                                       model=MODEL, max_tokens=6, temperature=0.8, seed=1)
    assert r.usage.completion_tokens == 6


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    prompt = "Echo this prompt"
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].text == prompt + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_values_out_of_range_are_400(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=fields)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("fields, param", [({"logprobs": 6}, "logprobs"), ({"logprobs": 1, "echo": True}, "logprobs")])
def test_completion_logprobs_out_of_range_are_400(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=fields)
    assert info.value.body["param"] == param


def test_everything_freed_after_the_module(live: LiveDaemon, client: openai.OpenAI) -> None:
    live.wait_idle()
    kv = live.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert live.daemon.admission.queued_requests == 0 and live.daemon.admission.queued_tokens == 0
