"""A PNG of one closed-loop run: p99 TPOT and TTFT against their SLOs, budgets, replicas, decisions."""
from __future__ import annotations

from typing import Any


def plot_timeline(result: dict[str, Any], path: str) -> None:
    """Four stacked panels over time; scaling decisions as vertical lines, budget moves as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, slo = result["timeline"], result["slo"]
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    title = result.get("title") or f"stallfree control --scenario {result['scenario']}"
    fig.suptitle(f"{title}  ({result['model']} on {result['hardware']})")

    ax = axes[0]
    ax.plot(t, [r["p99_tpot_ms"] for r in rows], label="p99 TPOT (worst known replica)", color="tab:blue")
    ax.axhline(slo["tpot_p99_ms"], color="tab:blue", linestyle="--", label="TPOT SLO")
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[1]
    ax.plot(t, [r["p99_ttft_ms"] for r in rows], label="p99 TTFT", color="tab:orange")
    ax.plot(t, [r["p99_queue_wait_ms"] for r in rows], label="p99 queue wait", color="tab:green")
    ax.axhline(slo["ttft_p99_ms"], color="tab:orange", linestyle="--", label="TTFT SLO")
    ax.axhline(slo["queue_wait_p99_ms"], color="tab:green", linestyle=":", label="queue wait SLO")
    ax.set_yscale("symlog", linthresh=100)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[2]
    names = sorted({d["name"] for r in rows for d in r["replica_detail"]}, key=lambda n: (len(n), n))
    for name in names:
        points = [(r["t"], d.get("token_budget")) for r in rows for d in r["replica_detail"]
                  if d["name"] == name and d.get("token_budget") is not None]
        if points:
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=f"{name} budget")
    for r in rows:
        for d in r["decisions"]:
            if d["kind"] in ("budget_lowered", "budget_raised"):
                ax.axvline(r["t"], color="tab:red" if d["kind"] == "budget_lowered" else "tab:green",
                           alpha=0.3, linewidth=1)
    ax.set_ylabel("token budget")
    ax.legend(loc="upper left", fontsize=8, ncol=4)

    ax = axes[3]
    ax.step(t, [r["desired_replicas"] for r in rows], where="post", label="desired replicas", color="tab:purple")
    ax.step(t, [r["ready_replicas"] for r in rows], where="post", label="ready replicas", color="tab:gray")
    oracle = result.get("oracle") or {}
    if oracle.get("phases"):
        # The oracle's fewest replicas meeting every SLO, phase by phase (it knew the load in advance).
        xs = [p["start_s"] for p in oracle["phases"]] + [t[-1]]
        ys = [p["replicas"] for p in oracle["phases"]]
        ax.step(xs, ys + ys[-1:], where="post", color="tab:green", linestyle="--", alpha=0.8,
                label=f"oracle ({oracle['replica_minutes']:.0f} replica-min; controller "
                      f"{result.get('replica_minutes') or 0:.0f}, "
                      f"{oracle.get('replica_minutes_over_oracle') or 0:.2f}x)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    for r in rows:
        for d in r["decisions"]:
            if d["kind"] in ("scaled_up", "scaled_down"):
                ax.axvline(r["t"], color="tab:purple", alpha=0.4, linestyle="--")
    ax.set_ylabel("replicas")
    ax.set_xlabel(result.get("time_label", "virtual time (s)"))
    ax.legend(loc="upper left", fontsize=8)
    for phase in result["load"][1:]:
        for panel in axes:
            panel.axvline(phase["start_s"], color="black", alpha=0.5, linestyle=":")
        axes[0].annotate(phase["label"] or "load change", (phase["start_s"], 1.0), xycoords=("data", "axes fraction"),
                         fontsize=7, va="top", ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
