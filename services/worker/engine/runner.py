"""The model runner: turns a scheduled batch into tensors, runs the forward, returns
hidden states and logits of the positions that sample.

Owns the model and the paged KV cache: per layer a K cache [num_blocks, kv_heads,
head_dim, block_size] and a V cache [num_blocks, kv_heads, block_size, head_dim];
slot = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.model import AttentionPlan, CausalLM
from services.worker.engine.outputs import StepLogits
from shared.scheduling.scheduler import ScheduledBatch


@dataclass(slots=True)
class ForwardResult:
    """Per sampling chunk, in batch order."""

    request_ids: list[str]
    hidden: torch.Tensor  # [N, hidden] last-position hidden state (after final norm)
    logits: StepLogits  # [N, vocab] fp32 on demand


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        # K^T and V per block (model.AttentionPlan has why).
        k_shape = (num_blocks, cfg.num_key_value_heads, cfg.head_dim, block_size)
        v_shape = (num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(k_shape, dtype=self.dtype, device=self.device),
                torch.zeros(v_shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def execute(self, batch: ScheduledBatch, token_ids: dict[str, list[int]]) -> ForwardResult:
        """Run one forward over every chunk of batch. token_ids: full sequence per request."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        plan = AttentionPlan(slot_mapping=torch.empty(0))
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        # 1. Flatten the chunks: tokens, positions, cache slots, block tables.
        for r, chunk in enumerate(batch.chunks):
            req = chunk.request
            ids = token_ids[req.request_id]
            plan.query_starts.append(len(input_ids))
            input_ids.extend(ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end))
            plan.query_lens.append(chunk.num_new_tokens)
            plan.context_lens.append(chunk.end)
            if chunk.num_new_tokens == 1:
                plan.decode_rows.append(r)
            else:
                num_blocks = -(-chunk.end // bs)
                plan.block_tables.append(torch.tensor(blocks[:num_blocks], device=self.device))
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(req.request_id)
        if len(plan.block_tables) < len(batch.chunks):
            # Keep block_tables indexable by request row; decodes read decode_blocks.
            tables = iter(plan.block_tables)
            empty = torch.empty(0, dtype=torch.long)
            decode_set = set(plan.decode_rows)
            plan.block_tables = [
                empty if r in decode_set else next(tables) for r in range(len(batch.chunks))
            ]
        plan.slot_mapping = torch.tensor(slots, device=self.device)
        # 2. Single-token chunks attend together over block-padded contexts.
        if plan.decode_rows:
            lens = [plan.context_lens[r] for r in plan.decode_rows]
            max_blocks = -(-max(lens) // bs)
            table = []
            for r in plan.decode_rows:
                blocks = batch.chunks[r].request.block_ids[:max_blocks]
                table.extend(blocks + [0] * (max_blocks - len(blocks)))
            plan.decode_blocks = torch.tensor(table, device=self.device)
            ctx = torch.tensor(lens, device=self.device).unsqueeze(1)
            span = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
            past = (span >= ctx).view(len(lens), 1, 1, -1)
            plan.decode_bias = torch.zeros(past.shape, device=self.device).masked_fill_(
                past, float("-inf")
            )
            plan.all_decode = len(plan.decode_rows) == len(batch.chunks)
            plan.decode_tokens = torch.tensor(
                [plan.query_starts[r] for r in plan.decode_rows], device=self.device
            )
        # 3. Forward, then logits only where a token is sampled.
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv_caches,
            plan,
        )
        last = hidden.index_select(
            0, torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        )
        logits = self.model.head_logits(last)
        return ForwardResult(sample_ids, last, logits)
