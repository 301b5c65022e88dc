"""An HF transformers model holding exactly our weights: the reference for exactness
tests and the anchor in engine benchmarks. Needs the `transformers` package (dev extra)."""

from __future__ import annotations

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
