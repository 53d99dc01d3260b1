"""The GPU check's targets, rows and verdicts: one table (row, figure, target, verdict), the JSON, the exit status.

Every row has a verdict, so nothing is silently fine:
  pass / FAIL   a correctness check, or a target judged against measured ceilings
  unverified    a target judged against nominal ceilings (the ceilings section did not run or failed)
  unmeasured    a target that could not be measured (backend missing, capture failed, batch not asked for)
  info          a figure with no target (timings of single backends, the ceilings themselves)
  skip          a backend or section that did not run, with the reason
  dry run       a target computed on the CPU: shown, never judged (the dry run checks that sections run)
The exit status is 0 only when no row is FAIL, unverified or unmeasured, every section asked for ran and none raised.
"""
from __future__ import annotations

import json
import os
import time
import traceback

TARGETS = {"decode_b64_over_floor": 1.3, "mixed_matmul_fraction": 0.55, "triton_over_flashinfer": 1.5,
           "bf16_rel_error": 1e-2}
NOMINAL_H200 = {"copy_bandwidth_bytes_s": 4.3e12, "bf16_matmul_flop_s": 790e12}  # KINDS.md readings, not this run's
GATING = ("FAIL", "unverified", "unmeasured")


class Report:
    def __init__(self, budget_s: float, dry_run: bool = False) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.dry_run = dry_run
        self.ceilings = dict(NOMINAL_H200)
        self.ceilings_source = "nominal: the ceilings section has not run"
        self.data: dict = {"targets": TARGETS, "dry_run": dry_run, "sections": {}, "skipped": {}, "errors": {}}
        self._rows: list[dict] | None = None  # the running section's rows

    # --- sections --------------------------------------------------------------------------------------

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def run(self, name: str, needs_s: float, fn) -> None:
        """Run fn() if the budget allows; an exception is recorded, and the next section still runs."""
        if self.left_s() < needs_s:
            self.skip(name, f"time budget: {self.left_s():.0f} s left, section needs about {needs_s:.0f} s")
            return
        t0 = time.monotonic()
        print(f"== {name} ({self.left_s():.0f} s of budget left)", flush=True)
        self._rows = rows = []
        try:
            fn()
        except Exception as exc:  # the check reports every failure and carries on
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"!! {name} failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        self._rows = None
        self.data["sections"][name] = {"rows": rows, "seconds": round(time.monotonic() - t0, 1)}

    def skip(self, name: str, why: str) -> None:
        self.data["skipped"][name] = why
        print(f"-- skipped {name}: {why}", flush=True)

    def set_ceilings(self, measured: dict, where: str) -> None:
        self.ceilings.update(measured)
        self.ceilings_source = f"measured ({where})"

    # --- rows ------------------------------------------------------------------------------------------

    def _add(self, check: str, figure: str, target: str, verdict: str, **data) -> dict:
        if self._rows is None:
            raise RuntimeError("rows are added inside a section (Report.run)")
        row = {"check": check, "figure": figure, "target": target, "verdict": verdict, **data}
        self._rows.append(row)
        return row

    def correct(self, check: str, figure: str, ok: bool, target: str, **data) -> dict:
        """A correctness check: judged on the CPU as on the GPU."""
        return self._add(check, figure, target, "pass" if ok else "FAIL", kind="correctness", **data)

    def target(self, check: str, figure: str, ok: bool, target: str, **data) -> dict:
        """A performance target over the ceilings: judged only against measured ceilings, only on the GPU."""
        if self.dry_run:
            verdict = "dry run"
        elif not self.ceilings_source.startswith("measured"):
            verdict = "unverified"
        else:
            verdict = "pass" if ok else "FAIL"
        return self._add(check, figure, target, verdict, kind="target", met=ok, **data)

    def unmeasured(self, check: str, target: str, why: str, **data) -> dict:
        return self._add(check, f"- ({why})", target, "dry run" if self.dry_run else "unmeasured", kind="target",
                         **data)

    def info(self, check: str, figure: str, **data) -> dict:
        return self._add(check, figure, "", "info", kind="info", **data)

    def skipped_row(self, check: str, why: str) -> dict:
        return self._add(check, f"- ({why})", "", "skip", kind="info")

    # --- the end ---------------------------------------------------------------------------------------

    def rows(self) -> list[tuple[str, dict]]:
        return [(name, r) for name, s in self.data["sections"].items() for r in s["rows"]]

    def problems(self, asked: list[str]) -> list[str]:
        """Why the check is not green (empty: every row passed)."""
        out = [f"{name}: {r['check']}: {r['verdict']}" for name, r in self.rows() if r["verdict"] in GATING]
        out += [f"section {name} raised: {why}" for name, why in self.data["errors"].items()]
        out += [f"section {name} did not run" for name in asked if name not in self.data["sections"]]
        out += [f"section {name} reported no rows" for name in asked
                if name in self.data["sections"] and not self.data["sections"][name]["rows"]]
        return out

    def finish(self, asked: list[str], path: str | None) -> int:
        """Print the one table, write the JSON; the exit status."""
        self.data["ceilings"] = dict(self.ceilings)
        self.data["ceilings_source"] = self.ceilings_source
        problems = self.problems(asked)
        self.data["problems"] = problems
        self.data["total_seconds"] = round(time.monotonic() - self.start, 1)
        print()
        print_table(self.rows())
        if any(r["kind"] == "target" for _, r in self.rows()):
            print(f"\ntargets judged against {self.ceilings_source}: "
                  f"{self.ceilings['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s copy, "
                  f"{self.ceilings['bf16_matmul_flop_s'] / 1e12:.0f} TFLOP/s bf16"
                  + ("  [dry run: targets shown, not judged]" if self.dry_run else ""))
        for p in problems:
            print(f"NOT MET  {p}")
        print(f"{'GREEN' if not problems else 'RED'}: {len(problems)} problems, {self.data['total_seconds']} s")
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            print(f"wrote {path}")
        return 1 if problems else 0


def print_table(rows: list[tuple[str, dict]]) -> None:
    cells = [(f"{section}: {r['check']}", r["figure"], r["target"], r["verdict"]) for section, r in rows]
    header = ("row", "figure", "target", "verdict")
    widths = [max([len(header[i])] + [len(c[i]) for c in cells]) for i in range(4)]
    for line in [header, tuple("-" * w for w in widths), *cells]:
        print("  ".join(s.ljust(w) for s, w in zip(line, widths)).rstrip(), flush=True)
