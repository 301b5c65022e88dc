"""Weights from disk into a CausalLM: GGUF files, HF-format directories, random models.

Every path ends in a HF-named state dict (`model.layers.{i}.self_attn.q_proj.weight`,
...) and a ModelConfig, so derived models (deltas over a base, see `delta.py`)
compose with any source.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.worker.engine.config import EngineConfig
from services.worker.engine.model import CausalLM
from services.worker.engine.model_config import ModelConfig
from shared.model_store import resolve

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time permutation of q/k rows (interleaved RoPE).

    llama.cpp stores each head's rotary pairs interleaved; HF keeps the two halves
    apart (rotate_half). Only the `llama` architecture is permuted.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF checkpoint (llama or qwen3 architecture) to dtype, HF names.

    Tensors are cast one at a time, so a bf16 load never holds the fp32 model.
    """
    import gguf  # local import: only workers that read GGUF pay for it

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = str(field("general.architecture"))
    if arch not in ("llama", "qwen3", "qwen2"):
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}")
    heads = int(field(f"{arch}.attention.head_count"))
    kv_heads = int(field(f"{arch}.attention.head_count_kv", heads))
    hidden = int(field(f"{arch}.embedding_length"))
    # Chat models end a turn with EOT/EOM (Llama 3's <|eot_id|>) as well as EOS.
    eos_ids = tuple(
        dict.fromkeys(
            int(v)
            for k in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (v := field(f"tokenizer.ggml.{k}")) is not None
        )
    )
    bos = field("tokenizer.ggml.bos_token_id")
    freq_factors: tuple[float, ...] | None = None
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        shape = [int(d) for d in reversed(t.shape)]
        w = (
            gguf.quants.dequantize(t.data, t.tensor_type)
            .reshape(shape)
            .astype(np.float32, copy=False)
        )
        name = t.name.removesuffix(".weight").removesuffix(".bias")
        kind = "bias" if t.name.endswith(".bias") else "weight"
        if name == "token_embd":
            key = "model.embed_tokens"
        elif name == "output_norm":
            key = "model.norm"
        elif name == "output":
            key = "lm_head"
        elif name == "rope_freqs":
            # Llama 3.1+ RoPE scaling, stored by llama.cpp as per-frequency divisors.
            freq_factors = tuple(float(x) for x in w.reshape(-1))
            continue
        elif name.startswith("blk."):
            _, idx, sub = name.split(".", 2)
            key = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[sub]}"
            if arch == "llama" and sub == "attn_q":
                w = _unpermute_rope(w, heads)
            elif arch == "llama" and sub == "attn_k":
                w = _unpermute_rope(w, kv_heads)
        else:
            continue
        state[f"{key}.{kind}"] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
    layers = int(field(f"{arch}.block_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    cfg = ModelConfig(
        vocab_size=state["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in state,
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        rope_freq_factors=freq_factors,
        architecture="qwen3" if arch == "qwen3" else "llama",
    )
    return cfg, state


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every *.safetensors shard of a HF-format checkpoint."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root}: no config.json (expected a HF-format model directory)")
    raw = json.loads(cfg_file.read_text())
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        # Chat checkpoints list their end-of-turn ids here (Qwen3, Llama 3).
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if gen_eos is not None:
            ids = (
                [raw.get("eos_token_id")]
                if not isinstance(raw.get("eos_token_id"), list)
                else raw["eos_token_id"]
            )
            extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
            raw["eos_token_id"] = [i for i in dict.fromkeys([*ids, *extra]) if i is not None]
    cfg = ModelConfig.from_hf(raw)
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{root}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return cfg, state


def random_config(vocab_size: int = 49152, **overrides: Any) -> ModelConfig:
    """A tiny Llama-shaped config: builds in well under a second."""
    base: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights for cfg.

    Scaled so that every layer matters and greedy argmaxes are well separated
    (std-0.02 weights give a model that echoes its input token, which makes
    exactness tests vacuous).
    """
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in CausalLM(cfg).hf_state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(t.shape, generator=gen)
        elif name == "lm_head.weight":
            state[name] = 4.0 * torch.randn(t.shape, generator=gen) / t.shape[1] ** 0.5
        else:  # linears [out, in] and biases
            fan_in = t.shape[-1] if t.dim() > 1 else t.shape[0]
            state[name] = 1.5 * torch.randn(t.shape, generator=gen) / fan_in**0.5
    return state


def build_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """Instantiate a CausalLM in dtype on device and load state (HF names) into it.

    Consumes state: tensors are cast one by one and dropped, and the model's
    parameters become the cast tensors themselves (built on the meta device, loaded
    with assign), so peak memory stays near one copy of the weights in the source
    dtype plus the fused q/k/v and gate/up copies of one layer at a time. Integer
    tensors (a trimmed head's kept ids) keep their dtype.
    """
    with torch.device("meta"):
        model = CausalLM(cfg)
    # Non-persistent buffers are not in the state: rebuild the RoPE tables (kept in
    # fp32 like HF's; cast per lookup).
    model.rotary = type(model.rotary)(cfg).to(device)
    cast = {}
    for name in list(state):
        t = state.pop(name)
        cast[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    model.load_hf_state_dict(cast, assign=True)  # raises on a missing tensor
    return model.eval()


def load_model(config: EngineConfig) -> CausalLM:
    """The model named in config (see shared.model_store), built for the engine: a
    delta merged, RoPE tables sized to max_model_len, weights packed when asked."""
    source = resolve(config.model)
    if source.kind == "random":
        cfg = random_config(max_position_embeddings=max(config.scheduler.max_model_len, 4096))
        state = random_state_dict(cfg, seed=config.seed)
    elif source.kind == "gguf":
        assert source.path is not None
        # Deltas merge in fp32; a plain checkpoint is cast straight to the target dtype.
        cfg, state = load_gguf(source.path, torch.float32 if source.delta else config.torch_dtype)
    else:
        assert source.path is not None
        cfg, state = load_hf_dir(source.path)
    if source.delta is not None:
        from services.worker.engine.delta import apply_delta, read_delta

        delta = read_delta(source.delta)
        state = apply_delta(state, delta)
        cfg = _with_layers(cfg, len(delta.layers))
    if config.scheduler.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len={config.scheduler.max_model_len} exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )
    # RoPE tables cover the positions this engine can reach, not the checkpoint's maximum.
    cfg = dataclasses.replace(cfg, max_position_embeddings=config.scheduler.max_model_len)
    model = build_model(cfg, state, config.torch_dtype, torch.device(config.device))
    del state
    if config.pack_weights:
        model.pack_for_cpu(
            batch_hint=config.scheduler.max_num_seqs, fp16_weights=config.fp16_weights
        )
    return model


def _with_layers(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    return dataclasses.replace(cfg, num_hidden_layers=num_layers)
