"""A stream whose client stops reading is ended, its request aborted and its engine slots freed; a client that
reads is never cut off."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from stallfree.node_daemon.server import streaming
from stallfree.node_daemon.server.streaming import SSEResponse
from tests.server_helpers import running_daemon

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/", "headers": []}


async def _endless():
    while True:
        yield "data: {}\n\n"
        await asyncio.sleep(0)


async def _no_disconnect():
    await asyncio.Event().wait()


def test_a_send_that_waits_past_the_bound_ends_the_stream() -> None:
    closed, stalled = [], []

    async def client_that_never_reads(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the socket's buffers are full: this send never completes

    async def scenario():
        response = SSEResponse(_endless(), on_close=lambda: closed.append(1), on_stall=lambda: stalled.append(1),
                               stall_abort_s=0.05)
        await asyncio.wait_for(response(SCOPE, _no_disconnect, client_that_never_reads), 10)
        return response

    response = asyncio.run(scenario())
    assert response.stalled and closed == [1] and stalled == [1]


def test_a_client_that_reads_is_never_cut_off() -> None:
    sent, closed = [], []

    async def events():
        for i in range(200):
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.001)  # a slow stream, much longer than the bound in all: each send is prompt

    async def reader(message):
        sent.append(message)

    async def scenario():
        response = SSEResponse(events(), on_close=lambda: closed.append(1), stall_abort_s=0.05)
        await response(SCOPE, _no_disconnect, reader)
        return response

    response = asyncio.run(scenario())
    assert not response.stalled and closed == [1]
    assert len(sent) == 202 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def _unread_stream(live) -> socket.socket:
    """A streamed n=64 request of 1,000 tokens each from a client that will read nothing of it."""
    host, port = live.url.removeprefix("http://").split(":")
    body = json.dumps({"model": live.daemon.served_model_name, "prompt": "hello", "n": 64, "stream": True,
                       "max_tokens": 1000, "ignore_eos": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connect: a small window
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_a_daemon_aborts_a_stream_nobody_reads_and_frees_its_slots(monkeypatch) -> None:
    monkeypatch.setattr(streaming, "STALL_ABORT_S", 0.5)
    before = streaming.stalled_streams.count
    with running_daemon() as live:
        sock = _unread_stream(live)
        try:
            deadline = time.monotonic() + 120
            while streaming.stalled_streams.count == before:  # the client reads nothing
                assert time.monotonic() < deadline, "the stream was never ended"
                time.sleep(0.05)
            live.wait_idle()  # every choice aborted: no engine slot or KV block held
        finally:
            sock.close()


def test_a_stream_nobody_reads_is_paused_before_it_is_aborted(monkeypatch) -> None:
    """Before the abort, a streamed n=64 request whose client reads nothing is paused once the socket's buffers are
    full: every choice's decodes stop (the engine generates nothing more for it) within a bounded backlog, then
    the abort frees it all."""
    monkeypatch.setattr(streaming, "STALL_ABORT_S", 3.0)
    before = streaming.stalled_streams.count
    with running_daemon() as live:
        sock = _unread_stream(live)
        try:
            scheduler = live.llm_engine.scheduler
            deadline = time.monotonic() + 60
            while scheduler.num_paused < 64:
                assert streaming.stalled_streams.count == before, "aborted before every choice was paused"
                assert time.monotonic() < deadline, "the choices were never paused"
                time.sleep(0.01)
            made = [r.num_output_tokens for r in scheduler._requests.values()]
            time.sleep(0.3)
            assert [r.num_output_tokens for r in scheduler._requests.values()] == made  # nothing generated
            assert max(made) < 1000  # paused before the end
            while streaming.stalled_streams.count == before:
                assert time.monotonic() < deadline, "the stream was never ended"
                time.sleep(0.05)
            live.wait_idle()
            assert scheduler.num_paused == 0
        finally:
            sock.close()
