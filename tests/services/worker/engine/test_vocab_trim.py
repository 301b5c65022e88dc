"""Trimmed-vocabulary LM heads (a delta's `vocab_keep`): logits only for the kept ids,
TRIMMED_LOGIT elsewhere, EOS always kept, and an engine that only ever emits kept
tokens; models without a trimmed head are unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu_kernels import can_pack, fp16_weights_supported
from services.worker.engine.delta import apply_delta, read_delta, save_delta
from services.worker.engine.engine import LLMEngine
from services.worker.engine.loader import build_model, random_config, random_state_dict
from services.worker.engine.model import VOCAB_KEEP_KEY, CausalLM
from services.worker.engine.outputs import TRIMMED_LOGIT, StepLogits, StepOutputs
from services.worker.engine.sampler import ARGMAX_CHUNK, first_argmax, greedy_tokens
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig

VOCAB, EOS = 512, 2
# Every third id from 30 on: excludes EOS (2), which the model must add back.
KEEP = torch.arange(30, VOCAB, 3, dtype=torch.int32)
PROMPTS = [[5, 9, 14, 200], list(range(30, 90)), [7]]


def tiny(
    dtype: torch.dtype = torch.float32, keep: torch.Tensor | None = None, tied: bool = False
) -> CausalLM:
    """A random 2-layer model, optionally with a trimmed head via the state dict."""
    cfg = random_config(
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    state = random_state_dict(cfg, seed=3)
    if keep is not None:
        state[VOCAB_KEEP_KEY] = keep
    return build_model(cfg, state, dtype, torch.device("cpu"))


def engine_for(model: CausalLM, dtype: str) -> LLMEngine:
    config = EngineConfig(
        model="random-tiny",
        dtype=dtype,
        scheduler=SchedulerConfig(num_kv_blocks=64, max_model_len=256),
    )
    return LLMEngine(config, model)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_outside_the_kept_set_are_floored_and_eos_is_kept(tied: bool) -> None:
    full, trimmed = tiny(tied=tied), tiny(keep=KEEP, tied=tied)
    assert (trimmed.lm_head is None) == tied
    assert trimmed.vocab_keep is not None
    expected_keep = torch.cat([torch.tensor([EOS]), KEEP.long()])
    assert torch.equal(trimmed.vocab_keep, expected_keep)
    hidden = torch.randn(5, full.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ref, got = full.compute_logits(hidden), trimmed.compute_logits(hidden)
    assert got.shape == ref.shape == (5, VOCAB) and got.dtype == torch.float32
    kept = torch.zeros(VOCAB, dtype=torch.bool)
    kept[expected_keep] = True
    assert bool((got[:, ~kept] == TRIMMED_LOGIT).all())
    torch.testing.assert_close(got[:, kept], ref[:, kept])
    # Softmax gives the dropped ids exactly 0, and entropy-style reads stay finite.
    probs = torch.softmax(got, dim=-1)
    assert bool((probs[:, ~kept] == 0).all())
    logp = torch.log_softmax(got, dim=-1)
    assert bool(torch.isfinite((logp.exp() * logp).sum(-1)).all())


def test_a_model_without_trimmed_head_is_unchanged() -> None:
    model = tiny()
    assert model.vocab_keep is None and model.kept_head is None
    assert VOCAB_KEEP_KEY not in model.hf_state_dict()
    hidden = torch.randn(3, model.config.hidden_size)
    weight = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    assert torch.equal(model.compute_logits(hidden), torch.nn.functional.linear(hidden, weight))


def test_hf_state_dict_stays_plain_hf_and_round_trips_with_the_kept_ids() -> None:
    model = tiny(keep=KEEP)
    assert model.vocab_keep is not None
    state = model.hf_state_dict()
    assert VOCAB_KEEP_KEY not in state  # HF twins load it as is
    again = build_model(
        model.config,
        {**state, VOCAB_KEEP_KEY: model.vocab_keep},
        torch.float32,
        torch.device("cpu"),
    )
    assert again.vocab_keep is not None
    assert torch.equal(again.vocab_keep, model.vocab_keep)


def test_bad_kept_ids_are_rejected() -> None:
    model = tiny()
    with pytest.raises(ValueError, match="lie in"):
        model.set_vocab_keep(torch.tensor([1, VOCAB]))
    with pytest.raises(ValueError, match="integer"):
        model.set_vocab_keep(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_generates_only_kept_tokens(dtype: str) -> None:
    model = tiny(getattr(torch, dtype), keep=KEEP)
    if dtype == "bfloat16" and can_pack(torch.device("cpu"), torch.bfloat16):
        assert model.pack_for_cpu(batch_hint=8)
    engine = engine_for(model, dtype)
    allowed = set(KEEP.tolist()) | {EOS}
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    hot = SamplingParams(max_tokens=20, temperature=1.5, seed=1, ignore_eos=True)
    for params in (greedy, hot):
        for out in engine.generate(PROMPTS, params):
            assert len(out) == 20 and set(out) <= allowed


@pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)
def test_packed_trimmed_head_matches_the_plain_one() -> None:
    plain, packed = tiny(torch.bfloat16, keep=KEEP), tiny(torch.bfloat16, keep=KEEP)
    assert packed.pack_for_cpu(batch_hint=8)
    hidden = torch.randn(7, plain.config.hidden_size).bfloat16()
    assert torch.equal(plain.compute_logits(hidden), packed.compute_logits(hidden))


@pytest.mark.skipif(not fp16_weights_supported(), reason="no fbgemm fp16 GEMM on this CPU")
def test_fp16_weight_trimmed_head_packs_only_the_kept_rows() -> None:
    """fp16 weights for a trimmed head: the kept rows, rounded to fp16, in fp32
    arithmetic; dropped ids keep the trimmed floor."""
    plain, packed = tiny(torch.float32, keep=KEEP), tiny(torch.float32, keep=KEEP)
    assert packed.pack_for_cpu(batch_hint=8, fp16_weights=True)
    assert packed.packed_head is not None and packed.packed_head.out_features == KEEP.numel() + 1
    hidden = torch.randn(7, plain.config.hidden_size)
    got, want = packed.compute_logits(hidden), plain.compute_logits(hidden)
    kept = plain.vocab_keep
    assert kept is not None and plain.kept_head is not None
    rounded = torch.nn.functional.linear(hidden, plain.kept_head.half().float())
    torch.testing.assert_close(got[:, kept], rounded, rtol=1e-5, atol=1e-5)
    dropped = torch.ones(VOCAB, dtype=torch.bool)
    dropped[kept] = False
    assert torch.equal(got[:, dropped], want[:, dropped])


def test_a_delta_with_vocab_keep_serves_a_trimmed_head(tmp_path: Path) -> None:
    cfg = random_config(vocab_size=VOCAB, eos_token_ids=(EOS,), num_hidden_layers=3)
    base = random_state_dict(cfg, seed=4)
    path = tmp_path / "student.safetensors"
    save_delta(path, [0, 2], {}, {}, "trimmed", vocab_keep=KEEP.flip(0))
    state = apply_delta(base, read_delta(path))
    model = build_model(
        random_config(vocab_size=VOCAB, eos_token_ids=(EOS,), num_hidden_layers=2),
        state,
        torch.float32,
        torch.device("cpu"),
    )
    assert model.vocab_keep is not None
    assert set(model.vocab_keep.tolist()) == set(KEEP.tolist()) | {EOS}
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for out in engine_for(model, "float32").generate(PROMPTS, greedy):
        assert set(out) <= set(KEEP.tolist()) | {EOS}


def test_an_old_delta_without_vocab_keep_serves_the_full_head(tmp_path: Path) -> None:
    cfg = random_config(vocab_size=VOCAB, eos_token_ids=(EOS,), num_hidden_layers=3)
    base = random_state_dict(cfg, seed=4)
    path = tmp_path / "old.safetensors"
    save_delta(path, [0, 2], {}, {}, "old")
    state = apply_delta(base, read_delta(path))
    assert VOCAB_KEEP_KEY not in state
    model = build_model(
        random_config(vocab_size=VOCAB, eos_token_ids=(EOS,), num_hidden_layers=2),
        state,
        torch.float32,
        torch.device("cpu"),
    )
    assert model.vocab_keep is None
    logits = model.compute_logits(torch.randn(2, cfg.hidden_size))
    assert bool((logits != TRIMMED_LOGIT).all())


def test_greedy_tokens_need_no_full_rows_and_keep_argmax_ties() -> None:
    keep = torch.tensor([3, 7, 8, 20, 40])
    rows = torch.tensor(
        [
            [0.5, 2.0, 2.0, -1.0, 2.0],  # a three-way tie: the lowest token id wins
            [-3.0, -2.0, -9.0, -1.5, -7.0],  # all negative, still above TRIMMED_LOGIT
        ]
    )
    step = StepLogits(rows, keep, vocab_size=64)
    assert greedy_tokens(step) == [7, 20]
    assert not step.is_spread  # greedy spread nothing over the vocabulary
    full = step.full()
    assert full.shape == (2, 64) and greedy_tokens(step) == full.argmax(-1).tolist()
    assert full[0, 7] == 2.0 and full[0, 0] == TRIMMED_LOGIT
    assert step.full() is full  # built once


@pytest.mark.parametrize(
    "width", [5, ARGMAX_CHUNK - 1, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 12290, 49152]
)
def test_first_argmax_is_argmax_with_its_tie_rule(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    rows = torch.randn(16, width, generator=g)
    assert torch.equal(first_argmax(rows), rows.argmax(-1))
    # Few distinct values: the max is repeated across chunks; the first one wins.
    ties = torch.randint(0, 3, (16, width), generator=g).float()
    assert torch.equal(first_argmax(ties), ties.argmax(-1))
    # The max only in the short last chunk, or only at the very first column.
    edge = torch.full((2, width), TRIMMED_LOGIT)
    edge[0, -1], edge[1, 0] = 1.0, 1.0
    assert first_argmax(edge).tolist() == [width - 1, 0]
    assert torch.equal(first_argmax(rows.t().contiguous().t()), rows.argmax(-1))  # strided
    # The max tied only in two later chunks (past the first): the earlier one wins.
    tied = torch.zeros(1, width)
    a, b = min(width - 2, ARGMAX_CHUNK + 3), width - 1
    tied[0, a] = tied[0, b] = 5.0
    assert first_argmax(tied).tolist() == [a]
    # NaN is argmax's maximum (its first one wins); no rows at all is no indices.
    nan = rows[:2].clone()
    nan[0, width // 2] = nan[1, width - 1] = float("nan")
    nan[1, width // 3] = float("nan")
    assert first_argmax(nan).tolist() == nan.argmax(-1).tolist() == [width // 2, width // 3]
    assert first_argmax(torch.empty(0, width)).shape == (0,)


def test_hook_outputs_build_full_logits_only_when_read() -> None:
    step = StepLogits(torch.zeros(1, 2), torch.tensor([1, 5]), vocab_size=8)
    out = StepOutputs(["r"], [1], step, torch.zeros(1, 4))
    assert not step.is_spread
    assert out.logits.shape == (1, 8) and step.is_spread
