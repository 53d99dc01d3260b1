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
    fig, axes = plt.subplots(4, 1, figsize=(13, 11), sharex=True)
    title = result.get("title") or f"stallfree control --scenario {result['scenario']}"
    fig.suptitle(f"{title}  ({result['model']} on {result['hardware']})")

    ax = axes[0]
    ax.plot(t, [r["p99_tpot_ms"] for r in rows], label="p99 TPOT (worst known replica)", color="tab:blue")
    ax.axhline(slo["tpot_p99_ms"], color="tab:blue", linestyle="--", label="TPOT SLO")
    ax.set_ylim(0, 1.1 * max([slo["tpot_p99_ms"]] + [r["p99_tpot_ms"] for r in rows if r["p99_tpot_ms"] is not None]))
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[1]
    ax.plot(t, [r["p99_ttft_ms"] for r in rows], label="p99 TTFT", color="tab:orange")
    ax.plot(t, [r["p99_queue_wait_ms"] for r in rows], label="p99 queue wait", color="tab:green")
    ax.axhline(slo["ttft_p99_ms"], color="tab:orange", linestyle="--", label="TTFT SLO")
    ax.axhline(slo["queue_wait_p99_ms"], color="tab:green", linestyle=":", label="queue wait SLO")
    ax.set_yscale("symlog", linthresh=100)
    highest = max([slo["ttft_p99_ms"], slo["queue_wait_p99_ms"]] + [r[k] for r in rows for k in
                                                                    ("p99_ttft_ms", "p99_queue_wait_ms") if r[k]])
    ax.set_ylim(bottom=0, top=2.0 * highest)  # both SLO lines inside the panel, never on its edge
    ax.set_ylabel("ms")
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[2]
    names = sorted({d["name"] for r in rows for d in r["replica_detail"]}, key=lambda n: (len(n), n))
    for name in names:
        points = [(r["t"], d.get("token_budget")) for r in rows for d in r["replica_detail"]
                  if d["name"] == name and d.get("token_budget") is not None]
        if points:
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", label=f"{name} budget")
    labelled: set[str] = set()
    for r in rows:
        for d in r["decisions"]:
            if d["kind"] in ("budget_lowered", "budget_raised"):
                label = "budget lowered" if d["kind"] == "budget_lowered" else "budget raised"
                ax.axvline(r["t"], color="tab:red" if d["kind"] == "budget_lowered" else "tab:green",
                           alpha=0.3, linewidth=1, label=None if label in labelled else label)
                labelled.add(label)
    ax.set_ylim(bottom=0)
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
                label = d["kind"].replace("_", " ")
                ax.axvline(r["t"], color="tab:purple", alpha=0.4, linestyle="--",
                           label=None if label in labelled else label)
                labelled.add(label)
    ax.set_ylabel("replicas")
    ax.set_xlabel(result.get("time_label", "virtual time (s)"))
    ax.legend(loc="upper left", fontsize=8)
    # Windows where no replica's p99 was known: shaded as unknown, not left as bare gaps in the lines.
    unknown = [r["t"] for r in rows if r["p99_tpot_ms"] is None]
    step = min((b - a for a, b in zip(t, t[1:]) if b > a), default=1.0)
    for panel in axes[:2]:
        for i, start in enumerate(unknown):
            panel.axvspan(start - step / 2, start + step / 2, color="0.85", zorder=0,
                          label="unknown (too few samples)" if i == 0 else None)
    # Steps where the loop judged an SLO infeasible (SLOFeasible=False), hatched in that SLO's panel.
    for panel, names, text in ((axes[0], ("tpot",), "TPOT judged infeasible"),
                               (axes[1], ("queue_wait", "ttft"), "queue wait / TTFT judged infeasible")):
        judged = [r["t"] for r in rows if any(n in (r.get("infeasible") or ()) for n in names)]
        for i, start in enumerate(judged):
            panel.axvspan(start - step / 2, start + step / 2, facecolor="none", edgecolor="tab:red", alpha=0.35,
                          hatch="//", linewidth=0, zorder=0, label=f"{text} (SLOFeasible=False)" if i == 0 else None)
    for phase in [p for p in result["load"] if p.get("start_s", 0) > 0]:
        for panel in axes:
            panel.axvline(phase["start_s"], color="black", alpha=0.5, linestyle=":")
    # Phase names in a strip above the panels, alternating heights so neighbours never overlap.
    for i, phase in enumerate(p for p in result["load"] if p.get("label")):
        axes[0].annotate(phase["label"], (phase["start_s"], 1.02 + 0.07 * (i % 2)),
                         xycoords=("data", "axes fraction"), fontsize=8, va="bottom", ha="left",
                         annotation_clip=False)
    for panel in axes:
        panel.set_xlim(left=0)
        # Beside the panel, not over the lines it explains.
        panel.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
