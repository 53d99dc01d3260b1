"""`promtool test rules`: every alert of manifests/monitoring/prometheusrule.yaml fires, for the right
InferenceService (and objective) only, on series labelled as Prometheus labels them when it scrapes through the
monitors stallfree ships: the ServiceMonitor the operator renders (each routing mode) or the cluster-wide one in
manifests/monitoring, and the operator's PodMonitor (tests/prometheus_targets.py says how). The SLO targets come
from the PrometheusRule the operator renders per service (render.slo_rule), as in a cluster.

Two services run side by side in namespace `ns`: `chat` misses every SLO, `calm` meets them; an
alert for `calm`, or none for `chat`, fails the test. Then the parts go down: the operator (the SLO alerts
still fire, and the operator-down alert does), a router, a new service's first bad minutes (no page yet), and a
service whose objectives have targets of their own (each judged against its own).
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
SLOS = {"ttftP99Ms": 500, "tpotP99Ms": 50, "queueWaitP99Ms": 200}
HISTOGRAMS = {"ttft": "stallfree_time_to_first_token_seconds", "tpot": "stallfree_time_per_output_token_seconds",
              "queue_wait": "stallfree_request_queue_time_seconds"}
OBJECTIVE_HISTOGRAMS = {"ttft": "stallfree_objective_time_to_first_token_seconds",
                        "tpot": "stallfree_objective_time_per_output_token_seconds",
                        "queue_wait": "stallfree_objective_request_queue_time_seconds"}
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)
# Samples 30 s apart: an hour (the fast burn rate's window with three quarters of its samples by 45 minutes), or
# 5 hours where the slow burn rate's 6-hour window must hold three quarters of its samples.
STEPS, EVAL = 120, "55m"
LONG_STEPS, LONG_EVAL = 600, "4h50m"
SLO_ALERTS = ("StallfreeTPOTP99AboveSLO", "StallfreeTTFTP99AboveSLO", "StallfreeQueueWaitP99AboveSLO")
ROUTER_ALERTS = ("StallfreeRouterDown", "StallfreeRouterNoHealthyReplica", "StallfreeRouterTTFTP99AboveSLO")
DAEMON_ALERTS = (*SLO_ALERTS, "StallfreePrefillSaturated", "StallfreeReplicaScrapeDown", *ROUTER_ALERTS)
OPERATOR_ALERTS = ("StallfreeSLOBreach", "StallfreeSLOBurnRateFast", "StallfreeSLOBurnRateSlow",
                   "StallfreePrefillCapacityExhausted", "StallfreeReplicaUnobservable", "StallfreeActuationFailing",
                   "StallfreeOperatorDown")

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool (Debian's prometheus package; .ci/run installs it) is needed")


def rule_alerts() -> list[str]:
    groups = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_has_a_unit_test() -> None:
    assert sorted(rule_alerts()) == sorted(DAEMON_ALERTS + OPERATOR_ALERTS)


# -- the cluster, as rendered --------------------------------------------------------------------------

def spec_of(mode: str, **extra: Any) -> s.InferenceServiceSpec:
    return s.parse_spec({"routing": {"mode": mode}, "slos": SLOS, **extra})


def children(name: str, mode: str) -> list[dict[str, Any]]:
    spec = spec_of(mode)
    return render.children(name, NS, spec, render.StartupKnobs.from_spec(spec), with_service_monitor=True,
                           with_slo_rule=True)


def cluster(mode: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(Services, pods, the rendered ServiceMonitors) of `chat` and `calm`, two daemon pods each."""
    services, pods, monitors = [], [], []
    for index, name in enumerate(("chat", "calm")):
        for child in children(name, mode):
            if child["kind"] == "Service":
                services.append(child)
            elif child["kind"] == "PrometheusRule":
                continue  # slo_groups
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


def slo_groups(services: dict[str, s.InferenceServiceSpec]) -> list[dict[str, Any]]:
    """The SLO targets' rule groups the operator renders, one PrometheusRule per service."""
    return [group for name, spec in services.items() for group in render.slo_rule(name, NS, spec)["spec"]["groups"]]


def operator_target() -> dict[str, str]:
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    monitor["metadata"]["namespace"] = "monitoring"
    deployment = yaml.safe_load((ROOT / "manifests" / "operator" / "deployment.yaml").read_text())
    (target,) = pod_monitor_targets(monitor, pods_of(deployment, 1, first_ip=99))
    return target


# -- series --------------------------------------------------------------------------------------------

def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def histogram(name: str, labels: dict[str, str], observed_s: float, steps: int = STEPS) -> list[dict[str, str]]:
    """Ten requests every 30 s, each taking `observed_s`."""
    out = []
    for le in (*BUCKETS, float("inf")):
        growth = "0+10x" if observed_s <= le else "0+0x"
        out.append(series(f"{name}_bucket", {**labels, "le": "+Inf" if le == float("inf") else repr(le)},
                          f"{growth}{steps}"))
    return out


def daemon_series(target: dict[str, str], bad: bool, objectives: dict[str, dict[str, float]] | None = None,
                  steps: int = STEPS) -> list[dict[str, str]]:
    """A daemon's series; `objectives` maps an objective to its observed seconds per metric (default: every
    request without one, 3x (bad) or 0.3x its service's SLOs)."""
    labels = series_labels(target, {"model_name": "m"})
    observed = {metric: SLO_S[metric] * (3 if bad else 0.3) for metric in SLO_S}
    out = []
    for metric, name in HISTOGRAMS.items():
        out += histogram(name, labels, observed[metric], steps)
    for objective, seconds in (objectives or {"default": observed}).items():
        for metric, name in OBJECTIVE_HISTOGRAMS.items():
            out += histogram(name, {**labels, "objective": objective}, seconds[metric], steps)
    # Every iteration fills the budget and requests wait (bad) or half-empty iterations (good).
    out += [series("stallfree_iteration_tokens_sum", labels, f"0+{5120 if bad else 2560}x{steps}"),
            series("stallfree_iteration_tokens_count", labels, f"0+10x{steps}"),
            series("stallfree_token_budget", labels, f"512x{steps}"),
            series("stallfree_num_requests_waiting", labels, f"{4 if bad else 0}x{steps}")]
    # The bad service's first pod stops answering scrapes after 10 minutes.
    down = bad and target["pod"].endswith("-0")
    out.append(series("up", series_labels(target, {}), f"1x20 0x{steps - 20}" if down else f"1x{steps}"))
    return out


def router_series(target: dict[str, str], bad: bool, steps: int = STEPS,
                  objectives: dict[str, float] | None = None) -> list[dict[str, str]]:
    """A router: the bad service's first router stops answering scrapes after 10 minutes, and its routers see no
    healthy replica; `objectives` maps an objective to the TTFT its requests see (default: 3x or 0.3x the SLO)."""
    down = bad and target["pod"].endswith("-0")
    out = [series("up", series_labels(target, {}), f"1x20 0x{steps - 20}" if down else f"1x{steps}"),
           series("stallfree_router_replicas_healthy", series_labels(target, {}),
                  (f"2x20 _x{steps - 20}" if down else f"0x{steps}") if bad else f"2x{steps}")]
    for objective, ttft_s in (objectives or {"default": SLO_S["ttft"] * (3 if bad else 0.3)}).items():
        out += histogram("stallfree_router_objective_observed_ttft_seconds",
                         series_labels(target, {"objective": objective}), ttft_s, steps)
    return out


def operator_series(target: dict[str, str], name: str, bad: bool, since_step: int = 0,
                    steps: int = STEPS) -> list[dict[str, str]]:
    """The operator's series of one service, from `since_step` on (a service made then)."""
    def labels(**extra: str) -> dict[str, str]:
        return series_labels(target, {"namespace": NS, "inferenceservice": name, **extra})

    def values(value: float | str) -> str:
        return (f"_x{since_step} " if since_step else "") + f"{value}x{steps - since_step}"

    out = []
    for metric, slo in SLO_S.items():
        out.append(series("stallfree_operator_slo_p99_seconds", labels(metric=metric), values(slo)))
        out.append(series("stallfree_operator_observed_p99_seconds", labels(metric=metric),
                          values(slo * (3 if bad else 0.3))))
    out += [series("stallfree_operator_condition", labels(type="SLOMet"), values(0 if bad else 1)),
            series("stallfree_operator_condition", labels(type="PrefillCapacityExhausted"), values(1 if bad else 0)),
            series("stallfree_operator_unknown_replicas", labels(), values(1 if bad else 0)),
            series("stallfree_operator_actuation_failures_total", labels(), f"0+{1 if bad else 0}x{steps}")]
    return out


def operator_up(target: dict[str, str], up: bool, steps: int = STEPS) -> dict[str, str]:
    return series("up", series_labels(target, {"namespace": target["namespace"]}), f"{1 if up else 0}x{steps}")


def expected(alert: str, daemons: list[dict[str, str]], operator: dict[str, str]) -> list[dict[str, str]]:
    """The labels each firing alert must carry: only `chat`'s."""
    severity = {"StallfreeSLOBurnRateFast": "critical", "StallfreePrefillSaturated": "info",
                "StallfreeRouterNoHealthyReplica": "critical"}.get(alert, "warning")
    chat = [t for t in daemons if t["service"] == "chat" and t.get("component") != "router"]
    routers = [t for t in daemons if t["service"] == "chat" and t.get("component") == "router"]
    if alert == "StallfreeRouterTTFTP99AboveSLO":  # none under service routing: no router
        return [{"namespace": NS, "service": "chat", "objective": "default", "severity": severity}] if routers else []
    if alert.endswith("AboveSLO"):
        return [{"namespace": NS, "service": "chat", "objective": "default", "severity": severity}]
    if alert == "StallfreePrefillSaturated":
        return [{"namespace": NS, "service": "chat", "pod": t["pod"], "severity": severity} for t in chat]
    if alert == "StallfreeReplicaScrapeDown":
        return [{**series_labels(t, {}), "severity": severity} for t in chat if t["pod"].endswith("-0")]
    if alert == "StallfreeRouterDown":  # none under service routing: no router
        return [{**series_labels(t, {}), "severity": severity} for t in routers if t["pod"].endswith("-0")]
    if alert == "StallfreeRouterNoHealthyReplica":
        return [{"namespace": NS, "service": "chat", "severity": severity}] if routers else []
    if alert == "StallfreeOperatorDown":
        return []  # up, in these tests
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


def promtool(tmp_path: Path, groups: list[dict[str, Any]], inputs: list[dict[str, str]],
             alerts: dict[str, list[dict[str, str]]], eval_time: str = EVAL) -> str:
    """Run `promtool test rules`: the shipped rules and `groups` on `inputs`; each alert fires with exactly the
    labels listed (none: it must not fire)."""
    shipped = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": shipped + groups}))
    tests = [{"interval": "30s", "input_series": inputs, "alert_rule_test": [
        {"eval_time": eval_time, "alertname": alert, "exp_alerts": [
            {"exp_labels": labels, "exp_annotations": annotations(alert, labels)} for labels in want]}
        for alert, want in alerts.items()]}]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "30s",
                                                        "tests": tests}))
    result = subprocess.run(["promtool", "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    return result.stdout


def cluster_inputs(daemons: list[dict[str, str]], operator: dict[str, str] | None,
                   steps: int = STEPS) -> list[dict[str, str]]:
    """Every daemon's and router's series, and the operator's (None: the operator is down, none of its series)."""
    inputs = [item for t in daemons for item in (router_series(t, t["service"] == "chat", steps)
                                                 if t.get("component") == "router"
                                                 else daemon_series(t, t["service"] == "chat", steps=steps))]
    if operator is not None:
        inputs += [item for name in ("chat", "calm")
                   for item in operator_series(operator, name, bad=name == "chat", steps=steps)]
        inputs.append(operator_up(operator, up=True, steps=steps))
    return inputs


def two_services(mode: str) -> list[dict[str, Any]]:
    return slo_groups({"chat": spec_of(mode), "calm": spec_of(mode)})


@pytest.mark.parametrize("monitor_source", ["rendered", "manifests"])
@pytest.mark.parametrize("mode", ["slo-aware", "service"])
def test_daemon_and_router_alerts_fire_for_the_service_that_misses_its_slos(tmp_path, mode: str,
                                                                            monitor_source: str) -> None:
    daemons = daemon_targets(mode, monitor_source)
    assert {t["service"] for t in daemons} == {"chat", "calm"}  # the InferenceService's name, in either mode
    operator = operator_target()
    alerts = {alert: expected(alert, daemons, operator) for alert in DAEMON_ALERTS}
    assert "SUCCESS" in promtool(tmp_path, two_services(mode), cluster_inputs(daemons, operator), alerts)


def test_operator_alerts_fire_for_the_service_that_misses_its_slos(tmp_path) -> None:
    daemons, operator = daemon_targets("slo-aware", "rendered"), operator_target()
    alerts = {alert: expected(alert, daemons, operator) for alert in OPERATOR_ALERTS}
    assert "SUCCESS" in promtool(tmp_path, two_services("slo-aware"), cluster_inputs(daemons, operator, LONG_STEPS),
                                 alerts, LONG_EVAL)


@pytest.mark.parametrize("mode", ["slo-aware", "service"])
def test_with_the_operator_down_the_slo_alerts_still_fire_and_its_absence_alerts(tmp_path, mode: str) -> None:
    """No operator series at all (not running, or not scraped): the targets are Prometheus' own rules."""
    daemons = daemon_targets(mode, "rendered")
    alerts = {alert: expected(alert, daemons, operator_target()) for alert in SLO_ALERTS}
    alerts["StallfreeOperatorDown"] = [{"severity": "warning"}]
    assert "SUCCESS" in promtool(tmp_path, two_services(mode), cluster_inputs(daemons, None), alerts)


def test_an_operator_that_answers_scrapes_is_not_down(tmp_path) -> None:
    operator = operator_target()
    inputs = [operator_up(operator, up=True)]
    assert "SUCCESS" in promtool(tmp_path, [], inputs, {"StallfreeOperatorDown": []})
    inputs = [operator_up(operator, up=False)]
    assert "SUCCESS" in promtool(tmp_path, [], inputs, {"StallfreeOperatorDown": [{"severity": "warning"}]})


def test_a_new_services_first_bad_minutes_do_not_page(tmp_path) -> None:
    """Ten minutes of bad windows, all a new service has: 100% of its short history, but not an hour of it."""
    operator = operator_target()
    inputs = operator_series(operator, "chat", bad=True, since_step=LONG_STEPS - 40, steps=LONG_STEPS)
    alerts = {"StallfreeSLOBurnRateFast": [], "StallfreeSLOBurnRateSlow": []}
    assert "SUCCESS" in promtool(tmp_path, [], inputs + [operator_up(operator, True, LONG_STEPS)], alerts, LONG_EVAL)


@pytest.mark.parametrize("mode", ["slo-aware", "service"])
def test_each_objective_is_judged_against_its_own_targets(tmp_path, mode: str) -> None:
    """interactive (TTFT 0.8 s) at 1 s breaches; batch (TTFT 20 s) at 5 s does not, though the service's own
    TTFT SLO is 0.5 s."""
    spec = spec_of(mode, objectives=[{"name": "interactive", "priority": 10, "ttftP99Ms": 800},
                                     {"name": "batch", "priority": -1, "ttftP99Ms": 20000, "tpotP99Ms": 500}])
    daemons = [t for t in daemon_targets(mode, "rendered") if t["service"] == "chat" and t.get("component") != "router"]
    routers = [t for t in daemon_targets(mode, "rendered") if t["service"] == "chat" and t.get("component") == "router"]
    good = {metric: SLO_S[metric] * 0.3 for metric in SLO_S}
    objectives = {"interactive": {**good, "ttft": 1.0}, "batch": {**good, "ttft": 5.0}}
    inputs = [item for t in daemons for item in daemon_series(t, bad=False, objectives=objectives)]
    inputs += [item for t in routers for item in router_series(t, bad=False, objectives={
        name: seconds["ttft"] for name, seconds in objectives.items()})]
    labels = {"namespace": NS, "service": "chat", "objective": "interactive", "severity": "warning"}
    alerts = {"StallfreeTTFTP99AboveSLO": [labels], "StallfreeTPOTP99AboveSLO": [],
              "StallfreeQueueWaitP99AboveSLO": [], "StallfreeRouterTTFTP99AboveSLO": [labels] if routers else []}
    assert "SUCCESS" in promtool(tmp_path, slo_groups({"chat": spec}), inputs, alerts)


@pytest.mark.parametrize("monitor_source", ["rendered", "manifests"])
def test_the_router_is_scraped_under_the_services_name(monitor_source: str) -> None:
    routers = [t for t in daemon_targets("slo-aware", monitor_source) if t.get("component") == "router"]
    assert sorted((t["service"], t["pod"][:len("chat-router")]) for t in routers) == [
        ("calm", "calm-router"), ("calm", "calm-router"), ("chat", "chat-router"), ("chat", "chat-router")]
    assert all(t["instance"].endswith(f":{render.ROUTER_PORT}") for t in routers)
