"""KV block accounting: which fixed-size blocks of the KV cache each request holds.

Pure bookkeeping over block ids; the engine maps ids to cache slots, the estimator
only counts. Blocks are handed out lowest id first so schedules are reproducible.
"""

from __future__ import annotations

import heapq

from shared.scheduling.request import SchedRequest


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens of KV."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the free list of KV blocks. Capacity is fixed at construction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def free_block_ids(self) -> frozenset[int]:
        return frozenset(self._free)

    def num_missing_blocks(self, req: SchedRequest, num_tokens: int) -> int:
        """Blocks req must still get to hold num_tokens tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(req.block_ids))

    def can_grow(self, req: SchedRequest, num_tokens: int) -> bool:
        return self.num_missing_blocks(req, num_tokens) <= len(self._free)

    def grow(self, req: SchedRequest, num_tokens: int) -> None:
        """Give req enough blocks for num_tokens tokens; caller checked can_grow."""
        missing = self.num_missing_blocks(req, num_tokens)
        assert missing <= len(self._free), "grow() without can_grow()"
        for _ in range(missing):
            req.block_ids.append(heapq.heappop(self._free))

    def free(self, req: SchedRequest) -> None:
        for block_id in req.block_ids:
            heapq.heappush(self._free, block_id)
        req.block_ids = []
