"""Decoder-only transformer of the Llama / Qwen3 family over a paged KV cache.

RMSNorm, rotary embeddings (with the checkpoint's theta and Llama-3 scaling),
grouped-query attention, SwiGLU MLP, tied or untied embeddings, Qwen3's per-head
q/k RMSNorm. The forward takes a flat list of tokens from many requests (no
padding) and an `AttentionPlan` saying which tokens belong to which request; each
layer writes its K/V into the shared cache and attends over each request's cached
context. Numerics follow HF transformers (norms in fp32, RoPE tables in fp32) so
that greedy outputs match token for token in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.cpu_kernels import (
    Fp16WeightLinear,
    PackedLinear,
    can_pack,
    fp16_weights_supported,
    pack_linears,
)
from services.worker.engine.outputs import StepLogits

# A trimmed-vocabulary head (CausalLM.set_vocab_keep): the state-dict entry holding the
# kept token ids; every other token gets TRIMMED_LOGIT (outputs.py says why finite).
VOCAB_KEEP_KEY = "vocab_keep"


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


@dataclass(slots=True)
class DecodeGroup:
    """Single-token requests attended together, each context padded to the group's
    longest (in blocks). Rows are in the order of `tokens`."""

    tokens: torch.Tensor  # [D] their token rows in the flat batch
    blocks: torch.Tensor  # [D * max_blocks] padded block ids
    # [D, 1, 1, max_blocks * block_size] fp32: 0 where a decode attends, -inf past its
    # context. Additive, so one op upcasts, scales and masks the scores.
    bias: torch.Tensor
    num: int  # D


@dataclass(slots=True)
class AttentionPlan:
    """How the flat token batch maps onto requests and the paged cache.

    Tokens are laid out request by request: request r owns tokens
    [query_starts[r], query_starts[r] + query_lens[r]) at positions
    [context_lens[r] - query_lens[r], context_lens[r]). Each layer's K and V caches
    are [kv_heads, num_blocks, block_size, head_dim]; slot = block * block_size +
    offset. KV head outermost: gathering a request's blocks (index_select on dim 1)
    gives each head's context as one contiguous [tokens, head_dim] run, so decode
    attention is one matmul per (head, request) over the whole context and prefill
    reads the gathered context with no permuted copy (see _attend_decodes).
    """

    slot_mapping: torch.Tensor  # [T] cache slot written by each new token
    query_starts: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)  # new tokens per request
    context_lens: list[int] = field(default_factory=list)  # cached + new, per request
    block_tables: list[torch.Tensor] = field(default_factory=list)  # per request: block ids
    # Requests with exactly one new token are attended together (padded decode), in
    # groups of similar context length (runner.decode_groups) so short contexts are
    # not padded to the longest.
    decode_rows: list[int] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # Every row of the batch is a decode, in order, one group: queries need no gather
    # or scatter.
    all_decode: bool = False
    # slot_mapping split into (block, offset), computed once per step by the first layer
    slot_blocks: torch.Tensor | None = None
    slot_offsets: torch.Tensor | None = None
    _prefill_rows: list[int] | None = None  # see prefill_rows()

    def prefill_rows(self) -> list[int]:
        """The requests not in decode_rows (attended one by one), found once per step."""
        if self._prefill_rows is None:
            decodes = set(self.decode_rows)
            self._prefill_rows = [r for r in range(len(self.query_lens)) if r not in decodes]
        return self._prefill_rows

    def block_offsets(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slot_blocks is None or self.slot_offsets is None:
            self.slot_blocks = torch.div(self.slot_mapping, block_size, rounding_mode="floor")
            self.slot_offsets = self.slot_mapping.remainder(block_size)
        return self.slot_blocks, self.slot_offsets


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's LlamaRMSNorm (normalise in fp32, cast, scale); F.rms_norm without a
        # weight computes the fp32 part bitwise alike in one op.
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)


def _rope_scaling(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """Normalise a rope_scaling / rope_parameters dict: None when it scales nothing."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    return None if kind in ("default", None) else dict(raw)


def _rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_freq_factors is not None:
        if len(cfg.rope_freq_factors) != dim // 2:
            raise ValueError(
                f"rope_freqs has {len(cfg.rope_freq_factors)} factors, expected {dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class Rotary(nn.Module):
    """Precomputed cos/sin tables, looked up by absolute position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq = _rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = inv_freq.shape[0]
        # sin with its first half negated: rotate_half(x) * sin == x.roll(half) * this,
        # bitwise (negating a factor commutes with rounding), in two ops instead of four.
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin() * sign, persistent=False)

    cos: torch.Tensor
    sin: torch.Tensor  # signed (see __init__)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the given positions, [T, 1, D]: looked up once per
        forward, for apply_rotary."""
        cos = self.cos[positions].to(dtype).unsqueeze(1)
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, heads, D] (HF's rotate_half convention; sin signed by Rotary)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul.
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = qkv[:, :q_end].view(num_tokens, -1, self.head_dim)
            k = qkv[:, q_end:k_end].view(num_tokens, -1, self.head_dim)
            q, k = apply_rotary(self.q_norm(q), *rope), apply_rotary(self.k_norm(k), *rope)
        else:
            # q and k heads side by side in qkv: one rotation for both.
            qk = apply_rotary(qkv[:, :k_end].view(num_tokens, -1, self.head_dim), *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        # Paged cache: write this step's K/V into their slots, then read contexts.
        # The index pair sits on adjacent dims, so the indexed shape is [Hkv, T, hd].
        blocks, offsets = plan.block_offsets(v_cache.shape[2])
        k_cache[:, blocks, offsets] = k.transpose(0, 1)
        v_cache[:, blocks, offsets] = v.transpose(0, 1)

        if plan.all_decode:
            out = self._attend_decodes(q, k_cache, v_cache, plan.decode_groups[0])
        else:
            out = torch.empty_like(q)
            for group in plan.decode_groups:
                qd = q.index_select(0, group.tokens)
                out.index_copy_(0, group.tokens, self._attend_decodes(qd, k_cache, v_cache, group))
            for r in plan.prefill_rows():
                start, end = plan.query_starts[r], plan.query_starts[r] + plan.query_lens[r]
                self._attend_prefill(
                    q[start:end],
                    k[start:end],
                    v[start:end],
                    k_cache,
                    v_cache,
                    plan,
                    r,
                    out[start:end],
                )
        return self.o_proj.forward(out.reshape(num_tokens, self.q_size))

    def _attend_prefill(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        r: int,
        out: torch.Tensor,
    ) -> None:
        """One request's new tokens over its whole context, causal (SDPA kernel).

        k_new, v_new: this chunk's own keys and values, [qlen, Hkv, hd]. SDPA's CPU
        flash kernel needs the last dimension contiguous; otherwise it falls back to
        the math path, measured ~2x slower with its mask checks."""
        ctx, qlen = plan.context_lens[r], q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
        if qlen == ctx:
            # A prompt's first chunk is its whole context: attend over the fresh K/V
            # (the values just written to the cache), no gather.
            k, v = k_new.transpose(0, 1).unsqueeze(0), v_new.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qh, k, v, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            blocks = plan.block_tables[r]
            # [Hkv, nblk, bs, hd] -> [1, Hkv, ctx, hd], the last dim contiguous
            shape = (1, self.num_kv_heads, -1, self.head_dim)
            k = k_cache.index_select(1, blocks).view(shape)[:, :, :ctx]
            v = v_cache.index_select(1, blocks).view(shape)[:, :, :ctx]
            # New tokens sit at the end of the context: token i sees keys <= ctx - qlen + i.
            rows = torch.arange(ctx - qlen, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        out.copy_(o[0].transpose(0, 1))

    def _attend_decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
    ) -> torch.Tensor:
        """A group of single-token requests at once over block-padded contexts: q is
        [D, H, hd], their queries in the group's order; returns [D, H, hd].

        Written out rather than through SDPA: with or without a padding mask the CPU
        SDPA kernel measured ~10x slower than these two batched matmuls (bf16, 16
        decodes of 100-190 tokens: ~3 ms vs ~0.3 ms a layer). Queries are grouped by
        the KV head they share (GQA), so K/V are never repeated. The gathered blocks
        of each (KV head, request) are one contiguous context (the cache's layout):
        the only copy of the context is the gather; scores come out in softmax order.
        """
        num, hkv, hd = group.num, self.num_kv_heads, self.head_dim
        gqa = self.num_heads // hkv
        k = k_cache.index_select(1, group.blocks).view(hkv, num, -1, hd)  # [Hkv, D, L, hd]
        v = v_cache.index_select(1, group.blocks).view(hkv, num, -1, hd)
        qh = q.view(num, hkv, gqa, hd).transpose(0, 1)  # [Hkv, D, G, hd]
        scores = torch.matmul(qh, k.transpose(-1, -2))  # [Hkv, D, G, L]
        # bias + scale * scores in fp32: the upcast, scale and mask in one op (same
        # values as scores.float() * scale then a -inf fill).
        scores = torch.add(group.bias.view(1, num, 1, -1), scores, alpha=self.scale)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, v)  # [Hkv, D, G, hd]
        return o.transpose(0, 1).reshape(num, self.num_heads, hd)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections fused into one matmul.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        half = gate_up.shape[-1] // 2
        return self.down_proj.forward(F.silu(gate_up[:, :half]) * gate_up[:, half:])


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
