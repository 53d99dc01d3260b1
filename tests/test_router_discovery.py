"""The router's discovery reads its service-account token at every poll: the kubelet rotates a projected token,
and a router that kept the first one would stop seeing replicas once it expired (about an hour for bound tokens)."""
from __future__ import annotations

import asyncio
import pathlib

import httpx

from stallfree.operator.router.discovery import EndpointSliceDiscovery

SLICE = {"items": [{"ports": [{"name": "http", "port": 8000}],
                    "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"name": "chat-0"}}]}]}


async def test_every_poll_presents_the_token_file_as_it_is_now(tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    seen: list[str] = []
    applied: list[dict[str, str]] = []

    def api_server(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {token_file.read_text().strip()}":
            return httpx.Response(401, json={"kind": "Status", "reason": "Unauthorized"})
        return httpx.Response(200, json=SLICE)

    discovery = EndpointSliceDiscovery("chat-daemons", "ns", applied.append, interval_s=0.0,
                                       api_server="https://kube.test", token_file=token_file, ca_file=False)
    task = asyncio.create_task(discovery.run(httpx.MockTransport(api_server)))
    async def until(value: str) -> None:
        while value not in seen:
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(until("Bearer first"), 30)
        token_file.write_text("second\n")  # the kubelet rotates it
        await asyncio.wait_for(until("Bearer second"), 30)
    finally:
        task.cancel()
    assert applied == [{"chat-0": "http://10.0.0.1:8000"}]
    assert "Bearer first" in seen and seen[-1] == "Bearer second"
