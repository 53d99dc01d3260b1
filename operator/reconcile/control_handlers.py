"""kopf glue for the SLO control loop: one control step per InferenceService every spec.tuning.intervalSeconds.

A kopf timer ticks every TICK_S and runs a step when the service's own interval has passed (the interval
is read from the spec at each tick, so changing it needs no restart). A step observes the service's
daemon pods over their admin API, lets the tuner and scaler decide, acts (PUT /admin/tuning, /scale in
managed mode) and writes what it saw and did to the status (status.control with its feasibility, the p99
columns, the SLOMet, PrefillCapacityExhausted and SLOFeasible conditions) and to the operator's metrics. The loop's memory lives in
status.control.state, so an operator that restarts resumes where it was and does not scale twice.

Loaded by `stallfree operator` next to the reconciler (handlers.py). Operator metrics are served on
STALLFREE_OPERATOR_METRICS_PORT (default 9090; 0 turns them off). With STALLFREE_PROMETHEUS_URL set, replicas
are observed through that Prometheus (series selected by namespace and service, one per pod) instead of
their admin API; tuning PUTs still go to the admin API.
"""
from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from typing import Any

import httpx
import kopf
from prometheus_client import start_http_server
from pydantic import ValidationError

from stallfree.contracts import Ceilings

from stallfree.operator.api import conditions as cond
from stallfree.operator.api import spec as s
from stallfree.operator.control.loop import ControlLoop, ControlState, StepResult
from stallfree.operator.control.policy import ControlPolicy
from stallfree.operator.reconcile.k8s_actuator import (KubernetesActuator, read_admin_token, replica_targets,
                                                       router_urls)
from stallfree.operator.reconcile import render
from stallfree.operator.reconcile.kube import Kube
from stallfree.operator.control.observe import Observer
from stallfree.operator.control.observe_http import HttpObserver
from stallfree.operator.control.observe_router import RouterQueueSource, http_queue_reader, summed_reader
from stallfree.operator.control.observe_prometheus import PrometheusObserver
from stallfree.operator.control.operator_metrics import OperatorMetrics

TICK_S = 1.0
SCRAPE_TIMEOUT_S = 3.0
METRICS_PORT_ENV = "STALLFREE_OPERATOR_METRICS_PORT"
PROMETHEUS_URL_ENV = "STALLFREE_PROMETHEUS_URL"
METRICS = OperatorMetrics()


@kopf.on.startup()
async def start_control_loop(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # One HTTP client for every service's scrapes and PUTs (connection reuse across steps).
    memo.control_http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
    if getattr(memo, "kube", None) is None:  # the reconciler's startup makes it too; whichever runs first
        memo.kube = Kube.from_environment()
    port = int(os.environ.get(METRICS_PORT_ENV, "9090"))
    if port and not getattr(memo, "control_metrics_served", False):
        start_http_server(port, registry=METRICS.registry)
        memo.control_metrics_served = True
        logger.info(f"operator metrics on :{port}/metrics")


@kopf.on.cleanup()
async def stop_control_loop(memo: kopf.Memo, **_: Any) -> None:
    client = getattr(memo, "control_http", None)
    if client is not None:
        await client.aclose()


@kopf.timer(s.GROUP, s.VERSION, s.PLURAL, interval=TICK_S, backoff=2 * TICK_S)
async def control_tick(body: kopf.Body, memo: kopf.Memo, logger: logging.LoggerAdapter, **_: Any) -> None:
    owner = dict(body)
    if owner["metadata"].get("deletionTimestamp"):
        return
    try:
        spec = s.parse_spec(dict(owner.get("spec") or {}))
    except ValidationError:
        return  # the reconciler reports InvalidSpec; nothing to control
    policy = ControlPolicy.from_spec(spec)
    now = time.time()
    last = getattr(memo, "control_last_step", None)
    if last is not None and now - last < policy.interval_s - TICK_S / 2:
        return
    memo.control_last_step = now
    result = await control_step(memo, owner, spec, policy, now)
    if result.failures:
        logger.warning("; ".join(result.failures))


async def control_step(memo: kopf.Memo, owner: dict[str, Any], spec: s.InferenceServiceSpec, policy: ControlPolicy,
                       now: float) -> StepResult:
    kube: Kube = memo.kube
    namespace, name = owner["metadata"]["namespace"], owner["metadata"]["name"]
    state: ControlState | None = getattr(memo, "control_state", None)
    if state is None:
        # First step of this operator process: resume from what the last one recorded.
        state = ControlState.from_dict(((owner.get("status") or {}).get("control") or {}).get("state"))
    # Read at every step, never cached: a Secret made anew (by hand, by GitOps, by the repair below) is
    # used from the next step on, not after an operator restart.
    token = await asyncio.to_thread(read_admin_token, kube, namespace, name)
    if token is None and owner["metadata"].get("generation", 1) == (owner.get("status") or {}).get(
            "observedGeneration"):
        await asyncio.to_thread(repair_children, kube, owner)
    targets = await asyncio.to_thread(replica_targets, kube, namespace, name)
    client: httpx.AsyncClient = memo.control_http
    if client.is_closed:  # the operator is stopping
        raise kopf.TemporaryError("operator stopping", delay=TICK_S)
    loop = ControlLoop(policy, observer_for(client, token, namespace, name, spec, policy),
                       KubernetesActuator(kube, owner, client, token, targets, SCRAPE_TIMEOUT_S), state,
                       queue_source=queue_source_for(memo, client, namespace, name, spec, policy, token))
    result = await loop.step(targets, spec.replicas, now)
    memo.control_state = loop.state
    generation = owner["metadata"].get("generation")
    conditions = [cond.condition(c.type, c.status, c.reason, c.message, generation)  # type: ignore[arg-type]
                  for c in result.conditions]
    await asyncio.to_thread(kube.update_status, namespace, name, status_fields(result), conditions)
    METRICS.record(namespace, name, result, policy)
    return result


def repair_children(kube: Kube, owner: dict[str, Any]) -> None:
    """The admin Secret is gone though the spec was reconciled: reconcile again (Secrets are not watched,
    which would take cluster-wide rights on every Secret)."""
    from stallfree.operator.reconcile.handlers import reconcile_latest  # registered by `stallfree operator`

    reconcile_latest(kube, owner["metadata"]["namespace"], owner["metadata"]["name"],
                     logging.getLogger("stallfree.operator"))


def queue_source_for(memo: kopf.Memo, client: httpx.AsyncClient, namespace: str, name: str,
                     spec: s.InferenceServiceSpec, policy: ControlPolicy,
                     token: str | None = None) -> RouterQueueSource | None:
    """The routers' queues (flow control) when the operator runs routers for this service, summed over their
    pods (found afresh at each reading, with this step's admin token); kept across steps (arrival rates come from
    two readings)."""
    if spec.routing.mode != "slo-aware":
        return None
    sources = memo.setdefault("queue_sources", {})  # kopf.Memo is a dict
    tokens = memo.setdefault("queue_tokens", {})
    key = (namespace, name)
    tokens[key] = token
    if key not in sources:
        kube: Kube = memo.kube

        async def readers() -> list:
            urls = await asyncio.to_thread(router_urls, kube, namespace, name)
            return [http_queue_reader(client, url, SCRAPE_TIMEOUT_S, tokens.get(key)) for url in urls]

        sources[key] = RouterQueueSource(summed_reader(readers), policy.window_s)
    return sources[key]


def observer_for(client: httpx.AsyncClient, token: str | None, namespace: str, name: str,
                 spec: s.InferenceServiceSpec, policy: ControlPolicy) -> Observer:
    prometheus = os.environ.get(PROMETHEUS_URL_ENV)
    if prometheus:
        ceilings = Ceilings(spec.engine.ceilings.max_token_budget, spec.engine.ceilings.max_num_seqs)
        return PrometheusObserver(client, prometheus, f'namespace="{namespace}", service="{name}"', policy.window_s,
                                  ceilings, policy.min_samples)
    return HttpObserver(client, token, SCRAPE_TIMEOUT_S, policy.min_samples)


def status_fields(result: StepResult) -> dict[str, Any]:
    """status.control (with each objective's p99s, goodput and feasibility) plus the printer columns' figures
    (worst known replica's p99s, median tuning, the service's goodput where the router reports objectives)."""
    p99 = result.observed_p99()
    tunings = [d.tuning for d in result.tuning if d.tuning is not None]
    control = result.to_status()
    fields: dict[str, Any] = {
        "control": control,
        "goodput": control.get("goodput"),
        "p99TtftMs": _round(p99["ttft_ms"]),
        "p99TpotMs": _round(p99["tpot_ms"]),
        "p99QueueWaitMs": _round(p99["queue_wait_ms"]),
    }
    if tunings:
        fields["tokenBudget"] = int(statistics.median_low(t.token_budget for t in tunings))
        fields["maxNumSeqs"] = int(statistics.median_low(t.max_num_seqs for t in tunings))
    return fields


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@kopf.on.delete(s.GROUP, s.VERSION, s.PLURAL, optional=True)
def forget_service(name: str, namespace: str, **_: Any) -> None:
    METRICS.forget(namespace, name)
