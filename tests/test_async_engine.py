"""AsyncEngine: the engine thread streams to asyncio callers; aborts, bad input, tuning, errors, shutdown."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from stallfree.contracts import Tuning, TuningError
from stallfree.node_daemon.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from tests.test_engine import make_engine, one_torch_thread, run_all, tokens_of  # noqa: F401 (autouse)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": list(range(10, 40)), "b": list(range(100, 170)), "c": [7, 8, 9]}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    engine = make_engine()
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, prompt_token_ids=ids, sampling=GREEDY)
    return {rid: tokens_of(outs) for rid, outs in run_all(engine).items()}


@pytest.fixture
async def client():
    engine = AsyncEngine(make_engine(budget=48), model_name="tiny")
    yield engine
    await engine.shutdown()


async def collect(client: AsyncEngine, rid: str, ids: list[int], sampling: SamplingParams = GREEDY) -> list[RequestOutput]:
    return [out async for out in client.generate(rid, ids, sampling)]


async def test_concurrent_streams_match_the_sync_engine(client: AsyncEngine, reference) -> None:
    results = await asyncio.gather(*(collect(client, rid, ids) for rid, ids in PROMPTS.items()))
    for rid, outs in zip(PROMPTS, results):
        assert tokens_of(outs) == reference[rid]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
    assert client.num_in_flight == 0
    kv = client.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks  # freed in the step that finished them, before their last output
    assert client.model_name == "tiny" and client.max_model_len == 256
    assert client.encode("hi") and "<|im_start|>user" in client.apply_chat_template([{"role": "user", "content": "hi"}])


async def test_bad_input_raises_while_other_streams_continue(client: AsyncEngine, reference) -> None:
    good = asyncio.create_task(collect(client, "a", PROMPTS["a"]))
    with pytest.raises(ValueError, match="empty"):
        await collect(client, "bad1", [])
    with pytest.raises(ValueError, match="context"):
        await collect(client, "bad2", [1] * 300)
    with pytest.raises(ValueError, match="max_tokens"):
        await collect(client, "bad3", [1, 2], SamplingParams(max_tokens=0))
    assert tokens_of(await good) == reference["a"]
    assert client.num_in_flight == 0


async def test_duplicate_request_id_is_refused(client: AsyncEngine) -> None:
    first = client.generate("dup", PROMPTS["b"], GREEDY)
    await first.__anext__()
    with pytest.raises(ValueError, match="already in flight"):
        await collect(client, "dup", PROMPTS["c"])
    rest = [out async for out in first]
    assert rest[-1].finished


async def test_leaving_a_stream_early_aborts_it_and_frees_its_blocks(client: AsyncEngine) -> None:
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = client.generate("early", PROMPTS["b"], long)
    async for out in stream:
        if out.num_output_tokens >= 2:
            break
    await stream.aclose()
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in client.generate("cancelled", PROMPTS["a"], long):
            got_first.set()

    task = asyncio.create_task(consume())
    await got_first.wait()
    task.cancel()  # the task now waits inside the stream for its next token
    with pytest.raises(asyncio.CancelledError):
        await task
    kv = client.engine.kv_cache
    for _ in range(100):
        if kv.num_free_blocks == kv.num_blocks and not client.engine.has_unfinished():
            break
        await asyncio.sleep(0.02)
    assert kv.num_free_blocks == kv.num_blocks
    assert client.num_in_flight == 0


async def test_a_caller_that_stops_reading_has_its_request_paused_until_it_reads(client: AsyncEngine, reference,
                                                                                 monkeypatch) -> None:
    """A caller PAUSE_BACKLOG outputs behind (a client that stopped reading) has its request paused: the engine
    generates nothing more for it and keeps its KV, while another stream runs to its end; when the caller reads
    again the request resumes and ends with the very tokens of an unpaused run. Aborting a paused request
    leaves nothing counted as paused."""
    from stallfree.node_daemon.engine import async_engine

    monkeypatch.setattr(async_engine, "PAUSE_BACKLOG", 3)
    # Long enough that a first read which merged every output made so far (a busy machine) still leaves the
    # request running when its backlog reaches 3.
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    unpaused = make_engine()
    unpaused.add_request("slow", prompt_token_ids=PROMPTS["c"], sampling=long)
    expected = tokens_of(run_all(unpaused)["slow"])
    scheduler = client.engine.scheduler
    slow = client.generate("slow", PROMPTS["c"], long)
    first = await slow.__anext__()
    request = scheduler.get_request("slow")
    # Read nothing more. That first read may itself have resumed a pause (it read outputs the engine had already
    # counted as unread), so wait for a pause that stays, its token count with it.
    seen: list[tuple[bool, int]] = []
    for _ in range(500):
        seen.append((request.paused, request.num_output_tokens))
        if len(seen) >= 5 and len(set(seen[-5:])) == 1 and seen[-1][0]:
            break
        await asyncio.sleep(0.02)
    assert request.paused and client.engine.num_paused == 1
    made = request.num_output_tokens
    assert made < long.max_tokens
    assert tokens_of(await collect(client, "a", PROMPTS["a"])) == reference["a"]
    assert request.num_output_tokens == made and request.block_ids  # nothing generated, KV kept
    rest = [out async for out in slow]
    assert tokens_of([first, *rest]) == expected and rest[-1].finished
    assert scheduler.num_paused == 0

    stalled = client.generate("stalled", PROMPTS["c"], long)
    await stalled.__anext__()
    for _ in range(500):
        if scheduler.num_paused:
            break
        await asyncio.sleep(0.01)
    assert scheduler.num_paused == 1
    await stalled.aclose()  # the client went away: aborted while paused
    for _ in range(100):
        if not client.engine.has_unfinished():
            break
        await asyncio.sleep(0.02)
    assert not client.engine.has_unfinished() and scheduler.num_paused == 0


async def test_a_request_waiting_on_the_kv_a_paused_one_holds_does_not_spin_the_loop(monkeypatch) -> None:
    """A paused request keeps its KV; a request that cannot be admitted beside it waits, and the engine loop sleeps
    meanwhile instead of stepping empty iterations, until the paused request's caller reads again."""
    from stallfree.node_daemon.engine import async_engine

    monkeypatch.setattr(async_engine, "PAUSE_BACKLOG", 3)
    client = AsyncEngine(make_engine(num_blocks=12), model_name="tiny")  # 192 tokens of KV
    try:
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        slow = client.generate("slow", PROMPTS["b"], long)
        first = await slow.__anext__()
        request = client.engine.scheduler.get_request("slow")
        seen: list[tuple[bool, int]] = []  # a pause that stays (the first read may have resumed one)
        for _ in range(500):
            seen.append((request.paused, request.num_output_tokens))
            if len(seen) >= 5 and len(set(seen[-5:])) == 1 and seen[-1][0]:
                break
            await asyncio.sleep(0.02)
        assert request.paused
        steps = []
        real_step = client.engine.step
        monkeypatch.setattr(client.engine, "step", lambda: steps.append(1) or real_step())
        blocked = asyncio.create_task(collect(client, "big", list(range(150)), GREEDY))  # 10 blocks: not beside it
        await asyncio.sleep(0.6)
        assert not blocked.done() and len(steps) <= 5  # slept, not spun
        rest = [out async for out in slow]  # the caller reads: it resumes, ends, and frees its KV for "big"
        assert rest[-1].finished and len(tokens_of([first, *rest])) == 100
        assert (await asyncio.wait_for(blocked, 30))[-1].finished
    finally:
        await client.shutdown()


async def test_explicit_abort_ends_the_stream(client: AsyncEngine) -> None:
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    stream = client.generate("x", PROMPTS["a"], long)
    first = await stream.__anext__()
    assert not first.finished
    await client.abort("x")
    rest = [out async for out in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert rest[-1].num_output_tokens < 200


async def test_tuning_is_checked_now_and_applied_before_the_next_iteration(client: AsyncEngine) -> None:
    with pytest.raises(TuningError, match="ceiling"):
        client.set_tuning(Tuning(token_budget=100_000, max_num_seqs=4))
    new = Tuning(token_budget=40, max_num_seqs=4)
    client.set_tuning(new)
    assert client.get_tuning() == new
    outs = await collect(client, "t", PROMPTS["b"])
    assert outs[-1].finished
    assert client.engine.scheduler.tuning == new
    assert client.ceilings.max_token_budget == 512


async def test_a_failing_step_fails_the_requests_in_flight_with_a_message(client: AsyncEngine, reference) -> None:
    executor = client.engine.executor
    real_execute = executor.execute
    calls = {"n": 0}

    def flaky(output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_execute(output)

    executor.execute = flaky
    try:
        outs = await collect(client, "doomed", PROMPTS["b"])
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert "device lost" in outs[-1].error
        # The loop survives: the next request is served normally.
        assert tokens_of(await collect(client, "c", PROMPTS["c"])) == reference["c"]
    finally:
        executor.execute = real_execute
    kv = client.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


class _RecordedWake(threading.Event):
    """The engine thread's wake event, recording each wait: the timeout asked, and that the thread got there."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        self.waiting.set()
        return super().wait(timeout)


async def test_an_idle_engine_sleeps_until_a_request_wakes_it(client: AsyncEngine, reference) -> None:
    await collect(client, "warm", PROMPTS["c"])
    iterations = client.engine.num_iterations
    old, wake = client._wake, _RecordedWake()
    client._wake = wake
    old.set()  # one more turn: nothing to do, so the thread waits on the new event
    assert await asyncio.to_thread(wake.waiting.wait, 10.0)
    # One wait without a timeout (a loop that polled would wait with one, or not at all), and no iteration.
    assert wake.timeouts == [None] and not wake.is_set()
    assert client.engine.num_iterations == iterations
    assert tokens_of(await collect(client, "woken", PROMPTS["c"])) == reference["c"]
    assert await client.wait_idle(timeout=1.0)


async def test_shutdown_aborts_streams_in_flight_and_refuses_new_ones() -> None:
    client = AsyncEngine(make_engine(), model_name="tiny")
    stream = client.generate("s", PROMPTS["a"], SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True))
    await stream.__anext__()
    await client.shutdown()
    rest = [out async for out in stream]
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert not client.is_running
    with pytest.raises(EngineDeadError):
        await collect(client, "late", PROMPTS["c"])


async def test_an_idle_task_waits_for_a_quiet_spell_after_the_last_step(client: AsyncEngine, reference,
                                                                         monkeypatch) -> None:
    """A gap between a client's requests is no time for the profile: it starts once no step ran for a while."""
    from stallfree.node_daemon.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 0.6)
    assert tokens_of(await collect(client, "before", PROMPTS["a"])) == reference["a"]
    answered = time.monotonic()
    ran: list[float] = []
    client.when_idle(0.0, lambda engine, should_stop: ran.append(time.monotonic()))
    for _ in range(300):
        if ran:
            break
        await asyncio.sleep(0.01)
    assert ran and ran[0] - answered >= 0.6 - 0.05


async def test_a_quiet_task_runs_once_after_a_quiet_spell(client: AsyncEngine, reference, monkeypatch) -> None:
    from stallfree.node_daemon.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 0.6)
    assert tokens_of(await collect(client, "before-quiet", PROMPTS["b"])) == reference["b"]
    answered = time.monotonic()
    ran: list[float] = []
    client.when_quiet(lambda: ran.append(time.monotonic()))
    for _ in range(300):
        if ran:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.7)
    assert len(ran) == 1 and ran[0] - answered >= 0.6 - 0.05


async def test_burst_tasks_run_once_after_each_burst_and_never_between_its_steps(client: AsyncEngine, reference,
                                                                                  monkeypatch) -> None:
    """The freed heap is handed back after a burst: once per quiet spell that follows steps, none before any."""
    from stallfree.node_daemon.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 0.4)
    ran: list[float] = []
    client.after_each_burst(lambda: ran.append(time.monotonic()))
    await asyncio.sleep(0.6)
    assert ran == [], "no burst has run yet"
    for burst in (1, 2):
        assert tokens_of(await collect(client, f"burst-{burst}", PROMPTS["a"])) == reference["a"]
        answered = time.monotonic()
        for _ in range(200):
            if len(ran) == burst:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.6)
        assert len(ran) == burst and ran[-1] - answered >= 0.4 - 0.05


async def test_an_idle_task_runs_when_idle_and_yields_to_a_request(client: AsyncEngine, reference,
                                                                   monkeypatch) -> None:
    from stallfree.node_daemon.engine import async_engine

    monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 0.0)
    seen: list[str] = []

    def task(engine, should_stop):
        seen.append("ran")
        deadline = time.monotonic() + 5.0
        while not should_stop() and time.monotonic() < deadline:  # a long idle job (the profile measured again)
            time.sleep(0.005)
        seen.append("stopped" if should_stop() else "timed out")
        return 60.0 if len(seen) < 3 else None  # ask to run again later

    client.when_idle(0.0, task)
    for _ in range(200):
        if seen:
            break
        await asyncio.sleep(0.01)
    assert seen == ["ran"]
    started = time.monotonic()
    outs = await collect(client, "a", PROMPTS["a"])  # stops the task at its next check, then is served
    assert tokens_of(outs) == reference["a"]
    assert seen == ["ran", "stopped"] and time.monotonic() - started < 4.0
    assert client._idle_task is not None and client._idle_task[0] > time.monotonic() + 30  # rescheduled later


async def test_the_watch_handed_in_sees_every_stepped_turn_and_is_closed(reference) -> None:
    class Recording:
        def __init__(self) -> None:
            self.began, self.tokens, self.closed = 0, [], False

        def begin(self) -> int:
            self.began += 1
            return self.began

        def end(self, began, commands_s, step_s, deliver_s, tokens) -> bool:
            assert began == self.began and min(commands_s, step_s, deliver_s) >= 0
            self.tokens.append(tokens)
            return False

        def close(self) -> None:
            self.closed = True

    watch = Recording()
    client = AsyncEngine(make_engine(), model_name="tiny", watch=watch)
    outs = await collect(client, "a", PROMPTS["a"])
    await client.shutdown()
    assert tokens_of(outs) == reference["a"]
    # One end per engine step, with the step's tokens: the prompt's 30, then one a decode.
    assert len(watch.tokens) == client.engine.num_iterations and sum(watch.tokens) == 30 + 15
    assert watch.closed


def test_a_slow_turn_is_logged_with_its_cause(caplog) -> None:
    from stallfree.node_daemon.measure.stall_watch import StallWatch

    watch = StallWatch(min_s=0.05, factor=4.0)
    try:
        for _ in range(10):  # typical turns: 1 ms for 16 tokens
            began = watch.begin()
            time.sleep(0.001)
            assert not watch.end(began, 0.0, 0.001, 0.0, 16)
        began = watch.begin()
        time.sleep(0.2)  # off the CPU: what another process taking the cores looks like from here
        with caplog.at_level("WARNING", logger="stallfree.engine.stall"):
            assert watch.end(began, 0.0, 0.2, 0.0, 16)
        message = caplog.records[-1].getMessage()
        assert "engine stall" in message and "off the CPU" in message
        # A long prefill is not a stall: per token it costs what a decode does.
        began = watch.begin()
        time.sleep(0.1)
        assert not watch.end(began, 0.0, 0.1, 0.0, 2048)
        # The collector pausing everything is named as such.
        import gc

        watch.min_s = 0.0
        began = watch.begin()
        gc.collect()
        caplog.clear()
        with caplog.at_level("WARNING", logger="stallfree.engine.stall"):
            assert watch.end(began, 0.0, 0.0, 0.0, 1)
        assert "garbage collection (generation 2)" in caplog.records[-1].getMessage()
    finally:
        watch.close()


class _LoopExitsOnRegister(dict):
    """The streams table of an engine whose loop exits just as a stream is registered (the race of generate)."""

    def __init__(self, client: AsyncEngine) -> None:
        super().__init__()
        self.client = client

    def __setitem__(self, key, value) -> None:
        self.client.shutdown_sync()  # the loop is gone, its exit path already ran
        super().__setitem__(key, value)


async def test_a_loop_that_exits_while_a_stream_registers_ends_the_stream() -> None:
    client = AsyncEngine(make_engine(), model_name="tiny")
    client._streams = _LoopExitsOnRegister(client)
    # Checked before the stream was registered, the caller waited forever; now it learns the engine is gone.
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect(client, "late", PROMPTS["c"]), timeout=5.0)
    assert client.num_in_flight == 0


async def test_an_internal_fault_adding_a_request_is_logged_and_not_a_validation_error(client: AsyncEngine,
                                                                                      reference, caplog) -> None:
    real_add = client.engine.add_request

    def broken_add(request_id, **kwargs):
        raise KeyError("block table slot")

    client.engine.add_request = broken_add
    try:
        with caplog.at_level("ERROR", logger="stallfree.node_daemon.engine.async_engine"):
            with pytest.raises(RequestFailedError, match="KeyError"):
                await collect(client, "x", PROMPTS["c"])
    finally:
        client.engine.add_request = real_add
    assert any("adding request x failed" in r.getMessage() and r.exc_info for r in caplog.records)
    # A request the engine refuses as invalid stays a ValueError (the caller's 400), and nothing is logged for it.
    caplog.clear()
    with pytest.raises(ValueError):
        await collect(client, "bad", [10 ** 9])
    assert not caplog.records
    assert tokens_of(await collect(client, "c", PROMPTS["c"])) == reference["c"]


def test_a_slow_readers_merged_update_keeps_every_field() -> None:
    """A reader that falls behind gets queued updates merged: the new tokens, text and logprobs of both, and the
    later update's counts, every one of them (the speculation counts were once dropped, so a loaded server's usage
    lost its speculation field). Every field of RequestOutput is checked, so a new one cannot be dropped silently."""
    import dataclasses

    from stallfree.node_daemon.engine.async_engine import _merge
    from stallfree.node_daemon.engine.engine_protocol import TokenLogprob

    concatenated = {"new_token_ids", "text", "logprobs"}

    def update(seed: int, finished: bool) -> RequestOutput:
        values = {}
        for field in dataclasses.fields(RequestOutput):
            if field.name == "request_id":
                values[field.name] = "r"
            elif field.name == "new_token_ids":
                values[field.name] = [seed, seed + 1]
            elif field.name == "logprobs":
                values[field.name] = [TokenLogprob(seed, "t", -0.5, [])]
            elif field.name == "finished":
                values[field.name] = finished
            elif field.type in ("str", "str | None"):
                values[field.name] = f"{field.name}-{seed}"
            else:
                values[field.name] = seed * 100 + len(field.name)
        return RequestOutput(**values)

    a, b = update(1, False), update(2, True)
    merged = _merge(a, b)
    for field in dataclasses.fields(RequestOutput):
        got, first, later = (getattr(o, field.name) for o in (merged, a, b))
        if field.name in concatenated:
            assert got == first + later, field.name
        else:
            assert got == later, field.name
