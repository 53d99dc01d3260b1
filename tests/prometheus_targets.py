"""The labels Prometheus gives a series scraped through a Prometheus Operator ServiceMonitor or PodMonitor.

The alert tests feed promtool series labelled exactly so. This follows what the Prometheus Operator
generates for a monitor (prometheus-operator's promcfg.go, v0.6x-0.8x): Kubernetes service discovery's
`__meta_kubernetes_*` labels; keep the selected Services (or pods) and the named port; then
namespace, service, pod and container from the discovered object, job (the Service's name; for a
PodMonitor NAMESPACE/MONITOR), endpoint (the port's name); then the monitor's own relabelings, with
Prometheus' relabel semantics (anchored regex, `$1` replacements, an empty result removes the label).
At scrape time `instance` defaults to the address and the metric's own labels meet the target's
(honorLabels: the metric's win; otherwise the metric's clash is kept as `exported_<label>`).
"""
from __future__ import annotations

import re
from typing import Any


def sd_label(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def matches_selector(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector:
        return False  # an empty ServiceMonitor selector selects nothing useful here: refuse it
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        value, values = labels.get(expr["key"]), expr.get("values") or []
        op = expr["operator"]
        if (op == "In" and value not in values) or (op == "NotIn" and value in values) \
                or (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def _expand(template: str, match: re.Match[str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: match.group(int(m.group(1))) if m.group(1).isdigit()
                  and int(m.group(1)) <= (match.re.groups or 0) else "", template)


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus relabel_configs (camelCase as in the monitors): None when the target is dropped."""
    labels = dict(labels)
    for config in configs:
        action = config.get("action", "replace").lower()
        regex = re.compile(f"^(?:{config.get('regex', '(.*)')})$")
        value = config.get("separator", ";").join(labels.get(s, "") for s in config.get("sourceLabels") or [])
        if action == "keep" and not regex.match(value):
            return None
        if action == "drop" and regex.match(value):
            return None
        if action == "replace":
            match = regex.match(value)
            if match:
                target = _expand(config["targetLabel"], match)
                result = _expand(config.get("replacement", "$1"), match)
                if result:
                    labels[target] = result
                else:
                    labels.pop(target, None)
        elif action == "labelmap":
            for key in list(labels):
                match = regex.match(key)
                if match:
                    labels[_expand(config.get("replacement", "$1"), match)] = labels[key]
        elif action == "labeldrop":
            labels = {k: v for k, v in labels.items() if not regex.match(k)}
    return labels


def _final(labels: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in labels.items() if not k.startswith("__")}
    out.setdefault("instance", labels["__address__"])
    return out


def _pod_meta(pod: dict[str, Any], container: dict[str, Any], port: dict[str, Any]) -> dict[str, str]:
    meta = {"__meta_kubernetes_namespace": pod["metadata"]["namespace"],
            "__meta_kubernetes_pod_name": pod["metadata"]["name"],
            "__meta_kubernetes_pod_container_name": container["name"],
            "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
            "__address__": f"{pod['status']['podIP']}:{port['containerPort']}"}
    meta.update({f"__meta_kubernetes_pod_label_{sd_label(k)}": v for k, v in pod["metadata"]["labels"].items()})
    return meta


def _namespaces(monitor: dict[str, Any]) -> set[str] | None:
    selector = monitor["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return None
    return set(selector.get("matchNames") or [monitor["metadata"].get("namespace")])


def service_monitor_targets(monitor: dict[str, Any], services: list[dict[str, Any]],
                            pods: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Every target of a ServiceMonitor: one per (endpoint, selected Service, pod behind it, port)."""
    namespaces = _namespaces(monitor)
    targets = []
    for endpoint in monitor["spec"]["endpoints"]:
        for service in services:
            s_meta = service["metadata"]
            if namespaces is not None and s_meta["namespace"] not in namespaces:
                continue
            if not matches_selector(monitor["spec"]["selector"], s_meta.get("labels") or {}):
                continue
            for port in service["spec"]["ports"]:
                if port.get("name") != endpoint["port"]:
                    continue
                for pod in pods:
                    if pod["metadata"]["namespace"] != s_meta["namespace"] or not (
                            service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()):
                        continue
                    for container in pod["spec"]["containers"]:
                        for c_port in container.get("ports") or []:
                            if port.get("targetPort") not in (c_port.get("name"), c_port["containerPort"]):
                                continue
                            meta = {**_pod_meta(pod, container, c_port),
                                    "__meta_kubernetes_service_name": s_meta["name"],
                                    "__meta_kubernetes_endpoint_port_name": port["name"]}
                            meta.update({f"__meta_kubernetes_service_label_{sd_label(k)}": v
                                         for k, v in (s_meta.get("labels") or {}).items()})
                            generated = [
                                {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
                                {"sourceLabels": ["__meta_kubernetes_service_name"], "targetLabel": "service"},
                                {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"},
                                {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "targetLabel": "container"},
                                {"sourceLabels": ["__meta_kubernetes_service_name"], "targetLabel": "job"},
                                {"targetLabel": "endpoint", "replacement": endpoint["port"]},
                            ]
                            labels = relabel(meta, generated + (endpoint.get("relabelings") or []))
                            if labels is not None:
                                targets.append({**_final(labels), "__honor__": str(endpoint.get("honorLabels", False))})
    return targets


def pod_monitor_targets(monitor: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, str]]:
    namespaces = _namespaces(monitor)
    targets = []
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        for pod in pods:
            if namespaces is not None and pod["metadata"]["namespace"] not in namespaces:
                continue
            if not matches_selector(monitor["spec"]["selector"], pod["metadata"]["labels"]):
                continue
            for container in pod["spec"]["containers"]:
                for c_port in container.get("ports") or []:
                    if c_port.get("name") != endpoint["port"]:
                        continue
                    generated = [
                        {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
                        {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "targetLabel": "container"},
                        {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"},
                        {"targetLabel": "job",
                         "replacement": f"{monitor['metadata'].get('namespace', 'monitoring')}/{monitor['metadata']['name']}"},
                        {"targetLabel": "endpoint", "replacement": endpoint["port"]},
                    ]
                    labels = relabel(_pod_meta(pod, container, c_port), generated + (endpoint.get("relabelings") or []))
                    if labels is not None:
                        targets.append({**_final(labels), "__honor__": str(endpoint.get("honorLabels", False))})
    return targets


def series_labels(target: dict[str, str], metric_labels: dict[str, str]) -> dict[str, str]:
    """A scraped sample's labels: the target's and the metric's, as honor_labels decides a clash."""
    honor = target.get("__honor__") == "True"
    out = {k: v for k, v in target.items() if k != "__honor__"}
    for key, value in metric_labels.items():
        if key in out and not honor:
            out[f"exported_{key}"] = value
        else:
            out[key] = value
    return out


def pods_of(deployment: dict[str, Any], replicas: int, first_ip: int = 10) -> list[dict[str, Any]]:
    """The pods a Deployment's template makes (names and IPs made up; labels and ports its own)."""
    template = deployment["spec"]["template"]
    name, namespace = deployment["metadata"]["name"], deployment["metadata"].get("namespace", "default")
    return [{"metadata": {"name": f"{name}-7d4b9-{i}", "namespace": namespace, "labels": dict(template["metadata"]["labels"])},
             "spec": template["spec"], "status": {"podIP": f"10.0.{first_ip}.{i + 1}"}} for i in range(replicas)]
