"""The gateway benchmark's baseline: an LLMEngine driven directly in this process."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from bench.gateway_settings import Settings, prompt
from shared.model_store import load_tokenizer
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig


class EngineSide:
    """add_request, then step() until done, on the worker's CPUs when the run pins
    them (the same core for both sides' engines). The engine is built as the worker
    builds its own: one torch thread, the same scheduler limits."""

    def __init__(self, settings: Settings) -> None:
        self.cpus = settings.worker_cpus
        from services.worker.engine.config import EngineConfig
        from services.worker.engine.engine import LLMEngine

        self.tok = load_tokenizer(settings.model)
        cfg = EngineConfig(
            model=settings.model,
            dtype=settings.dtype,
            threads=1,
            scheduler=SchedulerConfig(
                max_num_seqs=settings.max_num_seqs,
                num_kv_blocks=settings.num_kv_blocks,
                max_model_len=1024,
            ),
        )
        self.engine = LLMEngine.create(cfg)
        self.num_requests = 0
        # the duration of each ttft_s request's first step (its prefill), s
        self.first_steps_s: list[float] = []

    def _add(self, i: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = self.tok.apply_chat_template([{"role": "user", "content": prompt(i)}])
        self.engine.add_request(f"r{self.num_requests}", ids, params)
        self.num_requests += 1

    @contextlib.contextmanager
    def _on_cpus(self) -> Iterator[None]:
        """Run this thread (the engine runs in it: one torch thread) on the worker's CPUs."""
        if not self.cpus:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cpus)
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)

    def ttft_s(self, i: int, max_tokens: int) -> float:
        """The i-th prompt alone: the time to its first token, s."""
        with self._on_cpus():
            return self._ttft_s(i, max_tokens)

    def streams(self, num: int, max_tokens: int) -> tuple[int, float]:
        """`num` prompts at once, each to `max_tokens`: (tokens, wall time in s)."""
        with self._on_cpus():
            return self._streams(num, max_tokens)

    def _ttft_s(self, i: int, max_tokens: int) -> float:
        self.engine.pop_batch_samples()  # (earlier rounds': --breakdown has read them)
        t0 = time.perf_counter()
        self._add(i, max_tokens)
        first = 0.0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if not first and out.new_token_ids:
                    first = time.perf_counter() - t0
        self.first_steps_s.append(self.engine.pop_batch_samples()[0].duration_s)
        return first

    def _streams(self, num: int, max_tokens: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        for i in range(num):
            self._add(i, max_tokens)
        num_tokens = 0
        while self.engine.has_unfinished():
            num_tokens += sum(len(o.new_token_ids) for o in self.engine.step())
        return num_tokens, time.perf_counter() - t0
