"""The GPU check's targets and its report: sections bounded by a time budget, rows, printed tables, JSON."""
from __future__ import annotations

import json
import os
import time
import traceback

TARGETS = {"decode_b64_over_floor": 1.3, "mixed_matmul_fraction": 0.55, "triton_over_flashinfer": 1.5,
           "bf16_rel_error": 1e-2}
NOMINAL_H200 = {"copy_bandwidth_bytes_s": 4.3e12, "bf16_matmul_flop_s": 790e12}  # KINDS.md readings: dry run only


class Report:
    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.data: dict = {"targets": TARGETS, "sections": {}, "skipped": {}, "errors": {}}

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def run(self, name: str, needs_s: float, fn) -> None:
        """Run fn(rows) if the budget allows; an exception is recorded, and the next section still runs."""
        if self.left_s() < needs_s:
            self.skip(name, f"time budget: {self.left_s():.0f} s left, section needs about {needs_s:.0f} s")
            return
        t0 = time.monotonic()
        print(f"\n== {name} ({self.left_s():.0f} s of budget left)", flush=True)
        rows: list[dict] = []
        try:
            fn(rows)
        except Exception as exc:  # the check reports every failure and carries on
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        self.data["sections"][name] = {"rows": rows, "seconds": round(time.monotonic() - t0, 1)}

    def skip(self, name: str, why: str) -> None:
        self.data["skipped"][name] = why
        print(f"-- skipped {name}: {why}", flush=True)

    def save(self, path: str | None) -> None:
        self.data["total_seconds"] = round(time.monotonic() - self.start, 1)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            print(f"\nwrote {path}")


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Print rows: columns are (key, header, format)."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    print("  ".join(h.rjust(w) if i else h.ljust(w + 24) for i, ((_, h, _), w) in enumerate(zip(columns, widths))))
    for row in rows:
        cells = []
        for i, ((key, _, fmt), w) in enumerate(zip(columns, widths)):
            v = row.get(key)
            s = "-" if v is None else (format(v, fmt) if fmt and isinstance(v, (int, float)) else str(v))
            cells.append(s.ljust(w + 24) if i == 0 else s.rjust(w))
        print("  ".join(cells), flush=True)
