"""Turn one row of logits per request into the next token.

Order per request, as in vLLM/OpenAI: frequency/presence penalties on the tokens
the request has generated, temperature, top-k, top-p, then a draw from the
request's own generator (seeded requests reproduce their tokens whatever else is
in the batch). Greedy rows skip everything but the penalties and take the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.outputs import StepLogits
from shared.sampling import SamplingParams


@dataclass(slots=True)
class SamplingState:
    """What sampling needs to remember about one request between steps."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy requests
    output_counts: dict[int, int]  # token id -> times generated (for penalties)

    @classmethod
    def create(cls, params: SamplingParams, device: torch.device | str = "cpu") -> SamplingState:
        """device: where the logits live; the generator must be on the same device."""
        gen = None
        if not params.is_greedy:
            gen = torch.Generator(device=device)
            if params.seed is not None:
                gen.manual_seed(params.seed)
            else:
                gen.seed()
        return cls(params, gen, {})

    def record(self, token_id: int) -> None:
        if self.params.has_penalties:
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each sampled token (raw model distribution)
    top_logprobs: list[list[tuple[int, float]]] | None


def _apply_penalties(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    if not state.output_counts:
        return row
    ids = torch.tensor(list(state.output_counts.keys()), device=row.device)
    counts = torch.tensor(list(state.output_counts.values()), dtype=row.dtype, device=row.device)
    row = row.clone()
    row[ids] -= counts * state.params.frequency_penalty + state.params.presence_penalty
    return row


def _sample_row(row: torch.Tensor, state: SamplingState) -> int:
    p = state.params
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = (cum - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=state.generator).item())


def sample(logits: torch.Tensor | StepLogits, states: list[SamplingState]) -> SampleResult:
    """logits: fp32 [N, vocab] (or a step's StepLogits), one row per request in states'
    order. Plain greedy rows never need the full vocabulary."""
    step = logits if isinstance(logits, StepLogits) else StepLogits(logits, None, logits.shape[1])
    assert step.rows.shape[0] == len(states)
    greedy = [not s.params.has_penalties and s.params.is_greedy for s in states]
    token_ids: list[int] = []
    argmax = step.greedy() if any(greedy) else []
    for i, state in enumerate(states):
        if greedy[i]:
            token_ids.append(int(argmax[i]))
            continue
        row = _apply_penalties(step.full()[i], state)
        token_ids.append(int(row.argmax()) if state.params.is_greedy else _sample_row(row, state))
    for tok, state in zip(token_ids, states, strict=True):
        state.record(tok)

    want = [s.params.logprobs for s in states]
    if all(w is None for w in want):
        return SampleResult(token_ids, None, None)
    logp = torch.log_softmax(step.full(), dim=-1)
    index = torch.tensor(token_ids, device=logp.device).unsqueeze(1)
    chosen = logp.gather(1, index).squeeze(1).tolist()
    k_max = max((w or 0) for w in want)
    top: list[list[tuple[int, float]]] = [[] for _ in states]
    if k_max > 0:
        vals, idx = logp.topk(k_max, dim=-1)
        for i, w in enumerate(want):
            if w:
                top[i] = list(zip(idx[i, :w].tolist(), vals[i, :w].tolist(), strict=True))
    return SampleResult(token_ids, chosen, top)
