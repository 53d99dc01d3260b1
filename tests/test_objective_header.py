"""The router's signed objective header (issue 33): the router signs priority, deadline, TPOT target and name with
the admin token; the daemon believes only a signature that verifies, and serves any other request as one without
an objective. Over real HTTP, through the router to a sim daemon, the objective reaches the engine and the daemon's
goodput counters move."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from server_helpers import ADMIN_TOKEN, running_daemon
from stallfree.node_daemon.server.router_objective import RouterObjective
from stallfree.operator.router.forwarding import upstream_headers
from stallfree.operator.router.objectives import Objective as RouterObjectiveSpec, Objectives
from stallfree.operator.router.flow_control import FlowConfig
from stallfree.operator.router.waiting_room import WaitingRoom
from stallfree.request_objective_header import (OBJECTIVE_HEADER, REQUEST_ID_HEADER, SIGNATURE_HEADER, NonceBook,
                                                RequestObjective, at_target, bind, body_digest, decode, encode,
                                                headers, read)
from stallfree.router_queue_header import sign
from test_router_proxy import MODEL, SIM_ARGS, router

CHAT = RequestObjective("chat", 10, 1_700_000_100.25, 40.0)
BODY = b'{"model":"m","prompt":"hi"}'
SERVER = ("10.0.0.7", 8000)  # the daemon's listener, as its ASGI scope says


def _binding(body: bytes = BODY, url: str = "http://10.0.0.7:8000"):
    return bind("router-1-ab", body_digest(body), url)


def _read(signed, now, body: bytes = BODY, server=SERVER, nonces: NonceBook | None = None, token=ADMIN_TOKEN):
    return read(signed, token, now, body, server, nonces if nonces is not None else NonceBook())


def test_an_objective_survives_its_header_value():
    assert decode(encode(CHAT)) == CHAT
    assert decode(encode(RequestObjective("batch", -1))) == RequestObjective("batch", -1)
    for bad in ("", "[]", "{}", '{"name":""}', '{"name":"x","priority":1.5}', '{"name":"x","priority":true}',
                '{"name":"x","deadline":"soon"}', '{"name":"x","tpot_ms":-1}', '{"name":"x","deadline":NaN}',
                '{"name":"x","priority":99999999999}', json.dumps({"name": "x" * 200})):
        assert decode(bad) is None, bad


def test_the_daemon_believes_only_the_routers_signature():
    now = time.time()
    signed = dict(headers(CHAT, ADMIN_TOKEN, now, _binding()))
    assert _read(signed, now) == CHAT
    value = encode(CHAT, _binding())
    forged = [{OBJECTIVE_HEADER: value},  # unsigned, as a client would send it
              {OBJECTIVE_HEADER: value, SIGNATURE_HEADER: sign(value, "not-the-admin-token", now)},
              {OBJECTIVE_HEADER: value, SIGNATURE_HEADER: sign(encode(RequestObjective("chat", 0)), ADMIN_TOKEN, now)},
              {OBJECTIVE_HEADER: value, SIGNATURE_HEADER: sign(value, ADMIN_TOKEN, now - 3600)},  # stale
              {OBJECTIVE_HEADER: value, SIGNATURE_HEADER: "garbage"},
              {OBJECTIVE_HEADER: "not json", SIGNATURE_HEADER: sign("not json", ADMIN_TOKEN, now)}]
    for request_headers in forged:
        assert _read({**request_headers, REQUEST_ID_HEADER: "router-1-ab"}, now) is None, request_headers
    assert _read(signed, now, token=None) is None  # a daemon without an admin token believes no one
    assert headers(CHAT, None, now, _binding()) == []  # and a router without one sends nothing


def test_a_signed_objective_counts_for_its_own_request_once():
    """Captured on the wire, the header is worth nothing: not for another body, id or replica, not twice."""
    now = time.time()
    signed = dict(headers(CHAT, ADMIN_TOKEN, now, _binding()))
    assert signed[REQUEST_ID_HEADER] == "router-1-ab"
    nonces = NonceBook()
    assert _read(signed, now, body=BODY + b" ", nonces=nonces) is None  # another body
    assert _read({**signed, REQUEST_ID_HEADER: "mine"}, now, nonces=nonces) is None  # another request id
    assert _read(signed, now, server=("10.0.0.8", 8000), nonces=nonces) is None  # replayed to another daemon
    assert _read(signed, now, nonces=nonces) == CHAT  # the request it was signed for
    assert _read(signed, now + 1, nonces=nonces) is None  # ... once: a replay to the same daemon is ignored
    # Each nonce is remembered until its signature expires, no longer, and the book is bounded.
    assert len(nonces) == 1 and nonces.first_use("other", now, now + 10_000) and len(nonces) == 1
    full = NonceBook(capacity=1)
    assert full.first_use("a", now, now) and not full.first_use("b", now, now)


def test_the_replica_is_judged_by_ip_and_port_or_a_host_names_port():
    assert at_target("10.0.0.7:8000", ("10.0.0.7", 8000)) and not at_target("10.0.0.7:8000", ("10.0.0.7", 8001))
    assert not at_target("10.0.0.7:8000", ("10.0.0.9", 8000)) and at_target("[::1]:8000", ("::1", 8000))
    assert at_target("daemon-0.local:8000", ("10.0.0.7", 8000)) and not at_target("x:8000", None)


def test_the_engine_gets_the_deadline_on_its_own_clock_and_forgeries_are_counted():
    reader = RouterObjective()
    now = 1_700_000_100.0  # the deadline is 0.25 s away
    objective = reader.of(dict(headers(CHAT, ADMIN_TOKEN, now, _binding())), ADMIN_TOKEN, BODY, SERVER, now_s=now,
                          now_monotonic=50.0)
    assert objective is not None
    assert (objective.name, objective.priority, objective.tpot_target_ms) == ("chat", 10, 40.0)
    assert abs(objective.deadline - 50.25) < 1e-6
    assert reader.of({OBJECTIVE_HEADER: encode(CHAT)}, ADMIN_TOKEN, BODY, SERVER) is None and reader.ignored == 1
    assert reader.of({}, ADMIN_TOKEN, BODY, SERVER) is None and reader.ignored == 1


def test_a_client_cannot_send_the_objective_header_through_the_router():
    raw = [(OBJECTIVE_HEADER.encode(), encode(CHAT).encode()), (SIGNATURE_HEADER.encode(), b"x"),
           (b"x-stallfree-objective", b"chat"), (b"accept", b"*/*")]
    assert upstream_headers(raw, ("10.0.0.1", 5), "http") == [("accept", "*/*"), ("x-forwarded-for", "10.0.0.1"),
                                                            ("x-forwarded-proto", "http")]


def test_the_router_signs_the_deadline_from_its_arrival():
    spec = RouterObjectiveSpec("chat", priority=3, ttft_ms=2000.0, tpot_ms=50.0)
    room = WaitingRoom(FlowConfig(), Objectives({"chat": spec}, spec))
    arrived = time.time() - 0.5  # it waited 0.5 s in the router
    sent = dict(headers(room.signed(spec, 3, arrived), ADMIN_TOKEN, time.time(), _binding()))
    objective = _read(sent, time.time())
    assert objective is not None and (objective.name, objective.priority, objective.tpot_ms) == ("chat", 3, 50.0)
    assert objective.deadline_s == pytest.approx(arrived + 2.0)  # its arrival + 2 s
    assert room.signed(spec, 2, arrived) == RequestObjective("chat", 2, None, 50.0)  # sent below its band
    alone = WaitingRoom(FlowConfig(), Objectives({"chat": RouterObjectiveSpec("chat", 0, 2000.0)},
                                                 RouterObjectiveSpec("chat", 0, 2000.0)))
    assert alone.signed(alone.objectives.default, 0, arrived) is None  # one objective: first come, first served
    assert alone.signed(alone.objectives.default, -1, arrived) == RequestObjective("chat", -1)  # below its band


OBJECTIVES = json.dumps([{"name": "chat", "priority": 7, "ttftP99Ms": 600000, "tpotP99Ms": 60000, "default": True},
                         {"name": "impossible", "priority": 2, "ttftP99Ms": 0.001}])


def _metric(url: str, name: str, objective: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and f'objective="{objective}"' in line:
            return float(line.split()[-1])
    return 0.0


def test_over_http_the_objective_reaches_the_engine_and_goodput_moves():
    with running_daemon(base_args=SIM_ARGS) as daemon, router([daemon.url], "--objectives", OBJECTIVES) as url:
        scheduler = daemon.llm_engine.scheduler
        seen: dict[str, object] = {}
        add = scheduler.add_request

        def spy(request):
            seen[request.request_id] = (request.objective, request.arrival_time)
            add(request)

        scheduler.add_request = spy  # the engine thread adds through the instance attribute
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": True}
        sent_at = time.monotonic()
        for objective in ("chat", "impossible"):
            answer = httpx.post(url + "/v1/completions", json=body, timeout=30,
                                headers={"x-stallfree-objective": objective})
            assert answer.status_code == 200, answer.text
        # Straight to the daemon with a forged objective: served, as a request without one.
        forged = {OBJECTIVE_HEADER: encode(RequestObjective("chat", 1000)), SIGNATURE_HEADER: "0:forged"}
        assert httpx.post(daemon.url + "/v1/completions", json=body, headers=forged, timeout=30).status_code == 200
        objectives = [objective for objective, _ in seen.values()]
        assert len(objectives) == 3 and objectives[2] is None
        chat, impossible = objectives[0], objectives[1]
        assert (chat.name, chat.priority, chat.tpot_target_ms) == ("chat", 7, 60000.0)
        arrival = list(seen.values())[0][1]
        assert sent_at - 0.05 <= arrival
        assert abs(chat.deadline - (arrival + 600.0)) < 1.0  # the router's arrival plus the TTFT target
        assert (impossible.name, impossible.priority) == ("impossible", 2)
        for name, good in (("chat", 1.0), ("impossible", 0.0), ("default", 1.0)):
            assert _metric(daemon.url, "stallfree_objective_finished_requests_total", name) == 1.0, name
            assert _metric(daemon.url, "stallfree_objective_goodput_requests_total", name) == good, name
