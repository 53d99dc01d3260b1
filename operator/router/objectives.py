"""Objectives: the classes of requests the router serves (spec.objectives), and which one a request names (pure).

A request names its objective in `x-stallfree-objective`; its tenant is who its credentials say (identity.py),
and only a trusted gateway's `x-gateway-inference-fairness-id` (the Gateway API Inference Extension's header)
names one. No objective header: the default objective. A name the service does not define is refused (400) before
the request is queued or counted as demand. The operator hands the router the
objectives with their targets already resolved against spec.slos (`--objectives JSON`); without them the router
has one implicit objective at priority 0 with no TTFT target, so its queue stays first come, first served
(tenants, when requests name them, still take turns).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

OBJECTIVE_HEADER = "x-stallfree-objective"
TENANT_HEADER = "x-gateway-inference-fairness-id"
IMPLICIT = "default"
MAX_TENANT_CHARS = 128  # a tenant id is a key the queue keeps while the tenant waits: bounded


@dataclass(frozen=True)
class Objective:
    name: str
    priority: int = 0
    ttft_ms: float | None = None  # None: no deadline (the implicit objective: arrival order)
    tpot_ms: float | None = None
    queue_wait_ms: float | None = None

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


@dataclass(frozen=True)
class Objectives:
    by_name: dict[str, Objective]
    default: Objective

    @classmethod
    def implicit(cls) -> "Objectives":
        only = Objective(IMPLICIT)
        return cls({only.name: only}, only)

    def named(self, header: str | None) -> Objective | None:
        """The objective a request's header names (the default without one); None: no such objective."""
        if header is None or header.strip() == "":
            return self.default
        return self.by_name.get(header.strip())

    def names(self) -> list[str]:
        return sorted(self.by_name)


def deadline_s(objective: Objective, prompt_tokens: int, received_s: float,
               fastest_prefill_tokens_per_ms: float | None) -> float | None:
    """A request's place in its tenant's line: arrival plus the objective's TTFT target, less the prompt's prefill
    at the fastest replica (None: the objective has no TTFT target, arrival order)."""
    if objective.ttft_ms is None:
        return None
    rate = fastest_prefill_tokens_per_ms or 0.0
    prefill_ms = prompt_tokens / rate if rate > 0 else 0.0
    return received_s + (objective.ttft_ms - prefill_ms) / 1000.0


def parse_objectives(text: str) -> Objectives:
    """`--objectives`: a JSON list of {name, priority, ttftP99Ms, tpotP99Ms?, queueWaitP99Ms?, default?}.
    Raises ValueError naming the problem."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--objectives is not JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise ValueError("--objectives must be a non-empty JSON list of objectives")
    out: list[Objective] = []
    defaults: list[Objective] = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError(f"--objectives[{i}]: an object with a non-empty name is required")
        priority = item.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"--objectives[{i}] ({item['name']}): priority must be an integer")
        targets = {}
        for key in ("ttftP99Ms", "tpotP99Ms", "queueWaitP99Ms"):
            value = item.get(key)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"--objectives[{i}] ({item['name']}): {key} must be a positive number")
            targets[key] = None if value is None else float(value)
        objective = Objective(item["name"], priority, targets["ttftP99Ms"], targets["tpotP99Ms"],
                              targets["queueWaitP99Ms"])
        out.append(objective)
        if item.get("default") is True:
            defaults.append(objective)
    by_name = {o.name: o for o in out}
    if len(by_name) != len(out):
        raise ValueError("--objectives names an objective twice")
    if len(defaults) > 1:
        raise ValueError("--objectives marks more than one objective default")
    return Objectives(by_name, defaults[0] if defaults else out[0])


def header(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    """One request header's value (ASGI headers: lower-case names), or None."""
    key = name.encode()
    for k, v in headers:
        if k == key:
            return v.decode("latin-1")
    return None
