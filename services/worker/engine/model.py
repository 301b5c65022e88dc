"""Decoder-only transformer of the Llama / Qwen3 family over a paged KV cache.

Embeddings (tied or untied), decoder layers (attention.py, layers.py), the final
norm and the LM head, with CPU weight packing and a trimmed-vocabulary head. The
forward takes a flat list of tokens from many requests (no
padding) and an `AttentionPlan` saying which tokens belong to which request; each
layer writes its K/V into the shared cache and attends over each request's cached
context. Numerics follow HF transformers (norms in fp32, RoPE tables in fp32) so
that greedy outputs match token for token in fp32.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.attention import Attention, AttentionPlan, Rotary
from services.worker.engine.cpu_kernels import (
    Fp16WeightLinear,
    PackedLinear,
    can_pack,
    fp16_weights_supported,
    pack_linears,
)
from services.worker.engine.layers import MLP, RMSNorm
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.outputs import StepLogits

# A trimmed-vocabulary head (CausalLM.set_vocab_keep): the state-dict entry holding the
# kept token ids; every other token gets TRIMMED_LOGIT (outputs.py says why finite).
VOCAB_KEEP_KEY = "vocab_keep"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class CausalLM(nn.Module):
    """The model: embeddings, decoder layers, final norm, LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.packed_head: nn.Module | None = None  # set by pack_for_cpu
        # Trimmed head (set_vocab_keep): kept ids [K] (int64, sorted) and their head rows.
        self.vocab_keep: torch.Tensor | None = None
        self.kept_head: torch.Tensor | None = None

    def set_vocab_keep(self, ids: torch.Tensor) -> None:
        """Restrict the LM head to the token ids in `ids` (a trimmed vocabulary, as
        speculative-decoding drafters use): logits are computed for those rows only and
        every other token gets TRIMMED_LOGIT. The config's EOS/EOT ids are always kept,
        so a request can still end. Call after the weights are loaded."""
        vocab = self.config.vocab_size
        if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
            raise ValueError(f"vocab_keep must be a non-empty 1-D integer tensor, got {ids.dtype}")
        keep = torch.cat([ids.long().cpu(), torch.tensor(self.config.eos_token_ids).long()])
        keep = keep.unique(sorted=True)
        if int(keep.min()) < 0 or int(keep.max()) >= vocab:
            raise ValueError(f"vocab_keep ids must lie in [0, {vocab})")
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.vocab_keep = keep.to(weight.device)
        self.kept_head = weight.detach().index_select(0, self.vocab_keep).contiguous()

    def pack_for_cpu(self, batch_hint: int, fp16_weights: bool = False) -> bool:
        """Pre-pack every linear and the LM head for oneDNN (CPU bf16 and fp32), or
        with `fp16_weights` (fp32 models only) hold them as fp16 for fbgemm's fp16
        GEMM; see cpu_kernels.py. Returns whether it packed. Serving only: afterwards
        the state dict lacks the linear weights."""
        weight = self.embed_tokens.weight
        if fp16_weights:
            if weight.dtype != torch.float32 or weight.device.type != "cpu":
                raise ValueError("fp16 weights need an fp32 model on the CPU")
            if not fp16_weights_supported():
                raise ValueError("fp16 weights need fbgemm (an x86 CPU with AVX2)")
        elif not can_pack(weight.device, weight.dtype):
            return False
        pack_linears(self.layers, batch_hint, fp16_weights)
        # The (often tied) LM head gets its own packed copy; the embedding keeps the
        # plain table for its row gathers.
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # A trimmed head packs only its kept rows.
        head = head if self.kept_head is None else self.kept_head
        self.packed_head = (
            Fp16WeightLinear(head, None)
            if fp16_weights
            else PackedLinear(head, None, batch_hint, head.dtype == torch.float32)
        )
        return True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for every new token."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, h.dtype)
        layers = cast(list[DecoderLayer], list(self.layers))
        # Submodules are called through .forward: serving registers no module hooks,
        # and nn.Module.__call__'s hook checks cost ~2% of a decode step (8 calls a layer).
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            x = layer.input_layernorm.forward(h)
            h = h + layer.self_attn.forward(x, rope, k_cache, v_cache, plan)
            h = h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))
        return self.norm.forward(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for the given hidden states (TRIMMED_LOGIT outside a
        trimmed head's kept ids)."""
        return self.head_logits(hidden).full()

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> StepLogits:
        """The LM head over the given hidden states; a trimmed head's rows stay
        trimmed until something needs the whole vocabulary (StepLogits)."""
        if self.packed_head is not None:
            logits = self.packed_head(hidden).float()
        elif self.kept_head is not None:
            logits = F.linear(hidden, self.kept_head).float()
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight).float()
        return StepLogits(logits, self.vocab_keep, self.config.vocab_size)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load weights named as in HF Llama/Qwen3 checkpoints, fusing q/k/v and gate/up."""
        own: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            key = name.removeprefix("model.")
            if key.endswith("rotary_emb.inv_freq"):
                continue
            own[key] = t
        keep = own.pop(VOCAB_KEEP_KEY, None)
        if "lm_head.weight" in own and self.lm_head is None:
            tied = own.pop("lm_head.weight")
            if not torch.equal(tied, own["embed_tokens.weight"]):
                raise ValueError(
                    "config says tied embeddings but lm_head differs from embed_tokens"
                )
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [own.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
                if all(x is not None for x in parts):
                    own[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)  # type: ignore[arg-type]
            gate, up = own.pop(f"{p}mlp.gate_proj.weight"), own.pop(f"{p}mlp.up_proj.weight")
            own[f"{p}mlp.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
        missing, unexpected = self.load_state_dict(own, strict=False, assign=assign)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}"
            )
        if keep is not None:
            self.set_vocab_keep(keep)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights in HF names (q/k/v and gate/up split): feeds HF models in tests.
        A trimmed head's kept ids are not an HF weight and are left out (`vocab_keep`)."""
        cfg = self.config
        out: dict[str, torch.Tensor] = {}
        for key, t in self.state_dict().items():
            if ".qkv_proj." in key:
                q, k, v = t.split(
                    [
                        cfg.num_attention_heads * cfg.head_dim,
                        *[cfg.num_key_value_heads * cfg.head_dim] * 2,
                    ]
                )
                for n, part in zip("qkv", (q, k, v), strict=True):
                    out["model." + key.replace("qkv_proj", f"{n}_proj")] = part
            elif ".gate_up_proj." in key:
                gate, up = t.chunk(2)
                out["model." + key.replace("gate_up_proj", "gate_proj")] = gate
                out["model." + key.replace("gate_up_proj", "up_proj")] = up
            elif key.startswith("lm_head"):
                out[key] = t
            else:
                out["model." + key] = t
        return out
