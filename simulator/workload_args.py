"""The workload flags that `stallfree simulate` and `stallfree bench serve` share."""
from __future__ import annotations

import argparse

from stallfree.simulator.workload import WorkloadSpec, parse_length


def add_workload_args(parser: argparse.ArgumentParser, num_requests: int = 200, rate: float = 1.0) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--arrival", choices=("poisson", "gamma", "trace"), default="poisson",
                       help="arrival process (default poisson)")
    group.add_argument("--rate", type=float, default=rate, help="requests per second ('inf': all at once)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape: 1 is Poisson, below 1 burstier (with --arrival gamma)")
    group.add_argument("--trace", help="trace file (JSON lines or CSV: arrival_s, prompt_len, output_len)")
    group.add_argument("--prompt-len", default="sharegpt-prompt",
                       help="prompt length distribution: fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MIN:MAX], "
                            "mix:W*DIST|W*DIST, sharegpt-prompt (default)")
    group.add_argument("--output-len", default="sharegpt-output", help="output length distribution (same syntax)")
    group.add_argument("--sharegpt", action="store_true",
                       help="the ShareGPT-like mix for both lengths (the default already)")
    group.add_argument("--num-requests", type=int, default=num_requests)
    group.add_argument("--duration-s", type=float, help="stop arrivals after this many seconds")
    group.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                       help="share of each prompt that is a common prefix (a system prompt)")
    group.add_argument("--prefix-groups", type=int, default=1, help="number of distinct shared prefixes")
    group.add_argument("--seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace, max_total_len: int | None = None) -> WorkloadSpec:
    """Raises ValueError naming the bad flag's problem."""
    arrival = "trace" if args.trace and args.arrival == "poisson" else args.arrival
    prompt = "sharegpt-prompt" if args.sharegpt else args.prompt_len
    output = "sharegpt-output" if args.sharegpt else args.output_len
    spec = WorkloadSpec(
        arrival=arrival, rate=args.rate, burstiness=args.burstiness, prompt=parse_length(prompt),
        output=parse_length(output), num_requests=args.num_requests, duration_s=args.duration_s,
        shared_prefix_fraction=args.shared_prefix_fraction, num_prefix_groups=args.prefix_groups,
        trace_path=args.trace, max_total_len=max_total_len, seed=args.seed,
    )
    spec.check()
    return spec
