"""A request's grammar never stalls the daemon: built, checked and compiled off the event loop, bounded in size
(a 400 naming the bound) and time (a 400 past its own deadline, a 503 when others' grammars held every worker), and
refused by a backend that cannot constrain before its schema is looked at. Integers in generated JSON stay within
64 bits unless the schema says more."""
from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
from pydantic import BaseModel

from stallfree.node_daemon.server.errors import APIError
from stallfree.node_daemon.server.structured_requests import StructuredOutputs, plan_chat, plan_completion
from stallfree.node_daemon.structured import grammar as grammar_module
from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.grammar import MAX_GRAMMAR_CHARS, json_schema_grammar
from stallfree.node_daemon.structured.grammar_work import GrammarWork
from stallfree.node_daemon.structured.integer_bounds import INT64_MAX, INT64_MIN, bounded_integers
from stallfree.node_daemon.text.tool_calls.formats import HERMES
from tests.structured_helpers import smollm2_tokenizer


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}


def _wide_schema(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"property_{i:05d}": {"type": "string"} for i in range(num_properties)}}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer())


def _structured(compiler=None, work: GrammarWork | None = None) -> StructuredOutputs:
    if work is None:
        return StructuredOutputs(HERMES, None, {}.get, compiler)
    return StructuredOutputs(HERMES, None, {}.get, compiler, work)


def test_a_schema_past_the_size_bound_is_a_400_naming_it_before_it_is_checked(compiler, monkeypatch) -> None:
    checked = []
    monkeypatch.setattr(grammar_module, "_checked", lambda *a: checked.append(a))
    schema = _wide_schema(12_000)  # ~330 KB: checking it took seconds, quadratic in its size
    assert len(json.dumps(schema)) > MAX_GRAMMAR_CHARS
    for call in (lambda: plan_completion(_structured(compiler), _schema_format(schema)),
                 lambda: plan_chat(_structured(compiler), _schema_format(schema), None, None, None)):
        with pytest.raises(APIError) as caught:
            asyncio.run(call())
        assert caught.value.status == 400 and caught.value.param == "response_format"
        assert f"at most {MAX_GRAMMAR_CHARS}" in caught.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(APIError) as caught:
        asyncio.run(plan_chat(_structured(compiler), None, [tool], "required", None))
    assert caught.value.status == 400 and caught.value.param == "tools" and "at most" in caught.value.message
    assert not checked


def test_the_grammar_is_checked_off_the_event_loop(compiler, monkeypatch) -> None:
    """While a schema is being checked the loop runs other work: here the very task that lets the check end.
    Checked on the loop, the check would wait for it in vain (and give up after 10 s)."""
    release = threading.Event()
    original = grammar_module._checked
    seen_release = []

    def slow_check(text, origin):
        seen_release.append(release.wait(10))
        return original(text, origin)

    monkeypatch.setattr(grammar_module, "_checked", slow_check)

    async def scenario():
        plan = asyncio.ensure_future(plan_completion(_structured(compiler), _schema_format(_wide_schema(3))))
        await asyncio.sleep(0)
        while not seen_release and not plan.done():  # the loop turns while the check waits
            release.set()
            await asyncio.sleep(0.01)
        return await plan

    plan = asyncio.run(scenario())
    assert seen_release == [True] and plan.grammar is not None


def test_a_grammar_past_its_deadline_is_a_400_and_busy_workers_a_503(compiler, monkeypatch) -> None:
    release = threading.Event()
    original = grammar_module._checked
    monkeypatch.setattr(grammar_module, "_checked", lambda text, origin: (release.wait(30), original(text, origin))[1])
    work = GrammarWork(workers=1, deadline_s=0.05)
    structured = _structured(compiler, work)

    async def scenario():
        first = asyncio.ensure_future(plan_completion(structured, _schema_format(_wide_schema(4))))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(plan_completion(structured, _schema_format(_wide_schema(5))))
        results = await asyncio.gather(first, second, return_exceptions=True)
        release.set()
        return results

    try:
        too_slow, busy = asyncio.run(scenario())
    finally:
        release.set()
        work.close()
    assert isinstance(too_slow, APIError) and too_slow.status == 400 and too_slow.param == "response_format"
    assert "longer than" in too_slow.message
    assert isinstance(busy, APIError) and busy.status == 503 and busy.headers.get("Retry-After")


def test_a_backend_without_logits_refuses_before_looking_at_the_schema(monkeypatch) -> None:
    checked = []
    monkeypatch.setattr(grammar_module, "_checked", lambda *a: checked.append(a))
    for call in (lambda: plan_completion(_structured(), _schema_format(_wide_schema(2_000))),
                 lambda: plan_chat(_structured(), _schema_format(_wide_schema(2_000)), None, None, None)):
        with pytest.raises(APIError) as caught:
            asyncio.run(call())
        assert caught.value.status == 400 and caught.value.code == "unsupported_parameter"
    assert not checked
    assert asyncio.run(plan_completion(_structured(), {"type": "text"})).grammar is None


# --- integers within 64 bits -------------------------------------------------------------------------------


def test_unbounded_integers_get_64_bit_bounds_wherever_they_are() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": ["integer", "null"], "minimum": 0},
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}},
        "d": {"anyOf": [{"type": "integer", "maximum": 10 ** 30}, {"type": "string"}]}},
        "$defs": {"n": {"type": "integer", "exclusiveMaximum": 5}}}
    out = bounded_integers(schema)
    props = out["properties"]
    assert (props["a"]["minimum"], props["a"]["maximum"]) == (INT64_MIN, INT64_MAX)
    assert (props["b"]["minimum"], props["b"]["maximum"]) == (0, INT64_MAX)
    assert props["d"]["anyOf"][0] == {"type": "integer", "maximum": 10 ** 30, "minimum": INT64_MIN}
    assert out["$defs"]["n"] == {"type": "integer", "exclusiveMaximum": 5, "minimum": INT64_MIN}
    assert schema["properties"]["a"] == {"type": "integer"}  # the caller's schema is not changed


@pytest.mark.parametrize("schema", [
    {"enum": [-(2 ** 63) + 1, "x"]},
    {"const": -(2 ** 63)},
    {"type": "object", "properties": {"a": {"enum": [[1, -(2 ** 63) + 511]]}}},
    {"anyOf": [{"const": {"deep": [-(2 ** 63) + 1023]}}]},
])
def test_enum_and_const_integers_near_the_64_bit_minimum_are_refused_not_handed_to_the_library(schema) -> None:
    """The library's pattern for such a literal recursed until the checking thread's stack overflowed: the daemon
    died of SIGSEGV (found by the structured fuzz test). Now a ValueError (the request's 400) names the bound."""
    def check() -> None:
        try:
            json_schema_grammar(schema)
        except ValueError as exc:
            outcome.append(str(exc))

    outcome: list[str] = []
    thread = threading.Thread(target=check)  # a worker thread, as in the daemon (its stack is the one that broke)
    thread.start()
    thread.join()
    assert len(outcome) == 1 and "below" in outcome[0] and str(INT64_MIN) in outcome[0]


def test_enum_and_const_integers_from_the_accepted_minimum_up_are_served(compiler) -> None:
    compiled = compiler.compile(json_schema_grammar({"enum": [INT64_MIN, INT64_MAX, True]}))
    assert _accepts(compiled, compiler.tokenizer, str(INT64_MIN))


class City(BaseModel):
    name: str
    country: str
    population: int


def _accepts(compiled, tokenizer, text: str) -> bool:
    matcher = compiled.new_matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_generated_integers_end_within_64_bits_unless_the_schema_says_more(compiler) -> None:
    tokenizer = compiler.tokenizer
    city = compiler.compile(json_schema_grammar(City.model_json_schema()))
    head = '{"name":"Oslo","country":"NO","population":'
    assert _accepts(city, tokenizer, head + str(INT64_MAX) + "}")
    assert _accepts(city, tokenizer, head + "-" + str(-INT64_MIN) + "}")
    assert not _accepts(city, tokenizer, head + "1" * 20)  # a 20th digit can never be written
    narrow = compiler.compile(json_schema_grammar({"type": "object", "properties": {"n": {
        "type": "integer", "minimum": -5, "maximum": 999}}}))  # the schema's own bounds rule
    assert _accepts(narrow, tokenizer, '{"n":999}') and _accepts(narrow, tokenizer, '{"n":-5}')
    assert not _accepts(narrow, tokenizer, '{"n":1000') and not _accepts(narrow, tokenizer, '{"n":-6')


def test_tool_call_arguments_keep_integers_within_64_bits_too(compiler) -> None:
    tool = {"type": "function", "function": {"name": "census", "parameters": City.model_json_schema()}}
    plan = asyncio.run(plan_chat(_structured(compiler), None, [tool], "required", None))
    head = '<tool_call>\n{"name":"census","arguments":{"name":"Oslo","country":"NO","population":'
    assert not _accepts(plan.grammar, compiler.tokenizer, head + "1" * 20)
    assert _accepts(plan.grammar, compiler.tokenizer, head + "1" * 19)


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread priority is Linux's")
async def test_the_forward_leaves_a_core_to_grammar_work_while_it_runs() -> None:
    """A schema checked for seconds gets a core of its own (the forward runs a thread fewer meanwhile), at the
    process's priority: a lower one made every stream wait on the GIL its starved thread took."""
    import torch

    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig
    from stallfree.node_daemon.engine.engine import LLMEngine
    from stallfree.node_daemon.engine.sampling_params import SamplingParams
    from stallfree.node_daemon.models.config import ModelConfig

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=64)))
    work = GrammarWork(workers=1, deadline_s=5.0)
    release = threading.Event()

    def step() -> int:
        engine.add_request(f"r{engine.num_iterations}", prompt_token_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        return torch.get_num_threads()

    def checking() -> int:
        release.wait(10)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    try:
        assert step() == 2
        job = asyncio.ensure_future(work.run(checking))
        await asyncio.sleep(0.05)
        assert step() == 1  # the check runs: the forward took one thread
        release.set()
        assert await job == os.getpriority(os.PRIO_PROCESS, 0)  # the worker's thread: the process's priority
        assert step() == 2  # done: the core is the forward's again
    finally:
        release.set()
        work.close()
        torch.set_num_threads(before)


def test_a_job_that_starts_mid_step_waits_for_the_engine_to_leave_it_a_core(monkeypatch) -> None:
    """Started in the middle of a forward, a check oversubscribed the cores for that whole step (250 ms instead of
    20): while the engine is stepping, a job waits until it is left a core."""
    from stallfree.node_daemon.structured import grammar_work

    monkeypatch.setattr(grammar_work, "ENGINE_ACTIVE_S", 60.0)  # "stepping" whatever this machine's load
    monkeypatch.setattr(grammar_work, "HANDOFF_WAIT_S", 60.0)
    work = GrammarWork(workers=1, deadline_s=30.0)
    started = threading.Event()
    try:
        grammar_work.engine_stepping(core_left=False)
        caller = threading.Thread(target=lambda: asyncio.run(work.run(started.set)))
        caller.start()
        assert not started.wait(0.2)  # the engine keeps both cores: the job waits
        grammar_work.engine_stepping(core_left=True)
        assert started.wait(10)
        caller.join(10)
    finally:
        grammar_work.engine_stepping(core_left=True)
        work.close()
    grammar_work.engine_stepping(core_left=False)
    monkeypatch.setattr(grammar_work, "_engine_step_at", float("-inf"))  # no engine stepping for later tests
