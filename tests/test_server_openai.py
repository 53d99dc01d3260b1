"""The official `openai` client against a real daemon (tiny random model) on loopback uvicorn."""
from __future__ import annotations

import openai
import pytest

from server_helpers import LiveDaemon, running_daemon

MODEL = "tiny"


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    with running_daemon() as live:
        yield live


@pytest.fixture(scope="module")
def client(live: LiveDaemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt_len(live: LiveDaemon, text: str) -> int:
    return len(live.daemon.engine.encode(text))


def _chat_prompt_len(live: LiveDaemon, messages: list[dict]) -> int:
    engine = live.daemon.engine
    return len(engine.encode(engine.apply_chat_template(messages, add_generation_prompt=True)))


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_models_retrieve_gives_the_served_model_or_not_found(client: openai.OpenAI, live: LiveDaemon) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "stallfree"
    assert model.model_extra["max_model_len"] == live.daemon.engine.max_model_len
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.body["code"] == "model_not_found"


def test_invalid_values_raise_bad_request_as_openai_does(client: openai.OpenAI) -> None:
    """400 invalid_request_error (BadRequestError), not 422 (which the client raises as UnprocessableEntityError)."""
    for kwargs in ({"temperature": -1}, {"max_tokens": 0}, {"top_p": 3}, {"seed": 1 << 64},
                   {"extra_body": {"max_tokens": True}}, {"extra_body": {"stream": "yes"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="x", **({"max_tokens": 2} | kwargs))
        assert caught.value.body["type"] == "invalid_request_error", kwargs
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tool_choice="auto")


def test_completion_usage_and_length(client: openai.OpenAI, live: LiveDaemon) -> None:
    prompt = "The paged KV cache holds blocks"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == _prompt_len(live, prompt)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert live.daemon.engine.encode(r.choices[0].text)  # text came back


def test_completion_from_token_ids(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 3


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="chunked prefill", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage anywhere


def test_chat_with_max_completion_tokens(client: openai.OpenAI, live: LiveDaemon) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token budget?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == _chat_prompt_len(live, messages)
    assert r.usage.completion_tokens == 9


def test_chat_stream_with_include_usage(client: openai.OpenAI, live: LiveDaemon) -> None:
    messages = [{"role": "user", "content": "Stream, please."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == _chat_prompt_len(live, messages)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_are_honoured(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="stop strings end generation", temperature=0, extra_body={"ignore_eos": True})
    free = client.completions.create(max_tokens=24, **kwargs).choices[0].text
    # A stop string taken from the middle of the greedy output: the text must end right before its first match.
    stop = next(free[i:i + 2] for i in range(3, len(free) - 2) if "\ufffd" not in free[i:i + 2])
    cut = free[:free.index(stop)]
    r = client.completions.create(max_tokens=24, stop=[stop], **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == cut
    streamed = list(client.completions.create(max_tokens=24, stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_everything_freed_after_the_module(live: LiveDaemon, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="last one", max_tokens=2)
    live.wait_idle()
    kv = live.llm_engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert live.daemon.admission.queued_requests == 0 and live.daemon.admission.queued_tokens == 0


@pytest.mark.slow
def test_smollm2_answers_through_the_chat_api() -> None:
    """The embedded SmolLM2-135M-Instruct behind the whole stack: chat template, real tokenizer, EOS."""
    with running_daemon(["--model", "smollm2-135m", "--served-model-name", "smollm2", "--no-profile",
                         "--num-kv-blocks", "256", "--max-model-len", "2048"]) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"  # ended by the model's own end-of-turn token
        assert r.usage.prompt_tokens == _chat_prompt_len(live, messages)
        assert r.usage.completion_tokens < 16


def test_continuous_usage_stats_counts_tokens_per_event(live: LiveDaemon) -> None:
    import json

    import httpx

    body = {"model": MODEL, "prompt": "count me", "max_tokens": 12, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    content = [e for e in events if e["choices"] and e["choices"][0]["text"]]
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[-1] <= 12
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
