"""Token sampling over one iteration's sampling rows, with no full-vocabulary sort on the common paths.

Per row, in vLLM's order: logit_bias, repetition/frequency/presence penalties, temperature, then min_p,
top-k and top-p restrict the support (sampling_params.py says what each means).

- A batch of plain greedy rows is one argmax; greedy rows never touch randomness, and a temperature
  below MIN_TEMPERATURE is greedy (dividing by it would overflow).
- Only rows that use a feature pay for it: the bias/penalty rows are processed apart, logprobs are taken
  only for the rows that ask, and only the random rows are scaled and sampled.
- Restricted rows sample from a truncated candidate set: torch.topk of max(top_k, CANDIDATES) tokens.
  The top-p nucleus and the min_p support are computed over it against the full row's normaliser; a row
  whose support does not close inside the candidates (a very flat distribution) falls back to a full sort.
- Sampling is the exponential race (argmax of w / q with q ~ Exp(1) draws from w, unnormalised), in one
  vectorised step. Seeded rows draw a full-vocabulary q from their own torch.Generator and read it at
  their candidates, so their tokens do not depend on what else is in the batch or on the candidate count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from stallfree.node_daemon.engine.sampling_params import SamplingParams

CANDIDATES = 256  # tokens kept by topk before the top-p / min_p cut (the full sort is the rare fallback)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax as torch gives it (the first largest logit; the first NaN where there is one). On the CPU,
    once the compiled library has loaded, its vectorised scan: torch's took 140 us over Gemma 3's 262,144 logits,
    3% of a one-stream step; the library's 11 (models/cpu_argmax.h)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        from stallfree.node_daemon.models import cpu_decode

        if cpu_decode.is_loaded():
            return cpu_decode.ops().argmax_rows(logits).tolist()
    return logits.argmax(dim=-1).tolist()


class TokenHistory(Protocol):
    """What penalties read from a request (engine Request satisfies it): the prompt, then the outputs so far."""

    token_ids: list[int]
    num_prompt_tokens: int


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of one sampled position: the sampled token's and the `k` most likely (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None  # None when no row asked for logprobs


class _PenaltyState:
    """One request's token counts, kept incrementally (only the tokens generated since the last step are added).

    `ids` lists every distinct token of the prompt and the output so far: the penalties touch only those
    positions of the row (a few hundred), never the whole vocabulary.
    """

    __slots__ = ("counts", "num_seen", "ids", "_id_set")

    def __init__(self, vocab: int, prompt_token_ids: Sequence[int], device: torch.device) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # output tokens only
        self.num_seen = 0
        self._id_set = set(prompt_token_ids)
        self.ids = torch.tensor(sorted(self._id_set), dtype=torch.long, device=device)

    def update(self, history: TokenHistory) -> None:
        new = history.token_ids[history.num_prompt_tokens + self.num_seen:]  # only what is new since the last step
        if not new:
            return
        device = self.counts.device
        self.counts.index_add_(0, torch.tensor(list(new), dtype=torch.long, device=device),
                               torch.ones(len(new), dtype=torch.float32, device=device))
        self.num_seen += len(new)
        fresh = [t for t in dict.fromkeys(new) if t not in self._id_set]
        if fresh:
            self._id_set.update(fresh)
            self.ids = torch.cat((self.ids, torch.tensor(fresh, dtype=torch.long, device=device)))


class Sampler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self._penalties: dict[str, _PenaltyState] = {}
        self._biases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def free(self, request_id: str) -> None:
        """Forget a finished request's generator and penalty state."""
        self._generators.pop(request_id, None)
        self._penalties.pop(request_id, None)
        self._biases.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[str],
               histories: Sequence[TokenHistory] | None = None) -> list[int]:
        """logits [num_rows, vocab] -> one token id per row (row i belongs to request_ids[i])."""
        return self.sample_rows(logits, params, request_ids, histories).token_ids

    @torch.inference_mode()
    def sample_rows(self, logits: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[str],
                    histories: Sequence[TokenHistory] | None = None) -> SamplerOutput:
        """Tokens, and logprobs for the rows whose params ask; `histories` is needed when a row has penalties."""
        num_rows = logits.shape[0]
        if num_rows != len(params):
            raise ValueError(f"{num_rows} logit rows for {len(params)} sampling params")
        if not params:
            return SamplerOutput([])
        if all(p.plain_greedy for p in params):
            return SamplerOutput(argmax_rows(logits))  # the common case: nothing else runs
        greedy = [p.greedy for p in params]
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        proc = self._process(logits, params, request_ids, histories, processed) if processed else None
        rows = _RowSource(logits, proc, processed)
        tokens: list[int] = [0] * num_rows
        if any(greedy):
            plain = [i for i in range(num_rows) if greedy[i] and not params[i].processes_logits]
            if plain:
                argmax = argmax_rows(logits)
                for i in plain:
                    tokens[i] = argmax[i]
            biased = [i for i in processed if greedy[i]]
            if biased:
                for i, token in zip(biased, argmax_rows(rows.get(biased))):
                    tokens[i] = token
        random_rows = [i for i in range(num_rows) if not greedy[i]]
        if random_rows:
            temps = torch.tensor([params[i].temperature for i in random_rows], dtype=torch.float32,
                                 device=logits.device).unsqueeze(1)
            scaled = rows.get(random_rows) / temps
            picked = self._sample_random(scaled, [params[i] for i in random_rows],
                                         [request_ids[i] for i in random_rows])
            for i, token in zip(random_rows, picked):
                tokens[i] = token
        logprobs = _logprobs(rows, params, wants_logprobs, tokens) if wants_logprobs else None
        return SamplerOutput(tokens, logprobs)

    # ---- logits processing: bias and penalties ---------------------------------------------------

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[str],
                         histories: Sequence[TokenHistory] | None = None) -> torch.Tensor:
        """Every row as float32 after bias and penalties, before temperature (for tests and inspection)."""
        processed = [i for i, p in enumerate(params) if p.processes_logits]
        proc = self._process(logits, params, request_ids, histories, processed) if processed else None
        return _RowSource(logits, proc, processed).get(list(range(len(params)))).clone()

    def _process(self, logits: torch.Tensor, params: Sequence[SamplingParams], request_ids: Sequence[str],
                 histories: Sequence[TokenHistory] | None, processed: list[int]) -> torch.Tensor:
        """Float32 copies of the processed rows, bias and penalties applied (row j is processed[j])."""
        index = torch.tensor(processed, dtype=torch.long, device=logits.device)
        proc = logits.index_select(0, index).float()
        vocab = logits.shape[1]
        penalised: list[int] = []
        for j, i in enumerate(processed):
            p = params[i]
            if p.logit_bias:
                ids, values = self._bias(request_ids[i], p.logit_bias, vocab)
                proc[j].index_add_(0, ids, values)
            if p.needs_history:
                penalised.append(j)
        if penalised:
            if histories is None:
                raise ValueError("penalties need the requests' token histories")
            states = []
            for j in penalised:
                i = processed[j]
                state = self._penalties.get(request_ids[i])
                if state is None:
                    history = histories[i]
                    state = _PenaltyState(vocab, history.token_ids[:history.num_prompt_tokens], logits.device)
                    self._penalties[request_ids[i]] = state
                state.update(histories[i])
                states.append(state)
            apply_penalties(proc, penalised, states, [params[processed[j]] for j in penalised])
        return proc

    def _bias(self, request_id: str, logit_bias: dict[int, float], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._biases.get(request_id)
        if cached is None:
            items = [(t, b) for t, b in logit_bias.items() if 0 <= t < vocab]
            cached = (torch.tensor([t for t, _ in items], dtype=torch.long, device=self.device),
                      torch.tensor([b for _, b in items], dtype=torch.float32, device=self.device))
            self._biases[request_id] = cached
        return cached

    # ---- random rows -----------------------------------------------------------------------------

    def _sample_random(self, scaled: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> list[int]:
        vocab = scaled.shape[1]
        restricted = [j for j, p in enumerate(params) if _restricts(p, vocab)]
        out: list[int] = [0] * len(params)
        if len(restricted) < len(params):
            skip = set(restricted)
            free = [j for j in range(len(params)) if j not in skip]
            x = scaled if not restricted else scaled[free]
            weights = (x - x.amax(dim=-1, keepdim=True)).exp_()
            q = self._exponentials(weights.shape, [params[j] for j in free], [request_ids[j] for j in free],
                                   None, vocab)
            for j, token in zip(free, (weights / q).argmax(dim=-1).tolist()):
                out[j] = token
        if restricted:
            x = scaled if len(restricted) == len(params) else scaled[restricted]
            group = [params[j] for j in restricted]
            ids, weights = restricted_support(x, group)
            q = self._exponentials(weights.shape, group, [request_ids[j] for j in restricted], ids, vocab)
            picked = ids.gather(1, (weights / q).argmax(dim=-1, keepdim=True)).squeeze(1)
            for j, token in zip(restricted, picked.tolist()):
                out[j] = token
        return out

    def _exponentials(self, shape: torch.Size, params: list[SamplingParams], request_ids: list[str],
                      ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
        """Exp(1) draws for the race; a seeded row draws over the whole vocabulary, read at its candidates `ids`."""
        q = torch.empty(shape, dtype=torch.float32, device=self.device)
        seeded = [j for j, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            q.exponential_()
        if seeded:
            vocab_q = torch.empty(vocab, dtype=torch.float32, device=self.device)
            for j in seeded:
                vocab_q.exponential_(generator=self._generator(request_ids[j], params[j].seed))
                q[j] = vocab_q if ids is None else vocab_q[ids[j]]
        return q


def _restricts(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


class _RowSource:
    """Float32 rows of the batch, taken from the processed copy for processed rows."""

    def __init__(self, logits: torch.Tensor, proc: torch.Tensor | None, processed: list[int]) -> None:
        self.logits = logits
        self.proc = proc
        self.processed = processed
        self.position = {i: j for j, i in enumerate(processed)}

    def get(self, rows: list[int]) -> torch.Tensor:
        device = self.logits.device
        if len(rows) == self.logits.shape[0] and not self.position:
            return self.logits.float()
        if self.proc is not None and rows == self.processed:
            return self.proc
        x = self.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device)).float()
        if self.proc is not None:
            mine = [(k, self.position[i]) for k, i in enumerate(rows) if i in self.position]
            if mine:
                dst = torch.tensor([k for k, _ in mine], dtype=torch.long, device=device)
                src = torch.tensor([j for _, j in mine], dtype=torch.long, device=device)
                x.index_copy_(0, dst, self.proc.index_select(0, src))
        return x


def apply_penalties(x: torch.Tensor, rows: list[int], states: Sequence[_PenaltyState],
                    params: Sequence[SamplingParams]) -> None:
    """vLLM's penalties, in place on float rows `rows` of x, at each row's seen tokens only.

    Repetition over prompt and output tokens (positive logits divided by it, negative multiplied), then
    frequency (times the output count) and presence (once per token in the output) subtracted.
    """
    device = x.device
    vocab = x.shape[1]
    sizes = [len(state.ids) for state in states]
    if not sum(sizes):
        return
    flat = torch.cat([state.ids + row * vocab for state, row in zip(states, rows)])
    counts = torch.cat([state.counts.index_select(0, state.ids) for state in states])
    sizes_t = torch.tensor(sizes, device=device)

    def per_token(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).repeat_interleave(sizes_t)

    flat_x = x.view(-1)
    values = flat_x.index_select(0, flat)
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = per_token([p.repetition_penalty for p in params])
        values = torch.where(values > 0, values / rep, values * rep)
    if any(p.frequency_penalty for p in params):
        values = values - per_token([p.frequency_penalty for p in params]) * counts
    if any(p.presence_penalty for p in params):
        values = values - per_token([p.presence_penalty for p in params]) * (counts > 0).float()
    flat_x.index_copy_(0, flat, values)


def restricted_support(x: torch.Tensor, params: Sequence[SamplingParams],
                       candidates: int = CANDIDATES) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [rows, K], unnormalised weights [rows, K]) of each row's min_p / top-k / top-p support.

    `x` holds temperature-scaled logits. K = the largest top_k (at least `candidates` unless every row has a
    top_k); a row whose support does not
    close within K is recomputed over the whole vocabulary (K = vocab), so the result is always exact.
    """
    rows, vocab = x.shape
    device = x.device
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    # Rows bounded by their own top-k need no more candidates than that; the others take `candidates`.
    k = min(vocab, max(top_ks) if all(top_ks) else max(candidates, max(top_ks)))
    vals, ids = x.topk(k, dim=-1) if k < vocab else x.sort(dim=-1, descending=True)
    vmax = vals[:, :1]
    ranks = torch.arange(k, device=device).unsqueeze(0)
    top_k = torch.tensor([t or vocab for t in top_ks], device=device).unsqueeze(1)
    out = ranks >= top_k
    min_ps = [p.min_p for p in params]
    log_min_p = torch.tensor([math.log(m) if m > 0 else -math.inf for m in min_ps], device=device).unsqueeze(1)
    threshold = vmax + log_min_p
    if any(m > 0 for m in min_ps):
        out |= vals < threshold
    weights = (vals - vmax).exp_()
    # Inside the candidates when top-k bounds it, or min_p cuts before the last candidate.
    closed = (top_k <= k).squeeze(1) | (vals[:, -1:] < threshold).squeeze(1) if k < vocab else torch.ones(
        rows, dtype=torch.bool, device=device)
    top_ps = [p.top_p for p in params]
    if any(t < 1.0 for t in top_ps):
        kept = weights.masked_fill(out, 0.0)
        # The normaliser: the kept candidates where the support is closed, else the whole (min_p-cut) row.
        norm = kept.sum(dim=-1, keepdim=True)
        if k < vocab and not bool(closed.all()):
            full = (x - vmax).exp_()
            if any(m > 0 for m in min_ps):
                full = full.masked_fill(x < threshold, 0.0)
            norm = torch.where(closed.unsqueeze(1), norm, full.sum(dim=-1, keepdim=True))
        probs = kept / norm
        cum = probs.cumsum(dim=-1)
        # Rows without top-p never cut (float32 rounding would make the mass "reach" 1.0 before the tail).
        top_p = torch.tensor([t if t < 1.0 else math.inf for t in top_ps], dtype=torch.float32,
                             device=device).unsqueeze(1)
        out |= (cum - probs) >= top_p
        closed = closed | (cum[:, -1] >= top_p.squeeze(1))
    if k < vocab and not bool(closed.all()):
        # A flat row needs more than K candidates: the exact answer over the whole vocabulary (rare).
        return restricted_support(x, params, candidates=vocab)
    out[:, 0] = False  # the best token always stays
    return ids, weights.masked_fill_(out, 0.0)


def _logprobs(rows: _RowSource, params: Sequence[SamplingParams], wanted: list[int],
              tokens: list[int]) -> list[TokenLogprobs | None]:
    """Log-softmax of the processed, temperature-scaled rows (greedy rows at temperature 1), before truncation."""
    x = rows.get(wanted)
    temps = torch.tensor([1.0 if params[i].greedy else params[i].temperature for i in wanted],
                         dtype=torch.float32, device=x.device).unsqueeze(1)
    logp = torch.log_softmax(x / temps, dim=-1)
    picked = torch.tensor([tokens[i] for i in wanted], dtype=torch.long, device=x.device).unsqueeze(1)
    chosen = logp.gather(1, picked).squeeze(1).tolist()
    k = max(params[i].logprobs or 0 for i in wanted)
    top_vals, top_ids = (logp.topk(k, dim=-1) if k else (None, None))
    result: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(wanted):
        n = params[i].logprobs or 0
        top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else []
        result[i] = TokenLogprobs(tokens[i], chosen[j], top)
    return result
