"""Every PromQL expression of the Grafana dashboard and the PrometheusRule, run against a real Prometheus.

Debian's `prometheus` scrapes, on loopback, a live daemon (`stallfree serve --backend sim`, in-process)
and the operator's metrics (OperatorMetrics fed by the real ControlLoop observing that daemon and one
replica whose admin API is dead). The SLOs are set so tight that every alert's condition holds, the
budget is pinned at its bound under a steady stream of long prompts so prefill capacity is exhausted,
and at the end the daemon stops so the scrape-down alert has a target that was up and is not. Each
expression must return data; `promtool check rules` must accept the rules.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import start_http_server

from server_helpers import ADMIN_TOKEN, free_port, running_daemon
from stallfree.contracts import Ceilings, Tuning
from stallfree.operator.control.loop import ControlLoop
from stallfree.operator.control.policy import ControlPolicy, ScalingPolicy, SLOTargets, TuningBounds
from stallfree.operator.control.observe import ReplicaTarget
from stallfree.operator.control.observe_http import HttpObserver
from stallfree.operator.control.observe_prometheus import PrometheusObserver
from stallfree.operator.control.operator_metrics import OperatorMetrics
from stallfree.operator.api import spec as s
from stallfree.operator.reconcile import render

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
NAMESPACE, SERVICE, POD = "test", "chat", "chat-0"
SIM_DAEMON = ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100", "--max-model-len", "4096",
              "--max-token-budget", "512", "--max-num-seqs-ceiling", "64", "--max-num-seqs", "16",
              "--token-budget", "128", "--stats-window-s", "4", "--profile-max-seconds", "5"]
GRAFANA_VARS = {"$namespace": NAMESPACE, "$service": SERVICE, "$__rate_interval": "10s", "$__interval": "2s",
                "${datasource}": "prometheus"}

# Conditions this single daemon cannot show (no router runs, the operator is up, a minute is not an hour of
# history): each is run by the promtool unit tests in tests/test_alert_rules.py instead.
NOT_HERE = {"rule StallfreeRouterDown", "rule StallfreeRouterNoHealthyReplica", "rule StallfreeOperatorDown",
            "rule stallfree:router_objective_ttft_seconds:p99_5m", "rule StallfreeRouterTTFTP99AboveSLO"}
HISTORY = re.compile(r"\n\s*and stallfree:slo_window_bad:samples_\w+ >= \d+")

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="Debian's prometheus and promtool are needed")


def rule_groups(interval: str | None = None) -> list[dict[str, Any]]:
    """The shipped rules, and the SLO targets' rule the operator renders for `chat` (targets of 1 ms)."""
    spec = s.parse_spec({"slos": {"ttftP99Ms": 1, "tpotP99Ms": 1, "queueWaitP99Ms": 1}})
    groups = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())["spec"]["groups"]
    groups += render.slo_rule(SERVICE, NAMESPACE, spec)["spec"]["groups"]
    if interval:
        for group in groups:
            group["interval"] = interval
    return groups


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    exprs += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return exprs


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert not re.search(r"\$[{_a-zA-Z]", expr), expr  # every Grafana variable substituted
    return expr


def test_promtool_accepts_the_rules(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_keda_and_monitors_are_well_formed():
    keda = yaml.safe_load((MONITORING / "keda-scaledobject.yaml").read_text())
    trigger = keda["spec"]["triggers"][0]
    assert keda["spec"]["scaleTargetRef"]["kind"] == "InferenceService"
    assert "stallfree_operator_desired_replicas" in trigger["metadata"]["query"]
    assert yaml.safe_load((MONITORING / "servicemonitor.yaml").read_text())["kind"] == "ServiceMonitor"
    pod_monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    assert pod_monitor["kind"] == "PodMonitor"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True


class LoopbackActuator:
    """PUTs tuning to the daemons' admin API; there is no cluster here, so a scale call fails (and is counted)."""

    def __init__(self, client: httpx.Client, urls: dict[str, str]) -> None:
        self.client, self.urls, self.replicas = client, urls, []

    async def put_tuning(self, replica: str, tuning: Tuning) -> None:
        response = await asyncio.to_thread(self.client.put, f"{self.urls[replica]}/admin/tuning",
                                           json=tuning.to_dict(), headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        response.raise_for_status()

    async def set_replicas(self, replicas: int) -> None:
        self.replicas.append(replicas)
        raise RuntimeError("no cluster to scale in this test")

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        pass


class Prometheus:
    def __init__(self, tmp: Path, daemon_port: int, operator_port: int) -> None:
        self.port = free_port()
        rules = tmp / "rules.yaml"
        rules.write_text(yaml.safe_dump({"groups": rule_groups(interval="1s")}))
        labels = {"namespace": NAMESPACE, "service": SERVICE, "pod": POD, "component": "daemon"}
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "stallfree-daemon", "static_configs": [
                    {"targets": [f"127.0.0.1:{daemon_port}"], "labels": labels}]},
                {"job_name": "stallfree-operator", "honor_labels": True, "static_configs": [
                    {"targets": [f"127.0.0.1:{operator_port}"]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = subprocess.run(["promtool", "check", "config", str(tmp / "prometheus.yml")], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(tmp / "prometheus.log", "w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, "prometheus exited"
            time.sleep(0.2)
        raise AssertionError("prometheus not ready")

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.log.close()


def long_prompts(url: str, stop: threading.Event, deadline_s: float) -> None:
    """Back-to-back 1,500-token prompts (distinct, so the prefix cache cannot skip their prefill): every
    iteration fills the pinned budget and requests queue."""
    deadline = time.monotonic() + deadline_s
    with httpx.Client(timeout=30) as client:
        while not stop.is_set() and time.monotonic() < deadline:
            prompt = f"{threading.get_ident()} {time.monotonic_ns()} " + "lorem ipsum dolor " * 150
            try:
                client.post(f"{url}/v1/completions", json={"model": "llama-3-8b", "prompt": prompt, "max_tokens": 8})
            except httpx.HTTPError:
                return  # the daemon is stopping


def control_steps(policy: ControlPolicy, targets: list[ReplicaTarget], actuator: "LoopbackActuator",
                  metrics: OperatorMetrics, stop: threading.Event, results: list) -> None:
    """The real control loop, one step a second, in this thread's own event loop."""
    async def run() -> None:
        async with httpx.AsyncClient() as client:
            loop = ControlLoop(policy, HttpObserver(client, ADMIN_TOKEN, 2.0, policy.min_samples), actuator)
            while not stop.is_set():
                result = await loop.step(targets, 1, time.time())
                metrics.record(NAMESPACE, SERVICE, result, policy)
                results.append(result)
                await asyncio.sleep(1.0)

    asyncio.run(run())


@contextlib.contextmanager
def _stopping(stop: threading.Event, threads: list[threading.Thread]):
    """Stop the load and the loop before the daemon goes, whatever happened."""
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)


def test_every_dashboard_and_rule_expression_returns_data(tmp_path):
    metrics = OperatorMetrics()
    operator_port = free_port()
    server, _ = start_http_server(operator_port, addr="127.0.0.1", registry=metrics.registry)
    # SLOs no daemon can meet, and a budget pinned at its bound: every alert condition holds.
    policy = ControlPolicy(slo=SLOTargets(ttft_p99_ms=1, tpot_p99_ms=1, queue_wait_p99_ms=1),
                           bounds=TuningBounds(min_token_budget=128, max_token_budget=128),
                           scaling=ScalingPolicy(min_replicas=1, max_replicas=4, scale_up_stabilization_s=0),
                           interval_s=1, window_s=4,
                           min_samples=3)
    stop = threading.Event()
    prometheus = None
    threads: list[threading.Thread] = []
    try:
        with running_daemon(base_args=SIM_DAEMON) as daemon, httpx.Client(timeout=5) as put_client, \
                _stopping(stop, threads):
            daemon_port = int(daemon.url.rsplit(":", 1)[1])
            prometheus = Prometheus(tmp_path, daemon_port, operator_port)
            dead = f"http://127.0.0.1:{free_port()}"
            targets = [ReplicaTarget(POD, daemon.url), ReplicaTarget("chat-1", dead)]
            results: list = []

            actuator = LoopbackActuator(put_client, {POD: daemon.url, "chat-1": dead})
            threads = [threading.Thread(target=long_prompts, args=(daemon.url, stop, 90), daemon=True)
                       for _ in range(4)]
            threads.append(threading.Thread(target=control_steps,
                                            args=(policy, targets, actuator, metrics, stop, results), daemon=True))
            for thread in threads:
                thread.start()
            prometheus.wait_ready()

            expressions = dashboard_expressions()
            expressions += [(f"rule {r.get('record') or r.get('alert')}", HISTORY.sub("", r["expr"]))
                            for g in rule_groups() for r in g["rules"]
                            if f"rule {r.get('record') or r.get('alert')}" not in NOT_HERE]
            scrape_down = [(n, e) for n, e in expressions if "StallfreeReplicaScrapeDown" in n]
            pending = {name: grafana_to_promql(expr) if name.startswith(("panel", "annotation")) else expr
                       for name, expr in expressions if (name, expr) not in scrape_down}
            deadline = time.monotonic() + 60
            while pending and time.monotonic() < deadline:
                time.sleep(1.0)
                pending = {name: expr for name, expr in pending.items() if not prometheus.query(expr)}
            assert not pending, f"no data from: {json.dumps(pending, indent=1)}"

            # Grafana's variables come from label values that must exist.
            series = httpx.get(f"{prometheus.url}/api/v1/series",
                               params={"match[]": f'stallfree_token_budget{{namespace="{NAMESPACE}"}}'}).json()
            assert {s["service"] for s in series["data"]} == {SERVICE}

            # The loop saw what the alerts say: exhausted prefill, an unknown replica, a scale-up wanted.
            last = results[-1]
            assert {c.type: c.status for c in last.conditions if c.type != "SLOFeasible"} == {
                "SLOMet": "False", "PrefillCapacityExhausted": "True", "ServingPath": "True"}
            assert [o.name for o in last.unknown] == ["chat-1"]
            assert actuator.replicas and any("no cluster" in f for r in results for f in r.failures)

            # The Prometheus observer reads the same replica from the same series.
            async def observe_via_prometheus():
                async with httpx.AsyncClient() as client:
                    observer = PrometheusObserver(client, prometheus.url, f'namespace="{NAMESPACE}"', 5.0,
                                                  Ceilings(512, 64), min_samples=1)
                    return await observer.observe([ReplicaTarget(POD), ReplicaTarget("ghost")], time.time())

            seen, ghost = asyncio.run(observe_via_prometheus())
            assert seen.known and seen.stats.tuning.token_budget == 128 and seen.stats.ttft_ms.p99 > 0
            assert seen.stats.budget_utilisation > 0.5 and seen.stats.iterations > 0
            assert not ghost.known and "no stallfree series" in ghost.unknown_reason

        # The daemon is gone: a target that served metrics is now down.
        name, expr = scrape_down[0]
        deadline = time.monotonic() + 20
        while not prometheus.query(expr) and time.monotonic() < deadline:
            time.sleep(0.5)
        down = prometheus.query(expr)
        assert down and down[0]["metric"]["pod"] == POD, name
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        if prometheus is not None:
            prometheus.stop()
        server.shutdown()
