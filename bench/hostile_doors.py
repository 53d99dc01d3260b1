"""The doors, tried as a hostile or careless client would, against a daemon or a router.

Each check sends one kind of request and says what came back: deep nesting, a body far past the size limit,
headers that never finish (slowloris), paths outside the OpenAI API, clients that leave non-streamed requests
(counted as aborts on the replicas' /metrics), the replica's address and forwarded-for headers, demand from
refused requests (router only: /router/queue), the request fields a daemon must not simply take (hostile_fields.py:
stop strings, an unsigned queue-time header, legacy function calling), and a stream on a replica that stops
answering (router only, SIGSTOP on a daemon this bench started). `stallfree bench hostile` prints them beside its body table.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from stallfree.bench.hostile_fields import check_fields

SLOWLORIS_WAIT_S = 40.0  # a connection still open after this is "held"
LEAVERS = 10  # non-streamed requests whose client leaves after LEAVE_AFTER_S
LEAVE_AFTER_S = 1.0


@dataclass
class Target:
    url: str
    model: str
    router: bool
    replica_urls: list[str] = field(default_factory=list)  # the daemons behind (the url itself for a daemon)
    replica_pids: list[int] = field(default_factory=list)  # daemons this bench started (may be stopped)
    admin_token: str | None = None


def _raw(url: str, request: bytes, timeout_s: float = 10.0) -> tuple[int | None, float, bytes]:
    """(status or None when closed without one, seconds, answer head) for one raw request."""
    parts = urlsplit(url)
    started = time.perf_counter()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    took = time.perf_counter() - started
    try:
        return int(answer.split(b" ", 2)[1]), took, answer[:300]
    except (IndexError, ValueError):
        return None, took, answer[:300]


async def _aborts(client: httpx.AsyncClient, urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        text = (await client.get(url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith("stallfree_request_success_total") and 'finished_reason="abort"' in line:
                total += float(line.split()[-1])
    return total


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return response.text[:60].replace("\n", " ")


async def check_doors(target: Target) -> list[dict]:
    """One row per door: {door, sent, answer}."""
    rows: list[dict] = []
    url, model = target.url, target.model

    def row(door: str, sent: str, answer: str) -> None:
        rows.append({"door": door, "sent": sent, "answer": answer})

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        deep = b'{"model": "%s", "messages": ' % model.encode() + b"[" * 1000 + b"]" * 1000 + b"}"
        r = await client.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        row("deep nesting", "chat body with 1,000 nested [", f"{r.status_code} {_error_code(r)}")

        big = b'{"model": "%s", "prompt": "' % model.encode() + b"x" * (100 << 20) + b'"}'
        started = time.perf_counter()
        try:
            r = await client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            answer = f"{r.status_code} {_error_code(r)}"
        except httpx.HTTPError as exc:
            answer = f"no answer ({type(exc).__name__})"
        row("body size", "one 100 MB body", f"{answer} in {time.perf_counter() - started:.1f} s")

        status, took, _ = await asyncio.to_thread(_raw, url, b"GET /health HTTP/1.1\r\nHost: x\r\n",
                                                  SLOWLORIS_WAIT_S)
        row("header timeout", "headers never finished (slowloris)",
            f"{status} after {took:.1f} s" if took < SLOWLORIS_WAIT_S - 1 else f"held {SLOWLORIS_WAIT_S:g} s")

        auth = f"Authorization: Bearer {target.admin_token}\r\n".encode() if target.admin_token else b""
        answers = []
        for line in (b"GET /v1/%2e%2e/admin/stats", b"GET /v1/../metrics", b"PUT /v1/%2e%2e/admin/tuning",
                     b"GET /openapi.json"):
            body = b'{"max_num_seqs": 1}' if line.startswith(b"PUT") else b""
            status, _, _ = await asyncio.to_thread(
                _raw, url, line + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + auth
                + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            answers.append(f"{line.split(b' ')[1].decode()} {status}")
        row("paths outside /v1/", "/v1/%2e%2e/admin/stats, /v1/../metrics, PUT .../admin/tuning (admin token), "
            "/openapi.json", ", ".join(answers))

        if not target.replica_urls:
            row("client leaves", "-", "not measured: the replicas' URLs are not known here")
        else:
            await _leavers(client, target, row)
        r = await client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1},
                              headers={"X-Forwarded-For": "6.6.6.6"})
        shown = "x-stallfree-replica" in r.headers
        info = f"replica header {'shown' if shown else 'hidden'} without the admin token"
        if target.router:
            replicas = await client.get("/router/replicas")
            info += f"; /router/replicas without it: {replicas.status_code}"
        row("information", "no admin token; X-Forwarded-For: 6.6.6.6", info)

        if target.router:
            queue_auth = {"Authorization": f"Bearer {target.admin_token}"} if target.admin_token else {}
            before_q = (await client.get("/router/queue", headers=queue_auth)).json()
            await client.post("/v1/completions", json={"model": "no-such-model", "prompt": "x" * 4_000_000})
            await client.post("/v1/completions", json=["not", "an", "object"])
            after_q = (await client.get("/router/queue", headers=queue_auth)).json()
            row("demand from refused requests", "4 MB prompt for an unknown model (404), a JSON array (400)",
                f"arrived_prompt_tokens +{after_q['arrived_prompt_tokens'] - before_q['arrived_prompt_tokens']:.0f}")
        rows += await check_fields(client, model, target.replica_urls, target.admin_token)
        if target.router and target.replica_pids:
            rows.append(await _hung_replica(client, target))
    return rows


async def _leavers(client: httpx.AsyncClient, target: Target, row) -> None:
    """Non-streamed chats whose client leaves: how many the replicas abort."""
    before = await _aborts(client, target.replica_urls)
    body = {"model": target.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
            "ignore_eos": True}

    async def leave() -> None:
        try:
            await client.post("/v1/chat/completions", json=body, timeout=LEAVE_AFTER_S)
        except httpx.TimeoutException:
            pass

    await asyncio.gather(*(leave() for _ in range(LEAVERS)))
    await asyncio.sleep(2.0)
    aborted = await _aborts(client, target.replica_urls) - before
    row("client leaves", f"{LEAVERS} chats, max_tokens 2,000, client gone after {LEAVE_AFTER_S:g} s",
        f"{aborted:.0f} aborted on the replicas within 2 s")


async def _hung_replica(client: httpx.AsyncClient, target: Target) -> dict:
    """Streams through the router, then the replica serving the first of them SIGSTOPped: how its streams end."""
    admin = {"Authorization": f"Bearer {target.admin_token}"}  # so the router says which replica serves each
    where: list[str] = []
    endings: list[float] = []
    running = asyncio.Event()

    async def one(index: int) -> None:
        body = {"model": target.model, "prompt": f"story {index}: once upon a time", "max_tokens": 1500,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=admin) as response:
            where.append(response.headers.get("x-stallfree-replica", "?"))
            running.set()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"error"' in line:
                    endings.append(time.perf_counter())

    tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
    await asyncio.wait_for(running.wait(), 30)
    await asyncio.sleep(1.0)
    hosts = [url.split("://", 1)[1] for url in target.replica_urls]
    victim = hosts.index(where[0]) if where and where[0] in hosts else 0
    pid = target.replica_pids[victim]
    on_victim = sum(1 for name in where if name == hosts[victim])
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.perf_counter()
    try:
        await asyncio.wait(tasks, timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [at - stopped_at for at in endings]
    answer = (f"{len(errors)} of the {on_victim} streams on it ended with an error event, {min(errors):.1f}-"
              f"{max(errors):.1f} s after SIGSTOP" if errors else f"none of the {on_victim} streams on it ended "
              "with an error event")
    return {"door": "a replica hung for good", "sent": "SIGSTOP the daemon serving a stream (of 4, 2 daemons)",
            "answer": answer}


def print_doors(rows: list[dict], target_name: str) -> None:
    print(f"\ndoors ({target_name}):")
    for row in rows:
        print(f"  {row['door']:<28} {row['sent']:<72} -> {row['answer']}")
