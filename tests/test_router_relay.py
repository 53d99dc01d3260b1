"""The router's relay of a stream (proxy.py `_relay`) leaves no task behind with an exception nobody read: a
stream cancelled (its client left) just as its upstream ended must not print asyncio's "Task exception was never
retrieved ... StopAsyncIteration"."""
from __future__ import annotations

import asyncio
import gc

from stallfree.operator.router.proxy import Router, RouterConfig
from stallfree.operator.router.replicas import Replica, ReplicaPool


class _EndsAtOnce:
    """An upstream body with nothing more to send: its next chunk is the end."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    def __aiter__(self) -> "_EndsAtOnce":
        return self

    async def __anext__(self) -> bytes:
        self.ended.set()
        raise StopAsyncIteration


async def test_a_stream_cancelled_as_its_upstream_ends_leaves_no_unread_task_exception():
    reported: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    router = Router(ReplicaPool(None), RouterConfig())
    upstream = _EndsAtOnce()
    relay = router._relay(Replica("r0", url="http://r0"), upstream, b"data: 1\n\n")
    assert await relay.__anext__() == b"data: 1\n\n"
    consumer = asyncio.ensure_future(relay.__anext__())
    await upstream.ended.wait()  # the upstream's end is in: the relay has not yet run on it
    consumer.cancel()  # the client leaves in that very turn
    await asyncio.gather(consumer, return_exceptions=True)
    assert consumer.cancelled()
    del relay, consumer
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert [c.get("message") for c in reported] == []
