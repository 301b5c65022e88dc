"""Attention over the paged KV cache: the plan saying which flat tokens belong to which
request, rotary embeddings (the checkpoint's theta and Llama-3 scaling, in fp32 as
HF computes them), and grouped-query attention with Qwen3's per-head q/k RMSNorm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.layers import RMSNorm
from services.worker.engine.model_config import ModelConfig


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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
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
        inv_freq = rope_inv_freq(cfg)
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
