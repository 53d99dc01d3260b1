"""`stallfree bench hostile` against a live sim daemon: every body answered, the figures printed and written.
The goal is set out of reach of any machine's noise: this checks the command, not the timings."""
from __future__ import annotations

import asyncio
import json

import httpx

from stallfree.bench import hostile, hostile_doors, hostile_fields
from stallfree.bench.soak import SIM_DAEMON_ARGS

from server_helpers import ADMIN_TOKEN, running_daemon


def test_bench_hostile_against_a_live_daemon(tmp_path, capsys) -> None:
    out = tmp_path / "hostile.json"
    with running_daemon(SIM_DAEMON_ARGS, base_args=[]) as live:
        rc = hostile.main(["--url", live.url, "--streams", "2", "--quiet-s", "0.2", "--goal-ms", "1e9",
                           "--json", str(out), "--no-doors"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "max gap ms" in printed and "/health max ms" in printed and ": met" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["body"] for r in rows][:3] == ["quiet (no body)", "1.33M token ids", "100k messages"]
    assert all(r["max_gap_ms"] is not None and r["health_max_ms"] is not None for r in rows)
    codes = {r["body"]: r.get("code") for r in rows[1:]}
    assert codes["1.33M token ids"] == codes["100k messages"] == "too_many_values"
    assert all(r["status"] == 400 for r in rows[1:])  # the bodies within the bounds are over the context


def test_bench_hostile_through_a_router_tries_every_door(tmp_path, capsys) -> None:
    """--target router: two sim daemons and a router started here; the doors of issue 35 answered by the router."""
    out = tmp_path / "hostile_router.json"
    daemon_args = [f"--serve-arg={a}" for a in [*SIM_DAEMON_ARGS[4:], "--no-profile", "--header-timeout-s", "2"]]
    rc = hostile.main(["--target", "router", "--streams", "2", "--quiet-s", "0.2", "--goal-ms", "1e9",
                       "--json", str(out), *daemon_args, "--router-arg=--header-timeout-s=2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "doors (router)" in printed
    doors = {row["door"]: row["answer"] for row in json.loads(out.read_text())["doors"]}
    assert doors["deep nesting"].startswith("400")
    assert doors["body size"].startswith("413")
    assert doors["header timeout"].startswith("408")
    assert all(answer.endswith(" 404") for answer in doors["paths outside /v1/"].split(", "))
    assert doors["client leaves"].startswith(f"{hostile_doors.LEAVERS} aborted")
    assert "hidden" in doors["information"] and "401" in doors["information"]
    assert doors["demand from refused requests"] == "arrived_prompt_tokens +0"
    _assert_fields(doors)
    hung = doors["a replica hung for good"].split()
    assert hung[0] == hung[3] != "0" and "error event" in doors["a replica hung for good"]  # each one on it


def _assert_fields(doors: dict[str, str]) -> None:
    assert doors["stop strings"] == "400 invalid_value (param stop)"
    assert doors["stop strings at the bound"].startswith("200 ")
    waited = float(doors["queue-time header"].split("max queue wait then ")[1].split()[0])
    assert doors["queue-time header"].startswith("200") and waited < 60_000
    assert all(answer.endswith(" 400") for answer in doors["legacy function calling"].split(", "))


def test_bench_hostile_fields_against_a_live_daemon() -> None:
    async def run(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await hostile_fields.check_fields(client, SIM_DAEMON_ARGS[SIM_DAEMON_ARGS.index("--model") + 1],
                                                     [url], ADMIN_TOKEN)

    with running_daemon(SIM_DAEMON_ARGS, base_args=[]) as live:
        rows = asyncio.run(run(live.url))
    _assert_fields({row["door"]: row["answer"] for row in rows})
