"""`stallfree bench engine --compare A.json B.json ...`: the `--url` runs side by side, with ratios to the first.

A ratio above 1 means the first server is better on that row (faster, or less time, or less memory), so the
README's table reads the same way whichever row it is.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from stallfree.bench.engine_url import HIGHER_IS_BETTER, URL_LABELS, fmt


def ratio(key: str, first: float | None, other: float | None) -> str:
    if not first or not other:
        return "-"
    return f"{(first / other) if key in HIGHER_IS_BETTER else (other / first):.2f}x"


def compare(paths: list[str]) -> str:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    for path, run in zip(paths, runs):
        if run.get("mode") != "url":
            raise ValueError(f"{path} is not a `bench engine --url` run")
    labels = [run["label"] for run in runs]
    head = ["figure", *labels] + [f"{labels[0]} vs {label}" for label in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    sizes = SimpleNamespace(**runs[0]["sizes"])
    for key, text in URL_LABELS.items():
        cells = [fmt(run["rows"][key]) for run in runs]
        first = runs[0]["rows"][key].get("value")
        cells += [ratio(key, first, run["rows"][key].get("value")) for run in runs[1:]]
        lines.append("| " + " | ".join([text.format(**sizes.__dict__), *cells]) + " |")
    lines.append("\n(ratios: how many times better the first column is on that row; above 1 it leads)")
    return "\n".join(lines)
