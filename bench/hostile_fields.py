"""Request fields a daemon must not simply take from a client, tried against a daemon or a router.

Stop strings by the hundred thousand (and 16 long ones, the bound), a queue-time header the router did not sign
(what the replicas' window then reports as the largest queue wait), and the legacy function-calling and
guided-decoding fields. `stallfree bench hostile` prints these rows with the doors (hostile_doors.py).
"""
from __future__ import annotations

import time

import httpx

from stallfree.node_daemon.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from stallfree.router_queue_header import QUEUE_HEADER

FORGED_QUEUE_MS = 600_000
# vLLM's guided decoding, refused by name (OpenAI's deprecated functions/function_call are served as tools since 34).
LEGACY = {"guided_json": {"type": "object"}, "guided_regex": "[0-9]+", "guided_choice": ["yes", "no"],
          "guided_grammar": "root ::= \"a\""}


def _answer(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        error = None
    return f"{response.status_code} {error['code']} (param {error['param']})" if error else f"{response.status_code}"


async def _max_queue_wait_ms(client: httpx.AsyncClient, replica_urls: list[str], admin: dict) -> float | None:
    waits = []
    for url in replica_urls:
        stats = (await client.get(url + "/admin/stats", headers=admin)).json()
        waits.append((stats.get("queue_wait_ms") or {}).get("max") or 0.0)
    return max(waits) if waits else None


async def check_fields(client: httpx.AsyncClient, model: str, replica_urls: list[str],
                       admin_token: str | None) -> list[dict]:
    """One row per field: {door, sent, answer}; `client` is based on the target's URL."""
    rows: list[dict] = []
    completion = {"model": model, "prompt": "once upon a time", "max_tokens": 50}

    many = [f"stop-{i}" for i in range(100_000)]
    r = await client.post("/v1/completions", json=completion | {"stop": many})
    rows.append({"door": "stop strings", "sent": "10^5 stop strings (1.4 MB), 50 tokens", "answer": _answer(r)})
    bound = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]
    started = time.perf_counter()
    r = await client.post("/v1/completions", json=completion | {"stop": bound})
    rows.append({"door": "stop strings at the bound", "sent": f"{MAX_STOP_STRINGS} stops of {MAX_STOP_CHARS} "
                 "characters, 50 tokens", "answer": f"{_answer(r)} in {time.perf_counter() - started:.2f} s"})

    admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    r = await client.post("/v1/completions", json=completion | {"max_tokens": 2},
                          headers={QUEUE_HEADER: str(FORGED_QUEUE_MS)})
    if replica_urls and admin_token:
        waited = await _max_queue_wait_ms(client, replica_urls, admin)
        seen = f"replicas' window max queue wait then {waited:.0f} ms"
    else:
        seen = "replicas' window not read (their URLs or the admin token are not known here)"
    rows.append({"door": "queue-time header", "sent": f"{QUEUE_HEADER}: {FORGED_QUEUE_MS} (unsigned)",
                 "answer": f"{r.status_code}; {seen}"})

    answers = []
    for field, value in LEGACY.items():
        r = await client.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, field: value,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        answers.append(f"{field} {r.status_code}")
    rows.append({"door": "legacy function calling", "sent": ", ".join(LEGACY), "answer": ", ".join(answers)})
    return rows
