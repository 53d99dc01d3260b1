"""The admin API the operator drives: live tuning, window stats and the start-up profile (bearer token)."""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse

from stallfree.contracts import Tuning, TuningError, validate_tuning
from stallfree.node_daemon.measure.profiler import suggest_token_budget
from stallfree.node_daemon.server.app import get_daemon
from stallfree.node_daemon.server.errors import APIError


def require_admin(request: Request) -> None:
    get_daemon(request).auth.check_admin(request)


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/tuning")
async def get_tuning(request: Request) -> JSONResponse:
    return JSONResponse(get_daemon(request).require_engine().get_tuning().to_dict())


@router.put("/tuning")
async def put_tuning(request: Request) -> JSONResponse:
    """Replace some or all live knobs; checked against the ceilings, applied at the next iteration."""
    daemon = get_daemon(request)
    engine = daemon.require_engine()
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object of tuning fields", code="invalid_json")
    try:
        tuning = Tuning.from_dict(body, base=engine.get_tuning())
        validate_tuning(tuning, engine.ceilings)
        engine.set_tuning(tuning)
    except TuningError as exc:
        raise APIError(400, str(exc), code="invalid_tuning") from None
    daemon.metrics.set_tuning(tuning)
    return JSONResponse(tuning.to_dict())


@router.get("/stats")
async def get_stats(request: Request) -> JSONResponse:
    """Exactly WindowStats.to_dict(): the operator parses it with WindowStats.from_dict."""
    daemon = get_daemon(request)
    engine = daemon.require_engine()
    live = daemon.live_counts()
    kwargs = {} if live is None else {"num_waiting": live.num_waiting, "num_running": live.num_running,
                                      "kv_usage": live.kv_usage}
    tuning, ceilings = engine.get_tuning(), engine.ceilings
    # Sorting a busy window's samples takes milliseconds; numpy's sort releases the GIL in a worker thread.
    stats = await asyncio.to_thread(daemon.stats.snapshot, tuning, ceilings, **kwargs)
    stats = replace(stats, queued_prompt_tokens=daemon.admission.queued_tokens,
                    kv_capacity_tokens=daemon.kv_capacity_tokens or 0, slow_paths=daemon.metrics.slow_paths)
    return JSONResponse(stats.to_dict())


@router.get("/profile")
async def get_profile(request: Request, tpot_slo_ms: float | None = None) -> JSONResponse:
    """Profile.to_dict() plus the budget it suggests for a TPOT target (the query's, else the daemon's)."""
    daemon = get_daemon(request)
    engine = daemon.require_engine()
    if tpot_slo_ms is not None and not (math.isfinite(tpot_slo_ms) and 0 < tpot_slo_ms <= 1e6):
        raise APIError(400, f"tpot_slo_ms must be a positive number of milliseconds (at most 1e6), got {tpot_slo_ms}",
                       param="tpot_slo_ms")
    if daemon.profile is None:
        raise APIError(404, "this daemon has no profile yet: started with --no-profile, or none was cached for this "
                       "model and machine and it is measured on the idle engine (once the compiled CPU forward, "
                       "if it was compiling, is in use)", code="no_profile", reason="not_found")
    target = tpot_slo_ms if tpot_slo_ms is not None else daemon.tpot_slo_ms
    body = daemon.profile.to_dict()
    body["tpot_slo_ms"] = target
    body["suggested_token_budget"] = (
        None if target is None or not daemon.profile.mixed else
        suggest_token_budget(daemon.profile, target, engine.ceilings, engine.get_tuning()))
    return JSONResponse(body)
