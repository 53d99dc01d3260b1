"""Rendering an InferenceService's children: pure functions, no cluster."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from stallfree.cli.serve import build_parser, parse_options
from stallfree.operator.reconcile import render
from stallfree.operator.api import spec as s

BASE: dict[str, Any] = {
    "model": {"source": "embedded", "name": "smollm2-135m", "maxModelLen": 2048},
    "engine": {"device": "cpu", "ceilings": {"maxTokenBudget": 1024, "maxNumSeqs": 32},
               "tokenBudget": {"initial": 256, "min": 64, "max": 1024}, "maxNumSeqs": {"initial": 16, "max": 32}},
    "slos": {"tpotP99Ms": 200, "ttftP99Ms": 3000},
    "scaling": {"minReplicas": 1, "maxReplicas": 3},
    "replicas": 2,
}


def spec_with(**edits: Any) -> s.InferenceServiceSpec:
    data = copy.deepcopy(BASE)
    for dotted, value in edits.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return s.parse_spec(data)


def deployment_for(spec: s.InferenceServiceSpec, existing: dict[str, Any] | None = None) -> dict[str, Any]:
    return render.deployment("chat", "ns", spec, render.startup_knobs(spec, existing))


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# -- the daemon's command line --------------------------------------------------------------------------

def test_daemon_args_follow_the_daemon_command_line(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    args = render.daemon_args(spec_with(), admin_token_file=str(token))
    opts = parse_options(args)  # the daemon's own parser and checks accept them
    assert (opts.model, opts.served_model_name, opts.device) == ("smollm2-135m", "smollm2-135m", "cpu")
    assert (opts.ceilings.max_token_budget, opts.ceilings.max_num_seqs) == (1024, 32)
    assert (opts.tuning.token_budget, opts.tuning.max_num_seqs) == (256, 16)
    assert opts.tpot_slo_ms == 200.0 and opts.max_model_len == 2048 and opts.admin_token.current() == "t0ken"
    assert "--host" not in args and "--port" not in args  # the caller (pod or local runtime) picks those


@pytest.mark.parametrize("model,expected", [
    ({"source": "embedded", "name": "smollm2-135m"}, "smollm2-135m"),
    ({"source": "random", "name": "llama-3-8b"}, "random:llama-3-8b"),
    ({"source": "hf-folder", "path": "/models/llama", "name": "llama"}, "/models/llama"),
    ({"source": "gguf", "path": "/models/m.gguf"}, "/models/m.gguf"),
])
def test_model_sources_map_to_the_daemons_model_names(model: dict[str, Any], expected: str) -> None:
    args = render.daemon_args(spec_with(model=model))
    assert flag(args, "--model") == expected
    assert build_parser().parse_args(args).model == expected


def test_auto_max_num_seqs_starts_valid_beside_a_small_budget() -> None:
    wide = {"maxTokenBudget": 1024, "maxNumSeqs": 256}
    spec = spec_with(engine__tokenBudget={"initial": 96}, engine__maxNumSeqs={"initial": "auto"}, engine__ceilings=wide)
    knobs = render.StartupKnobs.from_spec(spec)
    assert knobs.max_num_seqs == 64  # min_budget_for(64) = 96: the engine default still fits
    spec = spec_with(engine__tokenBudget={"initial": 80}, engine__maxNumSeqs={"initial": "auto", "max": 32})
    assert render.StartupKnobs.from_spec(spec).max_num_seqs == 32
    spec = spec_with(engine__tokenBudget={"initial": 60}, engine__maxNumSeqs={"initial": "auto"}, engine__ceilings=wide)
    seqs = render.StartupKnobs.from_spec(spec).max_num_seqs
    assert seqs + 32 <= 60 and parse_options(render.daemon_args(spec)).tuning.max_num_seqs == seqs


def test_optional_flags() -> None:
    args = render.daemon_args(spec_with(engine__prefixCaching=False, engine__numKvBlocks=4096,
                                        engine__backend="sim", engine__hardware="h100",
                                        engine__maxQueueRequests=10), api_key_file="/k")
    assert "--no-prefix-caching" in args and flag(args, "--num-kv-blocks") == "4096"
    assert flag(args, "--backend") == "sim" and flag(args, "--hardware") == "h100"
    assert flag(args, "--max-queue-requests") == "10" and flag(args, "--api-key-file") == "/k"
    assert flag(args, "--token-budget") == "256"
    assert flag(render.daemon_args(spec_with(engine__tokenBudget={"initial": "auto"})), "--token-budget") == "auto"


# -- live knobs never touch the pod template, rollout fields always do ---------------------------------

LIVE_EDITS = [
    {"engine__tokenBudget": {"initial": 512, "min": 128, "max": 768}},
    {"engine__maxNumSeqs": {"initial": 8, "min": 2, "max": 24}},
    {"engine__maxPartialPrefills": 2, "engine__longPrefillThreshold": 256},
    {"slos": {"tpotP99Ms": 90, "ttftP99Ms": 500, "queueWaitP99Ms": 100, "windowSeconds": 60}},
    {"scaling": {"mode": "external", "minReplicas": 2, "maxReplicas": 8, "scaleDownStabilizationSeconds": 30}},
    {"tuning": {"mode": "off", "intervalSeconds": 2}},
    {"replicas": 3},
]
ROLLOUT_EDITS = [
    {"model": {"source": "random", "name": "tiny"}},
    {"model__maxModelLen": 1024},
    {"engine__image": "registry.example/stallfree:2"},
    {"engine__ceilings": {"maxTokenBudget": 2048, "maxNumSeqs": 32}},
    {"engine__device": "auto"},
    {"engine__dtype": "bfloat16"},
    {"engine__blockSize": 32},
    {"engine__prefixCaching": False},
    {"engine__kvMemoryFraction": 0.5},
    {"resources": {"limits": {"cpu": "2"}}},
    {"nodeSelector": {"pool": "cpu"}},
    {"tolerations": [{"key": "x", "operator": "Exists"}]},
]


@pytest.mark.parametrize("edit", LIVE_EDITS, ids=lambda e: ",".join(e))
def test_live_knob_changes_keep_the_pod_template(edit: dict[str, Any]) -> None:
    before = deployment_for(spec_with())
    changed = spec_with(**edit)
    assert render.template_hash(changed) == render.template_hash(spec_with())
    after = deployment_for(changed, existing=before)
    assert after["spec"]["template"] == before["spec"]["template"]


@pytest.mark.parametrize("edit", ROLLOUT_EDITS, ids=lambda e: ",".join(e))
def test_rollout_fields_change_the_pod_template(edit: dict[str, Any]) -> None:
    before = deployment_for(spec_with())
    changed = spec_with(**edit)
    after = deployment_for(changed, existing=before)
    assert render.template_hash(changed) != render.template_hash(spec_with())
    assert after["spec"]["template"] != before["spec"]["template"]
    annotations = after["spec"]["template"]["metadata"]["annotations"]
    assert annotations[render.ANNOTATION_TEMPLATE_HASH] == render.template_hash(changed)


def test_a_roll_takes_the_live_knobs_of_its_time() -> None:
    first = deployment_for(spec_with())
    live = spec_with(engine__tokenBudget={"initial": 512})
    kept = deployment_for(live, existing=first)
    assert flag(kept["spec"]["template"]["spec"]["containers"][0]["args"], "--token-budget") == "256"
    rolled = deployment_for(spec_with(engine__tokenBudget={"initial": 512}, engine__image="x:2"), existing=kept)
    assert flag(rolled["spec"]["template"]["spec"]["containers"][0]["args"], "--token-budget") == "512"


def test_a_hand_edited_knobs_annotation_falls_back_to_the_spec() -> None:
    existing = deployment_for(spec_with())
    existing["spec"]["template"]["metadata"]["annotations"][render.ANNOTATION_STARTUP_KNOBS] = "{broken"
    assert render.startup_knobs(spec_with(), existing) == render.StartupKnobs.from_spec(spec_with())


# -- the children ---------------------------------------------------------------------------------------

def test_deployment_is_one_hardened_daemon_per_node() -> None:
    deployment = deployment_for(spec_with(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["llm"]}]}]}}},
        nodeSelector={"pool": "llm"}, tolerations=[{"key": "llm", "operator": "Exists"}],
        resources={"limits": {"cpu": "2", "memory": "4Gi"}}, engine__drainTimeoutSeconds=45))
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["selector"]["matchLabels"] == render.selector_labels("chat")
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}  # CPU: a new one first
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert render.selector_labels("chat").items() <= labels.items()
    # Packed by resource requests, spread where the scheduler can (tests/test_placement.py); one per node on request.
    assert "podAntiAffinity" not in pod["affinity"]
    assert [c["topologyKey"] for c in pod["topologySpreadConstraints"]] == [
        "kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    assert "nodeAffinity" in pod["affinity"]  # the user's affinity is kept
    assert pod["nodeSelector"] == {"pool": "llm"} and pod["tolerations"] == [{"key": "llm", "operator": "Exists"}]
    container = pod["containers"][0]
    assert container["command"] == ["stallfree"] and container["args"][0] == "serve"
    assert flag(container["args"], "--port") == str(render.DAEMON_PORT)
    assert container["resources"] == {"limits": {"cpu": "2", "memory": "4Gi"}}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    # Liveness on a port of its own (issue 31): no connection flood on the serving port restarts the daemon.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": render.DAEMON_PORT, "probes": render.PROBE_PORT}
    assert flag(container["args"], "--probe-port") == str(render.PROBE_PORT)
    assert container["livenessProbe"]["httpGet"]["port"] == "probes"
    assert container["startupProbe"]["httpGet"]["port"] == "probes"
    assert container["readinessProbe"]["httpGet"]["port"] == "http"  # its /ready reports the connection cap
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(render.PRESTOP_SLEEP_S)]
    assert pod["terminationGracePeriodSeconds"] == 45 + render.PRESTOP_SLEEP_S + 10
    assert container["securityContext"]["runAsNonRoot"] and not container["securityContext"]["allowPrivilegeEscalation"]
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["automountServiceAccountToken"] is False
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["admin-token"] == render.ADMIN_TOKEN_DIR and mounts["tmp"] == "/tmp"
    assert flag(container["args"], "--admin-token-file") == f"{render.ADMIN_TOKEN_DIR}/{render.ADMIN_TOKEN_KEY}"
    secret_volume = next(v for v in pod["volumes"] if v["name"] == "admin-token")
    assert secret_volume["secret"]["secretName"] == render.admin_secret_name("chat")


def test_model_volume_and_api_key_are_mounted() -> None:
    spec = spec_with(model={"source": "hf-folder", "path": "/models/llama", "mountPath": "/models",
                            "volume": {"persistentVolumeClaim": {"claimName": "llama", "readOnly": True}}},
                     engine__apiKeySecret="chat-keys")
    pod = deployment_for(spec)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "llama", "readOnly": True}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert volumes["api-key"]["secret"]["secretName"] == "chat-keys"
    assert flag(container["args"], "--api-key-file") == f"{render.API_KEY_DIR}/{render.API_KEY_KEY}"
    assert flag(container["args"], "--model") == "/models/llama"


def test_replicas_follow_the_spec_inside_the_bounds() -> None:
    assert deployment_for(spec_with(replicas=9))["spec"]["replicas"] == 3
    assert deployment_for(spec_with(replicas=0))["spec"]["replicas"] == 1


def test_service_pdb_monitor_and_secret_select_the_daemons() -> None:
    service = render.service("chat", "ns")
    assert service["spec"]["selector"] == render.selector_labels("chat")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    pdb = render.pod_disruption_budget("chat", "ns", spec_with(replicas=2))
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": render.selector_labels("chat")}}
    monitor = render.service_monitor("chat", "ns")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    secret = render.admin_secret("chat", "ns", "t0ken")
    assert secret["stringData"] == {render.ADMIN_TOKEN_KEY: "t0ken"}
    assert secret["metadata"]["name"] == render.admin_secret_name("chat")
    plain = spec_with(routing__mode="service")
    kinds = [c["kind"] for c in render.children("chat", "ns", plain, render.StartupKnobs.from_spec(plain),
                                                 with_service_monitor=False)]
    assert kinds == ["Service", "NetworkPolicy", "PodDisruptionBudget", "Deployment"]
    for child in render.children("chat", "ns", spec_with(), render.StartupKnobs.from_spec(spec_with()), True):
        assert child["metadata"]["namespace"] == "ns"
        assert child["metadata"]["labels"][render.LABEL_MANAGED_BY] == render.MANAGED_BY


def test_selector_string_matches_the_labels() -> None:
    selector = render.selector_string("chat")
    assert dict(part.split("=") for part in selector.split(",")) == render.selector_labels("chat")


# -- slo-aware routing -------------------------------------------------------------------------------

def test_slo_aware_routing_puts_the_router_in_front_and_the_daemons_behind_a_headless_service() -> None:
    spec = spec_with()  # slo-aware is the default
    children = render.children("chat", "ns", spec, render.StartupKnobs.from_spec(spec), with_service_monitor=True)
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in children}
    client = by_name["Service", "chat"]
    assert client["spec"]["selector"] == render.router_selector_labels("chat")
    daemons = by_name["Service", "chat-daemons"]
    assert daemons["spec"]["clusterIP"] == "None" and daemons["spec"]["selector"] == render.selector_labels("chat")
    router = by_name["Deployment", "chat-router"]
    pod = router["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[:3] == ["router", "--service", "chat-daemons"]
    assert args[args.index("--policy") + 1] == "slo-aware"
    assert args[args.index("--admin-token-file") + 1] == f"{render.ADMIN_TOKEN_DIR}/{render.ADMIN_TOKEN_KEY}"
    # Liveness and start-up on the probe port, which no client connection reaches; readiness on the serving port.
    container = pod["containers"][0]
    assert args[args.index("--probe-port") + 1] == str(render.PROBE_PORT)
    assert container["livenessProbe"]["httpGet"]["port"] == container["startupProbe"]["httpGet"]["port"] == "probes"
    assert container["readinessProbe"]["httpGet"]["port"] == "http"
    assert pod["serviceAccountName"] == "chat-router" and pod["automountServiceAccountToken"] is True
    assert router["spec"]["selector"]["matchLabels"] == render.router_selector_labels("chat")
    assert router["spec"]["template"]["metadata"]["labels"].items() >= render.router_selector_labels("chat").items()
    # The router's pods never match the daemons' selector (PDB, anti-affinity, status counts).
    assert not render.selector_labels("chat").items() <= router["spec"]["template"]["metadata"]["labels"].items()
    # Least privilege: list EndpointSlices in its namespace, nothing else.
    role = by_name["Role", "chat-router"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]
    binding = by_name["RoleBinding", "chat-router"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "ns"}]
    # The ServiceMonitor scrapes the daemons' Service and the router's (tests/test_alert_rules.py: their labels).
    monitor = by_name["ServiceMonitor", "chat"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= daemons["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= client["metadata"]["labels"].items()
    assert {(api, kind, name) for api, kind, name in render.router_children_refs("chat")} == {
        (c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children
        if c["metadata"]["name"] in ("chat-router", "chat-daemons")}


def test_the_router_mounts_its_api_keys_and_the_gateways_secret_whole_so_they_rotate_in_place() -> None:
    spec = spec_with(routing__apiKeysSecret="chat-keys", routing__trustedUpstreamSecret="gateway")
    router = next(c for c in render.children("chat", "ns", spec, render.StartupKnobs.from_spec(spec), False)
                  if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat-router")
    pod = router["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--api-keys-file") + 1] == f"{render.ROUTER_KEYS_DIR}/{render.ROUTER_KEYS_KEY}"
    assert args[args.index("--trusted-upstream-secret-file") + 1] == \
        f"{render.UPSTREAM_SECRET_DIR}/{render.UPSTREAM_SECRET_KEY}"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "chat-keys"
    assert volumes["upstream-secret"]["secret"]["secretName"] == "gateway"
    assert all("subPath" not in m for m in container["volumeMounts"])  # a subPath mount is never updated
    plain = spec_with()
    plain_args = next(c for c in render.children("chat", "ns", plain, render.StartupKnobs.from_spec(plain), False)
                      if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat-router")
    assert "--api-keys-file" not in plain_args["spec"]["template"]["spec"]["containers"][0]["args"]


def test_routing_mode_never_rolls_the_daemons() -> None:
    assert render.template_hash(spec_with(routing__mode="service")) == render.template_hash(spec_with())
    assert render.template_hash(spec_with(routing__policy="round-robin")) == render.template_hash(spec_with())


def test_a_one_replica_service_keeps_serving_through_a_roll_and_a_drain() -> None:
    """A new daemon comes up before the old one goes, and no eviction takes the only one."""
    for spec in (spec_with(replicas=1), spec_with(replicas=1, resources={"limits": {"nvidia.com/gpu": 1}},
                                                  engine__device="cuda")):
        children = render.children("chat", "ns", spec, render.StartupKnobs.from_spec(spec), False)
        (deployment,) = [c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat"]
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        (pdb,) = [c for c in children if c["kind"] == "PodDisruptionBudget" and c["metadata"]["name"] == "chat"]
        assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    # Several GPU replicas: no surge (no spare accelerator), one at a time; drains one at a time.
    gpus = spec_with(replicas=3, resources={"limits": {"nvidia.com/gpu": 1}}, engine__device="cuda")
    assert render.rolling_update(gpus) == {"maxSurge": 0, "maxUnavailable": 1}
    assert render.pod_disruption_budget("chat", "ns", gpus)["spec"]["maxUnavailable"] == 1


def test_routers_take_no_gpu_toleration() -> None:
    spec = spec_with(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}])
    router = render.router_deployment("chat", "ns", spec)["spec"]["template"]["spec"]
    assert [t["key"] for t in router["tolerations"]] == ["dedicated"]
    daemon = render.deployment("chat", "ns", spec, render.StartupKnobs.from_spec(spec))["spec"]["template"]["spec"]
    assert [t["key"] for t in daemon["tolerations"]] == ["nvidia.com/gpu", "dedicated"]


def test_a_daemon_without_resources_is_not_best_effort_and_its_tmp_is_bounded() -> None:
    for backend in ("sim", "model"):
        spec = spec_with(engine__backend=backend, **({"engine__hardware": "h100"} if backend == "sim" else {}))
        pod = render.deployment("chat", "ns", spec, render.StartupKnobs.from_spec(spec))["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"], backend
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tmp"]["emptyDir"]["sizeLimit"] == render.TMP_SIZE_LIMIT
    asked = spec_with(resources={"requests": {"cpu": "3"}})
    container = render.deployment("chat", "ns", asked, render.StartupKnobs.from_spec(asked))["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "3"}}  # the spec's own, untouched
