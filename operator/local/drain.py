"""The end of a local run: stop the load, let in-flight requests finish within the spec's drain timeout, stop
the daemons."""
from __future__ import annotations

import asyncio
import time

from stallfree.operator.local.load import LoadDriver
from stallfree.operator.local.runtime import LocalRuntime
from stallfree.operator.local.view import LiveView


async def drain(runtime: LocalRuntime, load: LoadDriver | None, load_task: asyncio.Future | None, view: LiveView,
                timeout_s: float) -> None:
    """Stop sending, let in-flight requests finish for at most the spec's drainTimeoutSeconds, then stop the
    daemons; a progress line every few seconds, so a drain is never silent. The daemons keep serving while
    the load winds down (draining them first would make the router retry what they hold elsewhere)."""
    started = time.monotonic()
    view.say(f"draining: {load.in_flight if load else 0} request(s) in flight, up to {timeout_s:.0f}s "
             "(the spec's drainTimeoutSeconds)")
    if load_task is not None:
        while not load_task.done() and time.monotonic() - started < timeout_s:
            await asyncio.wait([load_task], timeout=min(5.0, max(0.1, timeout_s - (time.monotonic() - started))))
            if not load_task.done():
                view.say(f"draining: {load.in_flight if load else 0} request(s) still in flight "
                         f"({time.monotonic() - started:.0f}s of {timeout_s:.0f}s)")
        if not load_task.done():
            load_task.cancel()
            view.say(f"drain timeout: {load.in_flight if load else 0} request(s) cancelled")
        await asyncio.gather(load_task, return_exceptions=True)
    view.say("stopping the daemons")
    await runtime.close()
    view.say(f"stopped after a {time.monotonic() - started:.0f}s drain")
