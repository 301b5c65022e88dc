"""Greedy tokens equal HF transformers' greedy tokens, alone and batched (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.loader import build_model, random_config, random_state_dict
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig
from tests.services.worker.engine.conftest import hf_greedy, hf_twin

NEW_TOKENS = 64


def make_engine(cfg, state, **limits) -> LLMEngine:  # type: ignore[no-untyped-def]
    model = build_model(cfg, dict(state), torch.float32, torch.device("cpu"))
    econf = EngineConfig(model="in-memory", dtype="float32", scheduler=SchedulerConfig(**limits))
    return LLMEngine(econf, model)


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], arrive_at: list[int], n: int
) -> list[list[int]]:
    """Requests join at given step numbers (mid-way arrivals); greedy, EOS ignored."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done: set[int] = set()
    step = 0
    while len(done) < len(prompts):
        for i, t in enumerate(arrive_at):
            if t == step:
                engine.add_request(f"r{i}", prompts[i], params)
        for o in engine.step():
            i = int(o.request_id[1:])
            outs[i].extend(o.new_token_ids)
            if o.finished:
                done.add(i)
        step += 1
    return [outs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("tied,qk_norm", [(False, False), (True, False), (False, True)])
def test_random_tiny_matches_hf_alone_and_batched(tied: bool, qk_norm: bool) -> None:
    cfg = random_config(tie_word_embeddings=tied, qk_norm=qk_norm, num_hidden_layers=3)
    state = random_state_dict(cfg, seed=7)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (5, 37, 90, 1, 200)]
    hf = hf_twin(build_model(cfg, dict(state), torch.float32, torch.device("cpu")))
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]

    alone = [run_staggered(make_engine(cfg, state), [p], [0], NEW_TOKENS)[0] for p in prompts]
    assert alone == expected
    # Batched, mid-way arrivals, a small budget so long prompts are chunked next to decodes.
    engine = make_engine(cfg, state, max_num_batched_tokens=48, num_kv_blocks=128)
    batched = run_staggered(engine, prompts, [0, 0, 3, 10, 17], NEW_TOKENS)
    assert batched == expected


def test_smollm2_matches_hf_alone_and_batched(smollm2_state) -> None:  # type: ignore[no-untyped-def]
    from shared.model_store import load_tokenizer

    cfg, state = smollm2_state
    tok = load_tokenizer("smollm2-135m")
    texts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue, and then list three colours.",
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    model = build_model(cfg, dict(state), torch.float32, torch.device("cpu"))
    hf = hf_twin(model)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    del hf

    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            dtype="float32",
            scheduler=SchedulerConfig(num_kv_blocks=64, max_model_len=1024),
        ),
        model,
    )
    alone = run_staggered(engine, prompts[:1], [0], NEW_TOKENS)
    assert alone[0] == expected[0]
    batched = run_staggered(engine, prompts, [0, 2, 5], NEW_TOKENS)
    assert batched == expected
    # The answer is English, not noise: the loader read real weights.
    assert "Paris" in tok.decode(expected[0])


def test_a_hand_built_prefill_plan_matches_hf_logits() -> None:
    """The model's forward driven without the runner, as the training and scoring scripts
    do (scripts/train_routers.py prefill_hidden): a plan that lists whole sequences and no
    decode rows attends every one of them, and the logits equal HF's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts"))
    from train_routers import Sequence, prefill_hidden

    cfg = random_config(num_hidden_layers=2)
    state = random_state_dict(cfg, seed=5)
    engine = make_engine(cfg, state)
    rng = random.Random(1)
    seqs = [Sequence([rng.randrange(3, cfg.vocab_size) for _ in range(n)], 1) for n in (9, 70)]
    hf = hf_twin(build_model(cfg, dict(state), torch.float32, torch.device("cpu")))
    with torch.inference_mode():
        hidden = prefill_hidden(engine, seqs)
        for s, h in zip(seqs, hidden, strict=True):
            ours = engine.model.compute_logits(h)
            theirs = hf(torch.tensor([s.ids])).logits[0]
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
