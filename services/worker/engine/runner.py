"""The model runner: turns a scheduled batch into tensors, runs the forward, returns
hidden states and logits of the positions that sample.

Owns the model and the paged KV cache: per layer a K and a V cache, each [kv_heads,
num_blocks, block_size, head_dim] (model.AttentionPlan says why); slot = block_id *
block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.engine.attention import AttentionPlan, DecodeGroup
from services.worker.engine.model import CausalLM
from services.worker.engine.outputs import StepLogits
from shared.scheduling.scheduler import ScheduledBatch

# What one more decode group costs per layer (its gather, matmuls, mask and scatter
# ops), in units of one request-block of padded context gathered and attended.
# Measured on SmolLM2 (1 thread): see decode_groups.
DECODE_GROUP_COST_BLOCKS = 8


def decode_groups(num_blocks: list[int], group_cost: int) -> list[list[int]]:
    """Split decode requests (by their context length in blocks) into groups whose
    contexts are padded to the group's longest, minimising total padded blocks plus
    `group_cost` per group. Returns lists of indices into num_blocks, each in
    ascending index order (one group is then exactly the batch's order, which the
    all-decode fast path relies on), shortest contexts first; one group when
    splitting saves nothing.

    Groups are runs of the requests sorted by length; cuts fall only between
    distinct lengths, so the dynamic program runs over at most max_blocks values.
    """
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    values = sorted(set(num_blocks))
    count = [0] * len(values)  # requests per distinct length
    index = {v: i for i, v in enumerate(values)}
    for b in num_blocks:
        count[index[b]] += 1
    # best[j]: cost of grouping the requests of the first j distinct lengths;
    # cut[j]: where the last of those groups starts.
    best = [0] + [0] * len(values)
    cut = [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        members = 0
        best[j] = -1
        for i in range(j, 0, -1):  # last group = distinct lengths i-1 .. j-1
            members += count[i - 1]
            cost = best[i - 1] + group_cost + members * values[j - 1]
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i - 1
    bounds: list[int] = []
    j = len(values)
    while j > 0:
        bounds.append(j)
        j = cut[j]
    groups: list[list[int]] = []
    start = 0
    for j in reversed(bounds):
        size = sum(count[:j]) - start
        groups.append(sorted(order[start : start + size]))  # in batch order
        start += size
    return groups


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
        # KV head outermost, then block, token, dim (model.AttentionPlan has why).
        shape = (cfg.num_key_value_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
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
        # 2. Single-token chunks attend together over block-padded contexts, in groups
        # of similar length.
        if plan.decode_rows:
            ctx_blocks = [-(-plan.context_lens[r] // bs) for r in plan.decode_rows]
            groups = decode_groups(ctx_blocks, DECODE_GROUP_COST_BLOCKS)
            for members in groups:
                rows = [plan.decode_rows[i] for i in members]
                plan.decode_groups.append(self._decode_group(batch, plan, rows))
            # One group in batch order and nothing else: outputs need no scatter.
            plan.all_decode = len(groups) == 1 and len(plan.decode_rows) == len(batch.chunks)
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

    def _decode_group(
        self, batch: ScheduledBatch, plan: AttentionPlan, rows: list[int]
    ) -> DecodeGroup:
        """Block table, mask and token rows of decode requests `rows` (batch rows)."""
        bs = self.block_size
        lens = [plan.context_lens[r] for r in rows]
        max_blocks = -(-max(lens) // bs)
        table: list[int] = []
        for r in rows:
            blocks = batch.chunks[r].request.block_ids[:max_blocks]
            table.extend(blocks + [0] * (max_blocks - len(blocks)))
        ctx = torch.tensor(lens, device=self.device).unsqueeze(1)
        span = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
        past = (span >= ctx).view(len(lens), 1, 1, -1)
        return DecodeGroup(
            tokens=torch.tensor([plan.query_starts[r] for r in rows], device=self.device),
            blocks=torch.tensor(table, device=self.device),
            bias=torch.zeros(past.shape, device=self.device).masked_fill_(past, float("-inf")),
            num=len(rows),
        )
