"""The engines' batch samples in the gateway benchmark: each TTFT request's first step,
and (--breakdown) the throughput rounds taken apart.

A BatchSample stamps each engine iteration (wall_time_s at its start, duration_s of
schedule + forward + sample). The in-process engine's are popped from it; the worker's
are read where it writes them with its snapshot (Store.write_snapshot: the stack's
namespace and the worker's instance id)."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence
from typing import Any

import msgspec

from bench.gateway_engine import EngineSide
from bench.stats import percentile
from shared.scheduling.snapshot import BatchSample

SAMPLE_DECODER = msgspec.msgpack.Decoder(BatchSample)


async def worker_samples(store: Any, worker_id: str, count: int) -> list[Any]:
    """The worker's newest `count` batch samples, oldest first (`store`: a connected
    shared.store.Store of the stack's namespace)."""
    return [SAMPLE_DECODER.decode(b) for b in await store.read_samples(worker_id, count)]


def first_steps_ms(
    samples: Sequence[Any], starts_s: Sequence[float], ttfts_ms: Sequence[float]
) -> list[float | None]:
    """For each TTFT request (its wall-clock start and TTFT), the duration of the first
    engine step that began inside it (its prefill: the requests run one at a time),
    ms; None where no sample is there (the worker keeps its newest max_batch_samples)."""
    steps = sorted(samples, key=lambda b: b.wall_time_s)
    begins = [b.wall_time_s for b in steps]
    found: list[float | None] = []
    for start, ttft_ms in zip(starts_s, ttfts_ms, strict=True):
        k = bisect.bisect_left(begins, start)
        inside = k < len(steps) and begins[k] <= start + ttft_ms / 1e3
        found.append(1e3 * steps[k].duration_s if inside else None)
    return found


async def worker_first_steps(store: Any, worker_id: str, gateway: dict[str, Any]) -> None:
    """Set gateway["first_step_ms"]: the worker's first step in each TTFT request (all
    its samples kept: 10,000 by default, a default run writes ~3,500), matched by the
    requests' starts (gateway["ttft_at_wall_s"], taken out)."""
    gateway["first_step_ms"] = first_steps_ms(
        await worker_samples(store, worker_id, 1 << 20),
        gateway.pop("ttft_at_wall_s"),
        gateway["ttft_ms"],
    )


class RoundAnatomy:
    """One side's throughput rounds taken apart from its batch samples.

    The samples are on the same clock (time.time) as the round's start and end here,
    so a round of `wall` seconds splits into
      lead    round start -> first step (adding the requests; through the gateway also
              HTTP, tokenization and the bus)
      steps   the iterations' own compute (how many, and the mean per step; and the
              median of the decode-only steps of the round's largest batch, which two
              sides share whatever their prefill came as: where the gateway side's is
              slower, the engine ran slower, e.g. for the other CPU's work beside it)
      gaps    between one iteration's end and the next one's start (the engine's
              bookkeeping outside the timed part; in the worker also publishing the
              deltas, the snapshot writes, the event loop)
      tail    last step's end -> the client has every token
    and, of the steps, how many took prompt tokens and the time from the first step's
    start to the last such step's (`intake`: a round's requests reach the engine one
    at a time through the gateway, all at once in process; a later last prompt ends
    the round later).
    """

    FIELDS = (
        "lead_ms",
        "steps",
        "step_ms",
        "decode_step_ms_p50",
        "gap_us_p50",
        "gaps_ms",
        "tail_ms",
        "wall_ms",
        "prefill_steps",
        "intake_ms",
    )

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []

    def add(self, samples: list[Any], t0: float, t1: float) -> None:
        steps = sorted(
            (b for b in samples if t0 <= b.wall_time_s <= t1), key=lambda b: b.wall_time_s
        )
        if not steps:
            return
        ends = [b.wall_time_s + b.duration_s for b in steps]
        gaps = [nxt.wall_time_s - end for nxt, end in zip(steps[1:], ends, strict=False)]
        full = max(b.num_decode_tokens for b in steps)
        decodes = [b.duration_s for b in steps if not b.chunk_sizes and b.num_decode_tokens == full]
        prefills = [b for b in steps if b.num_prefill_tokens]
        self.rounds.append(
            {
                "lead_ms": 1e3 * (steps[0].wall_time_s - t0),
                "steps": len(steps),
                "step_ms": 1e3 * sum(b.duration_s for b in steps) / len(steps),
                "decode_step_ms_p50": 1e3 * percentile(decodes, 50) if decodes else 0.0,
                "gap_us_p50": 1e6 * percentile(gaps, 50) if gaps else 0.0,
                "gaps_ms": 1e3 * sum(gaps),
                "tail_ms": 1e3 * (t1 - ends[-1]),
                "wall_ms": 1e3 * (t1 - t0),
                "prefill_steps": len(prefills),
                "intake_ms": 1e3 * (prefills[-1].wall_time_s - steps[0].wall_time_s)
                if prefills
                else 0.0,
            }
        )

    def summary(self) -> dict[str, float]:
        """Each field's mean over the rounds."""
        n = len(self.rounds)
        return {f: sum(r[f] for r in self.rounds) / n for f in self.FIELDS} if n else {}


class RoundBreakdown:
    """Both sides' RoundAnatomy, fed after every throughput round; the worker's samples
    are read over `store` (connected by the caller, for the run)."""

    # the worker writes its samples with its snapshot, at most snapshot_interval_ms
    # (5 by default) after the step: wait this long before reading a round's last ones
    SAMPLES_SETTLE_S = 0.1

    def __init__(self, store: Any, worker_id: str) -> None:
        self.store, self.worker_id = store, worker_id
        self.sides = {"engine": RoundAnatomy(), "gateway": RoundAnatomy()}

    async def record(self, side: str, engine: EngineSide | None, t0: float, t1: float) -> None:
        """Add the round [t0, t1] of `side` ("engine": the in-process engine's samples,
        popped from `engine`; "gateway": the worker's newest)."""
        if side == "engine":
            assert engine is not None
            samples = engine.engine.pop_batch_samples()
        else:
            await asyncio.sleep(self.SAMPLES_SETTLE_S)
            samples = await worker_samples(self.store, self.worker_id, 2000)
        self.sides[side].add(samples, t0, t1)

    def summary(self) -> dict[str, dict[str, float]]:
        return {side: anatomy.summary() for side, anatomy in self.sides.items()}

    def each(self) -> dict[str, list[dict[str, float]]]:
        """Each side's rounds, in order."""
        return {side: anatomy.rounds for side, anatomy in self.sides.items()}
