"""The operator's own Prometheus series: desired vs actual replicas, decisions, observed p99s vs SLOs.

One series per InferenceService (labels namespace, inferenceservice); decisions count by kind and
reason code (bounded sets, never free text). `stallfree_operator_desired_replicas` is what KEDA or an
HPA reads in the external scaling mode. Seconds, as Prometheus wants them.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from stallfree.operator.control.loop import StepResult
from stallfree.operator.control.policy import ControlPolicy

_SERVICE = ["namespace", "inferenceservice"]
_CONDITION_VALUE = {"True": 1.0, "False": 0.0, "Unknown": -1.0}


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.desired_replicas = Gauge("stallfree_operator_desired_replicas",
                                      "Replicas the control loop wants (what KEDA/HPA follow in external mode).",
                                      _SERVICE, registry=reg)
        self.replicas = Gauge("stallfree_operator_replicas", "Replicas the service is set to (spec.replicas).",
                              _SERVICE, registry=reg)
        self.ready_replicas = Gauge("stallfree_operator_ready_replicas", "Replicas whose pods are ready.",
                                    _SERVICE, registry=reg)
        self.unknown_replicas = Gauge("stallfree_operator_unknown_replicas",
                                      "Replicas the loop could not measure (not ready, failed scrape, too few "
                                      "samples).", _SERVICE, registry=reg)
        self.decisions = Counter("stallfree_operator_decisions", "Control decisions that changed something.",
                                 [*_SERVICE, "kind", "reason"], registry=reg)
        self.observed_p99 = Gauge("stallfree_operator_observed_p99_seconds",
                                  "Worst known replica's exact window p99 (metric: ttft, tpot, queue_wait).",
                                  [*_SERVICE, "metric"], registry=reg)
        self.slo_p99 = Gauge("stallfree_operator_slo_p99_seconds", "The declared p99 SLO (metric as above).",
                             [*_SERVICE, "metric"], registry=reg)
        self.token_budget = Gauge("stallfree_operator_token_budget", "Token budget the tuner wants per replica.",
                                  [*_SERVICE, "replica"], registry=reg)
        self.max_num_seqs = Gauge("stallfree_operator_max_num_seqs", "max_num_seqs the tuner wants per replica.",
                                  [*_SERVICE, "replica"], registry=reg)
        self.condition = Gauge("stallfree_operator_condition", "1 True, 0 False, -1 Unknown (type: SLOMet, "
                               "PrefillCapacityExhausted).", [*_SERVICE, "type"], registry=reg)
        self.steps = Counter("stallfree_operator_control_steps", "Control steps run.", _SERVICE, registry=reg)
        self.failures = Counter("stallfree_operator_actuation_failures", "PUTs or scale calls that failed.",
                                _SERVICE, registry=reg)
        self._replicas_seen: dict[tuple[str, str], set[str]] = {}

    def record(self, namespace: str, name: str, result: StepResult, policy: ControlPolicy) -> None:
        key = (namespace, name)
        self.steps.labels(*key).inc()
        self.desired_replicas.labels(*key).set(result.scale.desired)
        self.replicas.labels(*key).set(result.scale.current)
        self.ready_replicas.labels(*key).set(sum(1 for o in result.observations if o.ready))
        self.unknown_replicas.labels(*key).set(len(result.unknown))
        for decision in result.tuning:
            if decision.changed or decision.kind == "reapply":
                self.decisions.labels(*key, decision.kind, decision.reason).inc()
        if result.scale.changed:
            self.decisions.labels(*key, result.scale.kind, result.scale.reason).inc()
        if result.failures:
            self.failures.labels(*key).inc(len(result.failures))
        slo = {"ttft": policy.slo.ttft_p99_ms, "tpot": policy.slo.tpot_p99_ms,
               "queue_wait": policy.slo.queue_wait_p99_ms}
        observed = result.observed_p99()
        for metric, target_ms in slo.items():
            self.slo_p99.labels(*key, metric).set(target_ms / 1000.0)
            value = observed[f"{metric}_ms"]
            if value is not None:
                self.observed_p99.labels(*key, metric).set(value / 1000.0)
            elif self._has(self.observed_p99, *key, metric):
                self.observed_p99.remove(*key, metric)  # no known replica: no figure, rather than a stale one
        for condition in result.conditions:
            self.condition.labels(*key, condition.type).set(_CONDITION_VALUE[condition.status])
        seen = set()
        for decision in result.tuning:
            if decision.tuning is not None:
                seen.add(decision.replica)
                self.token_budget.labels(*key, decision.replica).set(decision.tuning.token_budget)
                self.max_num_seqs.labels(*key, decision.replica).set(decision.tuning.max_num_seqs)
        for gone in self._replicas_seen.get(key, set()) - seen:
            self.token_budget.remove(*key, gone)
            self.max_num_seqs.remove(*key, gone)
        self._replicas_seen[key] = seen

    def forget(self, namespace: str, name: str) -> None:
        """Drop every series of a deleted InferenceService."""
        key = (namespace, name)
        for family in (self.desired_replicas, self.replicas, self.ready_replicas, self.unknown_replicas,
                       self.steps, self.failures):
            if self._has(family, *key):
                family.remove(*key)
        for family in (self.decisions, self.observed_p99, self.slo_p99, self.token_budget, self.max_num_seqs,
                       self.condition):
            for labels in [k for k in family._metrics if k[:2] == key]:  # noqa: SLF001 - no public iterator
                family.remove(*labels)
        self._replicas_seen.pop(key, None)

    @staticmethod
    def _has(family, *labels: str) -> bool:
        return tuple(labels) in family._metrics  # noqa: SLF001
