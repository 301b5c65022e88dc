"""The model runner: turns a scheduled batch into tensors, runs the forward, returns
hidden states and logits of the positions that sample.

Owns the model and the paged KV cache. The cache is one [num_slots, kv_heads,
head_dim] tensor per layer for K and for V; slot = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.model import AttentionPlan, CausalLM
from shared.scheduling.scheduler import ScheduledBatch


@dataclass(slots=True)
class ForwardResult:
    """Per sampling chunk, in batch order."""

    request_ids: list[str]
    hidden: torch.Tensor  # [N, hidden] last-position hidden state (after final norm)
    logits: torch.Tensor  # [N, vocab] fp32


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self._offsets = torch.arange(block_size, device=self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def _slots(self, block_ids: list[int], length: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, device=self.device)
        return (blocks.unsqueeze(1) * self.block_size + self._offsets).flatten()[:length]

    def execute(self, batch: ScheduledBatch, token_ids: dict[str, list[int]]) -> ForwardResult:
        """Run one forward over every chunk of batch. token_ids: full sequence per request."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        plan = AttentionPlan(
            slot_mapping=torch.empty(0), query_lens=[], context_lens=[], context_slots=[]
        )
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        # 1. Flatten the chunks: tokens, positions, cache slots.
        for r, chunk in enumerate(batch.chunks):
            req = chunk.request
            ids = token_ids[req.request_id]
            plan.query_starts.append(len(input_ids))
            input_ids.extend(ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            ctx_slots = self._slots(req.block_ids, chunk.end)
            slot_parts.append(ctx_slots[chunk.start : chunk.end])
            plan.query_lens.append(chunk.num_new_tokens)
            plan.context_lens.append(chunk.end)
            plan.context_slots.append(ctx_slots)
            if chunk.num_new_tokens == 1:
                plan.decode_rows.append(r)
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(req.request_id)
        plan.slot_mapping = torch.cat(slot_parts)
        # 2. Single-token chunks attend together over padded contexts.
        if plan.decode_rows:
            max_ctx = max(plan.context_lens[r] for r in plan.decode_rows)
            slots = torch.zeros((len(plan.decode_rows), max_ctx), dtype=torch.long, device=self.device)
            mask = torch.zeros((len(plan.decode_rows), 1, 1, max_ctx), dtype=torch.bool, device=self.device)
            for i, r in enumerate(plan.decode_rows):
                n = plan.context_lens[r]
                slots[i, :n] = plan.context_slots[r]
                mask[i, 0, 0, :n] = True
            plan.decode_slots, plan.decode_mask = slots, mask
        # 3. Forward, then logits only where a token is sampled.
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            plan,
        )
        last = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(last)
        return ForwardResult(sample_ids, last, logits)
