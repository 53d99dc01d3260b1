"""`stallfree bench engine --compare A.json B.json ...`: the `--url` runs side by side, with ratios to the first.

Runs with the same label are one column: each row's value is the median over them, so servers measured in
alternating rounds (A B A B A B: on a shared machine the load drifts between rounds) compare fairly. A ratio
above 1 means the first column is better on that row (faster, or less time, or less memory), so the tables in
docs/benchmarks.md read the same way whichever row it is.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from stallfree.bench.engine import Sizes
from stallfree.bench.engine_streams import median
from stallfree.bench.engine_url import HIGHER_IS_BETTER, SERVING_FIGURES, URL_LABELS, fmt


def ratio(key: str, first: float | None, other: float | None) -> str:
    if not first or not other:
        return "-"
    return f"{(first / other) if key in HIGHER_IS_BETTER else (other / first):.2f}x"


def _merge(runs: list[dict]) -> dict:
    """One run per label: every row's value the median of that label's runs."""
    merged = dict(runs[0], rows={key: dict(row) for key, row in runs[0]["rows"].items() if isinstance(row, dict)})
    for key, row in merged["rows"].items():
        for figure in ("value", "p99_gap_ms", "ttft_ms", "prefill_tok_s", *SERVING_FIGURES):  # what fmt prints
            if figure in row:
                row[figure] = median([r["rows"].get(key, {}).get(figure) for r in runs])
    return merged


def compare(paths: list[str]) -> str:
    loaded = [json.loads(Path(p).read_text()) for p in paths]
    for path, run in zip(paths, loaded):
        if run.get("mode") != "url":
            raise ValueError(f"{path} is not a `bench engine --url` run")
    by_label: dict[str, list[dict]] = {}
    for run in loaded:
        by_label.setdefault(run["label"], []).append(run)
    runs = [_merge(group) for group in by_label.values()]
    labels = list(by_label)
    head = ["figure", *labels] + [f"{labels[0]} vs {label}" for label in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    sizes = SimpleNamespace(**{**Sizes().__dict__, **runs[0]["sizes"]})  # runs from before a row existed
    missing = {"value": None, "note": "not in this run"}
    for key, text in URL_LABELS.items():
        cells = [fmt(run["rows"].get(key, missing)) for run in runs]
        first = runs[0]["rows"].get(key, missing).get("value")
        cells += [ratio(key, first, run["rows"].get(key, missing).get("value")) for run in runs[1:]]
        lines.append("| " + " | ".join([text.format(**sizes.__dict__), *cells]) + " |")
    rounds = ", ".join(f"{label}: {len(group)}" for label, group in by_label.items())
    lines.append(f"\n(medians over runs per server, {rounds}; ratios: how many times better the first column is on "
                 f"that row, above 1 it leads)")
    return "\n".join(lines)
