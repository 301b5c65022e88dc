"""Workloads: prompt sets, mixes, built lengths, Mooncake prefixes, the TTFT target rule."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadgen.data import data_dir, has_files
from loadgen.tokens import WordCounter
from loadgen.traces import TraceRow
from loadgen.workloads import (
    PROMPT_SET_FILES,
    Draft,
    JsonlWorkload,
    Prompt,
    PromptSetWorkload,
    RequestPolicy,
    TextCorpus,
    TraceWorkload,
    load_prompt_set,
    paper_slo_ttft_ms,
    parse_mix,
)

HAS_DATA = has_files(*(f"prompts/{name}" for name in PROMPT_SET_FILES.values()))
needs_data = pytest.mark.skipif(not HAS_DATA, reason="no data directory (`just data`)")


def test_paper_slo_rule() -> None:
    assert paper_slo_ttft_ms(0) == pytest.approx(158.0)
    assert paper_slo_ttft_ms(1000) == pytest.approx(161.5)
    assert paper_slo_ttft_ms(10_000_000) == 1120.0


def test_policy_applies_caps_slo_model_and_budget() -> None:
    counter = WordCounter()
    draft = Draft("alpaca", " ".join(["word"] * 100), counter.count(" ".join(["word"] * 100)), 300)
    policy = RequestPolicy(
        model="auto", slo_mode="paper", budget=0.01, max_input_tokens=26, max_output_tokens=64
    )
    spec = policy.finalize(3, draft, counter)
    assert spec.index == 3 and spec.model == "auto" and spec.budget == 0.01
    assert spec.input_tokens == 26 and len(spec.text.split()) == counter.units_for(26)
    assert spec.max_tokens == 64
    assert spec.slo_ttft_ms == pytest.approx(158.0 + 3.5e-3 * 26)
    fixed = RequestPolicy(model="m", slo_mode="fixed", slo_fixed_ms=250.0).finalize(
        0, draft, counter
    )
    assert fixed.slo_ttft_ms == 250.0
    assert RequestPolicy(model="m", slo_mode="none").finalize(0, draft, counter).slo_ttft_ms is None


@needs_data
@pytest.mark.parametrize("name", list(PROMPT_SET_FILES))
def test_every_prompt_set_loads_as_text_with_references(name: str) -> None:
    prompts = load_prompt_set(name, data_dir())
    assert len(prompts) >= 14
    assert all(p.task == name and p.text.strip() for p in prompts)
    assert sum(bool(p.reference.strip()) for p in prompts) >= 0.99 * len(prompts)


@needs_data
def test_task_shapes_differ_as_the_paper_says() -> None:
    counter = WordCounter()

    def mean_len(name: str) -> float:
        return float(np.mean([counter.count(p.text) for p in load_prompt_set(name, data_dir())]))

    assert mean_len("govreport") > mean_len("hotpotqa") > 10 * mean_len("alpaca")


@needs_data
def test_mixed_workload_follows_the_shares() -> None:
    shares = parse_mix("alpaca:3,aime:1")
    sets = {t: load_prompt_set(t, data_dir()) for t in shares}
    workload = PromptSetWorkload(sets, shares, WordCounter(), np.random.default_rng(0))
    tasks = Counter(d.task for d in itertools.islice(workload.drafts(), 4000))
    assert tasks["alpaca"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_default_mix_is_the_four_paper_tasks() -> None:
    assert parse_mix(None) == {
        "alpaca": 0.25,
        "hotpotqa": 0.25,
        "govreport": 0.25,
        "writingprompts": 0.25,
    }


def _corpus_prompts() -> list[Prompt]:
    words = [f"w{i}" for i in range(5000)]
    return [Prompt("t", " ".join(words[i : i + 100]), "r") for i in range(0, 5000, 100)]


def _corpus() -> TextCorpus:
    return TextCorpus(_corpus_prompts(), WordCounter(), seed=0)


def test_trace_prompts_are_built_to_the_trace_length() -> None:
    rows = [TraceRow(0.0, 650, 20), TraceRow(1.0, 13, 5)]
    drafts = list(TraceWorkload(rows, _corpus(), "trace-azure", np.random.default_rng(0)).drafts())
    counter = WordCounter()
    assert [len(d.text.split()) for d in drafts] == [counter.units_for(650), counter.units_for(13)]
    assert [d.output_tokens for d in drafts] == [20, 5]


def test_mooncake_blocks_share_real_prefixes() -> None:
    rows = [TraceRow(0.0, 1300, 5, hash_ids=(7, 8, 9)), TraceRow(0.5, 1300, 5, hash_ids=(7, 8, 11))]
    a, b = (
        d.text.split()
        for d in TraceWorkload(rows, _corpus(), "t", np.random.default_rng(0)).drafts()
    )
    per_block = WordCounter().units_for(512)
    assert a[: 2 * per_block] == b[: 2 * per_block]
    assert a[2 * per_block :] != b[2 * per_block :]


def test_jsonl_workload(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 7, "task": "greet", "slo_ttft_ms": 300},
        {"messages": [{"role": "user", "content": "hi"}], "model": "r2r"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    a, b, c = itertools.islice(JsonlWorkload(path, WordCounter()).drafts(), 3)
    assert (a.task, a.output_tokens, a.slo_ttft_ms) == ("greet", 7, 300)
    assert b.messages == [{"role": "user", "content": "hi"}] and b.model == "r2r"
    assert c.text == "hello there"  # cycles


def test_tokenizer_counter_is_exact(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from loadgen.tokens import create_token_counter

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(5000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = create_token_counter(str(tmp_path))
    corpus = TextCorpus(_corpus_prompts(), counter, seed=0)
    assert counter.count(corpus.text_of(123, start=7)) == 123
    with pytest.raises(ValueError):
        create_token_counter(str(tmp_path / "missing"))
