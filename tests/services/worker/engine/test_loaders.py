"""Checkpoints from disk: HF-format directories (Llama and Qwen3 shapes) and GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.hf_twin import build_hf_twin
from services.worker.engine.loader import build_model, load_hf_dir, random_config, random_state_dict
from shared.model_store import resolve
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_hf_directory_round_trip(tmp_path: Path, qk_norm: bool) -> None:
    cfg = random_config(qk_norm=qk_norm, tie_word_embeddings=qk_norm, head_dim=32)
    state = random_state_dict(cfg, seed=3)
    model = build_model(cfg, dict(state), torch.float32, torch.device("cpu"))
    build_hf_twin(model).save_pretrained(
        tmp_path
    )  # config.json + model.safetensors, as a hub checkpoint

    assert resolve(str(tmp_path)).kind == "hf"
    cfg2, _ = load_hf_dir(tmp_path)
    assert cfg2.qk_norm == qk_norm and cfg2.head_dim == 32
    assert cfg2.tie_word_embeddings == cfg.tie_word_embeddings
    engine = LLMEngine.create(  # fp32 weights: compared token for token with the plain model
        EngineConfig(
            model=str(tmp_path),
            dtype="float32",
            weight_dtype="same",
            scheduler=SchedulerConfig(num_kv_blocks=32, max_model_len=256),
        )
    )
    reference = LLMEngine(
        EngineConfig(
            dtype="float32",
            scheduler=SchedulerConfig(num_kv_blocks=32, max_model_len=256),
        ),
        model,
    )
    prompt = [[5, 17, 300, 41]]
    assert engine.generate(prompt, GREEDY) == reference.generate(prompt, GREEDY)


def test_missing_directory_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="unknown model"):
        resolve("no-such-model")


@pytest.mark.slow
def test_gguf_dequantization_matches_transformers(smollm2_state) -> None:  # type: ignore[no-untyped-def]
    """Our GGUF reader (incl. undoing llama.cpp's q/k row permutation) gives the same
    weights as transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM

    from shared.model_store import smollm2_gguf_path

    _, ours = smollm2_state
    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    theirs = hf.state_dict()
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        assert torch.allclose(ours[name].float(), theirs[name], atol=1e-6), name


def test_build_model_takes_the_state_tensors_without_a_second_copy() -> None:
    """Peak memory at load: parameters are the (cast) state tensors themselves, the
    model is fully materialised (nothing left on the meta device), and a missing
    tensor is an error, not a parameter left on meta."""
    cfg = random_config(num_hidden_layers=2)
    state = random_state_dict(cfg, seed=3)
    embed = state["model.embed_tokens.weight"]
    norm = state["model.norm.weight"]
    model = build_model(cfg, state, torch.float32, torch.device("cpu"))
    assert state == {}  # consumed
    assert model.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert model.norm.weight.data_ptr() == norm.data_ptr()
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    state = random_state_dict(cfg, seed=3)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        build_model(cfg, state, torch.float32, torch.device("cpu"))
