"""An HF transformers model holding exactly our weights: the reference for exactness
tests and the anchor in engine benchmarks. Needs the `transformers` package (dev extra)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from services.worker.engine.model import CausalLM


def build_hf_twin(model: CausalLM, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A HF *ForCausalLM with model's config and weights, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config
    hf_cfg = AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "sdpa"
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    state = {k: v.to(dtype) for k, v in model.hf_state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or any(m != "lm_head.weight" for m in missing):
        raise ValueError(f"HF twin mismatch: missing={missing} unexpected={unexpected}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def cache_kwarg(hf: torch.nn.Module) -> str:
    """The forward() keyword that takes the KV cache: `cache` in transformers 5.x, where
    `past_key_values` is deprecated (removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward() returned, under either name (see `cache_kwarg`)."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    return output.cache if "cache" in fields else output.past_key_values
