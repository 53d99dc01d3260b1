"""How a request ended, mapped once to its HTTP answer and its error metric (stallfree_request_errors{reason}).

A request that answers with one JSON body raises `Failure.api_error()` (the APIError handler counts it); a stream
that already answered 200 sends `Failure.sse_event()` as its last event and counts it (`count`). Either way the
error is counted once, with the same status, code and message.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from stallfree.node_daemon.engine.async_engine import EngineDeadError, RequestFailedError
from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.server import finish
from stallfree.node_daemon.server.errors import APIError, sse_error

log = logging.getLogger("stallfree.server")


@dataclass(frozen=True)
class Failure:
    """A request that did not finish normally: what its client is told, and the metric's reason."""

    status: int
    message: str
    code: str
    reason: str  # the stallfree_request_errors label
    retry_after_s: int | None = None

    def api_error(self) -> APIError:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return APIError(self.status, self.message, code=self.code, reason=self.reason, headers=headers)

    def sse_event(self) -> str:
        return sse_error(self.message, self.code)

    def count(self, metrics) -> None:
        """For a stream (no APIError handler sees it): count the error once."""
        metrics.record_error(self.reason)


ABORTED = Failure(503, "the request was aborted: the server is shutting down", "aborted", "draining", 1)


def of_finish(last: RequestOutput | None) -> Failure | None:
    """None when the engine finished the request normally (stop, length, a grammar's dead end); else why not."""
    if last is not None and last.finished and last.finish_reason in finish.NORMAL:
        return None
    if last is not None and last.finish_reason == "abort":
        return ABORTED
    detail = last.error if last is not None and last.error else "the engine stopped without an answer"
    return Failure(500, f"generation failed: {detail}", "engine_error", "engine")


def of_choices(lasts: list[RequestOutput | None]) -> Failure | None:
    """The first choice that did not finish normally, or None when every one did."""
    for last in lasts:
        failure = of_finish(last)
        if failure is not None:
            return failure
    return None


def of_exception(exc: Exception) -> Failure:
    """What the engine's stream raised: the request was invalid (400), the engine is gone (503), or a fault of
    the server's (500; an unexpected one is logged here, the engine's own RequestFailedError on its thread)."""
    if isinstance(exc, ValueError):
        return Failure(400, str(exc), "invalid_request", "invalid_request")
    if isinstance(exc, EngineDeadError):
        return Failure(503, str(exc), "engine_dead", "engine", 5)
    if not isinstance(exc, RequestFailedError):
        log.error("a request failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return Failure(500, "internal server error", "internal_error", "internal")
