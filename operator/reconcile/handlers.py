"""kopf handlers: make each InferenceService's children exist and report it truthfully.

Thin glue, level-triggered: every create, resume and update renders all children from the spec
(render.py) and applies them (kube.py), and a timer does the same every RESYNC_S, so children deleted by
hand come back and the status follows the Deployment's rollout. A spec that cannot be deployed (checks.py, or a schema the API server did not
enforce) gets an InvalidSpec condition and a Warning event, and nothing is made or changed: no
exception, so kopf does not retry it until the spec changes. A child the API server refuses as
Invalid (422) would be refused again on every retry: an InvalidChild condition, and kopf.PermanentError.

The operator's rights in a namespace come from a RoleBinding there (manifests/operator/namespaced/): where
none is bound, the service gets a NamespaceNotServed condition (its status is the one thing the operator
may write everywhere) and the next resync tries again.

kopf runs a service's timer and its change handlers side by side, so a resync and an update could apply
two specs at once, the older one last.
Every reconcile of one InferenceService therefore runs under its lock and reads the object afresh
inside it: the last one to run applies the newest spec.
"""
from __future__ import annotations

import logging
import secrets
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import kopf
from pydantic import ValidationError

from stallfree.operator.api import checks
from stallfree.operator.api import conditions as cond
from stallfree.operator.reconcile import render
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile.kube import Kube, KubeError, contains, load_configuration

FINALIZER = f"{s.GROUP}/finalizer"
SERVICE_MONITOR_API = ("monitoring.coreos.com/v1", "ServiceMonitor")
PROMETHEUS_RULE_API = ("monitoring.coreos.com/v1", "PrometheusRule")
# A failed reconcile (an API server hiccup) is retried after this, not kopf's default minute.
RETRY_BACKOFF_S = 5.0
# How often each service's children are read back and repaired, and its rollout reported (no child is
# watched: that would take cluster-wide rights on them).
RESYNC_S = 10.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: the status schema is structural and would prune it.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=s.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=s.GROUP, key="last-handled-configuration")
    # Events are what the operator *does* (kopf.info/warn below), not every log line.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    # A deletion waits for the service's timers (resync, control step) to exit; one in the middle of its run is
    # polled for every second, not kopf's default minute, so a deleted service is released promptly.
    settings.background.cancellation_polling = 1.0
    if getattr(memo, "kube", None) is None:
        memo.kube = Kube.from_environment()


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's own watches use the very credentials the operator's client uses (kube.load_configuration)."""
    config = load_configuration()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        scheme=scheme or None, token=token or None, certificate_path=config.cert_file,
        private_key_path=config.key_file, username=config.username or None, password=config.password or None)


@kopf.on.cleanup()
def close_client(memo: kopf.Memo, **_: Any) -> None:
    kube = getattr(memo, "kube", None)
    if kube is not None:
        kube.close()


# -- reconcile ------------------------------------------------------------------------------------------

@dataclass
class Applied:
    created: list[str]
    rolled: bool  # the pod template changed: the Deployment rolls
    previous_hash: str | None
    template_hash: str
    deployment: dict[str, Any]


def _parse(body: dict[str, Any]) -> tuple[s.InferenceServiceSpec | None, list[str]]:
    try:
        parsed = s.parse_spec(dict(body.get("spec") or {}))
    except ValidationError as exc:
        return None, [s.spec_errors(exc)]
    return parsed, checks.problems(parsed)


def _template_hash_of(deployment: dict[str, Any] | None) -> str | None:
    return ((deployment or {}).get("metadata") or {}).get("annotations", {}).get(render.ANNOTATION_TEMPLATE_HASH)


class ChildConflict(Exception):
    """An object the service would own already exists and belongs to someone else."""


class InvalidChild(Exception):
    """The API server refused a rendered child as Invalid (422): the same spec gets the same answer."""


def _written(kube: Kube, child: dict[str, Any]) -> dict[str, Any]:
    try:
        return kube.apply(child)
    except KubeError as exc:
        if exc.status != 422:
            raise  # conflicts, timeouts, outages: kopf retries those
        raise InvalidChild(f"{child['kind']}/{child['metadata']['name']} refused by the API server: "
                           f"{exc.message}") from exc


def _check_owned(current: dict[str, Any] | None, owner: dict[str, Any]) -> None:
    if current is None:
        return
    uid = owner["metadata"].get("uid")
    refs = (current.get("metadata") or {}).get("ownerReferences") or []
    if not any(ref.get("uid") == uid and ref.get("controller") for ref in refs):
        raise ChildConflict(f"{current.get('kind', 'object')} {current['metadata']['name']} exists and is not "
                            f"owned by this InferenceService; rename one of them or delete it")


def _is_daemons(child: dict[str, Any], name: str) -> bool:
    return child["kind"] == "Deployment" and child["metadata"]["name"] == name


def apply_children(kube: Kube, owner: dict[str, Any], spec: s.InferenceServiceSpec,
                   existing: dict[str, Any] | None) -> Applied:
    """Apply every child; ChildConflict (before anything is written) where a name is taken."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    created: list[str] = []
    knobs = render.startup_knobs(spec, existing)
    with_monitor, with_rule = kube.has_api(*SERVICE_MONITOR_API), kube.has_api(*PROMETHEUS_RULE_API)
    children = render.children(name, namespace, spec, knobs, with_service_monitor=with_monitor,
                               with_slo_rule=with_rule)
    currents = [existing if _is_daemons(child, name) else kube.get(
        child["apiVersion"], child["kind"], namespace, child["metadata"]["name"]) for child in children]
    secret = render.admin_secret(name, namespace, secrets.token_urlsafe(32))
    current_secret = kube.get("v1", "Secret", namespace, secret["metadata"]["name"])
    for current in [current_secret, *currents]:
        _check_owned(current, owner)

    kopf.adopt(secret, owner=owner)
    if current_secret is None and kube.create_if_absent(secret):  # made once: never rotated by a reconcile
        created.append(f"Secret/{secret['metadata']['name']}")

    deployment = None
    for child, current in zip(children, currents):
        kopf.adopt(child, owner=owner)
        result = current if current is not None and contains(current, child) else _written(kube, child)
        if current is None:
            created.append(f"{child['kind']}/{child['metadata']['name']}")
        if _is_daemons(child, name):
            deployment = result
    assert deployment is not None
    if spec.routing.mode != "slo-aware":
        # Routing switched to a plain Service: what the router needed goes (only if it is ours).
        for api_version, kind, child_name in render.router_children_refs(name):
            current = kube.get(api_version, kind, namespace, child_name)
            if current is not None:
                _check_owned(current, owner)
                kube.delete(api_version, kind, namespace, child_name)
    previous = _template_hash_of(existing)
    new_hash = render.template_hash(spec)
    return Applied(created, existing is not None and previous != new_hash, previous, new_hash, deployment)


def refresh_status(kube: Kube, owner: dict[str, Any], spec: s.InferenceServiceSpec,
                   deployment: dict[str, Any] | None, generation: int | None) -> None:
    """Status from the Deployment: replica counts and the reconciler's conditions."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    desired = spec.desired_replicas()
    fields: dict[str, Any] = {**cond.rollout_status(deployment), "desiredReplicas": desired,
                              "selector": render.selector_string(name),
                              "templateHash": _template_hash_of(deployment),
                              "endpoint": render.endpoint(name, namespace)}
    if generation is not None:
        fields["observedGeneration"] = generation
    updates = cond.rollout_conditions(deployment, desired, generation)
    current = (owner.get("status") or {}).get("conditions")
    # The control loop owns these; until it reports, say plainly that nothing was observed.
    updates += [c for c in cond.awaiting_observation(generation) if cond.find(current, c["type"]) is None]
    kube.update_status(namespace, name, fields, updates)


def reconcile_service(kube: Kube, owner: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> None:
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    generation = owner["metadata"].get("generation")
    existing = kube.get("apps/v1", "Deployment", namespace, name)
    spec, problems = _parse(owner)
    if problems:
        message = "; ".join(problems)
        logger.warning(f"invalid spec, nothing applied: {message}")
        kopf.warn(owner, reason="InvalidSpec", message=message)
        kube.update_status(namespace, name, {"observedGeneration": generation},
                           cond.invalid_spec(message, generation, serving_previous=existing is not None))
        return
    assert spec is not None
    try:
        applied = apply_children(kube, owner, spec, existing)
    except ChildConflict as exc:
        logger.warning(f"not applied: {exc}")
        kopf.warn(owner, reason="ChildConflict", message=str(exc))
        kube.update_status(namespace, name, {"observedGeneration": generation}, [
            cond.condition(cond.DEGRADED, "True", "ChildConflict", str(exc), generation),
            cond.condition(cond.PROGRESSING, "False", "ChildConflict", "waiting for the name to be free", generation),
            cond.condition(cond.READY, "False", "ChildConflict", str(exc), generation)])
        return
    except InvalidChild as exc:
        logger.warning(f"not applied: {exc}")
        kopf.warn(owner, reason="InvalidChild", message=str(exc))
        kube.update_status(namespace, name, {"observedGeneration": generation},
                           cond.invalid_child(str(exc), generation, serving_previous=existing is not None))
        # No retry until the spec changes: a retry would meet the same 422, forever.
        raise kopf.PermanentError(str(exc)) from exc
    if applied.created:
        kopf.info(owner, reason="Created", message=f"made {', '.join(applied.created)}")
    if applied.rolled:
        kopf.info(owner, reason="RollingOut",
                  message=f"pod template {applied.previous_hash} -> {applied.template_hash} (model, image, "
                          "ceilings or placement changed): replicas restart one at a time")
    refresh_status(kube, owner, spec, applied.deployment, generation)


_locks_guard = threading.Lock()
_service_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)


def _lock_of(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _service_locks[(namespace, name)]


def reconcile_latest(kube: Kube, namespace: str, name: str,
                     logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Reconcile the InferenceService as it is now, one reconcile per service at a time; nothing when
    it is gone or being deleted (its children go with it)."""
    with _lock_of(namespace, name):
        owner = kube.get_service(namespace, name)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        try:
            reconcile_service(kube, owner, logger)
        except KubeError as exc:
            if exc.status != 403:
                raise
            report_not_served(kube, owner, exc, logger)


def report_not_served(kube: Kube, owner: dict[str, Any], exc: KubeError,
                      logger: logging.Logger | logging.LoggerAdapter) -> None:
    """No rights in this namespace: say how to grant them, in the one place the operator may always write."""
    namespace, generation = owner["metadata"]["namespace"], owner["metadata"].get("generation")
    message = (f"the operator may not manage objects in namespace {namespace} ({exc.message}); bind its rights "
               f"there: kubectl -n {namespace} apply -f manifests/operator/namespaced/rolebinding.yaml")
    logger.warning(message)
    kube.update_status(namespace, owner["metadata"]["name"], {"observedGeneration": generation}, [
        cond.condition(cond.DEGRADED, "True", "NamespaceNotServed", message, generation),
        cond.condition(cond.PROGRESSING, "False", "NamespaceNotServed", "waiting for the RoleBinding", generation),
        cond.condition(cond.READY, "False", "NamespaceNotServed", message, generation)])


@kopf.on.resume(s.GROUP, s.VERSION, s.PLURAL, backoff=RETRY_BACKOFF_S)
@kopf.on.create(s.GROUP, s.VERSION, s.PLURAL, backoff=RETRY_BACKOFF_S)
@kopf.on.update(s.GROUP, s.VERSION, s.PLURAL, backoff=RETRY_BACKOFF_S)
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: logging.LoggerAdapter, **_: Any) -> None:
    reconcile_latest(memo.kube, body["metadata"]["namespace"], body["metadata"]["name"], logger)


# -- resync: children repaired and rollouts reported without watching them ----------------------------

def _resync_needed(owner: dict[str, Any]) -> bool:
    """Whether a resync may apply: not for a spec already refused (its condition stands until it changes)."""
    spec, problems = _parse(owner)
    return spec is not None and not problems and not _refused(owner)


def _refused(owner: dict[str, Any]) -> bool:
    """Whether this generation's children were refused (422) or a name is taken: the same spec would meet the
    same answer, so that condition stands until the spec changes."""
    degraded = cond.find((owner.get("status") or {}).get("conditions"), cond.DEGRADED)
    return bool(degraded and degraded.get("reason") in ("InvalidChild", "ChildConflict")
                and degraded.get("observedGeneration") == owner["metadata"].get("generation"))


@kopf.timer(s.GROUP, s.VERSION, s.PLURAL, interval=RESYNC_S, initial_delay=RESYNC_S)
def resync(body: kopf.Body, memo: kopf.Memo, logger: logging.LoggerAdapter, **_: Any) -> None:
    """Level-triggered repair: a child deleted or changed by hand is made again, and the status follows the
    Deployment's rollout. Children are read, not watched: a watch of Deployments or Services in every
    namespace would need cluster-wide rights on them, which the operator does not hold."""
    if not body["metadata"].get("deletionTimestamp") and _resync_needed(dict(body)):
        reconcile_latest(memo.kube, body["metadata"]["namespace"], body["metadata"]["name"], logger)


# -- delete ---------------------------------------------------------------------------------------------

@kopf.on.delete(s.GROUP, s.VERSION, s.PLURAL)
def delete(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: logging.LoggerAdapter,
           **_: Any) -> None:
    """Owner references let the garbage collector do this too; deleting explicitly drains the
    daemons first (the Deployment goes first) and leaves nothing behind where no collector runs."""
    kube: Kube = memo.kube
    deleted = []
    for api_version, kind, child in (("apps/v1", "Deployment", name), ("policy/v1", "PodDisruptionBudget", name),
                                     ("v1", "Service", name), ("networking.k8s.io/v1", "NetworkPolicy", name), (*SERVICE_MONITOR_API, name),
                                     (*PROMETHEUS_RULE_API, name), *render.router_children_refs(name),
                                     ("v1", "Secret", render.admin_secret_name(name))):
        if kind in ("ServiceMonitor", "PrometheusRule") and not kube.has_api(api_version, kind):
            continue
        if kube.delete(api_version, kind, namespace, child):
            deleted.append(f"{kind}/{child}")
    logger.info(f"deleted {', '.join(deleted) or 'nothing (children already gone)'}")
