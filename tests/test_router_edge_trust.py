"""The router's edge against hostile clients: legal non-ASCII header values pass (no 500), a flood of headers is a
431 and the forwarding keeps no cookies (a request's cost stays linear in what it sends), replica addresses and
the queue's state only for the admin token, and a probe port with no connection cap."""
from __future__ import annotations

import socket

import httpx

from router_fakes import FAKE_MODEL, fake_replica
from server_helpers import ADMIN_TOKEN
from stallfree.http_doors.connections import PROBE_SLOTS
from stallfree.net import free_port
from stallfree.operator.router.edge import MAX_HEADERS
from stallfree.operator.router.forwarding import NoCookies
from test_router_proxy import router

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BODY = {"model": FAKE_MODEL, "prompt": "hello"}


def test_an_obs_text_header_value_is_passed_on_as_its_bytes():
    with fake_replica() as fake, router([fake.url]) as url:
        answer = httpx.post(url + "/v1/completions", json=BODY, headers=[("x-title", "Zürich".encode())], timeout=10)
        assert answer.status_code == 200, answer.text
        assert fake.inference()[-1][2]["x-title"] == "Zürich".encode().decode("latin-1")  # the very bytes


def test_more_headers_than_the_bound_is_a_431_that_reaches_no_replica():
    with fake_replica() as fake, router([fake.url]) as url:
        many = [(f"x-h{i}", "v") for i in range(MAX_HEADERS + 1)]
        answer = httpx.post(url + "/v1/completions", json=BODY, headers=many, timeout=10)
        assert answer.status_code == 431 and answer.json()["error"]["code"] == "too_many_headers"
        assert fake.inference() == []
        fine = [(f"x-h{i}", "v") for i in range(MAX_HEADERS - 10)]
        assert httpx.post(url + "/v1/completions", json=BODY, headers=fine, timeout=10).status_code == 200


def test_the_forwarding_client_keeps_no_cookie_for_the_next_request():
    seen: list[str | None] = []

    def replica(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("cookie"))
        return httpx.Response(200, headers={"set-cookie": "session=one-clients-secret; Path=/"}, json={})

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(replica)) as client:
            client._cookies = NoCookies()  # as Router.start sets it
            for _ in range(2):
                await client.get("http://10.0.0.1:8000/v1/models")

    import asyncio

    asyncio.run(scenario())
    assert seen == [None, None]  # one client's cookie never rides on another's request


def test_replica_addresses_and_the_queue_are_for_the_admin_token_only():
    with fake_replica() as fake, router([fake.url]) as url:
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        address = fake.url.split("://")[1]
        anonymous = httpx.get(url + "/metrics", timeout=10).text
        assert "stallfree_router_replicas_healthy 1.0" in anonymous and address not in anonymous
        assert 'replica="' not in anonymous
        admin = httpx.get(url + "/metrics", headers=ADMIN, timeout=10).text
        assert f'replica="{address}"' in admin
        queue = httpx.get(url + "/router/queue", timeout=10)
        assert queue.status_code == 401 and queue.json()["error"]["code"] == "unauthorized"
        assert httpx.get(url + "/router/queue", headers=ADMIN, timeout=10).json()["arrivals"] == 1


def test_the_probe_port_answers_with_every_serving_connection_taken():
    probe = free_port()
    with fake_replica() as fake, router([fake.url], "--probe-port", str(probe), "--max-connections", "4") as url:
        host, port = url.removeprefix("http://").split(":")
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4 + PROBE_SLOTS)]
        try:
            health = httpx.get(f"http://127.0.0.1:{probe}/health", timeout=10)
            ready = httpx.get(f"http://127.0.0.1:{probe}/ready", timeout=10)
        finally:
            for sock in socks:
                sock.close()
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert ready.status_code == 200 and ready.json() == {"ready": True, "replicas_healthy": 1}
        assert httpx.get(f"http://127.0.0.1:{probe}/v1/models", timeout=10).status_code == 404  # probes only


def test_a_request_that_stalled_its_replica_is_not_sent_on_to_stall_the_next():
    with fake_replica() as a, fake_replica() as b, router([a.url, b.url]) as url:
        answer = httpx.post(url + "/v1/completions", json={**BODY, "freeze_s": 3}, timeout=30)
        assert answer.status_code == 503 and "stopped answering" in answer.json()["error"]["message"]
        assert len(a.inference()) + len(b.inference()) == 1  # one replica stalled, not both
        # Other requests are still served (and retried) as before.
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200
