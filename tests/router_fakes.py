"""A tiny fake replica for the router's tests: answers the polls as a daemon does and records what reaches it.

`/v1/completions` streams `events` SSE events `gap_s` apart (then `[DONE]`), or with `"hang": true` stops
after two events and sends nothing more; non-streamed it answers after `delay_s` (with `freeze_s` its whole
event loop first stops that long, as a daemon choking on a request). Every request's path and
headers are recorded, and so is each client that left before its answer was complete (`left`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stallfree.contracts import Ceilings, Percentiles, Tuning, WindowStats
from stallfree.net import free_port

FAKE_MODEL = "fake-model"
FAKE_CONTEXT = 1000


@dataclass
class FakeReplica:
    url: str = ""
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (method, raw path, headers)
    left: int = 0  # requests whose client went away before the answer was complete
    finished: int = 0

    def inference(self) -> list[tuple[str, str, dict[str, str]]]:
        """What reached it besides the router's polls."""
        return [s for s in self.seen if s[1] not in ("/ready", "/admin/stats", "/admin/profile", "/v1/models")]

    def inference_paths(self) -> list[str]:
        return [path for _, path, _ in self.inference()]


def _stats() -> dict:
    empty = Percentiles()
    return asdict(WindowStats(window_s=30.0, ttft_ms=empty, tpot_ms=empty, itl_ms=empty, queue_wait_ms=empty,
                              request_rate=0.0, prompt_tokens_per_s=0.0, generation_tokens_per_s=0.0,
                              prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0, budget_utilisation=0.0,
                              kv_usage=0.0, preemptions=0, num_waiting=0, num_running=0, tuning=Tuning(),
                              ceilings=Ceilings(), mean_iteration_ms=10.0, kv_capacity_tokens=100000))


def _app(fake: FakeReplica):
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        fake.seen.append((scope["method"], scope["raw_path"].decode(), dict(request.headers)))
        path = scope["path"]
        if path == "/ready":
            response = JSONResponse({"ready": True})
        elif path == "/admin/stats":
            response = JSONResponse(_stats())
        elif path == "/v1/models":
            response = JSONResponse({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model",
                                                                 "max_model_len": FAKE_CONTEXT}]})
        elif path == "/v1/completions":
            body = json.loads(await request.body())
            response = _stream(fake, body, receive) if body.get("stream") else await _whole(fake, body, receive)
        else:
            response = JSONResponse({"error": "a path the router must never forward"}, status_code=418)
        await response(scope, receive, send)

    return app


def _stream(fake: FakeReplica, body: dict, receive) -> Response:
    async def events():
        try:
            for i in range(int(body.get("events", 5))):
                if body.get("hang") and i == 2:
                    await asyncio.sleep(3600)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i)}]})}\n\n".encode()
                await asyncio.sleep(float(body.get("gap_s", 0.01)))
            yield b"data: [DONE]\n\n"
            fake.finished += 1
        except BaseException:
            fake.left += 1
            raise

    return StreamingResponse(events(), media_type="text/event-stream")


async def _whole(fake: FakeReplica, body: dict, receive) -> Response:
    if body.get("freeze_s"):  # a request the replica chokes on: its event loop (and its /ready) stops this long
        time.sleep(float(body["freeze_s"]))

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait((watcher,), timeout=float(body.get("delay_s", 0.0)))
    watcher.cancel()
    if done:
        fake.left += 1
        return Response(status_code=499)
    fake.finished += 1
    return JSONResponse({"choices": [{"index": 0, "text": "ok"}]})


@contextlib.contextmanager
def fake_replica() -> Iterator[FakeReplica]:
    fake = FakeReplica()
    port = free_port()
    fake.url = f"http://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(_app(fake), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="fake-replica", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake replica did not start"
        time.sleep(0.01)
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=10)
