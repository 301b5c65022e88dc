"""The benchmark loop: dispatch each request at its offset, collect the records.

Open loop: the dispatcher sleeps until origin + offset (absolute schedule) and
starts a task per request; with --max-concurrency the task then waits for a slot
(its queue time). Closed loop (infinite rate with --max-concurrency): the
dispatcher itself waits for a free slot, so at most N requests exist at once and
a --duration-bounded run can go on indefinitely.

Prompts are built ahead of their send time, while the dispatcher would otherwise
sleep (`AheadBuffer`), so building a long prompt never makes a send late.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tqdm import tqdm

from loadgen.arrivals import ArrivalSchedule
from loadgen.client import OpenAIClient
from loadgen.records import RequestRecord, Status
from loadgen.workloads import RequestSpec

PREFETCH_S = 2.0  # requests due within this are built ahead of their send time
MAX_AHEAD = 256  # built-but-unsent requests held at most
BUILD_GUARD_S = 0.005  # no building this close to a send


class AheadBuffer:
    """(offset, spec) pairs built ahead of their send time, in the dispatcher's idle time.

    Building a prompt costs milliseconds (a trace's long prompts, a tokenizer's
    decode); built just in time, a burst of simultaneous arrivals would go out late.
    """

    def __init__(self, offsets_s: Iterable[float], specs: Iterator[RequestSpec]) -> None:
        self._pairs = zip(offsets_s, specs, strict=False)
        self._ready: deque[tuple[float, RequestSpec]] = deque()
        self._is_exhausted = False

    def build_one(self, until_s: float) -> bool:
        """Build the next pair if it is due before until_s and there is room; True if built."""
        if self._is_exhausted or len(self._ready) >= MAX_AHEAD:
            return False
        if self._ready and self._ready[-1][0] >= until_s:
            return False
        pair = next(self._pairs, None)
        if pair is None:
            self._is_exhausted = True
            return False
        self._ready.append(pair)
        return True

    def fill(self, until_s: float) -> None:
        """Build every pair due before until_s (up to MAX_AHEAD)."""
        while self.build_one(until_s):
            pass

    def pop(self) -> tuple[float, RequestSpec] | None:
        """The next pair (built now if none is ready), None at the end."""
        if not self._ready:
            self.build_one(until_s=math.inf)
        return self._ready.popleft() if self._ready else None


@dataclass(frozen=True, slots=True)
class RunLimits:
    """When to stop and how many may run at once."""

    max_concurrency: int | None = None
    is_closed_loop: bool = False  # infinite rate with a concurrency bound
    duration_s: float | None = None  # stop dispatching after this
    show_progress: bool = True


@dataclass(slots=True)
class RunResult:
    """What a run produced."""

    records: list[RequestRecord]
    origin_epoch_ns: int  # wall clock at the origin, for epoch timestamps
    duration_s: float  # origin to the last request's end
    is_interrupted: bool = False


class BenchmarkRunner:
    """Runs one benchmark: offsets x specs against one client."""

    def __init__(self, client: OpenAIClient, limits: RunLimits) -> None:
        self._client = client
        self._limits = limits

    async def run(
        self, offsets_s: Iterable[float], specs: Iterator[RequestSpec], total: int | None
    ) -> RunResult:
        """Dispatch every (offset, spec) pair, wait for all, return the records."""
        limits = self._limits
        ahead = AheadBuffer(offsets_s, specs)
        ahead.fill(until_s=PREFETCH_S)  # the first burst is built before the clock starts
        origin_ns = time.perf_counter_ns()
        origin_epoch_ns = time.time_ns()
        schedule = ArrivalSchedule(origin_ns)
        slots = asyncio.Semaphore(limits.max_concurrency) if limits.max_concurrency else None
        bar = tqdm(total=total, disable=not limits.show_progress, unit="req", dynamic_ncols=True)
        records: list[RequestRecord] = []
        tasks: set[asyncio.Task[None]] = set()
        is_interrupted = False
        try:
            while (item := ahead.pop()) is not None:
                offset, spec = item
                if limits.duration_s is not None and schedule.now_s() >= limits.duration_s:
                    break
                # idle until the send: build the requests due soon (prompts cost ms each)
                while schedule.now_s() < offset - BUILD_GUARD_S and ahead.build_one(
                    until_s=schedule.now_s() + PREFETCH_S
                ):
                    pass
                await schedule.wait_until(offset)
                record = RequestRecord(spec, scheduled_ns=round(offset * 1e9))
                record.dispatched_ns = time.perf_counter_ns() - origin_ns
                is_closed_loop = limits.is_closed_loop and slots is not None
                if is_closed_loop:
                    assert slots is not None
                    await slots.acquire()
                    if limits.duration_s is not None and schedule.now_s() >= limits.duration_s:
                        slots.release()
                        break
                    record.scheduled_ns = record.dispatched_ns  # no schedule to lag behind
                records.append(record)
                task = asyncio.create_task(self._one(record, origin_ns, slots, is_closed_loop, bar))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            # Ctrl-C: stop, keep what finished, mark the rest cancelled.
            is_interrupted = True
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            bar.close()
        for record in records:
            if record.status is Status.PENDING:
                record.status = Status.CANCELLED
                record.error = record.error or "not finished when the run ended"
        end_ns = max((r.end_ns for r in records), default=time.perf_counter_ns() - origin_ns)
        return RunResult(records, origin_epoch_ns, end_ns / 1e9, is_interrupted)

    async def _one(
        self,
        record: RequestRecord,
        origin_ns: int,
        slots: asyncio.Semaphore | None,
        is_slot_held: bool,
        bar: tqdm,
    ) -> None:
        try:
            if slots is not None and not is_slot_held:
                async with slots:
                    await self._client.send(record, origin_ns)
            else:
                await self._client.send(record, origin_ns)
        except Exception as exc:  # a loadgen bug: keep it in the results, keep running
            record.status = Status.STREAM_ERROR
            record.error = f"loadgen internal error: {exc!r}"
        finally:
            if is_slot_held and slots is not None:
                slots.release()
            bar.update(1)
            if not record.is_ok:
                bar.set_postfix_str(f"last error: {record.error[:60]}", refresh=False)
