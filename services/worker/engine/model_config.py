"""A checkpoint's architecture: the HF config.json fields the model reads, and back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _rope_scaling(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """Normalise a rope_scaling / rope_parameters dict: None when it scales nothing."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    return None if kind in ("default", None) else dict(raw)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of one checkpoint (HF config.json names, where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: inv_freq /= factor
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False  # Qwen2-style q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a HF config.json dict (Llama, Qwen2, Qwen3)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # transformers 5 writes RoPE settings (theta and scaling) as `rope_parameters`.
        rope_params = cfg.get("rope_parameters") or {}
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or rope_params),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            qk_norm=arch.startswith("Qwen3"),
            attention_bias=cfg.get("attention_bias", arch.startswith("Qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture="qwen3" if arch.startswith("Qwen3") else "llama",
        )

    def to_hf(self) -> dict[str, Any]:
        """A HF config.json dict describing the same model (for exactness checks)."""
        arch = "Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"
        return {
            "architectures": [arch],
            "model_type": "qwen3" if self.qk_norm else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
