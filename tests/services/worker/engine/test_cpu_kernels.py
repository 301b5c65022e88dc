"""Packed oneDNN linears: same outputs as F.linear, and an engine that packs its
weights generates the same tokens as one that does not. fp16 weights (fbgemm): fp32
arithmetic on fp16-rounded weights, so an engine holding them generates what a plain
fp32 engine on the rounded weights does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine import config as engine_config
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu_kernels import (
    Fp16WeightLinear,
    PackedLinear,
    can_pack,
    fp16_weights_supported,
)
from services.worker.engine.engine import LLMEngine
from services.worker.engine.model import CausalLM
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig

needs_packing = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)
needs_fp16_weights = pytest.mark.skipif(
    not fp16_weights_supported(), reason="no fbgemm fp16 GEMM on this CPU"
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


def tiny_config(dtype: str, pack: bool, weight_dtype: str = "same") -> EngineConfig:
    return EngineConfig(
        model="random-tiny",
        dtype=dtype,
        weight_dtype=weight_dtype,
        pack_weights=pack,
        scheduler=SchedulerConfig(num_kv_blocks=64, max_model_len=256),
    )


def tiny_engine(dtype: str, pack: bool, weight_dtype: str = "same") -> LLMEngine:
    engine = LLMEngine.create(tiny_config(dtype, pack, weight_dtype))
    assert (engine.model.packed_head is not None) == pack
    return engine


PROMPTS = [[5, 9, 14, 200], list(range(30, 90)), [7]]


def greedy_run(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Greedy tokens and their log-probabilities for PROMPTS, batched."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    return tokens, logprobs


def assert_same_answers(
    a: tuple[dict[str, list[int]], dict[str, list[float]]],
    b: tuple[dict[str, list[int]], dict[str, list[float]]],
) -> None:
    """Same greedy tokens, log-probabilities equal within fp32 rounding."""
    assert a[0] == b[0]
    assert set(a[1]) == set(b[1]) == {f"r{i}" for i in range(len(PROMPTS))}
    for rid in a[1]:
        torch.testing.assert_close(
            torch.tensor(b[1][rid]), torch.tensor(a[1][rid]), rtol=1e-4, atol=1e-4
        )


def test_packed_fp32_engine_generates_the_same_tokens() -> None:
    """The served fp32 engine (packed) against the exactness reference (plain)."""
    assert_same_answers(
        greedy_run(tiny_engine("float32", False)), greedy_run(tiny_engine("float32", True))
    )


@needs_fp16_weights
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_fp16_weight_linear_is_fp32_arithmetic_on_rounded_weights(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    got = Fp16WeightLinear(w, b)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, w.half().float(), b), rtol=1e-5, atol=1e-5)
    # and the rounding is what it costs against the fp32 weights (not nothing, small)
    assert not torch.equal(got, F.linear(x, w, b))
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-2, atol=1e-2)
    # a column slice (the MLP's halves are views) reads as its contiguous copy
    wide = torch.randn(rows, 128, generator=gen)
    torch.testing.assert_close(
        Fp16WeightLinear(w, None)(wide[:, :64]),
        Fp16WeightLinear(w, None)(wide[:, :64].contiguous()),
    )


@needs_fp16_weights
def test_fp16_weight_linear_takes_any_leading_shape() -> None:
    """fbgemm takes 2-D inputs with rows only; a vector, a 3-D batch and an empty
    batch come back shaped like F.linear's."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen)
    lin, ref = Fp16WeightLinear(w, None), w.half().float()
    for x in (torch.randn(64, generator=gen), torch.randn(2, 3, 64, generator=gen)):
        torch.testing.assert_close(lin(x), F.linear(x, ref), rtol=1e-5, atol=1e-5)
    assert lin(torch.empty(0, 64)).shape == (0, 96)


def _round_weights_to_fp16(model: CausalLM) -> None:
    """The plain model's reference for fp16 weights: every linear's weight and the LM
    head rounded to fp16 (the embedding table keeps fp32, as the engine's does)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.half().float())
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    rounded = nn.Linear(head.shape[1], head.shape[0], bias=False)
    with torch.no_grad():
        rounded.weight.copy_(head.half().float())
    model.packed_head = rounded  # head_logits takes this head first


@needs_fp16_weights
def test_fp16_weights_engine_equals_plain_engine_on_rounded_weights() -> None:
    served = tiny_engine("float32", True, weight_dtype="float16")
    assert served.config.fp16_weights
    assert isinstance(served.model.packed_head, Fp16WeightLinear)
    layer = served.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp16WeightLinear)
    assert isinstance(layer.mlp.down_proj, Fp16WeightLinear)
    reference = tiny_engine("float32", False)
    _round_weights_to_fp16(reference.model)
    assert_same_answers(greedy_run(reference), greedy_run(served))


@pytest.mark.parametrize("supported", [True, False])
def test_weight_dtype_resolution_and_errors(
    supported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto: fp16 weights for packed fp32 on a CPU with fbgemm, else the compute
    dtype; float16 refused, with the reason, wherever it cannot run."""
    monkeypatch.setattr(engine_config, "fp16_weights_supported", lambda: supported)
    fp16_if = "float16" if supported else "float32"
    assert tiny_config("float32", True, "auto").resolved_weight_dtype == fp16_if
    assert tiny_config("float32", True, "auto").fp16_weights == supported
    assert tiny_config("float32", False, "auto").resolved_weight_dtype == "float32"  # plain model
    assert tiny_config("float32", True, "same").resolved_weight_dtype == "float32"
    assert tiny_config("bfloat16", True, "auto").resolved_weight_dtype == "bfloat16"
    assert not tiny_config("bfloat16", True, "auto").fp16_weights
    with pytest.raises(ValueError, match="needs dtype float32"):
        tiny_config("bfloat16", True, "float16")
    with pytest.raises(ValueError, match="needs pack_weights"):
        tiny_config("float32", False, "float16")
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        tiny_config("float32", True, "int4")
    if supported:
        assert tiny_config("float32", True, "float16").fp16_weights
    else:
        with pytest.raises(ValueError, match="needs fbgemm"):
            tiny_config("float32", True, "float16")
    env = EngineConfig().with_env({"BATON_WEIGHT_DTYPE": "same", "BATON_DTYPE": "float32"})
    assert (env.dtype, env.weight_dtype) == ("float32", "same")


@needs_packing
def test_packed_engine_generates_the_same_tokens() -> None:
    prompts = [[5, 9, 14, 200], list(range(30, 90)), [7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers = [tiny_engine("bfloat16", pack).generate(prompts, params) for pack in (False, True)]
    assert answers[0] == answers[1]
