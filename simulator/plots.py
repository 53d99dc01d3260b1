"""PNG figures for the simulator and the benchmark client (matplotlib, no display)."""
from __future__ import annotations

from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _cdf(ax, values: Sequence[float], label: str) -> None:
    ordered = sorted(v for v in values if v is not None)
    if ordered:
        n = len(ordered)
        ax.plot(ordered, [(i + 1) / n for i in range(n)], label=label)


def _slo(ax, value: float | None, vertical: bool = True) -> None:
    if value is not None:
        (ax.axvline if vertical else ax.axhline)(value, color="red", linestyle="--", linewidth=1, label="SLO")


def latency_cdfs(series: dict[str, dict[str, Sequence[float]]], path: str, title: str,
                 slos: dict[str, float | None] | None = None) -> None:
    """CDFs of TTFT, TPOT, ITL and end-to-end latency; `series` maps a label to {metric: values in ms}."""
    slos = slos or {}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, name) in zip(axes.flat, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                                               ("e2e_ms", "end-to-end"))):
        for label, values in series.items():
            _cdf(ax, values.get(metric, []), label)
        _slo(ax, slos.get(metric))
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log)")
        ax.set_ylabel("share of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scenario_bars(cases: list[dict[str, Any]], path: str) -> None:
    """Largest decode gap, TTFT and decode tokens during the prefill, one bar per case."""
    labels = ["no chunking" if c["no_chunking"] else f"budget {c['token_budget']}" for c in cases]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, name in zip(axes, ("max_decode_gap_ms", "ttft_ms", "decode_tokens_during_prefill"),
                             ("largest decode gap (ms)", "long prompt TTFT (ms)", "decode tokens during prefill")):
        values = [c[key] for c in cases]
        ax.bar(labels, values, color=["tab:red" if c["no_chunking"] else "tab:blue" for c in cases])
        for i, v in enumerate(values):
            ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_title(name, fontsize=10)
    first = cases[0]
    fig.suptitle(f"{first['decoders']} decoders, then a {first['prompt_len']}-token prompt ({first['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def capacity_probes(results: list[dict[str, Any]], path: str) -> None:
    """Each policy's probes: tail time between tokens and median queue wait against the rate."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        probes = sorted(result["probes"], key=lambda p: p["rate"])
        rates = [p["rate"] for p in probes]
        line = left.plot(rates, [p["tbt_ms"] for p in probes], "o-", label=result["policy"])[0]
        right.plot(rates, [p["median_queue_wait_ms"] for p in probes], "o-", label=result["policy"])
        for ax in (left, right):
            ax.axvline(result["capacity_rps"], color=line.get_color(), linestyle=":", linewidth=1)
    criteria = results[0]["criteria"]
    left.axhline(criteria["tbt_slo_ms"], color="red", linestyle="--", label="TBT SLO")
    right.axhline(criteria["max_median_queue_wait_ms"], color="red", linestyle="--", label="limit")
    left.set_ylabel(f"{criteria['tbt_quantile']} time between tokens (ms)")
    right.set_ylabel("median queue wait (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("capacity search (dotted: capacity)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def budget_frontier(sweep: dict[str, Any], path: str) -> None:
    """p99 TTFT and p99 TPOT against the budget, and the TTFT/TPOT frontier the budgets trace."""
    points = sweep["points"]
    budgets = [p["token_budget"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(budgets, [p["ttft_p99_ms"] for p in points], "o-", color="tab:blue", label="p99 TTFT")
    left.set_xlabel("token budget")
    left.set_ylabel("p99 TTFT (ms)", color="tab:blue")
    left.set_xscale("log", base=2)
    twin = left.twinx()
    twin.plot(budgets, [p["tpot_p99_ms"] for p in points], "s-", color="tab:orange", label="p99 TPOT")
    twin.plot(budgets, [p["itl_p99_ms"] for p in points], "^--", color="tab:brown", label="p99 ITL")
    twin.axhline(sweep["tpot_slo_ms"], color="red", linestyle="--", linewidth=1, label="TPOT SLO")
    twin.set_ylabel("p99 TPOT / ITL (ms)", color="tab:orange")
    left.axvline(sweep["profile_budget"], color="green", linestyle=":", label=f"profile rule: {sweep['profile_budget']}")
    handles = left.get_legend_handles_labels()
    twin_handles = twin.get_legend_handles_labels()
    left.legend(handles[0] + twin_handles[0], handles[1] + twin_handles[1], fontsize=8, loc="center right")
    right.plot([p["tpot_p99_ms"] for p in points], [p["ttft_p99_ms"] for p in points], "o-")
    for p in points:
        right.annotate(str(p["token_budget"]), (p["tpot_p99_ms"], p["ttft_p99_ms"]), fontsize=8)
    right.axvline(sweep["tpot_slo_ms"], color="red", linestyle="--", linewidth=1, label="TPOT SLO")
    right.set_xlabel("p99 TPOT (ms)")
    right.set_ylabel("p99 TTFT (ms)")
    right.set_yscale("log")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("budget sweep: latency frontier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
