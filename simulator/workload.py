"""Workloads: when requests arrive and how long their prompts and outputs are.

The same specification drives the simulator (virtual time) and `stallfree bench serve` (a live endpoint).
Arrivals: Poisson, gamma with a burstiness factor (vLLM's convention: shape = burstiness, so 1 is
Poisson and smaller is burstier), or a trace file. Lengths: fixed, uniform, lognormal, mixtures, and a
ShareGPT-like preset. A shared-prefix fraction makes the first part of every prompt common (a system
prompt), which the prefix cache can serve. Each request may name its objective (a class of requests with its
own priority and SLOs: the router's `x-stallfree-objective`) and its tenant (`x-gateway-inference-fairness-id`);
empty: the service's default objective, no tenant.

Length syntax (`parse_length`):
  fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MIN:MAX] | mix:W*DIST|W*DIST... | sharegpt-prompt | sharegpt-output
"""
from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stallfree.arrivals import arrival_times
from stallfree.contracts import percentile


class LengthDist(Protocol):
    def sample(self, rng: random.Random) -> int: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Fixed:
    value: int

    def sample(self, rng: random.Random) -> int:
        return self.value

    def describe(self) -> str:
        return f"fixed:{self.value}"


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def describe(self) -> str:
        return f"uniform:{self.lo}:{self.hi}"


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    lo: int = 1
    hi: int = 1 << 20

    def sample(self, rng: random.Random) -> int:
        value = int(round(rng.lognormvariate(math.log(self.median), self.sigma)))
        return min(self.hi, max(self.lo, value))

    def describe(self) -> str:
        return f"lognormal:{self.median:g}:{self.sigma:g}:{self.lo}:{self.hi}"


@dataclass(frozen=True)
class Mixture:
    weights: tuple[float, ...]
    parts: tuple[LengthDist, ...]

    def sample(self, rng: random.Random) -> int:
        return rng.choices(self.parts, weights=self.weights)[0].sample(rng)

    def describe(self) -> str:
        return "mix:" + "|".join(f"{w:g}*{p.describe()}" for w, p in zip(self.weights, self.parts))


def lognormal_from_p90(median: float, p90: float, lo: int = 1, hi: int = 1 << 20) -> LogNormal:
    """A lognormal with the given median and 90th percentile (z(0.9) = 1.2816)."""
    return LogNormal(median, math.log(p90 / median) / 1.2815516, lo, hi)


# Sarathi-Serve's openchat_sharegpt4 figures: prompt median 1,730 / p90 5,696 tokens, output median 415 /
# p90 834; clipped so prompt plus output stays within an 8K context.
SHAREGPT_PROMPT = lognormal_from_p90(1730, 5696, lo=16, hi=7000)
SHAREGPT_OUTPUT = lognormal_from_p90(415, 834, lo=8, hi=1192)
NAMED_LENGTHS: dict[str, LengthDist] = {"sharegpt-prompt": SHAREGPT_PROMPT, "sharegpt-output": SHAREGPT_OUTPUT}


def parse_length(spec: str) -> LengthDist:
    """Parse the length syntax of the module docstring; raises ValueError naming the bad part."""
    spec = spec.strip()
    if spec in NAMED_LENGTHS:
        return NAMED_LENGTHS[spec]
    kind, _, rest = spec.partition(":")
    if kind == "mix":
        return _parse_mixture(spec, rest)
    try:
        args = [float(a) for a in rest.split(":")] if rest else []
    except ValueError:
        raise ValueError(f"bad length distribution {spec!r}: its arguments must be numbers") from None
    if kind == "fixed" and len(args) == 1:
        _check_positive(spec, int(args[0]))
        return Fixed(int(args[0]))
    if kind == "uniform" and len(args) == 2:
        lo, hi = int(args[0]), int(args[1])
        _check_positive(spec, lo)
        if hi < lo:
            raise ValueError(f"bad length distribution {spec!r}: uniform needs LO <= HI")
        return Uniform(lo, hi)
    if kind == "lognormal" and len(args) in (2, 4):
        if args[0] <= 0 or args[1] < 0:
            raise ValueError(f"bad length distribution {spec!r}: lognormal needs MEDIAN > 0 and SIGMA >= 0")
        lo, hi = (int(args[2]), int(args[3])) if len(args) == 4 else (1, 1 << 20)
        _check_positive(spec, lo)
        return LogNormal(args[0], args[1], lo, hi)
    raise ValueError(
        f"bad length distribution {spec!r}; use fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MIN:MAX], "
        f"mix:W*DIST|W*DIST or one of {', '.join(NAMED_LENGTHS)}"
    )


def _parse_mixture(spec: str, rest: str) -> Mixture:
    weights, parts = [], []
    for item in rest.split("|"):
        weight, star, dist = item.partition("*")
        try:
            weights.append(float(weight))
        except ValueError:
            star = ""
        if not star:
            raise ValueError(f"bad length distribution {spec!r}: mixture part {item!r} needs the form WEIGHT*DIST")
        parts.append(parse_length(dist))
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"bad length distribution {spec!r}: mixture weights must be >= 0 and not all zero")
    return Mixture(tuple(weights), tuple(parts))


def _check_positive(spec: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"bad length distribution {spec!r}: lengths must be at least 1 token")


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when it arrives and its lengths in tokens."""

    arrival_s: float
    prompt_len: int
    output_len: int
    shared_prefix_len: int = 0  # leading prompt tokens common to every request of its prefix group
    prefix_group: int = 0
    objective: str = ""  # the objective it names ("": the service's default)
    tenant: str = ""  # who sent it ("": no tenant)


@dataclass
class WorkloadSpec:
    arrival: str = "poisson"  # poisson | gamma | trace
    rate: float = 1.0  # requests per second (inf: all at t=0)
    burstiness: float = 1.0  # gamma shape; 1 = Poisson, < 1 burstier
    prompt: LengthDist = field(default_factory=lambda: SHAREGPT_PROMPT)
    output: LengthDist = field(default_factory=lambda: SHAREGPT_OUTPUT)
    num_requests: int = 100
    duration_s: float | None = None  # stop generating arrivals after this time (whichever comes first)
    shared_prefix_fraction: float = 0.0
    num_prefix_groups: int = 1
    trace_path: str | None = None
    max_total_len: int | None = None  # clip prompt + output to a model's context
    seed: int = 0
    objective: str = ""  # every generated request names this objective ("": the default)
    tenant: str = ""  # and comes from this tenant ("": none)

    def check(self) -> None:
        if self.arrival not in ("poisson", "gamma", "trace"):
            raise ValueError(f"unknown arrival process {self.arrival!r}; use poisson, gamma or trace")
        if self.arrival == "trace" and not self.trace_path:
            raise ValueError("arrival 'trace' needs a trace file")
        if self.arrival != "trace" and not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(f"shared_prefix_fraction must be in [0, 1], got {self.shared_prefix_fraction}")
        if self.num_prefix_groups < 1:
            raise ValueError("num_prefix_groups must be at least 1")


def arrival_times_of(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """Every arrival time, the first at t=0, drawn before any length (so a seed keeps its workload)."""
    shape = spec.burstiness if spec.arrival == "gamma" else 1.0
    return list(arrival_times(spec.rate, rng, count=spec.num_requests, first_at_start=True, burstiness=shape))


def generate(spec: WorkloadSpec) -> list[RequestSpec]:
    """The workload's requests in arrival order (deterministic for a seed)."""
    spec.check()
    if spec.arrival == "trace":
        requests = load_trace(spec.trace_path or "")
        return [_clip(r, spec.max_total_len) for r in requests[: spec.num_requests]]
    rng = random.Random(spec.seed)
    requests = []
    for index, now in enumerate(arrival_times_of(spec, rng)):
        if spec.duration_s is not None and now > spec.duration_s:
            break
        prompt_len = spec.prompt.sample(rng)
        output_len = spec.output.sample(rng)
        shared = int(spec.shared_prefix_fraction * prompt_len)
        request = RequestSpec(now, prompt_len, output_len, shared, index % spec.num_prefix_groups,
                              spec.objective, spec.tenant)
        requests.append(_clip(request, spec.max_total_len))
    return requests


def _clip(request: RequestSpec, max_total_len: int | None) -> RequestSpec:
    if max_total_len is None or request.prompt_len + request.output_len <= max_total_len:
        return request
    prompt_len = min(request.prompt_len, max_total_len - 1)
    output_len = min(request.output_len, max_total_len - prompt_len)
    return RequestSpec(request.arrival_s, prompt_len, output_len, min(request.shared_prefix_len, prompt_len),
                       request.prefix_group, request.objective, request.tenant)


def load_trace(path: str | Path) -> list[RequestSpec]:
    """A trace: JSON lines or CSV with arrival_s, prompt_len, output_len (optional shared_prefix_len, prefix_group,
    objective, tenant)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    requests = []
    for number, row in enumerate(rows, start=1):
        try:
            request = RequestSpec(
                float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"]),
                int(row.get("shared_prefix_len") or 0), int(row.get("prefix_group") or 0),
                str(row.get("objective") or ""), str(row.get("tenant") or ""),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: record {number} needs arrival_s, prompt_len, output_len: {exc}") from None
        if request.prompt_len < 1 or request.output_len < 1 or request.arrival_s < 0:
            raise ValueError(f"{path}: record {number} has a negative time or an empty prompt/output")
        requests.append(request)
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def describe_workload(spec: WorkloadSpec, requests: list[RequestSpec]) -> dict[str, Any]:
    """What a run was served: the spec's distributions and rate, or a trace's own figures.

    A trace has no length distribution or rate of its own beyond its records: its lengths are given as
    their median and 90th percentile, its rate as arrivals over the span they cover.
    """
    if spec.arrival != "trace":
        return {"arrival": spec.arrival, "rate": spec.rate, "burstiness": spec.burstiness,
                "prompt": spec.prompt.describe(), "output": spec.output.describe(), "num_requests": len(requests),
                "seed": spec.seed, "shared_prefix_fraction": spec.shared_prefix_fraction}
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    rate = (len(requests) - 1) / span if span > 0 else math.inf
    return {"arrival": "trace", "trace": spec.trace_path, "rate": rate, "duration_s": span,
            "prompt": _observed([r.prompt_len for r in requests]), "output": _observed([r.output_len for r in requests]),
            "num_requests": len(requests),
            "shared_prefix_fraction": (sum(r.shared_prefix_len for r in requests)
                                       / max(1, sum(r.prompt_len for r in requests)))}


def workload_label(description: dict[str, Any]) -> str:
    """One line for a report header: lengths, arrival process and rate."""
    rate = description["rate"]
    rate_text = "all at once" if math.isinf(rate) else f"{rate:.3g} req/s"
    arrival = f"trace {description['trace']}" if description["arrival"] == "trace" else description["arrival"]
    return f"prompt {description['prompt']}, output {description['output']}, {arrival} {rate_text}"


def _observed(lengths: list[int]) -> str:
    if not lengths:
        return "none"
    ordered = sorted(lengths)
    return f"median {percentile(ordered, 0.5)} / p90 {percentile(ordered, 0.9)} (trace)"


def prompt_token_ids(request: RequestSpec, index: int, vocab_lo: int, vocab_hi: int) -> list[int]:
    """Deterministic prompt tokens: the group's shared prefix, then tokens unique to this request.

    The unique part opens with the request's index in base (vocab_hi - vocab_lo) so no two requests share
    a block past the common prefix (the prefix cache keys blocks by content).
    """
    span = vocab_hi - vocab_lo
    shared = [vocab_lo + (request.prefix_group * 7 + k) % span for k in range(request.shared_prefix_len)]
    marker, n = [], index + 1
    while n:
        n, digit = divmod(n, span)
        marker.append(vocab_lo + digit)
    rest = request.prompt_len - request.shared_prefix_len
    unique = (marker + [vocab_lo + (index * 31 + k) % span for k in range(max(0, rest - len(marker)))])[:rest]
    return shared + unique
