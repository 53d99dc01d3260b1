"""The live terminal view of `stallfree up`: replicas, budgets, p99s against SLOs, decisions as they happen.

On a terminal it redraws one screen per control step; elsewhere (a pipe, CI) it prints one line per
step and each event once, so logs stay readable.
"""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from stallfree.operator.control.loop import StepResult
from stallfree.operator.control.policy import ControlPolicy
from stallfree.operator.local.load import LoadPhase
from stallfree.operator.control.timeline import format_row, step_row

CLEAR = "\x1b[H\x1b[2J"
RED, GREEN, DIM, RESET = "\x1b[31m", "\x1b[32m", "\x1b[2m", "\x1b[0m"


class LiveView:
    def __init__(self, service: str, policy: ControlPolicy, live: bool, stream: TextIO = sys.stdout) -> None:
        self.service = service
        self.policy = policy
        self.live = live
        self.stream = stream
        self.messages: list[str] = []
        self.current_phase: LoadPhase | None = None
        self.events_shown = 0
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:6.0f}s] {message}"
        self.messages.append(line)
        if not self.live:
            print(line, file=self.stream, flush=True)

    def waiting(self, seconds: float) -> None:
        if self.live:
            self.stream.write(f"\rwaiting for replicas to load the model and profile themselves... {seconds:4.0f}s")
            self.stream.flush()

    def phase(self, phase: LoadPhase) -> None:
        self.current_phase = phase
        self.say(f"load phase '{phase.label}': {phase.rate_per_s:.2f} req/s, {phase.prompt_tokens}-token prompts, "
                 f"{phase.max_tokens} output tokens, {phase.duration_s:.0f}s")

    def step(self, result: StepResult, runtime: Any) -> None:
        row = step_row(result)
        row["t"] = result.time - runtime.started
        new_events = runtime.events[self.events_shown:]
        self.events_shown = len(runtime.events)
        for event in new_events:
            self.messages.append(f"[{event.t:6.0f}s] {'!' if event.warning else ' '} {event.reason}: {event.message}")
        if not self.live:
            print(format_row(row), file=self.stream, flush=True)
            for event in new_events:
                print(f"    event {event.reason}: {event.message}", file=self.stream, flush=True)
            return
        self.stream.write(CLEAR + self._screen(row) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def _screen(self, row: dict[str, Any]) -> str:
        slo = self.policy.slo
        phase = f"load: {self.current_phase.label}" if self.current_phase else "no load"
        lines = [
            f"stallfree up  {self.service}   t={row['t']:.0f}s   {phase}   (Ctrl-C drains and stops)",
            f"SLOs p99: TTFT {slo.ttft_p99_ms:.0f} ms  TPOT {slo.tpot_p99_ms:.0f} ms  queue wait "
            f"{slo.queue_wait_p99_ms:.0f} ms        replicas {row['replicas']} -> desired {row['desired_replicas']} "
            f"(ready {row['ready_replicas']})",
            "",
            f"{'replica':<18}{'state':<10}{'budget':>7}{'seqs':>6}{'p99 TPOT':>10}{'p99 TTFT':>10}{'p99 queue':>11}"
            f"{'KV':>6}{'wait':>6}",
        ]
        for r in row["replica_detail"]:
            state = "ok" if r["known"] else "unknown"
            lines.append(
                f"{r['name']:<18}{state:<10}{_v(r.get('token_budget')):>7}{_v(r.get('max_num_seqs')):>6}"
                f"{self._ms(r.get('p99_tpot_ms'), slo.tpot_p99_ms):>19}{self._ms(r.get('p99_ttft_ms'), slo.ttft_p99_ms):>19}"
                f"{self._ms(r.get('p99_queue_wait_ms'), slo.queue_wait_p99_ms):>20}"
                f"{_pct(r.get('kv_usage')):>6}{_v(r.get('num_waiting')):>6}")
            if not r["known"]:
                lines.append(f"{'':<18}{DIM}{r.get('unknown_reason', '')}{RESET}")
        conditions = "  ".join(f"{k}={v}" for k, v in row["conditions"].items())
        lines += ["", f"conditions: {conditions}"]
        if row.get("feasible"):
            lines.append(row["feasible"])  # SLOFeasible with the profile's numbers: what no setting can meet
        lines += ["", "recent events and messages:"]
        lines += self.messages[-12:]
        return "\n".join(lines)

    @staticmethod
    def _ms(value: float | None, slo: float) -> str:
        if value is None:
            return f"{DIM}{'-':>10}{RESET}"
        colour = GREEN if value <= slo else RED
        return f"{colour}{value:>10.0f}{RESET}"


def _v(value: Any) -> str:
    return "-" if value is None else str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
