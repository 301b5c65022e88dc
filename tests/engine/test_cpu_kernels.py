"""Packed oneDNN linears: same outputs as F.linear, and an engine that packs its
weights generates the same tokens as one that does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu_kernels import PackedLinear, can_pack
from services.worker.engine.engine import LLMEngine
from shared.sampling import SamplingParams

needs_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_packed_linear_equals_f_linear_bitwise(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    assert torch.equal(PackedLinear(w, b, batch_hint=16)(x), F.linear(x, w, b))
    assert torch.equal(PackedLinear(w, None, batch_hint=4)(x), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_packed_fp32_linear_matches_f_linear(rows: int) -> None:
    """fp32 packs too (sgemm re-packs the weight inside every call): one row takes
    the plain weight (bitwise equal), more rows oneDNN's packed one (another
    summation order: equal within fp32 rounding)."""
    assert can_pack(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    got, want = PackedLinear(w, b, batch_hint=16, keep_plain=True)(x), F.linear(x, w, b)
    if rows == 1:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def tiny_engine(dtype: str, pack: bool) -> LLMEngine:
    engine = LLMEngine.create(
        EngineConfig(
            model="random-tiny", dtype=dtype, num_kv_blocks=64, max_model_len=256, pack_weights=pack
        )
    )
    assert (engine.model.packed_head is not None) == pack
    return engine


def test_packed_fp32_engine_generates_the_same_tokens() -> None:
    """The served fp32 engine (packed) against the exactness reference (plain):
    same greedy tokens, log-probabilities equal within fp32 rounding."""
    prompts = [[5, 9, 14, 200], list(range(30, 90)), [7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = []
    for pack in (False, True):
        engine = tiny_engine("float32", pack)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
        outs.append((tokens, logprobs))
    assert outs[0][0] == outs[1][0]
    for rid in outs[0][1]:
        torch.testing.assert_close(
            torch.tensor(outs[1][1][rid]), torch.tensor(outs[0][1][rid]), rtol=1e-4, atol=1e-4
        )


@needs_packing
def test_packed_engine_generates_the_same_tokens() -> None:
    prompts = [[5, 9, 14, 200], list(range(30, 90)), [7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers = [tiny_engine("bfloat16", pack).generate(prompts, params) for pack in (False, True)]
    assert answers[0] == answers[1]
