"""The real kopf operator against kmock's Kubernetes emulator over HTTP.

Each test starts `kopf run` (KopfRunner, in a thread) with the operator's handlers, points it and the
operator's client at the emulator through KUBECONFIG, changes InferenceServices through the
emulator's HTTP API as kubectl would, and checks what the operator made.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import httpx
import kopf
import kopf.testing
import pytest
import yaml

from kmock import KubernetesError
from kmock_bridge import BridgedEmulator
from stallfree.operator.reconcile import handlers  # noqa: F401  (registers the handlers with kopf)
from stallfree.operator.reconcile import render
from stallfree.operator.api import spec as s

pytestmark = [pytest.mark.kmock(cls=BridgedEmulator),
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NS = "ns1"
IS_RESOURCE = f"{s.GROUP}/{s.VERSION}/{s.PLURAL}"
IS_URL = f"/apis/{s.GROUP}/{s.VERSION}/namespaces/{NS}/{s.PLURAL}"
DEPLOYMENTS = "apps/v1/deployments"


# The operator's rights: cluster-wide, plus those a RoleBinding grants in each namespace it serves.
RBAC_RULES = [rule for path in ("clusterrole.yaml", "namespaced/clusterrole.yaml") for rule in yaml.safe_load(
    (pathlib.Path(__file__).resolve().parents[1] / "manifests" / "operator" / path).read_text())["rules"]]


def rbac_verb(request: Any) -> str:
    method = str(request.method.value)
    if method == "GET":
        return "watch" if request.params.get("watch") in ("true", "1") else "get" if request.name else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]


def assert_rbac_allows_what_the_operator_did(kmock: BridgedEmulator) -> None:
    """Least privilege, checked from the other side: every API call the operator made is allowed."""
    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                   for rule in RBAC_RULES)

    calls = set()
    for request in kmock._requests:
        if request.resource is None or not request.resource.plural \
                or request.headers.get("User-Agent", "").startswith("kmock"):
            continue  # discovery, or the test acting as a user
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        calls.add((request.resource.group, resource, rbac_verb(request)))
    denied = sorted(call for call in calls if not allowed(*call))
    assert calls and not denied, denied


@pytest.fixture(autouse=True)
def kubeconfig(tmp_path, kmock: BridgedEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""
kind: Config
apiVersion: v1
current-context: kmock
clusters: [{{name: kmock, cluster: {{server: "{kmock.url!s}"}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: kmock}}}}]
users: [{{name: kmock, user: {{token: test}}}}]
""")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kmock.install_basics(NS)


RESYNC_S = 0.5  # the resync timer's interval here (the operator's is handlers.RESYNC_S): repairs in test time


def reconciler_registry() -> kopf.OperatorRegistry:
    """The reconciler's handlers only, even where another test module imported the control loop's
    handlers into kopf's default registry; its resync timer ticks every RESYNC_S."""
    source, registry = kopf.get_default_registry(), kopf.OperatorRegistry()
    for part in ("_activities", "_indexing", "_watching", "_spawning", "_changing", "_webhooks"):
        for handler in getattr(source, part).get_all_handlers():
            if getattr(handler.fn, "__module__", None) == handlers.__name__:
                if handler.fn is handlers.resync:
                    handler = dataclasses.replace(handler, interval=RESYNC_S, initial_delay=RESYNC_S)
                getattr(registry, part).append(handler)
    return registry


@pytest.fixture(autouse=True)
def rbac_checked(kmock: BridgedEmulator):
    yield
    assert_rbac_allows_what_the_operator_did(kmock)


class Operator:
    """`kopf run` in a thread; stopping it never blocks the event loop that serves the emulator."""

    def __init__(self) -> None:
        # As deployed: every namespace (kopf then lists no namespaces), rights checked per call (rbac_checked).
        self.runner = kopf.testing.KopfRunner(["run", "--standalone", "--all-namespaces"],
                                              registry=reconciler_registry(), timeout=20)

    async def __aenter__(self) -> "Operator":
        self.runner.__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.runner.__exit__, None, None, None)
        assert self.runner.exit_code == 0, self.runner.output


async def eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll until `check()` returns something truthy without raising; fail with its last error."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (KeyError, AssertionError, ValueError, TypeError) as exc:
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met in {timeout}s: {last!r}")


HANDLED = f"{s.GROUP}/last-handled-configuration"  # kopf's diff base, written after the handlers succeeded


def manifest(name: str = "chat", **spec: Any) -> dict[str, Any]:
    base = {"model": {"source": "embedded", "name": "smollm2-135m"},
            "engine": {"device": "cpu", "tokenBudget": {"initial": 256}, "maxNumSeqs": {"initial": 16}},
            "slos": {"tpotP99Ms": 200}}
    for key, value in spec.items():
        base[key] = value
    return {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": name, "namespace": NS},
            "spec": base}


def obj(kmock: BridgedEmulator, resource: str, name: str) -> dict[str, Any]:
    return kmock.objects[resource, NS, name].raw


def exists(kmock: BridgedEmulator, resource: str, name: str) -> bool:
    try:
        return not kmock.objects[resource, NS, name].deleted
    except KeyError:
        return False


def condition(kmock: BridgedEmulator, name: str, type_: str) -> dict[str, Any]:
    for item in obj(kmock, IS_RESOURCE, name).get("status", {}).get("conditions", []):
        if item["type"] == type_:
            return item
    raise KeyError(type_)


async def create(kmock: BridgedEmulator, body: dict[str, Any]) -> None:
    response = await kmock.post(IS_URL, json=body)
    assert response.status == 201 or response.status == 200, await response.text()


async def patch_spec(kmock: BridgedEmulator, name: str, spec_patch: dict[str, Any]) -> None:
    response = await kmock.patch(f"{IS_URL}/{name}", json={"spec": spec_patch},
                                 headers={"Content-Type": "application/merge-patch+json"})
    assert response.status == 200, await response.text()


def events(kmock: BridgedEmulator, reason: str) -> list[dict[str, Any]]:
    out = []
    for resource in ("v1/events", "events.k8s.io/v1/events"):
        for request in kmock[kmock.resource(resource)]:
            data = request.data or {}
            if request.method == "POST" and data.get("reason") == reason:
                out.append(data)
    return out


async def test_create_makes_owned_children_with_the_right_fields(kmock: BridgedEmulator) -> None:
    async with Operator():
        await create(kmock, manifest())
        deployment = await eventually(lambda: obj(kmock, DEPLOYMENTS, "chat"))
        await eventually(lambda: exists(kmock, "v1/services", "chat")
                         and exists(kmock, "policy/v1/poddisruptionbudgets", "chat")
                         and exists(kmock, "v1/secrets", "chat-admin-token"))
        await eventually(lambda: condition(kmock, "chat", "Ready")["reason"] == "NoReplicaReady")

        owner_uid = obj(kmock, IS_RESOURCE, "chat")["metadata"]["uid"]
        for resource, name in ((DEPLOYMENTS, "chat"), ("v1/services", "chat"),
                               ("policy/v1/poddisruptionbudgets", "chat"), ("v1/secrets", "chat-admin-token")):
            refs = obj(kmock, resource, name)["metadata"]["ownerReferences"]
            assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == \
                [(s.KIND, "chat", owner_uid, True)], resource

        pod = deployment["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[0] == "serve"
        assert args[args.index("--model") + 1] == "smollm2-135m"
        assert args[args.index("--device") + 1] == "cpu"
        assert args[args.index("--token-budget") + 1] == "256"
        assert args[args.index("--max-num-seqs") + 1] == "16"
        assert args[args.index("--tpot-slo-ms") + 1] == "200"
        assert args[args.index("--admin-token-file") + 1] == "/etc/stallfree/admin/token"
        assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert deployment["spec"]["replicas"] == 1
        # slo-aware routing (the default): clients reach the router; the daemons sit behind a headless Service.
        assert obj(kmock, "v1/services", "chat")["spec"]["selector"] == render.router_selector_labels("chat")
        assert obj(kmock, "v1/services", "chat-daemons")["spec"]["selector"] == render.selector_labels("chat")
        assert not exists(kmock, "monitoring.coreos.com/v1/servicemonitors", "chat")  # no such API here

        # The status is patched in steps (conditions, then the rest): wait for the step that records the generation.
        await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"].get("observedGeneration") == 1)
        status = obj(kmock, IS_RESOURCE, "chat")["status"]
        assert status["selector"] == render.selector_string("chat")
        assert status["endpoint"] == f"http://chat.{NS}.svc:80"
        assert condition(kmock, "chat", "SLOMet")["status"] == "Unknown"
        await eventually(lambda: events(kmock, "Created"))

        # The Deployment controller reports a ready replica: the service becomes Ready.
        response = await kmock.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat/status", json={"status": {
            "observedGeneration": deployment["metadata"]["generation"], "replicas": 1, "readyReplicas": 1,
            "updatedReplicas": 1, "availableReplicas": 1}}, headers={"Content-Type": "application/merge-patch+json"})
        assert response.status == 200
        await eventually(lambda: condition(kmock, "chat", "Ready")["status"] == "True")
        assert condition(kmock, "chat", "Progressing")["reason"] == "RolloutComplete"
        assert obj(kmock, IS_RESOURCE, "chat")["status"]["readyReplicas"] == 1


def template(kmock: BridgedEmulator, name: str = "chat") -> dict[str, Any]:
    return copy.deepcopy(obj(kmock, DEPLOYMENTS, name)["spec"]["template"])


async def test_live_knob_change_leaves_the_pod_template_untouched(kmock: BridgedEmulator) -> None:
    async with Operator():
        await create(kmock, manifest())
        before = await eventually(lambda: template(kmock))
        token_before = obj(kmock, "v1/secrets", "chat-admin-token")["stringData"]["token"]

        await patch_spec(kmock, "chat", {"replicas": 3, "slos": {"tpotP99Ms": 120, "ttftP99Ms": 900},
                                         "engine": {"tokenBudget": {"initial": 512, "max": 1024}},
                                         "tuning": {"intervalSeconds": 5}, "scaling": {"maxReplicas": 6}})
        await eventually(lambda: obj(kmock, DEPLOYMENTS, "chat")["spec"]["replicas"] == 3)
        await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"]["observedGeneration"] == 2)
        assert template(kmock) == before  # no restart: same args, same annotations
        args = before["spec"]["containers"][0]["args"]
        assert args[args.index("--token-budget") + 1] == "256"  # the start-up value the pods run with
        assert obj(kmock, "v1/secrets", "chat-admin-token")["stringData"]["token"] == token_before
        assert len(kmock.objects["v1/secrets", NS, "chat-admin-token"].history) == 1  # made once
        assert not events(kmock, "RollingOut")


async def test_model_change_rolls_the_pod_template(kmock: BridgedEmulator) -> None:
    async with Operator():
        await create(kmock, manifest())
        before = await eventually(lambda: template(kmock))
        await patch_spec(kmock, "chat", {"model": {"source": "random", "name": "tiny"},
                                         "engine": {"tokenBudget": {"initial": 512}}})
        after = await eventually(lambda: (t := template(kmock)) != before and t)
        hash_key = render.ANNOTATION_TEMPLATE_HASH
        assert after["metadata"]["annotations"][hash_key] != before["metadata"]["annotations"][hash_key]
        args = after["spec"]["containers"][0]["args"]
        assert args[args.index("--model") + 1] == "random:tiny"
        assert args[args.index("--token-budget") + 1] == "512"  # a roll picks up the live knobs too
        await eventually(lambda: events(kmock, "RollingOut"))
        await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"]["templateHash"]
                         == after["metadata"]["annotations"][hash_key])


async def test_invalid_spec_sets_a_condition_and_makes_nothing(kmock: BridgedEmulator) -> None:
    async with Operator():
        await create(kmock, manifest("bad", model={"source": "hf-folder", "path": "models/llama"}))
        degraded = await eventually(lambda: condition(kmock, "bad", "Degraded"))
        assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
        assert "must be an absolute path" in degraded["message"]
        assert condition(kmock, "bad", "Ready")["status"] == "False"
        await eventually(lambda: events(kmock, "InvalidSpec"))
        # kopf records the spec as handled once the handler returned: a wrong reconcile has shown itself by then.
        await eventually(lambda: HANDLED in obj(kmock, IS_RESOURCE, "bad")["metadata"].get("annotations", {}))
        for resource, name in ((DEPLOYMENTS, "bad"), ("v1/services", "bad"), ("v1/secrets", "bad-admin-token"),
                               ("policy/v1/poddisruptionbudgets", "bad")):
            assert not exists(kmock, resource, name), resource

        # Fixing the spec makes the service.
        await patch_spec(kmock, "bad", {"model": {"source": "embedded", "path": None}})
        await eventually(lambda: exists(kmock, DEPLOYMENTS, "bad"))
        await eventually(lambda: condition(kmock, "bad", "Degraded")["status"] == "False")


ROUTER_CHILDREN = ((DEPLOYMENTS, "chat-router"), ("v1/services", "chat-daemons"), ("v1/serviceaccounts", "chat-router"),
                   ("rbac.authorization.k8s.io/v1/roles", "chat-router"),
                   ("rbac.authorization.k8s.io/v1/rolebindings", "chat-router"))


async def test_routing_modes_make_and_remove_the_router(kmock: BridgedEmulator) -> None:
    async with Operator():
        await create(kmock, manifest())
        await eventually(lambda: all(exists(kmock, r, n) for r, n in ROUTER_CHILDREN))
        owner_uid = obj(kmock, IS_RESOURCE, "chat")["metadata"]["uid"]
        for resource, name in ROUTER_CHILDREN:
            assert [r["uid"] for r in obj(kmock, resource, name)["metadata"]["ownerReferences"]] == [owner_uid]
        router = obj(kmock, DEPLOYMENTS, "chat-router")["spec"]["template"]["spec"]
        assert router["serviceAccountName"] == "chat-router"
        assert router["containers"][0]["args"][:3] == ["router", "--service", "chat-daemons"]
        role = obj(kmock, "rbac.authorization.k8s.io/v1/roles", "chat-router")
        assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                  "verbs": ["list"]}]
        daemons_before = template(kmock)
        # The router's Deployment reporting ready replicas does not count as daemons. The daemons' Deployment
        # reports next (later on the same watch): once the status shows its count, the router's report was
        # handled too, and no status written since the router's report may say a replica is ready.
        versions = len(kmock.objects[IS_RESOURCE, NS, "chat"].history)
        for deployment, status in (("chat-router", {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                                                    "availableReplicas": 1}),
                                   ("chat", {"replicas": 1, "updatedReplicas": 1})):
            response = await kmock.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/{deployment}/status",
                                         json={"status": status},
                                         headers={"Content-Type": "application/merge-patch+json"})
            assert response.status == 200
        await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"]["updatedReplicas"] == 1)
        assert condition(kmock, "chat", "Ready")["reason"] == "NoReplicaReady"
        written = [item for version in kmock.objects[IS_RESOURCE, NS, "chat"].history[versions:]
                   for item in ((version or {}).get("status") or {}).get("conditions") or [] if item["type"] == "Ready"]
        assert written and all(item["status"] == "False" for item in written), written

        await patch_spec(kmock, "chat", {"routing": {"mode": "service"}})
        await eventually(lambda: obj(kmock, "v1/services", "chat")["spec"]["selector"]
                         == render.selector_labels("chat"))
        await eventually(lambda: not any(exists(kmock, r, n) for r, n in ROUTER_CHILDREN))
        assert template(kmock) == daemons_before  # switching routing never restarts a daemon
        assert obj(kmock, IS_RESOURCE, "chat")["status"]["endpoint"] == f"http://chat.{NS}.svc:80"


async def test_delete_removes_children_and_releases_the_object(kmock: BridgedEmulator) -> None:
    async with Operator():
        await create(kmock, manifest())
        await eventually(lambda: exists(kmock, DEPLOYMENTS, "chat") and exists(kmock, "v1/secrets", "chat-admin-token"))
        response = await kmock.delete(f"{IS_URL}/chat")
        assert response.status == 200
        await eventually(lambda: not exists(kmock, IS_RESOURCE, "chat"))  # finalizer removed, object gone
        for resource, name in ((DEPLOYMENTS, "chat"), ("v1/services", "chat"), ("v1/secrets", "chat-admin-token"),
                               ("policy/v1/poddisruptionbudgets", "chat"), *ROUTER_CHILDREN):
            assert not exists(kmock, resource, name), resource


async def test_service_monitor_only_where_the_api_exists(kmock: BridgedEmulator) -> None:
    kmock.resources["monitoring.coreos.com/v1/servicemonitors"] = kmock.ResourceInfo(
        kind="ServiceMonitor", namespaced=True, verbs={"get", "list", "create", "patch", "delete"})
    async with Operator():
        await create(kmock, manifest())
        monitor = await eventually(lambda: obj(kmock, "monitoring.coreos.com/v1/servicemonitors", "chat"))
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
        assert monitor["metadata"]["ownerReferences"][0]["name"] == "chat"


async def test_stallfree_operator_command_reconciles_and_answers_liveness(kmock: BridgedEmulator, tmp_path) -> None:
    """`stallfree operator` as a process: it reconciles, and kopf's /healthz answers for the livenessProbe."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "operator.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "stallfree.cli", "operator", "--all-namespaces", "--no-control-loop",
         "--liveness-host", "127.0.0.1", "--liveness-port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        await create(kmock, manifest())
        await eventually(lambda: exists(kmock, DEPLOYMENTS, "chat"), timeout=30)

        async def healthz() -> int:
            async with httpx.AsyncClient() as client:
                try:
                    return (await client.get(f"http://127.0.0.1:{port}/healthz", timeout=2)).status_code
                except httpx.HTTPError:
                    return 0

        deadline = time.monotonic() + 20
        while await healthz() != 200:
            assert time.monotonic() < deadline and process.poll() is None, (tmp_path / "operator.log").read_text()
            await asyncio.sleep(0.2)
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 15)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)
        log.close()


async def test_a_name_taken_by_someone_else_is_not_taken_over(kmock: BridgedEmulator) -> None:
    foreign = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "chat", "namespace": NS},
               "spec": {"replicas": 5, "template": {"spec": {"containers": [{"name": "web", "image": "nginx"}]}}}}
    response = await kmock.post(f"/apis/apps/v1/namespaces/{NS}/deployments", json=foreign)
    assert response.status in (200, 201)
    async with Operator():
        await create(kmock, manifest())
        degraded = await eventually(lambda: condition(kmock, "chat", "Degraded"))
        assert degraded["reason"] == "ChildConflict" and "not owned" in degraded["message"]
        await eventually(lambda: events(kmock, "ChildConflict"))
        assert obj(kmock, DEPLOYMENTS, "chat")["spec"]["replicas"] == 5  # untouched
        assert not exists(kmock, "v1/secrets", "chat-admin-token")  # nothing half made


async def test_a_child_the_api_server_refuses_sets_a_condition_and_is_not_retried(
        kmock: BridgedEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 31: a 422 on the Deployment used to be an exception kopf retried forever, with no condition.
    refused: list[str] = []
    bridge_write = BridgedEmulator._bridge_write

    def invalid_daemons(self: BridgedEmulator, request: Any) -> Any:
        name = request.name or ((request.data or {}).get("metadata") or {}).get("name")
        if request.resource is not None and request.resource.plural == "deployments" and name == "chat" \
                and request.subresource is None:
            refused.append(str(request.method.value))
            raise KubernetesError(status=422, reason="Invalid", message='Deployment.apps "chat" is invalid: '
                                        'spec.template.spec.volumes[1].hostPath.path: Invalid value: "/"')
        return bridge_write(self, request)

    monkeypatch.setattr(BridgedEmulator, "_bridge_write", invalid_daemons)
    async with Operator():
        await create(kmock, manifest())
        degraded = await eventually(lambda: condition(kmock, "chat", "Degraded"))
        assert degraded["status"] == "True" and degraded["reason"] == "InvalidChild"
        assert "Deployment/chat" in degraded["message"] and "hostPath.path" in degraded["message"]
        assert condition(kmock, "chat", "Ready")["status"] == "False"
        assert condition(kmock, "chat", "Ready")["reason"] == "InvalidChild"
        await eventually(lambda: events(kmock, "InvalidChild"))
        # kopf records the spec as handled (a permanent failure): no retry is pending.
        await eventually(lambda: HANDLED in obj(kmock, IS_RESOURCE, "chat")["metadata"].get("annotations", {}))
        attempts = len(refused)
        await asyncio.sleep(2.0)  # kopf's retry of a plain exception would come within its backoff
        assert len(refused) == attempts <= 2, refused  # one apply, and its create fallback at most
        assert not exists(kmock, DEPLOYMENTS, "chat")


async def test_a_refused_roll_keeps_its_condition_through_rollout_reports(
        kmock: BridgedEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    # A spec change whose Deployment the API server refuses: the old pods serve on, and their Deployment's
    # status reports must not overwrite InvalidChild with a healthy-looking Degraded=False.
    refusing = False
    bridge_write = BridgedEmulator._bridge_write

    def invalid_roll(self: BridgedEmulator, request: Any) -> Any:
        if refusing and request.resource is not None and request.resource.plural == "deployments" \
                and request.name == "chat" and request.subresource is None:
            raise KubernetesError(status=422, reason="Invalid", message='Deployment.apps "chat" is invalid')
        return bridge_write(self, request)

    monkeypatch.setattr(BridgedEmulator, "_bridge_write", invalid_roll)
    async with Operator():
        await create(kmock, manifest())
        await eventually(lambda: obj(kmock, IS_RESOURCE, "chat")["status"].get("observedGeneration") == 1)
        refusing = True
        await patch_spec(kmock, "chat", {"model": {"source": "random", "name": "tiny"}})
        await eventually(lambda: condition(kmock, "chat", "Degraded")["reason"] == "InvalidChild")
        assert condition(kmock, "chat", "Ready")["reason"] != "InvalidChild"  # the old pods still serve
        response = await kmock.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat/status", json={"status": {
            "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "availableReplicas": 1}},
            headers={"Content-Type": "application/merge-patch+json"})
        assert response.status == 200
        await asyncio.sleep(1.5)  # the Deployment's event is handled well within this
        assert condition(kmock, "chat", "Degraded")["reason"] == "InvalidChild"


async def test_a_namespace_without_the_operators_rolebinding_gets_a_condition_and_is_served_once_bound(
        kmock: BridgedEmulator) -> None:
    """The operator holds no cluster-wide rights on children: where no RoleBinding grants them, the API server
    answers 403, and the service says how to bind them; the resync serves it once they are granted."""
    refusal = kmock[f"get /apis/apps/v1/namespaces/{NS}/deployments/chat"] << 403
    async with Operator():
        await create(kmock, manifest())
        degraded = await eventually(lambda: condition(kmock, "chat", "Degraded"))
        assert degraded["status"] == "True" and degraded["reason"] == "NamespaceNotServed"
        assert f"kubectl -n {NS} apply -f manifests/operator/namespaced/rolebinding.yaml" in degraded["message"]
        assert not exists(kmock, DEPLOYMENTS, "chat")
        kmock._payloads.remove(refusal)  # the user binds the rights
        await eventually(lambda: exists(kmock, DEPLOYMENTS, "chat"))
        await eventually(lambda: condition(kmock, "chat", "Degraded")["status"] == "False")
