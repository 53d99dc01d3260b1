"""Reading an ASGI request's body, then watching for its client to leave."""
from __future__ import annotations

from starlette.types import Receive


async def whole_body(receive: Receive) -> bytes:
    """The body (the door guard replays it as one message)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


async def client_left(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read already: the next message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
