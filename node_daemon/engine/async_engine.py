"""AsyncEngine: the engine loop on its own thread, streamed to asyncio callers (engine_protocol.EngineClient).

The HTTP event loop never runs an iteration, so serving requests cannot stretch one. Callers hand
commands (add, abort, tuning) to the engine thread through a deque and wake it with an event; the
thread applies them between iterations, runs `LLMEngine.step()`, and hands each iteration's outputs
back in one `call_soon_threadsafe` per event loop. With nothing to do it sleeps on the event (no
spinning), or runs a task handed to `when_idle` (the start-up profile measured again), which stops at
the next iteration when a command arrives, or, once a burst of serving has gone quiet, those handed
to `after_each_burst` (the freed heap handed back). Each turn is reported to a `TurnWatch` (the
daemon hands in measure/stall_watch.py's, which logs a slow turn with its cause). An exception in a
step fails every in-flight request with finish_reason "error" and its
message, logs the traceback, and the loop carries on for new requests.

Backpressure: a caller PAUSE_BACKLOG outputs behind (a streaming client that stopped reading) has its request
paused in the engine (its decodes skipped, its KV kept) until it reads again, so a slow reader costs the other
streams nothing while the server decides whether to abort it (server/streaming.py: STALL_ABORT_S).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

from stallfree.contracts import Ceilings, Tuning, validate_tuning
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from stallfree.node_daemon.engine.request import Objective
    from stallfree.node_daemon.structured.compiler import CompiledGrammar

log = logging.getLogger(__name__)

# An idle task (engine.when_idle) starts only once no step has run for this long.
IDLE_TASK_QUIET_S = 3.0
# Outputs a caller may leave unread before its request is paused (each is one iteration's tokens; a caller that
# keeps up reads every one as it comes).
PAUSE_BACKLOG = 64
# When only paused requests could run, the loop waits on its wake event, checking at least this often.
PAUSED_WAIT_S = 0.5


class TurnWatch(Protocol):
    """Told of every turn of the engine loop (commands, one step, the hand-off); `end` returns True for a stall."""

    def begin(self) -> Any: ...

    def end(self, began: Any, commands_s: float, step_s: float, deliver_s: float, tokens: int) -> bool: ...

    def close(self) -> None: ...


class _NoWatch:
    """The default: nothing watches the turns (tests, benchmarks); the daemon hands in a StallWatch."""

    def begin(self) -> None:
        return None

    def end(self, began: Any, commands_s: float, step_s: float, deliver_s: float, tokens: int) -> bool:
        return False

    def close(self) -> None:
        pass


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or died): no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request for a reason of its own, not the request's (a bug: a 500, logged)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # Outputs handed to the queue (the engine thread's count) and taken from it (the caller's): their difference
    # is what the caller has not read. Past PAUSE_BACKLOG the engine pauses the request until the caller reads.
    delivered: int = 0
    taken: int = 0
    paused: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str | None = None, watch: TurnWatch | None = None) -> None:
        self.engine = engine
        self.model_name: str = model_name or engine.config.model.model
        self.max_model_len: int = engine.max_model_len
        self._streams: dict[str, _Stream] = {}  # touched by event loops; the engine thread only reads
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._pending_tuning: Tuning | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._idle_task: tuple[float, Callable[..., float | None]] | None = None
        self._last_step = time.monotonic()  # when the engine last ran a step: idle tasks wait for a quiet spell
        self._quiet_tasks: deque[Callable[[], Any]] = deque()
        self._burst_tasks: list[Callable[[], Any]] = []
        self._burst_tasks_ran = self._last_step  # they run after each burst of steps, not before the first
        self.stall_watch: TurnWatch = watch or _NoWatch()
        self._thread = threading.Thread(target=self._run, name="stallfree-engine", daemon=True)
        self._thread.start()

    # ---- EngineClient ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                         **extra)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       waited_s: float = 0.0, checked: bool = False,
                       grammar: CompiledGrammar | None = None,
                       objective: Objective | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until one is finished. Leaving early (break, cancel) aborts it.
        `waited_s`: how long it already waited before it reached this daemon (the router's queue): its
        arrival is that much earlier, so queue wait and TTFT count from the router's arrival. `checked`: the caller
        applied engine/request_rules.py to it already (the server, before admission). `grammar`: the output must
        follow it (LLMEngine.add_request). `objective`: its priority, deadline (this clock: time.monotonic) and TPOT
        target, as the router signed them.

        Bad input raises ValueError at the first iteration; an internal fault while adding it raises
        RequestFailedError (logged on the engine thread); nothing else in flight is disturbed.
        """
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        # Registered before the liveness check: a loop that exits after the check still finds the stream on
        # its way out (_fail_streams_on_exit) and ends it; checked first, the caller could wait forever.
        self._streams[request_id] = stream
        if self._dead is not None or self._stopping or not self._thread.is_alive():
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine is not running: {self._dead or 'shut down'}")
        self._submit(("add", request_id, list(prompt_token_ids), sampling, time.monotonic() - max(0.0, waited_s),
                      checked, grammar, objective))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                taken = 1
                while not item.finished and not stream.queue.empty():
                    more = stream.queue.get_nowait()
                    if isinstance(more, BaseException):  # keep the exception for the next round
                        stream.queue.put_nowait(more)
                        break
                    item = _merge(item, more)
                    taken += 1
                stream.taken += taken
                if stream.paused:  # the caller reads again: the engine goes on with it
                    stream.paused = False
                    self._submit(("resume", request_id))
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks are freed at the next turn of the engine loop)."""
        self._submit(("abort", request_id))

    def get_tuning(self) -> Tuning:
        pending = self._pending_tuning
        return pending if pending is not None else self.engine.get_tuning()

    def set_tuning(self, tuning: Tuning) -> None:
        """Check against the ceilings now (raises contracts.TuningError); applied before the next iteration."""
        validate_tuning(tuning, self.engine.ceilings)
        self._pending_tuning = tuning
        self._submit(("tuning", tuning))

    @property
    def ceilings(self) -> Ceilings:
        return self.engine.ceilings

    # ---- lifecycle and drain -----------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished (what a drain waits for)."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._dead is None

    async def wait_idle(self, timeout: float | None = None, poll_s: float = 0.02) -> bool:
        """Wait until nothing is in flight; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._streams:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop; requests still in flight finish with finish_reason "abort"."""
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, timeout)

    def shutdown_sync(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def when_idle(self, delay_s: float, task: Callable[..., float | None]) -> None:
        """Run task(engine, should_stop) on the engine thread once it has been idle and `delay_s` passed.

        should_stop() turns true when a command (a request) arrives: the task must return at its next
        iteration. It returns the delay before it runs again, or None when done."""
        self._idle_task = (time.monotonic() + delay_s, task)
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------------

    def _submit(self, command: tuple[Any, ...]) -> None:
        self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        watch = self.stall_watch
        clock = time.perf_counter
        try:
            while True:
                turn = clock()
                began = watch.begin()
                self._apply_commands()
                if self._stopping:
                    break
                if not engine.has_unfinished():
                    self._idle()
                    continue
                commands_s = clock() - turn
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - the requests must learn why they ended
                    log.exception("engine step failed; failing the requests in flight")
                    outputs = engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                stepped = clock()
                self._last_step = time.monotonic()
                if outputs:
                    self._deliver(outputs)
                watch.end(began, commands_s, stepped - turn - commands_s, clock() - stepped,
                          engine.last_num_scheduled_tokens)
                if not engine.last_num_scheduled_tokens and engine.num_paused:
                    # Only paused requests could run (a waiting one may need the KV they hold): nothing to do
                    # until a caller reads (a command), a request comes, or the server aborts one.
                    self._wake.wait(PAUSED_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - a dead loop must not leave callers waiting
            log.exception("engine loop died")
            self._dead = exc
            self._deliver(engine.fail_all(f"engine loop died: {type(exc).__name__}: {exc}"))
            raise
        finally:
            watch.close()
            self._fail_streams_on_exit()

    def when_quiet(self, task: Callable[[], Any]) -> None:
        """Run task() once on the engine thread after a quiet spell (no step for IDLE_TASK_QUIET_S): a short
        one-off job that holds the GIL (the grammar library's vocabulary, a second on 262k tokens), which in a
        client's burst would stall every stream."""
        self._quiet_tasks.append(task)
        self._wake.set()

    def after_each_burst(self, task: Callable[[], Any]) -> None:
        """Run task() on the engine thread after every quiet spell that follows steps (no step for
        IDLE_TASK_QUIET_S): what a burst of serving left behind is tidied once, never between its steps."""
        self._burst_tasks.append(task)

    def _idle(self) -> None:
        """Nothing to run: sleep until woken, or run a quiet task, the burst tasks or the idle task when due."""
        burst_done = bool(self._burst_tasks) and self._last_step > self._burst_tasks_ran
        if self._quiet_tasks or burst_done:
            wait = self._last_step + IDLE_TASK_QUIET_S - time.monotonic()
            if wait > 0 or self._commands:
                self._wake.wait(max(wait, 0.0))
                self._wake.clear()
                return
            if self._quiet_tasks:
                tasks = [self._quiet_tasks.popleft()]
            else:
                tasks, self._burst_tasks_ran = self._burst_tasks, self._last_step
            for task in tasks:
                try:
                    task()
                except Exception:  # noqa: BLE001 - an idle task must never take the loop down
                    log.exception("quiet task failed")
            return
        task = self._idle_task
        if task is None:
            self._wake.wait()
            self._wake.clear()
            return
        due, fn = task
        # Only after a quiet spell: a client's requests come in bursts with short gaps between them, and an idle
        # task (the profile: iterations of up to seconds at the AVX2 tier) run in such a gap delays the next one.
        due = max(due, self._last_step + IDLE_TASK_QUIET_S)
        wait = due - time.monotonic()
        if wait > 0 or self._commands:
            self._wake.wait(max(wait, 0.0))
            self._wake.clear()
            return
        self._idle_task = None
        try:
            again = fn(self.engine, lambda: bool(self._commands) or self._stopping)
        except Exception:  # noqa: BLE001 - an idle task must never take the loop down
            log.exception("idle task failed")
            again = None
        if again is not None and self._idle_task is None:
            self._idle_task = (time.monotonic() + again, fn)

    def _apply_commands(self) -> None:
        commands = self._commands
        engine = self.engine
        while commands:
            command = commands.popleft()
            kind = command[0]
            if kind == "add":
                _, request_id, token_ids, sampling, arrival, checked, grammar, objective = command
                try:
                    engine.add_request(request_id, prompt_token_ids=token_ids, sampling=sampling, arrival_time=arrival,
                                       checked=checked, grammar=grammar, objective=objective)
                except ValueError as exc:  # the request is invalid: the caller's 400
                    self._deliver_to(request_id, exc)
                except Exception as exc:  # noqa: BLE001 - the engine's fault: logged, the caller's 500
                    log.exception("adding request %s failed", request_id)
                    self._deliver_to(request_id, RequestFailedError(f"{type(exc).__name__}: {exc}"))
            elif kind == "abort":
                request = engine.abort_request(command[1])
                if request is not None:
                    self._deliver([RequestOutput(request.request_id, [], "", True, "abort", request.num_prompt_tokens,
                                                 len(request.output_token_ids), request.num_cached_tokens)])
            elif kind == "resume":
                engine.pause_request(command[1], False)
            elif kind == "tuning":
                try:
                    engine.set_tuning(command[1])
                except Exception:  # noqa: BLE001 - validated at set_tuning; keep the loop alive regardless
                    log.exception("could not apply tuning %s", command[1])
                if self._pending_tuning is command[1]:
                    self._pending_tuning = None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One hand-off per event loop per iteration."""
        streams = self._streams
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, output))
                stream.delivered += 1
                if not output.finished and not stream.paused and stream.delivered - stream.taken >= PAUSE_BACKLOG:
                    # Its caller (a client that stopped reading) is this far behind: stop generating for it. The
                    # unread outputs are on their way to its queue, so its next read resumes it.
                    stream.paused = True
                    self.engine.pause_request(output.request_id, True)
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _deliver_to(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:
                pass

    def _fail_streams_on_exit(self) -> None:
        """Anything still waiting when the loop ends gets a final output instead of hanging."""
        engine = self.engine
        outputs = []
        for request_id in list(self._streams):
            request = engine.abort_request(request_id)
            reason = "error" if self._dead is not None else "abort"
            error = f"engine loop died: {self._dead}" if self._dead is not None else None
            prompt_len = request.num_prompt_tokens if request is not None else 0
            out_len = len(request.output_token_ids) if request is not None else 0
            outputs.append(RequestOutput(request_id, [], "", True, reason, prompt_len, out_len, error=error))
        if outputs:
            self._deliver(outputs)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two queued updates of one request as one (a slow reader gets fewer, larger updates): the new tokens, text and
    logprobs of both, the later one's counts (every count is the request's so far)."""
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.text + b.text, b.finished,
                         b.finish_reason, b.num_prompt_tokens, b.num_output_tokens, b.num_cached_tokens, b.error,
                         a.logprobs + b.logprobs if a.logprobs and b.logprobs else a.logprobs or b.logprobs,
                         num_drafted_tokens=b.num_drafted_tokens, num_accepted_tokens=b.num_accepted_tokens)
