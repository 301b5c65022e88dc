"""Shared builders for engine tests: random tiny models, SmolLM2, HF twins."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def hf_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The HF transformers model with exactly our weights (fp32), for exactness checks."""
    from services.worker.engine.hf_twin import build_hf_twin

    return build_hf_twin(model)  # type: ignore[arg-type]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's own forward with its KV cache, argmax each step, EOS not special."""
    from services.worker.engine.hf_twin import cache_kwarg, returned_cache

    out: list[int] = []
    kwarg = cache_kwarg(hf)
    with torch.inference_mode():
        res = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            res = hf(torch.tensor([[tok]]), use_cache=True, **{kwarg: returned_cache(res)})
    return out


@pytest.fixture(scope="session")
def smollm2_state() -> tuple[object, dict[str, torch.Tensor]]:
    from services.worker.engine.loader import load_gguf
    from shared.model_store import smollm2_gguf_path

    return load_gguf(smollm2_gguf_path())
