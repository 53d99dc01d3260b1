"""OpenAI-style error JSON for every failure, and the handlers that guarantee no stack trace leaves the process.

{"error": {"message", "type", "param", "code"}} with the status that fits, as OpenAI's API gives them:
400 bad request (malformed JSON, wrong types and invalid values alike: `invalid_request_error`), 401 auth,
404 unknown model or route, 408 body too slow, 413 body too large, 429 queue full, 503 draining, 500 bug.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from stallfree.http_doors.error_json import error_body

log = logging.getLogger("stallfree.server")


class APIError(Exception):
    """An error a client caused (or must retry); rendered as OpenAI error JSON."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 reason: str = "invalid_request", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.reason = reason  # the metrics label (stallfree_request_errors{reason})
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def sse_error(message: str, code: str) -> str:
    """An error inside a stream that already answered 200: one data event, then the stream ends."""
    return f"data: {json.dumps(error_body(500, message, code=code))}\n\n"


# pydantic names the member of a union that failed in the error's location ("prompt.list[int].0"): not a field.
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "TextContentPart", "StreamOptions"}


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, bool]:
    """(message, param, malformed_json) from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, False
    first = errors[0]
    if first.get("type") == "recursion_loop":
        return "the JSON body is nested too deeply", None, True
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', 'cannot parse')}", None, True
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    if first.get("type") == "missing" and not loc:
        return "request body is empty: expected a JSON object", None, True
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "model_attributes_type" or (not loc and "dict" in msg.lower()):
        return "request body must be a JSON object", None, True
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {msg}{more}", param, False


def install_error_handlers(app: FastAPI, record_error) -> None:
    """`record_error(reason)` counts each error in the metrics."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        record_error(exc.reason)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, malformed = _describe_validation(exc)
        if malformed:
            record_error("invalid_request")
            return JSONResponse(error_body(400, message, param=param, code="invalid_json"), status_code=400)
        record_error("validation")
        kind = exc.errors()[0].get("type", "") if exc.errors() else ""
        code = "invalid_type" if kind.endswith("_type") else "invalid_value"
        return JSONResponse(error_body(400, message, param=param, code=code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif status == 405:
            message, code = f"method {request.method} not allowed on {request.url.path}", "method_not_allowed"
        elif status == 413:
            message, code = str(exc.detail), "request_too_large"
        else:
            message, code = str(exc.detail), None
        record_error({404: "not_found", 413: "too_large"}.get(status, "invalid_request"))
        return JSONResponse(error_body(status, message, code=code), status_code=status,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The trace goes to the log, never to the client.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        record_error("internal")
        return JSONResponse(error_body(500, "internal server error", code="internal_error"), status_code=500)
