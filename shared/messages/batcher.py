"""Delayed batching: routing statistics (worker -> batcher) and B* tables (batcher -> workers).

    {ns}.batcher.stats    RoutingStats   every worker of a token-level preset, once per window
    {ns}.batcher.tables   BatchTables    the batcher, on every recompute; also kept in Redis
                                         under `keys.batch_tables(ns, preset)` for restarts

A worker of model m of a preset holds m's next step until at least
B_m(N) = tables.b[m][min(N, len) - 1] of the preset's requests are ready at m
(N: the preset's requests active in the system), or the oldest ready one has
waited hold_timeout_ms, or all N are at m. Contract details: docs/batcher.md.
"""

from __future__ import annotations

import msgspec


class RoutingStats(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker observed for one token-level preset since its previous report."""

    instance_id: str  # the reporting worker
    preset: str  # routing preset name
    models: list[str]  # the preset's models in order (index 0 = entry model)
    model_index: int  # this worker's model in `models`
    window_s: float  # seconds covered by this report
    num_tokens: int  # tokens this model sampled for the preset's requests (taken-back ones too)
    num_handoffs: int  # hand-offs this model sent to a peer
    num_taken_back: int = 0  # hand-offs whose just-sampled token the peer rewrites (not output)
    # One entry per forward step that held any of the preset's requests, same length:
    step_batch_sizes: list[int] = []  # requests in the step
    step_seconds: list[float] = []  # seconds the step took (forward + sampling + hook)
    num_active: int = 0  # the preset's requests active in the system at the report, N


class BatchTables(msgspec.Struct, frozen=True, kw_only=True):
    """B*(N) per model of one preset, and the hold timeout that backs them up."""

    preset: str  # routing preset name
    version: int  # increases whenever the table changes (also across batcher restarts)
    models: list[str]  # the preset's models in order (index 0 = entry model)
    b: list[list[int]]  # b[m][N-1]: B of model m at concurrency N = 1..len; clamp N to len
    # ms; an idle model steps anyway once its oldest ready request waited this
    hold_timeout_ms: float
    is_estimated: bool  # False: the all-ones default (eager async) while samples are too few
    published_at_s: float  # batcher wall clock (time.time()) when this version was made
    # The estimates the tables came from (absent while is_estimated is False):
    p: float | None = None  # hand-offs per entry-model token
    tokens_per_visit: float | None = None  # tokens the large model writes per visit
    step_intercept_s: list[float] = []  # seconds, per model: t_m(b) = intercept + per_request * b
    step_per_request_s: list[float] = []  # seconds per request, per model
    predicted_tok_s: list[float] = []  # output tokens/s the chain predicts at B*(N), N = 1..len
    eager_tok_s: list[float] = []  # output tokens/s it predicts at all-ones, N = 1..len

    def b_for(self, model_index: int, num_active: int) -> int:
        """B of a model at concurrency N (N clamped to the table; N < 1 reads as 1)."""
        row = self.b[model_index]
        return row[min(max(num_active, 1), len(row)) - 1]


ROUTING_STATS_DECODER = msgspec.msgpack.Decoder(RoutingStats)
BATCH_TABLES_DECODER = msgspec.msgpack.Decoder(BatchTables)
