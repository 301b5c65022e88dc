"""A real LLMEngine stepped in its own process, as a worker runs it, for a benchmark that
decides beside it: requests go in over one pipe; after every step the engine's snapshot,
the first-token times, the ids that finished and the batch samples come back over
another (no NATS hop, no Redis).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from shared.sampling import SamplingParams
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot

if TYPE_CHECKING:  # (imports torch: loaded in the engine's process only)
    from services.worker.engine.config import EngineConfig


def _engine_process_main(
    ecfg: EngineConfig, t_origin: float, commands: Connection, results: Connection
) -> None:
    """The engine's own process (as a worker runs it): take submissions, step while
    there is work, and after every step send the snapshot, the first-token times, the
    ids that finished and the batch samples."""
    import torch

    from services.worker.engine.engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine.create(ecfg)
    results.send((engine.snapshot(), [], [], []))  # ready
    seen_first: set[str] = set()
    while True:
        # 1. submissions (block briefly while idle, never while there is work)
        ready = commands.poll(0 if engine.has_unfinished() else 0.05)
        while ready:
            cmd = commands.recv()
            if cmd is None:
                return
            rid, ids, params, predicted = cmd
            engine.add_request(rid, ids, params, predicted_output_tokens=predicted)
            ready = commands.poll(0)
        if not engine.has_unfinished():
            continue
        # 2. one step, then what a reader needs, on the shared monotonic clock
        outputs = engine.step()
        t = time.perf_counter() - t_origin
        firsts = []
        for out in outputs:
            if out.new_token_ids and out.request_id not in seen_first:
                seen_first.add(out.request_id)
                firsts.append((out.request_id, t))
        done = [out.request_id for out in outputs if out.finished]
        seen_first.difference_update(done)
        results.send((engine.snapshot(), firsts, done, engine.pop_batch_samples()))


class EngineProcess:
    """Steps a real engine in its own process, as a worker does, so that the
    benchmark's decisions and refits never take the GIL from the engine's steps (in
    one process they stretched the replay's steps against the warm-up's).

    A reader thread applies each step's report under one lock: the snapshot, the
    first-token times and the ids that finished, so a reader never sees a finished
    request as merely unseen. perf_counter is CLOCK_MONOTONIC, shared by both
    processes, so first-token times are on the benchmark's clock.
    """

    def __init__(self, ecfg: EngineConfig, t_origin: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._res_recv, self._res_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_engine_process_main,
            args=(ecfg, t_origin, self._cmd_recv, self._res_send),
            name="engine",
            daemon=True,
        )
        self.lock = threading.Lock()
        self.first: dict[str, float] = {}
        self.done: set[str] = set()
        self.submitted: set[str] = set()
        self.samples: list[BatchSample] = []
        self.snapshot: WorkloadSnapshot | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="engine-reader", daemon=True)

    def start(self) -> None:
        self._proc.start()
        self._reader.start()
        if not self._ready.wait(600):
            raise RuntimeError("the engine process did not start")

    def _read_loop(self) -> None:
        while True:
            try:
                snap, firsts, done, samples = self._res_recv.recv()
            except (EOFError, OSError):
                return
            with self.lock:
                self.snapshot = snap
                self.first.update(firsts)
                self.done.update(done)
                self.samples.extend(samples)
            self._ready.set()

    def submit(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        predicted_output_tokens: int | None = None,
    ) -> None:
        with self.lock:
            self.submitted.add(rid)
        self._cmd_send.send((rid, ids, params, predicted_output_tokens))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._cmd_send.send(None)
        self._proc.join(timeout=60)
        if self._proc.exitcode not in (0, None):
            raise RuntimeError(f"engine process failed (exit code {self._proc.exitcode})")

    def read(self) -> tuple[WorkloadSnapshot, set[str]]:
        with self.lock:
            assert self.snapshot is not None
            return self.snapshot, set(self.done)

    def take_samples(self) -> list[BatchSample]:
        with self.lock:
            s, self.samples = self.samples, []
        return s

    def wait_idle(self, timeout_s: float) -> None:
        """Until every submitted request has finished (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.submitted <= self.done:
                    return
            time.sleep(0.01)
