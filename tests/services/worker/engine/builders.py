"""Random tiny Llama-shaped models (fp32, built in well under a second) and engines
over them."""

from __future__ import annotations

from typing import Any

import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.loader import build_model, random_config, random_state_dict
from services.worker.engine.model import CausalLM
from shared.scheduling.scheduler import SchedulerConfig


def random_model(seed: int, device: str = "cpu", **config: Any) -> CausalLM:
    """Random weights (`seed`) for random_config with 2 layers unless `config` says."""
    cfg = random_config(**{"num_hidden_layers": 2, **config})
    return build_model(cfg, random_state_dict(cfg, seed=seed), torch.float32, torch.device(device))


def engine_config(device: str = "cpu", **limits: int) -> EngineConfig:
    """fp32 on `device`; 64 KV blocks and 256 tokens of context unless `limits` say."""
    scheduler = SchedulerConfig(**{"num_kv_blocks": 64, "max_model_len": 256, **limits})
    return EngineConfig(dtype="float32", device=device, scheduler=scheduler)


def random_engine(seed: int, **limits: int) -> LLMEngine:
    """An engine (engine_config) over random_model(seed) on the CPU."""
    return LLMEngine(engine_config("cpu", **limits), random_model(seed))
