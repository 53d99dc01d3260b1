"""What a benchmark result records about the CPU it ran on: the tier the kernels take (models/cpu_tier.py), the
flags it was read from, and the paths each daemon's start-up named ("CPU paths: ..." in its log).

Figures from different CPUs, or from one CPU with a lower tier forced (STALLFREE_CPU_TIER), are not comparable;
the JSON says which they are.
"""
from __future__ import annotations

import os
from pathlib import Path

_PATHS_LINE = "CPU paths: "


def cpu_record() -> dict:
    from stallfree.node_daemon.models.cpu_tier import ENV, cpu_flags, resolve_tier

    record: dict = {"model": _model_name(), "cores": os.cpu_count(), "forced_tier": os.environ.get(ENV) or None,
                    "flags": cpu_flags().split(":", 1)[-1].split()}
    try:  # cpu_tier()'s answer, read afresh: the tier the daemons this bench starts (in its environment) take
        tier = resolve_tier(os.environ.get(ENV) or None)
        record.update(tier=tier.name, detected_tier=tier.detected)
    except ValueError as e:  # a forced tier this CPU lacks: the daemons refuse it too
        record.update(tier=None, tier_error=str(e))
    return record


def paths_from_logs(folder: Path) -> dict[str, str]:
    """Per daemon log in `folder` (by file stem), the last paths its start-up named (a background compile of the
    forward logs them again once it loads)."""
    found = {}
    for log in sorted(folder.glob("*.log")):
        lines = [line for line in log.read_text(errors="replace").splitlines() if _PATHS_LINE in line]
        if lines:
            found[log.stem] = lines[-1].split(_PATHS_LINE, 1)[1].strip()
    return found


def _model_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None
