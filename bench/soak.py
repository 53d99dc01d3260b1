"""`stallfree bench soak`: thousands of streaming requests across local replicas, random client
cancellations and a replica killed mid-run; afterwards every request must have an explicit outcome,
every KV block must be free again and the surviving daemons' memory must stay flat.

The daemons are real `stallfree serve` processes on loopback (the sim backend by default, so the
engine, scheduler, KV cache and HTTP paths run at full speed on a CPU). Requests go only to replicas
that answered /ready at the last look, as a Service routes; a killed replica is restarted, as a
kubelet would.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stallfree.loadgen.prompts import PromptBuilder
from stallfree.operator.local.daemons import LocalDaemonSet, LocalReplica
from stallfree.ready import answers_ready_async, wait_until_ready_async

SIM_DAEMON_ARGS = ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100", "--max-model-len", "4096",
                   "--max-token-budget", "2048", "--token-budget", "1024", "--max-num-seqs-ceiling", "128",
                   "--max-num-seqs", "128",
                   # A short stats window and a small KV cache: the soak outlasts the window many times and
                   # fills the prefix-cache index early, so what memory holds is bounded by design well
                   # before the measurements; growth after that would be a leak.
                   "--stats-window-s", "5", "--num-kv-blocks", "2048"]
OUTCOMES = ("completed", "cancelled", "failed_on_killed_replica", "failed")


@dataclass
class SoakConfig:
    requests: int = 3000
    concurrency: int = 64
    replicas: int = 2
    cancel_fraction: float = 0.2
    kill_at_fraction: float = 0.4  # the share of requests sent before replica 0 is killed (<0: no kill)
    seed: int = 0
    time_limit_s: float = 600.0
    daemon_args: list[str] = field(default_factory=lambda: list(SIM_DAEMON_ARGS))


@dataclass
class Outcome:
    kind: str
    replica: str
    detail: str = ""


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, config: SoakConfig, workdir: Path) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.token = secrets.token_urlsafe(16)
        self.daemons = LocalDaemonSet("soak", config.daemon_args, self.token, workdir / "logs")
        self.ready: set[str] = set()
        self.killed: set[str] = set()  # names of replicas killed at least once (their failures are expected)
        self.outcomes: list[Outcome | None] = [None] * config.requests
        self.kills = 0
        self.restarts = 0
        self.prompts = PromptBuilder(chars_per_token=1.0)  # prompt lengths in characters: any mix will do

    async def run(self) -> dict[str, Any]:
        config = self.config
        self.daemons.scale_to(config.replicas)
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=3.0)) as client:
            try:
                await self._wait_all_ready(client, 120.0)
                supervisor = asyncio.create_task(self._supervise(client))
                survivor = self.daemons.replicas[-1]
                memory: dict[str, float | None] = {}
                semaphore = asyncio.Semaphore(config.concurrency)
                kill_at = int(config.requests * config.kill_at_fraction) if config.kill_at_fraction >= 0 else -1
                tasks = []
                for index in range(config.requests):
                    await semaphore.acquire()
                    if index in (config.requests // 5, config.requests // 2):  # after warm-up, then half-way
                        memory["at_20pct" if index == config.requests // 5 else "at_50pct"] = rss_mb(survivor.process.pid)
                    if index == kill_at:
                        self._kill(self.daemons.replicas[0])
                    task = asyncio.create_task(self._one(client, index))
                    task.add_done_callback(lambda _t: semaphore.release())
                    tasks.append(task)
                    if time.monotonic() - started > config.time_limit_s:
                        break
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=config.time_limit_s)
                await self._wait_all_ready(client, 60.0)
                kv = await self._kv_after(client)
                memory["end"] = rss_mb(survivor.process.pid)
                supervisor.cancel()
            finally:
                await asyncio.to_thread(self.daemons.shutdown)
        counts = {kind: sum(1 for o in self.outcomes if o is not None and o.kind == kind) for kind in OUTCOMES}
        lost = sum(1 for o in self.outcomes if o is None)
        failures: dict[str, int] = {}
        for o in self.outcomes:
            if o is not None and o.kind.startswith("failed"):
                failures[o.detail[:80]] = failures.get(o.detail[:80], 0) + 1
        return {
            "requests": config.requests, "concurrency": config.concurrency, "replicas": config.replicas,
            **counts, "lost": lost, "kills": self.kills, "restarts": self.restarts,
            "kv_after": kv, "leaked_kv_replicas": sum(1 for v in kv.values() if v["kv_usage"] != 0 or v["running"]),
            "survivor_rss_mb": memory,
            "failure_reasons": failures, "wall_s": round(time.monotonic() - started, 1),
        }

    async def _one(self, client: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(self.config.seed * 1_000_003 + index)
        urls = [r for r in self.daemons.replicas if r.name in self.ready and r.alive]
        if not urls:
            self.outcomes[index] = Outcome("failed", "-", "no ready replica")
            return
        replica = urls[index % len(urls)]
        cancel_after = rng.randint(1, 6) if rng.random() < self.config.cancel_fraction else None
        body = {"model": "llama-3-8b", "prompt": self.prompts.text(rng.randint(20, 600), seed=index, lead=f"{index}:"),
                "max_tokens": rng.randint(4, 48), "stream": True, "ignore_eos": True}
        self.outcomes[index] = await self._stream(client, replica, body, cancel_after)

    async def _stream(self, client: httpx.AsyncClient, replica: LocalReplica, body: dict[str, Any],
                      cancel_after: int | None) -> Outcome:
        tokens = 0
        try:
            async with client.stream("POST", f"{replica.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return self._failure(replica, f"HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return Outcome("completed", replica.name) if tokens else self._failure(replica, "no tokens")
                    event = json.loads(data)
                    if "error" in event:
                        return self._failure(replica, f"stream error: {event['error'].get('message', '')}")
                    tokens += 1
                    if cancel_after is not None and tokens >= cancel_after:
                        return Outcome("cancelled", replica.name)  # leaving the block closes the connection
            return self._failure(replica, "stream ended without [DONE]")
        except (httpx.HTTPError, OSError) as exc:
            return self._failure(replica, f"{type(exc).__name__}")

    def _failure(self, replica: LocalReplica, detail: str) -> Outcome:
        kind = "failed_on_killed_replica" if replica.name in self.killed else "failed"
        return Outcome(kind, replica.name, detail)

    def _kill(self, replica: LocalReplica) -> None:
        self.killed.add(replica.name)
        self.ready.discard(replica.name)
        self.daemons.kill(replica.name)
        self.kills += 1

    async def _supervise(self, client: httpx.AsyncClient) -> None:
        """Restart dead daemons and keep the routable set current, like a kubelet and an endpoints controller."""
        while True:
            restarted = self.daemons.restart_dead()
            self.restarts += len(restarted)
            await self._refresh_ready(client)
            await asyncio.sleep(0.3)

    async def _refresh_ready(self, client: httpx.AsyncClient) -> None:
        replicas = list(self.daemons.replicas)
        states = await asyncio.gather(*(answers_ready_async(client, r.url) for r in replicas))
        self.ready = {r.name for r, good in zip(replicas, states) if good}

    async def _wait_all_ready(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """Every replica answers /ready; a dead one is restarted meanwhile, as the supervisor would."""
        async def all_ready() -> bool:
            self.restarts += len(self.daemons.restart_dead())
            await self._refresh_ready(client)
            return len(self.ready) == len(self.daemons.replicas)

        await wait_until_ready_async(all_ready, timeout_s, poll_s=0.3,
                                     what=f"replicas (logs in {self.daemons.log_dir})")

    async def _kv_after(self, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        """Each replica's KV usage once idle (waits briefly for aborted requests to be reaped)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        out: dict[str, dict[str, Any]] = {}
        for replica in self.daemons.replicas:
            stats: dict[str, Any] = {}
            for _ in range(50):
                stats = (await client.get(f"{replica.url}/admin/stats", headers=headers, timeout=3.0)).json()
                if stats["kv_usage"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
                    break
                await asyncio.sleep(0.1)
            out[replica.name] = {"kv_usage": stats["kv_usage"], "running": stats["num_running"],
                                 "waiting": stats["num_waiting"]}
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--kill-at", type=float, default=0.4, help="share of requests sent before a kill (<0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit-s", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    config = SoakConfig(requests=args.requests, concurrency=args.concurrency, replicas=args.replicas,
                        cancel_fraction=args.cancel_fraction, kill_at_fraction=args.kill_at, seed=args.seed,
                        time_limit_s=args.time_limit_s)
    with tempfile.TemporaryDirectory(prefix="stallfree-soak-") as tmp:
        result = asyncio.run(Soak(config, Path(tmp)).run())
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    ok = result["lost"] == 0 and result["failed"] == 0 and result["leaked_kv_replicas"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
