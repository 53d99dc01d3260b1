"""`promtool test rules`: every alert of manifests/monitoring/prometheusrule.yaml fires, for the right
InferenceService only, on series labelled as Prometheus labels them when it scrapes through the monitors
stallfree ships: the ServiceMonitor the operator renders (each routing mode) or the cluster-wide one in
manifests/monitoring, and the operator's PodMonitor (tests/prometheus_targets.py says how).

Two services run side by side in namespace `ns`: `chat` misses every SLO, `calm` meets them; an
alert for `calm`, or none for `chat`, fails the test.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from prometheus_targets import pod_monitor_targets, pods_of, series_labels, service_monitor_targets
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
NS = "ns"
SLO_S = {"ttft": 0.5, "tpot": 0.05, "queue_wait": 0.2}
HISTOGRAMS = {"ttft": "stallfree_time_to_first_token_seconds", "tpot": "stallfree_time_per_output_token_seconds",
              "queue_wait": "stallfree_request_queue_time_seconds"}
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEPS = 80  # 30 s apart: 40 minutes of samples
DAEMON_ALERTS = ("StallfreeTPOTP99AboveSLO", "StallfreeTTFTP99AboveSLO", "StallfreeQueueWaitP99AboveSLO",
                 "StallfreePrefillSaturated", "StallfreeReplicaScrapeDown")
OPERATOR_ALERTS = ("StallfreeSLOBreach", "StallfreeSLOBurnRateFast", "StallfreeSLOBurnRateSlow",
                   "StallfreePrefillCapacityExhausted", "StallfreeReplicaUnobservable", "StallfreeActuationFailing")

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool (Debian's prometheus package; .ci/run installs it) is needed")


def rule_alerts() -> list[str]:
    groups = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_has_a_unit_test() -> None:
    assert sorted(rule_alerts()) == sorted(DAEMON_ALERTS + OPERATOR_ALERTS)


# -- the cluster, as rendered --------------------------------------------------------------------------

def children(name: str, mode: str) -> list[dict[str, Any]]:
    spec = s.parse_spec({"routing": {"mode": mode}})
    return render.children(name, NS, spec, render.StartupKnobs.from_spec(spec), with_service_monitor=True)


def cluster(mode: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(Services, pods, the rendered ServiceMonitors) of `chat` and `calm`, two daemon pods each."""
    services, pods, monitors = [], [], []
    for index, name in enumerate(("chat", "calm")):
        for child in children(name, mode):
            if child["kind"] == "Service":
                services.append(child)
            elif child["kind"] == "ServiceMonitor":
                monitors.append(child)
            elif child["kind"] == "Deployment":
                pods += pods_of(child, 2, first_ip=10 * index + (5 if child["metadata"]["name"].endswith("router") else 0))
    return services, pods, monitors


def daemon_targets(mode: str, monitor_source: str) -> list[dict[str, str]]:
    services, pods, rendered = cluster(mode)
    if monitor_source == "rendered":
        targets = [t for m in rendered for t in service_monitor_targets(m, services, pods)]
    else:
        static = next(d for d in yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text())
                      if d["kind"] == "ServiceMonitor")
        static["metadata"]["namespace"] = "monitoring"
        targets = service_monitor_targets(static, services, pods)
    addresses = [t["instance"] for t in targets]
    assert len(addresses) == len(set(addresses)), "a pod scraped twice"
    return targets


def operator_target() -> dict[str, str]:
    monitor = next(d for d in yaml.safe_load_all((MONITORING / "servicemonitor.yaml").read_text())
                   if d["kind"] == "PodMonitor")
    monitor["metadata"]["namespace"] = "monitoring"
    deployment = yaml.safe_load((ROOT / "manifests" / "operator" / "deployment.yaml").read_text())
    (target,) = pod_monitor_targets(monitor, pods_of(deployment, 1, first_ip=99))
    return target


# -- series --------------------------------------------------------------------------------------------

def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def histogram(name: str, labels: dict[str, str], observed_s: float) -> list[dict[str, str]]:
    """Ten requests every 30 s, each taking `observed_s`."""
    out = []
    for le in (*BUCKETS, float("inf")):
        growth = "0+10x" if observed_s <= le else "0+0x"
        out.append(series(f"{name}_bucket", {**labels, "le": "+Inf" if le == float("inf") else repr(le)},
                          f"{growth}{STEPS}"))
    return out


def daemon_series(target: dict[str, str], bad: bool) -> list[dict[str, str]]:
    labels = series_labels(target, {"model_name": "m"})
    out = []
    for metric, name in HISTOGRAMS.items():
        out += histogram(name, labels, SLO_S[metric] * (3 if bad else 0.3))
    # Every iteration fills the budget and requests wait (bad) or half-empty iterations (good).
    out += [series("stallfree_iteration_tokens_sum", labels, f"0+{5120 if bad else 2560}x{STEPS}"),
            series("stallfree_iteration_tokens_count", labels, f"0+10x{STEPS}"),
            series("stallfree_token_budget", labels, f"512x{STEPS}"),
            series("stallfree_num_requests_waiting", labels, f"{4 if bad else 0}x{STEPS}")]
    # The bad service's first pod stops answering scrapes after 10 minutes.
    down = bad and target["pod"].endswith("-0")
    up = series_labels(target, {})
    out.append(series("up", up, f"1x20 0x{STEPS - 20}" if down else f"1x{STEPS}"))
    return out


def operator_series(target: dict[str, str], name: str, bad: bool) -> list[dict[str, str]]:
    def labels(**extra: str) -> dict[str, str]:
        return series_labels(target, {"namespace": NS, "inferenceservice": name, **extra})

    out = []
    for metric, slo in SLO_S.items():
        out.append(series("stallfree_operator_slo_p99_seconds", labels(metric=metric), f"{slo}x{STEPS}"))
        out.append(series("stallfree_operator_observed_p99_seconds", labels(metric=metric),
                          f"{slo * (3 if bad else 0.3)}x{STEPS}"))
    out += [series("stallfree_operator_condition", labels(type="SLOMet"), f"{0 if bad else 1}x{STEPS}"),
            series("stallfree_operator_condition", labels(type="PrefillCapacityExhausted"),
                   f"{1 if bad else 0}x{STEPS}"),
            series("stallfree_operator_unknown_replicas", labels(), f"{1 if bad else 0}x{STEPS}"),
            series("stallfree_operator_actuation_failures_total", labels(), f"0+{1 if bad else 0}x{STEPS}")]
    return out


def expected(alert: str, daemons: list[dict[str, str]], operator: dict[str, str]) -> list[dict[str, str]]:
    """The labels each firing alert must carry: only `chat`'s."""
    severity = {"StallfreeSLOBurnRateFast": "critical", "StallfreePrefillSaturated": "info"}.get(alert, "warning")
    chat = [t for t in daemons if t["service"] == "chat" and t.get("component") != "router"]
    if alert.endswith("AboveSLO"):
        return [{"namespace": NS, "service": "chat", "inferenceservice": "chat", "severity": severity}]
    if alert == "StallfreePrefillSaturated":
        return [{"namespace": NS, "service": "chat", "pod": t["pod"], "severity": severity} for t in chat]
    if alert == "StallfreeReplicaScrapeDown":
        return [{**series_labels(t, {}), "severity": severity} for t in chat if t["pod"].endswith("-0")]
    base = series_labels(operator, {"namespace": NS, "inferenceservice": "chat"})
    if alert == "StallfreeSLOBreach":
        return [{**base, "type": "SLOMet", "severity": severity}]
    if alert == "StallfreePrefillCapacityExhausted":
        return [{**base, "type": "PrefillCapacityExhausted", "severity": severity}]
    if alert.startswith("StallfreeSLOBurnRate"):  # the recording rule's `on (...)` keeps only those labels
        return [{"namespace": NS, "inferenceservice": "chat", "metric": metric, "severity": severity} for metric in SLO_S]
    return [{**base, "severity": severity}]


def annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations with its labels filled in, as Prometheus' templates would ($value: 1)."""
    groups = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
    rule = next(r for g in groups for r in g["rules"] if r.get("alert") == alert)
    out = {}
    for key, text in (rule.get("annotations") or {}).items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
        out[key] = text.replace("{{ $value }}", "1")
    return out


def promtool_test(tmp_path: Path, daemons: list[dict[str, str]], alerts: tuple[str, ...]) -> str:
    groups = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    operator = operator_target()
    inputs = [item for t in daemons if t.get("component") != "router"
              for item in daemon_series(t, bad=t["service"] == "chat")]
    inputs += [item for name in ("chat", "calm") for item in operator_series(operator, name, bad=name == "chat")]
    tests = [{"interval": "30s", "input_series": inputs, "alert_rule_test": [
        {"eval_time": "25m", "alertname": alert, "exp_alerts": [
            {"exp_labels": labels, "exp_annotations": annotations(alert, labels)}
            for labels in expected(alert, daemons, operator)]}
        for alert in alerts]}]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "30s",
                                                        "tests": tests}))
    result = subprocess.run(["promtool", "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return result.stdout


@pytest.mark.parametrize("monitor_source", ["rendered", "manifests"])
@pytest.mark.parametrize("mode", ["slo-aware", "service"])
def test_daemon_alerts_fire_for_the_service_that_misses_its_slos(tmp_path, mode: str, monitor_source: str) -> None:
    daemons = daemon_targets(mode, monitor_source)
    assert {t["service"] for t in daemons} == {"chat", "calm"}  # the InferenceService's name, in either mode
    assert "SUCCESS" in promtool_test(tmp_path, daemons, DAEMON_ALERTS)


def test_operator_alerts_fire_for_the_service_that_misses_its_slos(tmp_path) -> None:
    assert "SUCCESS" in promtool_test(tmp_path, daemon_targets("slo-aware", "rendered"), OPERATOR_ALERTS)


@pytest.mark.parametrize("monitor_source", ["rendered", "manifests"])
def test_the_router_is_scraped_under_the_services_name(monitor_source: str) -> None:
    routers = [t for t in daemon_targets("slo-aware", monitor_source) if t.get("component") == "router"]
    assert sorted((t["service"], t["pod"][:len("chat-router")]) for t in routers) == [
        ("calm", "calm-router"), ("calm", "calm-router"), ("chat", "chat-router"), ("chat", "chat-router")]
    assert all(t["instance"].endswith(f":{render.ROUTER_PORT}") for t in routers)
