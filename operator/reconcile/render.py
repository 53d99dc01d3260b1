"""Render an InferenceService's children: pure functions from the typed spec to Kubernetes objects.

Nothing here talks to a cluster. The reconciler applies what these return; the local runtime reuses
`daemon_args` to start the same daemons as processes.

Live knobs (token budget, max_num_seqs and their bounds, SLOs, tuning, scaling, replicas) must never
restart a pod: the control loop moves them over the daemons' admin API. Yet a daemon still needs
start-up values for them. So the pod template carries the *start-up knobs* it was last rolled with
(an annotation) and keeps them until something rollout-relevant changes: the template is a function
of the rollout-relevant fields only, and its hash (`template_hash`) says so.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from stallfree.contracts import Tuning
from stallfree.profile_rules import give_way
from stallfree.operator.api import checks
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import images

DAEMON_PORT = 8000
# The daemon's probe listener (`--probe-port`): no connection flood on DAEMON_PORT reaches it.
PROBE_PORT = 8001
ROUTER_PORT = 8080
SERVICE_PORT = 80
ADMIN_TOKEN_DIR = "/etc/stallfree/admin"
ADMIN_TOKEN_KEY = "token"
API_KEY_DIR = "/etc/stallfree/api-key"
API_KEY_KEY = "api-key"
ROUTER_KEYS_DIR = "/etc/stallfree/router-keys"  # the router's API keys (spec.routing.apiKeysSecret, key keys.json)
ROUTER_KEYS_KEY = "keys.json"
UPSTREAM_SECRET_DIR = "/etc/stallfree/upstream"  # the trusted gateway's secret (spec.routing.trustedUpstreamSecret)
UPSTREAM_SECRET_KEY = "secret"
PRESTOP_SLEEP_S = 5  # lets the endpoints controller take the pod out of the Service before SIGTERM
RUN_AS_USER = 1000
RENDER_VERSION = 2  # bump when rendering changes in a way running pods must pick up
# What a daemon asks for when its spec asks for nothing: never BestEffort (the first evicted under pressure).
DEFAULT_DAEMON_RESOURCES = {
    "sim": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
    "model": {"requests": {"cpu": "1", "memory": "2Gi"}},
}
TMP_SIZE_LIMIT = "4Gi"  # /tmp: compiled kernels (CPU extension, Triton) and caches

LABEL_SERVICE = f"{s.GROUP}/inferenceservice"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "stallfree-operator"
ANNOTATION_TEMPLATE_HASH = f"{s.GROUP}/template-hash"
ANNOTATION_STARTUP_KNOBS = f"{s.GROUP}/startup-knobs"

# Spec fields the daemons pick up live, over the admin API or from the operator's control loop.
LIVE_ENGINE_FIELDS = ("token_budget", "max_num_seqs", "max_partial_prefills", "long_prefill_threshold")
LIVE_SPEC_FIELDS = ("slos", "scaling", "tuning", "replicas")


# -- names and labels -----------------------------------------------------------------------------------

def selector_labels(name: str) -> dict[str, str]:
    return {LABEL_SERVICE: name, LABEL_COMPONENT: "daemon"}


def labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "stallfree", "app.kubernetes.io/instance": name,
            LABEL_MANAGED_BY: MANAGED_BY, **selector_labels(name)}


def selector_string(name: str) -> str:
    """The pods' label selector as /scale and kubectl want it."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def router_labels(name: str) -> dict[str, str]:
    return {**labels(name), LABEL_COMPONENT: "router"}


def router_selector_labels(name: str) -> dict[str, str]:
    return {LABEL_SERVICE: name, LABEL_COMPONENT: "router"}


def router_name(name: str) -> str:
    return f"{name}-router"


def daemons_service_name(name: str) -> str:
    """The daemons' own (headless) Service when the router fronts them: its EndpointSlices list them."""
    return f"{name}-daemons"


def endpoint(name: str, namespace: str) -> str:
    """Where clients send requests, either way: the Service named after the InferenceService."""
    return f"http://{name}.{namespace}.svc:{SERVICE_PORT}"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin-token"


# -- the start-up knobs and the rollout hash ------------------------------------------------------------

@dataclass(frozen=True)
class StartupKnobs:
    """Live knobs as a daemon gets them on its command line; the control loop moves them afterwards."""

    token_budget: int | str  # "auto": the daemon picks it from its profile and the TPOT SLO
    max_num_seqs: int
    max_partial_prefills: int
    long_prefill_threshold: int
    tpot_slo_ms: float
    stats_window_s: float

    @classmethod
    def from_spec(cls, spec: s.InferenceServiceSpec) -> "StartupKnobs":
        engine = spec.engine
        return cls(token_budget=engine.token_budget.initial, max_num_seqs=startup_max_num_seqs(spec),
                   max_partial_prefills=engine.max_partial_prefills,
                   long_prefill_threshold=engine.long_prefill_threshold,
                   tpot_slo_ms=spec.slos.tpot_p99_ms, stats_window_s=spec.slos.window_seconds)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "StartupKnobs":
        return cls(**json.loads(text))


def startup_max_num_seqs(spec: s.InferenceServiceSpec) -> int:
    """max_num_seqs "auto": the engine's default, inside the live bounds, leaving an initial budget room."""
    bounds = spec.engine.max_num_seqs
    if bounds.initial != s.AUTO:
        return int(bounds.initial)
    seqs = max(bounds.min, min(Tuning().max_num_seqs, bounds.upper(spec.engine.ceilings)))
    budget = spec.engine.token_budget.initial
    if budget != s.AUTO:
        _, seqs = give_way(int(budget), seqs, bounds.min, int(budget))
    return seqs


def rollout_view(spec: s.InferenceServiceSpec) -> dict[str, Any]:
    """The spec without its live knobs: what the pod template depends on."""
    data = spec.model_dump(mode="json")
    for key in LIVE_SPEC_FIELDS:
        data.pop(key, None)
    for key in LIVE_ENGINE_FIELDS:
        data["engine"].pop(key, None)
    data.pop("routing", None)  # the router is its own Deployment: switching it never restarts a daemon
    data.pop("objectives", None)  # read by the router only (for now): editing them never restarts a daemon
    data.pop("default_objective", None)
    data["engine"]["image"] = daemon_image(spec)  # a new default image rolls the daemons
    data["render_version"] = RENDER_VERSION
    return data


def daemon_image(spec: s.InferenceServiceSpec) -> str:
    """The spec's image, else the serving variant its device needs (a GPU asked for: CUDA)."""
    cuda = spec.engine.device == "cuda" or (spec.engine.device == "auto" and checks.gpu_count(spec) > 0)
    return images.serving_image(spec.engine.image, cuda=cuda)


def template_hash(spec: s.InferenceServiceSpec) -> str:
    payload = json.dumps(rollout_view(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def startup_knobs(spec: s.InferenceServiceSpec, existing: dict[str, Any] | None) -> StartupKnobs:
    """Keep the running pods' start-up knobs unless the template rolls anyway (then take the spec's)."""
    annotations = ((((existing or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
        "annotations") or {}
    if annotations.get(ANNOTATION_TEMPLATE_HASH) == template_hash(spec) and ANNOTATION_STARTUP_KNOBS in annotations:
        try:
            return StartupKnobs.from_json(annotations[ANNOTATION_STARTUP_KNOBS])
        except (TypeError, ValueError):
            pass  # an annotation someone edited by hand: fall back to the spec's values
    return StartupKnobs.from_spec(spec)


# -- the daemon's command line --------------------------------------------------------------------------

def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def daemon_args(spec: s.InferenceServiceSpec, knobs: StartupKnobs | None = None, *,
                admin_token_file: str | None = None, api_key_file: str | None = None) -> list[str]:
    """`stallfree serve` arguments for this spec, without --host/--port (the caller picks those)."""
    knobs = knobs or StartupKnobs.from_spec(spec)
    model, engine = spec.model, spec.engine
    args = ["--model", model.daemon_model, "--served-model-name", model.served_name, "--backend", engine.backend]
    if engine.hardware:
        args += ["--hardware", engine.hardware]
    args += ["--device", engine.device, "--dtype", engine.dtype, "--attention-backend", engine.attention_backend]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    args += ["--block-size", str(engine.block_size), "--kv-memory-fraction", _num(engine.kv_memory_fraction)]
    if engine.num_kv_blocks:
        args += ["--num-kv-blocks", str(engine.num_kv_blocks)]
    if not engine.prefix_caching:
        args.append("--no-prefix-caching")
    args += ["--max-token-budget", str(engine.ceilings.max_token_budget),
             "--max-num-seqs-ceiling", str(engine.ceilings.max_num_seqs),
             "--token-budget", str(knobs.token_budget), "--max-num-seqs", str(knobs.max_num_seqs),
             "--max-partial-prefills", str(knobs.max_partial_prefills),
             "--long-prefill-threshold", str(knobs.long_prefill_threshold),
             "--tpot-slo-ms", _num(knobs.tpot_slo_ms), "--stats-window-s", _num(knobs.stats_window_s)]
    if engine.max_queue_requests is not None:
        args += ["--max-queue-requests", str(engine.max_queue_requests)]
    if engine.max_queue_tokens is not None:
        args += ["--max-queue-tokens", str(engine.max_queue_tokens)]
    args += ["--drain-timeout-s", _num(engine.drain_timeout_seconds)]
    # The control loop owns the budget here, and its capacity model (prefill tokens/s at a budget) does not yet
    # count chunks cut below the budget for their prefix: the daemons keep every chunk at the budget it sets.
    args.append("--no-prefix-cut")
    if admin_token_file:
        args += ["--admin-token-file", admin_token_file]
    if api_key_file:
        args += ["--api-key-file", api_key_file]
    return args


# -- children -------------------------------------------------------------------------------------------

def _meta(name: str, namespace: str, service: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(service)}


def admin_secret(name: str, namespace: str, token: str) -> dict[str, Any]:
    """The admin token the operator presents to the daemons' /admin API. Made once, never rotated here."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(admin_secret_name(name), namespace, name),
            "stringData": {ADMIN_TOKEN_KEY: token}}


def _affinity(spec: s.InferenceServiceSpec, name: str) -> dict[str, Any] | None:
    """The user's affinity, plus one daemon per node only where the spec asks for it."""
    affinity = spec.affinity.to_manifest() if spec.affinity is not None else {}  # a fresh dict
    if spec.placement.one_per_node:
        anti = affinity.setdefault("podAntiAffinity", {})
        terms = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
        terms.append({"labelSelector": {"matchLabels": selector_labels(name)},
                      "topologyKey": "kubernetes.io/hostname"})
    return affinity or None


def spread(selector: dict[str, str]) -> list[dict[str, Any]]:
    """Spread replicas over nodes, then zones, where the scheduler can; never leave one Pending for it.

    Replicas pack by their resource requests (an 8-GPU node takes eight 1-GPU daemons), as KServe and
    llm-d render model servers; the spread only prefers emptier nodes and zones."""
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": dict(selector)}}
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")]


def _volumes(spec: s.InferenceServiceSpec, name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "admin-token", "secret": {"secretName": admin_secret_name(name), "defaultMode": 0o440}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.engine.api_key_secret:
        volumes.append({"name": "api-key", "secret": {
            "secretName": spec.engine.api_key_secret, "defaultMode": 0o440,
            "items": [{"key": API_KEY_KEY, "path": API_KEY_KEY}]}})
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    if spec.model.volume is not None:
        volumes.append({"name": "model", **spec.model.volume.to_pod_volume()})
        mounts.append({"name": "model", "mountPath": spec.model.mount_path, "readOnly": True})
    return volumes, mounts


def _probe(path: str, period_s: int, failures: int, timeout_s: int = 3, port: str = "http") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def pod_template(name: str, spec: s.InferenceServiceSpec, knobs: StartupKnobs) -> dict[str, Any]:
    volumes, mounts = _volumes(spec, name)
    api_key_file = f"{API_KEY_DIR}/{API_KEY_KEY}" if spec.engine.api_key_secret else None
    args = ["serve", *daemon_args(spec, knobs, admin_token_file=f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
                                  api_key_file=api_key_file),
            "--host", "0.0.0.0", "--port", str(DAEMON_PORT), "--probe-port", str(PROBE_PORT)]
    resources = {k: dict(v) for k, v in (("limits", spec.resources.limits), ("requests", spec.resources.requests))
                 if v} or copy.deepcopy(DEFAULT_DAEMON_RESOURCES[spec.engine.backend])
    container = {
        "name": "daemon",
        "image": daemon_image(spec),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["stallfree"],
        "args": args,
        "ports": [{"name": "http", "containerPort": DAEMON_PORT, "protocol": "TCP"},
                  {"name": "probes", "containerPort": PROBE_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
                {"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": resources,
        "volumeMounts": mounts,
        # Loading the model and profiling the device take minutes on a cold node: a startup probe
        # holds liveness off until /health first answers. Liveness asks the probe port (past the serving
        # port's connection cap a busy daemon would be restarted); readiness asks the serving port, whose
        # /ready says "connections full" so a full daemon gets no new work.
        "startupProbe": _probe("/health", 5, 180, port="probes"),
        "livenessProbe": _probe("/health", 10, 3, timeout_s=5, port="probes"),
        "readinessProbe": _probe("/ready", 5, 2),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": spread(selector_labels(name)),
        "automountServiceAccountToken": False,  # the daemon never talks to the API server
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        # SIGTERM starts the daemon's drain; give it the drain timeout plus the preStop pause.
        "terminationGracePeriodSeconds": math.ceil(spec.engine.drain_timeout_seconds) + PRESTOP_SLEEP_S + 10,
    }
    affinity = _affinity(spec, name)
    if affinity:
        pod_spec["affinity"] = affinity
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_manifest() for t in spec.tolerations]
    return {
        "metadata": {
            "labels": labels(name),
            "annotations": {ANNOTATION_TEMPLATE_HASH: template_hash(spec),
                            ANNOTATION_STARTUP_KNOBS: knobs.to_json(),
                            "prometheus.io/scrape": "true", "prometheus.io/port": str(DAEMON_PORT),
                            "prometheus.io/path": "/metrics"},
        },
        "spec": pod_spec,
    }


def deployment(name: str, namespace: str, spec: s.InferenceServiceSpec, knobs: StartupKnobs) -> dict[str, Any]:
    meta = _meta(name, namespace, name)
    meta["annotations"] = {ANNOTATION_TEMPLATE_HASH: template_hash(spec)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.desired_replicas(),
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update(spec)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1200,
            "template": pod_template(name, spec, knobs),
        },
    }


def service(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, namespace, name),
            "spec": {"type": "ClusterIP", "selector": selector_labels(name),
                     "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def rolling_update(spec: s.InferenceServiceSpec) -> dict[str, int]:
    """A new daemon first, then the old one goes, so a roll never leaves the service with fewer replicas; except
    for GPU services of several replicas, where scarce accelerators leave no room for an extra pod (one at a
    time goes, the others serve). A one-replica GPU service waits for a free GPU rather than going down."""
    if checks.gpu_count(spec) > 0 and spec.desired_replicas() > 1:
        return {"maxSurge": 0, "maxUnavailable": 1}
    return {"maxSurge": 1, "maxUnavailable": 0}


def pod_disruption_budget(name: str, namespace: str, spec: s.InferenceServiceSpec) -> dict[str, Any]:
    """One daemon at a time: a node drain never takes more than one replica's capacity away, and never the only
    one (a drain waits until the service has another, say after a scale-up or with scaling.minReplicas: 2)."""
    budget = {"minAvailable": 1} if spec.desired_replicas() <= 1 else {"maxUnavailable": 1}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(name, namespace, name),
            "spec": {**budget, "selector": {"matchLabels": selector_labels(name)}}}


def prometheus_label(label: str) -> str:
    """A Kubernetes label as Prometheus' service discovery spells it (__meta_kubernetes_*_label_<this>)."""
    return "".join(c if c.isalnum() else "_" for c in label)


def service_monitor(name: str, namespace: str, interval_s: int = 15) -> dict[str, Any]:
    """Scrape every pod of the service: the daemons and, in slo-aware routing, the routers.

    It selects each Service carrying the service's label (the daemons' own, headless `NAME-daemons`
    under the router, and the router's `NAME`), so every pod is scraped once. Prometheus would label a
    daemon's series `service="NAME-daemons"` there; the rules, dashboard and Prometheus observer select
    `service="NAME"`, so the relabeling sets it (and `component`: daemon or router) in both modes.
    """
    relabelings = [{"action": "replace", "targetLabel": "service", "replacement": name},
                   {"action": "replace", "targetLabel": "component",
                    "sourceLabels": [f"__meta_kubernetes_pod_label_{prometheus_label(LABEL_COMPONENT)}"]}]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(name, namespace, name),
            "spec": {"selector": {"matchLabels": {LABEL_SERVICE: name, LABEL_MANAGED_BY: MANAGED_BY}},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": f"{interval_s}s",
                                    "relabelings": relabelings}]}}


# Who may reach the daemons' port besides the service's routers: the operator (its control loop's admin API
# calls; the namespace it runs in, from its Deployment) and Prometheus (kube-prometheus-stack's pods carry
# this label).
OPERATOR_NAMESPACE_ENV = "STALLFREE_OPERATOR_NAMESPACE"
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "stallfree-operator"}
SCRAPER_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}


def network_policy(name: str, namespace: str, spec: s.InferenceServiceSpec) -> dict[str, Any]:
    """The daemons' ingress. In slo-aware routing their port takes only the service's routers, the operator and
    the scraper, so no pod gets past the router's doors, shedding and fairness; in service routing the daemons
    are the front door, so their port stays open. Nothing else reaches any daemon port (kubelet probes come
    from the node, which NetworkPolicy implementations let through)."""
    operator_ns = os.environ.get(OPERATOR_NAMESPACE_ENV) or "stallfree-system"
    port = [{"protocol": "TCP", "port": DAEMON_PORT}]
    if spec.routing.mode == "slo-aware":
        peers = [{"podSelector": {"matchLabels": router_selector_labels(name)}},
                 {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_ns}},
                  "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}},
                 {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(SCRAPER_POD_LABELS)}}]
        ingress = [{"from": peers, "ports": port}]
    else:
        ingress = [{"ports": port}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(name, namespace, name),
            "spec": {"podSelector": {"matchLabels": selector_labels(name)}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


SLO_RECORD = "stallfree:slo_p99_seconds"


def slo_rule(name: str, namespace: str, spec: s.InferenceServiceSpec) -> dict[str, Any]:
    """The service's p99 targets as Prometheus series, one per objective and metric (`default`: requests without
    one, or spec.slos where no objectives are declared). The shipped alerts compare the daemons' per-objective
    histograms with these, so they hold while the operator is down: the targets live in Prometheus' rules."""
    rules = [{"record": SLO_RECORD, "expr": f"vector({target_ms / 1000.0:g})",
              "labels": {"namespace": namespace, "service": name, "objective": o.name, "metric": metric}}
             for o in spec.resolved_objectives()
             for metric, target_ms in (("ttft", o.ttft_p99_ms), ("tpot", o.tpot_p99_ms),
                                       ("queue_wait", o.queue_wait_p99_ms))]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": _meta(name, namespace, name),
            "spec": {"groups": [{"name": f"stallfree-slo.{namespace}.{name}", "interval": "30s", "rules": rules}]}}


# -- the router (spec.routing.mode slo-aware) ----------------------------------------------------------

def objectives_json(objectives: list[s.Objective]) -> str:
    """The router's --objectives: each objective with its targets resolved (router/objectives.py reads it)."""
    return json.dumps([{"name": o.name, "priority": o.priority, "ttftP99Ms": o.ttft_p99_ms, "tpotP99Ms": o.tpot_p99_ms,
                        "queueWaitP99Ms": o.queue_wait_p99_ms, "default": o.default} for o in objectives],
                      separators=(",", ":"))


def router_args(name: str, spec: s.InferenceServiceSpec) -> list[str]:
    return ["router", "--service", daemons_service_name(name), "--policy", spec.routing.policy,
            "--admin-token-file", f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}", "--host", "0.0.0.0",
            "--port", str(ROUTER_PORT), "--probe-port", str(PROBE_PORT),
            "--queue-wait-slo-ms", f"{spec.slos.queue_wait_p99_ms:g}",
            "--drain-timeout-s", f"{spec.engine.drain_timeout_seconds:g}",
            *(["--objectives", objectives_json(spec.resolved_objectives())] if spec.objectives else []),
            *(["--api-keys-file", f"{ROUTER_KEYS_DIR}/{ROUTER_KEYS_KEY}"] if spec.routing.api_keys_secret else []),
            *(["--trusted-upstream-secret-file", f"{UPSTREAM_SECRET_DIR}/{UPSTREAM_SECRET_KEY}"]
              if spec.routing.trusted_upstream_secret else [])]


def _router_secrets(spec: s.InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The router's API keys and trusted gateway secret, mounted whole (never by subPath: a mounted Secret is
    updated in place, so keys rotate without a restart)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for secret, volume, key, path in ((spec.routing.api_keys_secret, "api-keys", ROUTER_KEYS_KEY, ROUTER_KEYS_DIR),
                                      (spec.routing.trusted_upstream_secret, "upstream-secret", UPSTREAM_SECRET_KEY,
                                       UPSTREAM_SECRET_DIR)):
        if secret:
            volumes.append({"name": volume, "secret": {"secretName": secret, "defaultMode": 0o440,
                                                       "items": [{"key": key, "path": key}]}})
            mounts.append({"name": volume, "mountPath": path, "readOnly": True})
    return volumes, mounts


def router_deployment(name: str, namespace: str, spec: s.InferenceServiceSpec) -> dict[str, Any]:
    container = {
        "name": "router",
        "image": images.control_plane_image(),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["stallfree"],
        "args": router_args(name, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "probes", "containerPort": PROBE_PORT, "protocol": "TCP"}],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
                         *_router_secrets(spec)[1]],
        # Liveness on the probe port: a connection flood on the serving port is not a reason to restart it.
        "startupProbe": _probe("/health", 2, 30, port="probes"),
        "livenessProbe": _probe("/health", 10, 3, port="probes"),
        "readinessProbe": _probe("/ready", 2, 2, timeout_s=2),
        # As the daemons': the endpoints controller takes the pod out of the Service before SIGTERM.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(name),
        "automountServiceAccountToken": True,  # it lists its daemons' EndpointSlices, nothing else
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": [{"name": "admin-token", "secret": {"secretName": admin_secret_name(name), "defaultMode": 0o440}},
                    *_router_secrets(spec)[0]],
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "fsGroup": RUN_AS_USER,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "topologySpreadConstraints": spread(router_selector_labels(name)),  # two routers, two nodes
        # In-flight requests (streams included) finish after the preStop pause; queued ones are sent on.
        "terminationGracePeriodSeconds": math.ceil(spec.engine.drain_timeout_seconds) + PRESTOP_SLEEP_S + 10,
    }
    # The daemons' tolerations, but none for GPU taints: a router needs no accelerator and must not take a
    # GPU node's room.
    router_tolerations = [t.to_manifest() for t in spec.tolerations if "gpu" not in (t.key or "").lower()]
    if router_tolerations:
        pod_spec["tolerations"] = router_tolerations
    meta = {"name": router_name(name), "namespace": namespace, "labels": router_labels(name)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.routing.replicas,
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": router_labels(name),
                                      "annotations": {"prometheus.io/scrape": "true",
                                                      "prometheus.io/port": str(ROUTER_PORT),
                                                      "prometheus.io/path": "/metrics"}},
                         "spec": pod_spec},
        },
    }


def router_pod_disruption_budget(name: str, namespace: str) -> dict[str, Any]:
    """A node drain takes one router at a time: with 2 (the default) one always answers."""
    meta = {"name": router_name(name), "namespace": namespace, "labels": router_labels(name)}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector_labels(name)}}}


def router_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """A ServiceAccount that may list EndpointSlices in its own namespace: all the router reads of the API."""
    meta = {"name": router_name(name), "namespace": namespace, "labels": router_labels(name)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(name)},
         "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}]},
    ]


def router_service(name: str, namespace: str) -> dict[str, Any]:
    """The Service clients use, in front of the router pods."""
    meta = {"name": name, "namespace": namespace, "labels": router_labels(name)}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"type": "ClusterIP", "selector": router_selector_labels(name),
                     "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def daemons_service(name: str, namespace: str) -> dict[str, Any]:
    """Headless: no virtual IP to spread requests, only EndpointSlices for the router to read."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(daemons_service_name(name), namespace, name),
            "spec": {"clusterIP": "None", "selector": selector_labels(name), "publishNotReadyAddresses": False,
                     "ports": [{"name": "http", "port": DAEMON_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def router_children_refs(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of what slo-aware routing adds: removed again when the mode is service."""
    return [("apps/v1", "Deployment", router_name(name)), ("policy/v1", "PodDisruptionBudget", router_name(name)),
            ("v1", "Service", daemons_service_name(name)),
            ("rbac.authorization.k8s.io/v1", "RoleBinding", router_name(name)),
            ("rbac.authorization.k8s.io/v1", "Role", router_name(name)),
            ("v1", "ServiceAccount", router_name(name))]


def children(name: str, namespace: str, spec: s.InferenceServiceSpec, knobs: StartupKnobs,
             with_service_monitor: bool, with_slo_rule: bool = False) -> list[dict[str, Any]]:
    """Every child but the Secret (made once, separately), in the order they are applied."""
    routed = spec.routing.mode == "slo-aware"
    out = [router_service(name, namespace) if routed else service(name, namespace)]
    if routed:
        out += [daemons_service(name, namespace), *router_rbac(name, namespace)]
    out += [network_policy(name, namespace, spec), pod_disruption_budget(name, namespace, spec),
            deployment(name, namespace, spec, knobs)]
    if routed:
        out += [router_pod_disruption_budget(name, namespace), router_deployment(name, namespace, spec)]
    if with_service_monitor:
        out.append(service_monitor(name, namespace))
    if with_slo_rule:
        out.append(slo_rule(name, namespace, spec))
    return out
