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


# Columns per chunk of `first_argmax`'s first pass.
ARGMAX_CHUNK = 1024


def first_argmax(rows: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum of every row of a 2-D tensor: what
    `rows.argmax(-1)` returns (NaN counts as the maximum, as there), several times
    faster on a CPU.

    argmax and max(dim) reduce to a value and an index per element; `amax` alone is
    a plain vector reduction. So: the max of every chunk of ARGMAX_CHUNK columns
    (amax), the first chunk that holds the row's max, then the first maximal index
    inside that chunk only. A row's first maximum lies in the first chunk whose max
    equals the row's max, so the tie rule is argmax's. One thread, [16, 49152] fp32:
    ~65 us against ~410 us for max(dim) and ~435 us for argmax. Columns past the
    last whole chunk form one shorter chunk. Other devices, shapes and layouts take
    argmax (on a GPU it is one kernel, this is several)."""
    if rows.dim() != 2 or rows.device.type != "cpu" or not rows.is_contiguous():
        return rows.argmax(dim=-1)
    n, width = rows.shape
    chunks = width // ARGMAX_CHUNK
    if chunks == 0:
        return rows.argmax(dim=-1)
    whole = chunks * ARGMAX_CHUNK
    chunk_max = rows[:, :whole].view(n, chunks, ARGMAX_CHUNK).amax(dim=-1)  # [n, chunks]
    if whole < width:
        chunk_max = torch.cat([chunk_max, rows[:, whole:].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * ARGMAX_CHUNK  # the first chunk holding the max
    # Each row's chosen chunk, [n, ARGMAX_CHUNK]. Past the end of a short last chunk the
    # columns are clamped to its last one: repeats of a value it holds, after it, so
    # the first maximal index is still a real column's.
    cols = (start.unsqueeze(1) + torch.arange(ARGMAX_CHUNK, device=rows.device)).clamp_(
        max=width - 1
    )
    return start + rows.gather(1, cols).argmax(dim=-1)


def greedy_tokens(step: StepLogits) -> list[int]:
    """The first maximal token id of every row (torch.argmax's tie rule), from the
    kept columns alone for a trimmed head."""
    best = first_argmax(step.rows)
    return (best if step.keep is None else step.keep[best]).tolist()


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
        # Keep the smallest prefix whose mass reaches top_p, and always the first token:
        # a top_p below float32's smallest value (1e-320 is valid input) rounds to 0 in
        # the comparison, which would otherwise drop every token and fail the step.
        drop = (cum - sorted_probs) >= p.top_p
        drop[0] = False
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
    argmax = greedy_tokens(step) if any(greedy) else []
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
