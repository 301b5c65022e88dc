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


def test_fp32_is_never_packed() -> None:
    assert not can_pack(torch.device("cpu"), torch.float32)


@needs_packing
def test_packed_engine_generates_the_same_tokens() -> None:
    prompts = [[5, 9, 14, 200], list(range(30, 90)), [7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers = []
    for pack in (False, True):
        engine = LLMEngine.create(
            EngineConfig(
                model="random-tiny",
                dtype="bfloat16",
                num_kv_blocks=64,
                max_model_len=256,
                pack_weights=pack,
            )
        )
        assert (engine.model.packed_head is not None) == pack
        answers.append(engine.generate(prompts, params))
    assert answers[0] == answers[1]
