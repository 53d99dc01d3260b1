"""Routes that validate the body body_guard.py already parsed, instead of parsing it again on the event loop.

FastAPI parses a JSON body with json.loads in the request's task: for a body of a few MB that is one C call
holding the event loop (and the GIL) for ~0.1 s while every stream waits. The body guard parses each JSON
body once, large ones on a worker thread, and leaves the result in the scope (PARSED_BODY); a route of this
class hands it to FastAPI, which validates it as usual (errors and the OpenAPI schema unchanged).
"""
from __future__ import annotations

from typing import Any, Callable, Coroutine

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from stallfree.http_doors.body_guard import PARSED_BODY


class _ParsedRequest(Request):
    async def json(self) -> Any:
        if PARSED_BODY in self.scope:
            return self.scope[PARSED_BODY]
        return await super().json()


class ParsedBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_body_handler(request: Request) -> Response:
            return await handler(_ParsedRequest(request.scope, request.receive))

        return parsed_body_handler
