"""`stallfree bench scheduler`: microseconds of one scheduling step in steady state.

256 requests running (decoding, a few prefilling) and 1,024 waiting: every step schedules, the
"model" samples a synthetic token for every chunk that samples (the scheduler is pure, so this is
its real workload), update_from_output advances and finishes requests, and arrivals refill the
queue to its target. schedule() and update_from_output() are timed apart; arrivals are not timed.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from stallfree.contracts import Ceilings, Tuning, percentile
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.engine.kv_cache_manager import KVCacheManager
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler import Scheduler

VOCAB = 32000


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stallfree bench scheduler", description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, default=256, help="max_num_seqs: requests kept running")
    p.add_argument("--waiting", type=int, default=1024, help="requests kept waiting")
    p.add_argument("--token-budget", type=int, default=1024)
    p.add_argument("--max-partial-prefills", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=32768)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(256, 768), metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix", type=int, default=64, help="tokens of a system prompt shared by all requests")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--warmup", type=int, default=1000, help="steps before timing (reach steady state)")
    p.add_argument("--steps", type=int, default=2000, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--output", help="also write the JSON figures to this file")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    tuning = Tuning(token_budget=args.token_budget, max_num_seqs=args.running,
                    max_partial_prefills=args.max_partial_prefills)
    ceilings = Ceilings(max_token_budget=max(2048, args.token_budget), max_num_seqs=args.running)
    max_model_len = args.shared_prefix + args.prompt_len[1] + args.output_len[1]
    config = SchedulerConfig(ceilings=ceilings, tuning=tuning, max_model_len=max_model_len)
    kv = KVCacheManager(args.num_blocks, args.block_size, enable_prefix_caching=not args.no_prefix_caching)
    scheduler = Scheduler(config, kv)
    system_prompt = [rng.randrange(VOCAB) for _ in range(args.shared_prefix)]
    counter = 0

    def refill() -> None:
        nonlocal counter
        while scheduler.num_waiting < args.waiting:
            prompt = system_prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(*args.prompt_len))]
            sampling = SamplingParams(max_tokens=rng.randint(*args.output_len), ignore_eos=True)
            request = Request(f"req-{counter}", prompt, sampling, arrival_time=0.0)
            t0 = perf()
            scheduler.add_request(request)  # hashes the prompt's full blocks, once, on arrival
            add_us.append((perf() - t0) / 1000)
            counter += 1

    perf = time.perf_counter_ns
    add_us: list[float] = []
    schedule_us: list[float] = []
    update_us: list[float] = []
    running: list[int] = []
    tokens: list[int] = []
    finished = prompt_tokens = hit_tokens = 0
    for step in range(args.warmup + args.steps):
        refill()
        t0 = perf()
        output = scheduler.schedule()
        t1 = perf()
        sampled = {chunk.request.request_id: rng.randrange(VOCAB) for chunk in output.chunks if chunk.samples}
        t2 = perf()
        done = scheduler.update_from_output(output, sampled)
        t3 = perf()
        finished += len(done)
        for request in done:  # the metrics' definition: prompt tokens served from the prefix cache
            prompt_tokens += request.num_prompt_tokens
            hit_tokens += request.num_cached_tokens
        if step >= args.warmup:
            schedule_us.append((t1 - t0) / 1000)
            update_us.append((t3 - t2) / 1000)
            running.append(scheduler.num_running)
            tokens.append(output.num_tokens)
    schedule_us.sort()
    update_us.sort()
    return {
        "median_us": round(statistics.median(schedule_us), 2),
        "p99_us": round(percentile(schedule_us, 0.99), 2),
        "p90_us": round(percentile(schedule_us, 0.90), 2),
        "update_median_us": round(statistics.median(update_us), 2),
        "update_p90_us": round(percentile(update_us, 0.90), 2),
        "update_p99_us": round(percentile(update_us, 0.99), 2),
        "add_request_median_us": round(statistics.median(add_us[-args.steps:]), 2),
        "steps": args.steps,
        "mean_running": round(statistics.fmean(running), 1),
        "waiting": args.waiting,
        "mean_tokens_per_step": round(statistics.fmean(tokens), 1),
        "token_budget": args.token_budget,
        "finished": finished,
        "preemptions": scheduler.num_preemptions,
        "kv_usage": round(kv.usage, 3),
        "prefix_cache_hit_rate": round(hit_tokens / max(1, prompt_tokens), 3),
        "prefix_caching": not args.no_prefix_caching,
        "python": sys.version.split()[0],
    }


def main(argv: list[str]) -> int:
    args = _parse(argv)
    result = run(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"schedule():           median {result['median_us']:8.1f} us   p90 {result['p90_us']:8.1f} us"
          f"   p99 {result['p99_us']:8.1f} us")
    print(f"update_from_output(): median {result['update_median_us']:8.1f} us   p90 {result['update_p90_us']:8.1f} us"
          f"   p99 {result['update_p99_us']:8.1f} us")
    print(f"add_request():        median {result['add_request_median_us']:8.1f} us   (arrival: prompt block hashes)")
    print(f"steady state: {result['mean_running']} running, {result['waiting']} waiting, "
          f"{result['mean_tokens_per_step']} tokens/step of budget {result['token_budget']}, "
          f"{result['finished']} finished over {result['steps']} steps, {result['preemptions']} preemptions, "
          f"KV usage {result['kv_usage']:.0%}, prefix-cache hit rate {result['prefix_cache_hit_rate']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
