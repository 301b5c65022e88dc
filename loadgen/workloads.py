"""Workloads: what each request asks, built lazily as the schedule needs it.

Sources: the real prompt sets in `shared/data/prompts/` (one task each), a
`mixed` task mix with shares, random lengths (text cut from a prompt set), a
JSONL file of prompts, or a trace's lengths (prompts built to the trace's input
length from a prompt set; Mooncake's prefix blocks become shared text blocks, so
requests that share hash ids share a real prompt prefix).

Every source yields `Draft`s; `RequestPolicy.finalize` turns one into a
`RequestSpec` with the TTFT target, caps, model and budget applied uniformly.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from loadgen.tokens import TokenCounter
from loadgen.traces import MOONCAKE_BLOCK_TOKENS, TraceRow

PROMPT_SET_FILES = {
    "alpaca": "alpaca_5000_random.json",
    "hotpotqa": "hotpotqa_dev_distractor_hard_500.jsonl",
    "govreport": "leval_govreport_summ_14.jsonl",
    "writingprompts": "writingprompts_train498_with_gpt4.csv",
    "aime": "aime2024_30.jsonl",
}
# The four task shapes of the latency-aware routing paper, equal shares.
DEFAULT_MIX = {"alpaca": 0.25, "hotpotqa": 0.25, "govreport": 0.25, "writingprompts": 0.25}
MIN_OUTPUT_TOKENS = 4  # as `vllm bench serve` drops shorter references: TPOT needs >= 2

# TTFT target rule of the latency-aware routing (SFS) paper.
PAPER_SLO_BASE_MS = 158.0
PAPER_SLO_PER_TOKEN_MS = 3.5e-3
PAPER_SLO_MIN_MS = 150.0
PAPER_SLO_MAX_MS = 1120.0


def paper_slo_ttft_ms(prompt_tokens: int) -> float:
    """158 ms + 3.5e-3 ms per prompt token, clipped to [150, 1120] ms."""
    raw = PAPER_SLO_BASE_MS + PAPER_SLO_PER_TOKEN_MS * prompt_tokens
    return min(max(raw, PAPER_SLO_MIN_MS), PAPER_SLO_MAX_MS)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a prompt set."""

    task: str
    text: str
    reference: str  # the set's reference answer (sets the output length)


@dataclass(frozen=True, slots=True)
class Draft:
    """A request before policy: text and lengths."""

    task: str
    text: str
    input_tokens: int  # estimated (or the trace's, after caps)
    output_tokens: int  # wanted output length (sent as max_tokens)
    messages: list[dict[str, Any]] | None = None  # JSONL chat messages, used verbatim
    model: str | None = None  # per-request override (JSONL)
    slo_ttft_ms: float | None = None  # per-request override (JSONL)
    budget: float | None = None  # per-request override (JSONL)
    label: str = ""  # trace label (BurstGPT model)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """Everything needed to send one request."""

    index: int
    task: str
    text: str
    input_tokens: int  # estimated prompt tokens (for the SLO rule and reports)
    max_tokens: int
    model: str
    slo_ttft_ms: float | None
    budget: float | None
    messages: list[dict[str, Any]] | None = None
    label: str = ""


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """Per-request settings applied to every draft."""

    model: str
    slo_mode: str = "paper"  # "paper" | "fixed" | "none"
    slo_fixed_ms: float | None = None
    budget: float | None = None  # cost budget per request, sent as a header
    max_tokens: int | None = None  # override every request's output length
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def finalize(self, index: int, draft: Draft, counter: TokenCounter) -> RequestSpec:
        """Apply caps, the TTFT target, model and budget."""
        text, input_tokens = draft.text, draft.input_tokens
        if (
            draft.messages is None
            and self.max_input_tokens is not None
            and input_tokens > self.max_input_tokens
        ):
            text = counter.cut(text, self.max_input_tokens)
            input_tokens = self.max_input_tokens
        max_tokens = self.max_tokens if self.max_tokens is not None else draft.output_tokens
        if self.max_output_tokens is not None:
            max_tokens = min(max_tokens, self.max_output_tokens)
        slo = draft.slo_ttft_ms
        if slo is None and self.slo_mode == "fixed":
            slo = self.slo_fixed_ms
        elif slo is None and self.slo_mode == "paper":
            slo = paper_slo_ttft_ms(input_tokens)
        return RequestSpec(
            index=index,
            task=draft.task,
            text=text,
            input_tokens=input_tokens,
            max_tokens=max(1, max_tokens),
            model=draft.model or self.model,
            slo_ttft_ms=slo,
            budget=draft.budget if draft.budget is not None else self.budget,
            messages=draft.messages,
            label=draft.label,
        )


class Workload(Protocol):
    """An endless source of drafts."""

    def drafts(self) -> Iterator[Draft]: ...


# -- prompt sets ---------------------------------------------------------------


def load_prompt_set(name: str, data_dir: Path) -> list[Prompt]:
    """Read one of the shared prompt sets as chat prompts."""
    if name not in PROMPT_SET_FILES:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {list(PROMPT_SET_FILES)}")
    path = data_dir / "prompts" / PROMPT_SET_FILES[name]
    if name == "alpaca":
        return [
            Prompt(
                name, r["instruction"] + (f"\n\n{r['input']}" if r["input"] else ""), r["output"]
            )
            for r in json.loads(path.read_text())
        ]
    if name == "writingprompts":
        csv.field_size_limit(sys.maxsize)
        with path.open(newline="") as f:
            return [
                Prompt(
                    name, f"Write a story for this prompt: {r['prompt'].strip()}", r["completion"]
                )
                for r in csv.DictReader(f)
            ]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if name == "hotpotqa":
        return [Prompt(name, _hotpotqa_text(r), r["answer"]) for r in rows]
    if name == "govreport":
        return [
            Prompt(name, f"{r['instructions'][0]}\n\n{r['input']}", r["outputs"][0]) for r in rows
        ]
    return [Prompt(name, r["problem"], r["solution"]) for r in rows]  # aime


def _hotpotqa_text(row: dict[str, Any]) -> str:
    paragraphs = "\n\n".join(f"{title}: {' '.join(sents)}" for title, sents in row["context"])
    return (
        "Answer the question using the paragraphs below.\n\n"
        f"{paragraphs}\n\nQuestion: {row['question']}\nAnswer:"
    )


class PromptSetWorkload:
    """Prompts of one or more sets; the task of each request drawn by share."""

    def __init__(
        self,
        sets: dict[str, list[Prompt]],
        shares: dict[str, float],
        counter: TokenCounter,
        rng: np.random.Generator,
    ) -> None:
        assert sets and set(shares) == set(sets), "every set needs a share"
        self._sets = sets
        self._tasks = list(shares)
        weights = np.array([shares[t] for t in self._tasks], dtype=float)
        assert (weights > 0).all(), "shares must be positive"
        self._probs = weights / weights.sum()
        self._counter = counter
        self._rng = rng

    def drafts(self) -> Iterator[Draft]:
        orders = {t: self._rng.permutation(len(p)) for t, p in self._sets.items()}
        cursors = dict.fromkeys(self._sets, 0)
        lengths: dict[tuple[str, int], tuple[int, int]] = {}
        while True:
            task = self._tasks[int(self._rng.choice(len(self._tasks), p=self._probs))]
            order = orders[task]
            index = int(order[cursors[task] % len(order)])
            cursors[task] += 1
            prompt = self._sets[task][index]
            if (task, index) not in lengths:  # count each prompt once
                lengths[(task, index)] = (
                    self._counter.count(prompt.text),
                    max(MIN_OUTPUT_TOKENS, self._counter.count(prompt.reference)),
                )
            num_in, num_out = lengths[(task, index)]
            yield Draft(task=task, text=prompt.text, input_tokens=num_in, output_tokens=num_out)


def parse_mix(spec: str | None) -> dict[str, float]:
    """`alpaca:0.4,hotpotqa:0.6` -> shares; None -> the paper's four tasks, equal."""
    if not spec:
        return dict(DEFAULT_MIX)
    shares: dict[str, float] = {}
    for part in spec.split(","):
        name, _, share = part.partition(":")
        shares[name.strip()] = float(share) if share else 1.0
    return shares


# -- text built to a length ----------------------------------------------------


BLOCK_STRIDE_UNITS = 104_729  # a prime: block texts start far apart in the corpus


class TextCorpus:
    """A prompt set as one long run of units (words or token ids), cut into prompts."""

    def __init__(self, prompts: Sequence[Prompt], counter: TokenCounter, seed: int) -> None:
        order = np.random.default_rng(seed).permutation(len(prompts))
        self.units = counter.units([prompts[int(i)].text for i in order])
        assert self.units, "empty corpus"
        self._counter = counter

    def take(self, start: int, num_units: int) -> list[Any]:
        """num_units units from `start`, wrapping around."""
        n = len(self.units)
        start %= n
        if start + num_units <= n:
            return self.units[start : start + num_units]
        out = self.units[start:]
        while len(out) < num_units:
            out.extend(self.units[: num_units - len(out)])
        return out

    def text_of(self, num_tokens: int, start: int) -> str:
        """Text of num_tokens tokens (approximately, without a tokenizer)."""
        return self._counter.render(self.take(start, self._counter.units_for(num_tokens)))

    def text_of_blocks(self, hash_ids: Sequence[int], block_tokens: int, num_tokens: int) -> str:
        """Per-hash-id blocks (same id, same text) in order, cut to num_tokens."""
        per_block = self._counter.units_for(block_tokens)
        units: list[Any] = []
        for h in hash_ids:
            units.extend(self.take(h * BLOCK_STRIDE_UNITS, per_block))
        return self._counter.render(units[: self._counter.units_for(num_tokens)])


class RandomWorkload:
    """Random lengths (uniform in len*(1 -/+ range_ratio)), text from a corpus."""

    def __init__(
        self,
        corpus: TextCorpus,
        input_len: int,
        output_len: int,
        range_ratio: float,
        rng: np.random.Generator,
    ) -> None:
        assert 0.0 <= range_ratio < 1.0
        self._corpus = corpus
        self._input = (input_len, range_ratio)
        self._output = (output_len, range_ratio)
        self._rng = rng

    def _length(self, mean_and_ratio: tuple[int, float]) -> int:
        mean, ratio = mean_and_ratio
        low, high = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
        return max(1, int(self._rng.integers(low, high + 1)))

    def drafts(self) -> Iterator[Draft]:
        while True:
            num_in = self._length(self._input)
            start = int(self._rng.integers(len(self._corpus.units)))
            yield Draft(
                "random", self._corpus.text_of(num_in, start), num_in, self._length(self._output)
            )


class TraceWorkload:
    """A trace's rows in order: prompts built to each row's input length."""

    def __init__(
        self, rows: Sequence[TraceRow], corpus: TextCorpus, task: str, rng: np.random.Generator
    ) -> None:
        self._rows = rows
        self._corpus = corpus
        self._task = task
        self._rng = rng

    def drafts(self) -> Iterator[Draft]:
        for row in self._rows:
            if row.hash_ids:
                text = self._corpus.text_of_blocks(
                    row.hash_ids, MOONCAKE_BLOCK_TOKENS, row.input_tokens
                )
            else:
                start = int(self._rng.integers(len(self._corpus.units)))
                text = self._corpus.text_of(row.input_tokens, start)
            yield Draft(self._task, text, row.input_tokens, row.output_tokens, label=row.label)


@dataclass(slots=True)
class JsonlWorkload:
    """Prompts from a JSONL file, cycled in order.

    Each line: `prompt` (text) or `messages` (chat list, sent verbatim); optional
    `max_tokens`, `task`, `model`, `slo_ttft_ms`, `budget`.
    """

    path: Path
    counter: TokenCounter
    default_max_tokens: int = 128

    def drafts(self) -> Iterator[Draft]:
        rows = [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]
        if not rows:
            raise ValueError(f"{self.path}: no prompts")
        while True:
            for r in rows:
                messages = r.get("messages")
                text = r.get("prompt") or "\n".join(
                    str(m.get("content", "")) for m in messages or []
                )
                yield Draft(
                    task=str(r.get("task", "jsonl")),
                    text=text,
                    input_tokens=self.counter.count(text),
                    output_tokens=int(r.get("max_tokens", self.default_max_tokens)),
                    messages=messages,
                    model=r.get("model"),
                    slo_ttft_ms=r.get("slo_ttft_ms"),
                    budget=r.get("budget"),
                )
