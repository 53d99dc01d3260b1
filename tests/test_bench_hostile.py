"""`stallfree bench hostile` against a live sim daemon: every body answered, the figures printed and written.
The goal is set out of reach of any machine's noise: this checks the command, not the timings."""
from __future__ import annotations

import json

from stallfree.bench import hostile
from stallfree.bench.soak import SIM_DAEMON_ARGS

from server_helpers import running_daemon


def test_bench_hostile_against_a_live_daemon(tmp_path, capsys) -> None:
    out = tmp_path / "hostile.json"
    with running_daemon(SIM_DAEMON_ARGS, base_args=[]) as live:
        rc = hostile.main(["--url", live.url, "--streams", "2", "--quiet-s", "0.2", "--goal-ms", "1e9",
                           "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "max gap ms" in printed and "/health max ms" in printed and ": met" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["body"] for r in rows][:3] == ["quiet (no body)", "1.33M token ids", "100k messages"]
    assert all(r["max_gap_ms"] is not None and r["health_max_ms"] is not None for r in rows)
    codes = {r["body"]: r.get("code") for r in rows[1:]}
    assert codes["1.33M token ids"] == codes["100k messages"] == "too_many_values"
    assert all(r["status"] == 400 for r in rows[1:])  # the bodies within the bounds are over the context
