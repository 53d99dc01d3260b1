"""What the router refuses itself, before a request is queued or counted as demand (pure).

The scaler sizes the service from the prompt tokens that arrive at the router (`/router/queue`), so a
request no replica would serve must not count: a body that is not a JSON object (400) and a model no replica
serves (404, once the replicas' /v1/models are known) are answered here, and a prompt's estimate counts at
most the model's context (a longer prompt is a 400 on the replica, and one 4 MB prompt is no million tokens
of demand). So is an objective the service does not define (`x-stallfree-objective`, 400 naming it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

from stallfree.operator.router.objectives import OBJECTIVE_HEADER, Objective, Objectives
from stallfree.operator.router.replicas import Replica
from stallfree.operator.router.requests import RequestInfo


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    code: str
    param: str | None = None


def served_models(replicas: Iterable[Replica]) -> dict[str, int] | None:
    """model id -> context length over the replicas that said what they serve; None when none did yet."""
    served: dict[str, int] | None = None
    for replica in replicas:
        if replica.models is not None:
            served = served or {}
            for model, context in replica.models.items():
                served[model] = max(served.get(model, 0), context)
    return served


def refusal(parsed: Any, served: dict[str, int] | None) -> Refusal | None:
    """Why the router answers this generation request itself, or None (it goes to a replica)."""
    if not isinstance(parsed, dict):
        return Refusal(400, "the request body must be a JSON object", "invalid_json")
    model = parsed.get("model")
    if not isinstance(model, str):
        return Refusal(400, "model: a model id (a string) is required", "invalid_value", "model")
    if served is not None and model not in served:
        names = ", ".join(f"`{m}`" for m in sorted(served)[:8])
        return Refusal(404, f"The model `{model[:200]}` does not exist; this service serves {names}.",
                       "model_not_found", "model")
    return None


def bounded(info: RequestInfo, model: str, served: dict[str, int] | None) -> RequestInfo:
    """The request with its prompt estimate at most the model's context, when that is known."""
    context = (served or {}).get(model, 0)
    if context and info.prompt_tokens > context:
        return replace(info, prompt_tokens=context)
    return info


def objective_or_refusal(header: str | None, objectives: Objectives) -> Objective | Refusal:
    """The objective the request names, or the 400 that names what it asked for and what exists."""
    objective = objectives.named(header)
    if objective is not None:
        return objective
    names = ", ".join(f"`{n}`" for n in objectives.names()[:16])
    return Refusal(400, f"{OBJECTIVE_HEADER}: the objective `{(header or '').strip()[:100]}` does not exist; "
                   f"this service defines {names}.", "unknown_objective", OBJECTIVE_HEADER)
