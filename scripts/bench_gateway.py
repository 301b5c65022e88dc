"""Benchmark: what the service path costs over calling the engine directly.

Same model, same prompts, side by side in one run:

  engine   an LLMEngine in this process: add_request, step() until done
  gateway  HTTP -> gateway -> worker process -> gateway -> SSE, over the gateway's
           direct link to the worker (a Unix socket; --worker link=false: NATS),
           the gateway routing the one instance itself ([gateway]
           route_single_locally), with NATS, Redis, the estimator, one worker and
           the gateway each a separate process on free ports (started and stopped
           here)

Measures TTFT at concurrency 1 (--ttft-requests sequential requests, a short
answer each) and output tokens/s with --streams concurrent streams of exactly
--new-tokens tokens. The two paths alternate request by request (TTFT) and
round by round (throughput), so a change in background load hits both alike.
Each TTFT request follows an idle gap (--idle-ms, 50 by default: both sides start
cold, as at low load); the same requests are then also sent back to back (warm
processes, as under steady load) and reported beside them.
Prints the added TTFT p50/p99 and the tokens/s ratio (all rounds' tokens over all
their time, and beside it the median of each gateway round against the engine round
next to it, with their spread: a slow phase of the host that hit one side's rounds
shows there), the two targets' figures each with its 95% bootstrap interval over the
run's request pairs and round pairs (how far the host's noise leaves a run's figure
from what more runs would give; --pool combines runs' --out files into one figure and
interval), the added TTFT once more with each side's first step (the prefill's own
compute, the worker's from the batch samples it writes to Redis) taken out of each
request's TTFT: what the path adds around the compute, which a long prefill's noise
buries in the plain figure (JSON `outside_first_step`), and as anchors the bare
NATS request/reply time between two processes, the HTTP floor (the same client
against a server that answers at once: what HTTP alone adds, no gateway behind
it; also for the other client; and again against a server that answers once another
process, on the worker's CPU, has computed as long as the engine's first step: HTTP
and one hop there and back around a step that long, which costs more after a longer
wait on a VM) and the load average; JSON to --out:

  {"added_ttft_ms_p50": ..., "added_ttft_ms_p99": ..., "stream_tok_s_ratio": ...,
   "added_ttft_ms_p50_ci95": [low, high], "stream_tok_s_ratio_ci95": [low, high], ...}

It also takes the gateway TTFT apart (after the idle gap and back to back, p50) with
the gateway's own stamps from each answer's `baton` object: prepare (parse, chat
template, tokenize), route, submit -> first token at the gateway (the crossings to the
worker and back, its wake-up, the prefill step), and what is left of the client's
TTFT: HTTP both ways and the first chunk's SSE framing (JSON `gateway_ttft_split`).

With --breakdown a passive NATS subscriber also splits the gateway TTFT at the
two bus crossings (http->submit, worker, delta->sse; p50 of each: only for requests
that cross NATS, so with `--worker link=false`; by default they take the gateway's
direct link to the worker, shared/link.py), and each side's
throughput rounds are taken apart from the engines' batch samples (the in-process
engine's own, the worker's from Redis): steps per round, compute per step, the gap
between steps (time spent outside engine.step), the lead before the first step and
the tail after the last, so the tok/s ratio shows where it goes (the means printed and
in JSON `round_breakdown`, each round in order in `round_breakdown_each`).

With two CPUs or more the worker runs on a CPU of its own and every other process
of the run (this one, with the client) on the rest, as the cluster file's `cpus`
settings pin a deployment; the in-process engine runs on the worker's CPU (while
the worker idles), so both sides' engines compute on the same core (--cpus none:
the OS places everything; on 2 cores, alternated runs of the two gave the pinned
layout ~0.05 more of the engine's token rate and ~0.3 ms more added TTFT).

The client runs on the machine under test, so its CPU is taken from the
services it measures: by default it is aiohttp on uvloop (what vLLM's and SGLang's
serving benchmarks use), whose HTTP floor here is half httpx's (the openai SDK's
client; --client httpx measures with it).

Targets: added TTFT p50 <= 2 ms; the gateway keeps >= 90% of the
engine's token rate at 16 streams.

    python scripts/bench_gateway.py --model random-tiny --out results/bench_gateway.json
    python scripts/bench_gateway.py --pool results/run1.json results/run2.json
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp
import httpx
import msgspec
import numpy as np
import scipy.stats
import uvloop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.stats import percentile  # noqa: E402
from services.launcher.servers import free_port, start_nats, start_redis, stop_process_group  # noqa: E402
from shared.model_store import load_tokenizer  # noqa: E402
from shared.runtime import compact_cpus, exit_on_sigterm, freeze_heap  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.scheduling.scheduler import SchedulerConfig  # noqa: E402
from shared.scheduling.snapshot import BatchSample  # noqa: E402

SAMPLE_DECODER = msgspec.msgpack.Decoder(BatchSample)  # the worker's batch samples in Redis

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Summarize the plot of Romeo and Juliet.",
    "List four prime numbers and explain what makes them prime.",
    "How does a bicycle stay upright?",
]

CLUSTER = """
namespace = "bench"
nats_url = "{nats}"
redis_url = "{redis}"
server_cpus = {rest_cpus}
[gateway]
port = {port}
max_in_flight = 1024
cpus = {rest_cpus}
[estimator]
policy = "shortest-queue"
cpus = {rest_cpus}
[models.{model}]
dtype = "{dtype}"
[[instances]]
model = "{model}"
replicas = 1
cpus = {worker_cpus}
[instances.scheduler]
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = 512
num_kv_blocks = {num_kv_blocks}
max_model_len = 1024
"""


def p50_by_name(rows: Sequence[tuple[float, ...]], names: tuple[str, ...]) -> dict[str, float]:
    """{name_ms_p50: the p50 of that column of rows}, ms; {} without rows."""
    if not rows:
        return {}
    return {f"{name}_ms_p50": percentile([r[i] for r in rows], 50) for i, name in enumerate(names)}


# -- how precise a run is ----------------------------------------------------------
#
# On a shared 2-core VM one 16-stream round of the in-process engine alone ran at
# 3,760-6,070 tok/s within a run (random-tiny, 24 rounds), and a pure matmul loop
# pinned to one core varied 7% (CV) from one 0.3 s slice to the next: a run's ratio
# carries that noise. The bench says how much, with a bootstrap confidence interval
# over what it measured in pairs (scipy.stats.bootstrap, paired: each resample keeps
# a round's engine and gateway halves, or a TTFT request's two sides, together, so a
# slow phase of the host that hit both is not counted as a difference).

CI_LEVEL = 0.95
CI_RESAMPLES = 9999
RAW = ("ttft_ms", "round_tokens", "round_wall_s")  # a run's samples, per side
STEPS = "first_step_ms"  # and each TTFT request's first step, where every run has them
SAME = ("model", "dtype", "streams", "new_tokens")  # what pooled runs must share


def _ci(samples: tuple[Sequence[float] | Any, ...], statistic: Any) -> tuple[float, float] | None:
    """The CI_LEVEL percentile-bootstrap interval of `statistic` over paired samples
    (None with fewer than two pairs). Seeded: one run's numbers give one interval."""
    if len(samples[0]) < 2:
        return None
    res = scipy.stats.bootstrap(
        tuple(np.asarray(x, dtype=float) for x in samples),
        statistic,
        paired=True,
        vectorized=True,
        confidence_level=CI_LEVEL,
        n_resamples=CI_RESAMPLES,
        method="percentile",
        random_state=np.random.default_rng(0),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _rate_ratio(ne: Any, we: Any, ng: Any, wg: Any, axis: int = -1) -> Any:
    """The gateway's token rate over the engine's, each all its rounds' tokens over
    all their time (stream_tok_s_ratio)."""
    return (ng.sum(axis) / wg.sum(axis)) / (ne.sum(axis) / we.sum(axis))


def ratio_ci(
    engine_tokens: Sequence[float],
    engine_wall_s: Sequence[float],
    gateway_tokens: Sequence[float],
    gateway_wall_s: Sequence[float],
) -> tuple[float, float] | None:
    """The interval of the tok/s ratio, resampling round pairs."""
    return _ci((engine_tokens, engine_wall_s, gateway_tokens, gateway_wall_s), _rate_ratio)


def _added_p50(engine: Any, gateway: Any, axis: int = -1) -> Any:
    return np.percentile(gateway, 50, axis=axis) - np.percentile(engine, 50, axis=axis)


def _added_p50_outside(e_ttft: Any, e_step: Any, g_ttft: Any, g_step: Any, axis: int = -1) -> Any:
    return _added_p50(e_ttft - e_step, g_ttft - g_step, axis)


def outside_first_step(
    engine: Mapping[str, Any], gateway: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The added TTFT without the prefill's own time: each side's TTFT less its first
    step's compute (the request pairs where the worker's step was found), p50 and its
    interval, and each side's first step p50. Where the prefill is long (SmolLM2's
    ~80-130 ms here) its run-to-run noise buries the path's ~2 ms in the plain
    figure; this one is what the path adds around the compute. None without steps."""
    if STEPS not in engine or STEPS not in gateway:  # (a run from before they were kept)
        return None
    pairs = [
        (et, es, gt, gs)
        for et, es, gt, gs in zip(
            engine["ttft_ms"], engine[STEPS], gateway["ttft_ms"], gateway[STEPS], strict=True
        )
        if gs is not None
    ]
    if not pairs:
        return None
    e_ttft, e_step, g_ttft, g_step = (np.asarray(c, dtype=float) for c in zip(*pairs, strict=True))
    return {
        "added_ttft_ms_p50": float(_added_p50_outside(e_ttft, e_step, g_ttft, g_step)),
        "added_ttft_ms_p50_ci95": _ci((e_ttft, e_step, g_ttft, g_step), _added_p50_outside),
        "first_step_ms_p50": {
            "engine": float(np.percentile(e_step, 50)),
            "gateway": float(np.percentile(g_step, 50)),
        },
        "pairs": len(pairs),
    }


def added_p50_ci(
    engine_ms: Sequence[float], gateway_ms: Sequence[float]
) -> tuple[float, float] | None:
    """The interval of the added TTFT p50, resampling request pairs (the engine's i-th
    TTFT request and the gateway's ran back to back)."""
    return _ci((engine_ms, gateway_ms), _added_p50)


def chat_ids(tok: object, i: int) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])  # type: ignore[attr-defined]


# -- engine, in process ---------------------------------------------------------


class EngineSide:
    """The baseline: an LLMEngine driven directly in this process, on the worker's CPUs
    when the run pins them (the same core for both sides' engines)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.cpus: list[int] = args.worker_cpus
        from services.worker.engine.config import EngineConfig
        from services.worker.engine.engine import LLMEngine

        self.tok = load_tokenizer(args.model)
        cfg = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            threads=1,
            scheduler=SchedulerConfig(
                max_num_seqs=max(16, args.streams),
                num_kv_blocks=args.num_kv_blocks,
                max_model_len=1024,
            ),
        )
        self.engine = LLMEngine.create(cfg)
        self.num_requests = 0
        # the duration of each ttft_s request's first step (its prefill), s
        self.first_steps_s: list[float] = []

    def _add(self, i: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"r{self.num_requests}", chat_ids(self.tok, i), params)
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
        with self._on_cpus():
            return self._ttft_s(i, max_tokens)

    def streams(self, num: int, max_tokens: int) -> tuple[int, float]:
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


# -- through the gateway --------------------------------------------------------


class ServerSplit:
    """The gateway's own account of each TTFT request, from the `baton` object of its
    last chunk: `prepare_ms` (parse, chat template, tokenize), `router_overhead_ms` and
    `first_token_ms` (submit -> first token at the gateway: the crossings to the worker
    and back, its wake-up and the prefill step). What the client waited beyond them is
    HTTP both ways, the handler's start and the first chunk's SSE framing."""

    FIELDS = ("prepare_ms", "router_overhead_ms", "first_token_ms")
    NAMES = ("http_and_sse", "prepare", "route", "submit_to_first_token")

    def __init__(self) -> None:
        self.rows: list[tuple[float, ...]] = []

    def record(self, ttft_s: float, baton: dict[str, Any] | None) -> None:
        values = [None if baton is None else baton.get(f) for f in self.FIELDS]
        if all(isinstance(v, int | float) for v in values):
            parts = [float(v) for v in values]  # type: ignore[arg-type]
            self.rows.append((1e3 * ttft_s - sum(parts), *parts))

    def summary(self) -> dict[str, float]:
        """p50 of each part, ms (empty without rows)."""
        return p50_by_name(self.rows, self.NAMES)


class PathObserver:
    """--breakdown: a passive NATS subscriber on the worker's and the gateway's inboxes.

    It timestamps (in this process, on the same clock as the client) when each
    request's SubmitRequest crosses the bus and when its first token's DeltaBatch
    does, splitting the gateway-path TTFT into
      http->submit   HTTP parse, tokenize, route, publish + one NATS hop
      worker         NATS hop, worker wake-up, add_request, prefill step, publish
      delta->sse     NATS hop, gateway merge, detokenize, SSE chunk, HTTP to the client
    (each of the two bus crossings also pays this observer's own hop, equally).
    """

    def __init__(self) -> None:
        self.submit_at: dict[str, float] = {}
        self.first_delta_at: dict[str, float] = {}
        self.rows: list[tuple[float, float, float]] = []
        self._nc: object = None

    async def start(self, nats_url: str) -> None:
        import nats

        from shared.messages.gateway import DELTA_BATCH_DECODER, TokenDelta
        from shared.messages.worker import WORKER_INBOUND_DECODER, SubmitRequest

        async def on_submit(msg: object) -> None:
            now = time.perf_counter()
            inbound = WORKER_INBOUND_DECODER.decode(msg.data)  # type: ignore[attr-defined]
            if isinstance(inbound, SubmitRequest):
                self.submit_at[inbound.request_id] = now

        async def on_delta(msg: object) -> None:
            now = time.perf_counter()
            for ev in DELTA_BATCH_DECODER.decode(msg.data).events:  # type: ignore[attr-defined]
                if isinstance(ev, TokenDelta) and ev.token_ids:
                    self.first_delta_at.setdefault(ev.request_id, now)

        nc = await nats.connect(nats_url)
        await nc.subscribe("bench.worker.*.in", cb=on_submit)
        await nc.subscribe("bench.gateway.*.in", cb=on_delta)
        await nc.flush()
        self._nc = nc

    def record(self, request_id: str, t0: float, t_first: float) -> None:
        sub, delta = self.submit_at.pop(request_id, None), self.first_delta_at.pop(request_id, None)
        if sub is not None and delta is not None:
            self.rows.append((1e3 * (sub - t0), 1e3 * (delta - sub), 1e3 * (t_first - delta)))

    def summary(self) -> dict[str, float]:
        return p50_by_name(self.rows, ("http_to_submit", "worker", "delta_to_sse"))

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()  # type: ignore[attr-defined]


class RoundAnatomy:
    """--breakdown: one side's throughput rounds taken apart from its batch samples.

    A BatchSample stamps each engine iteration (wall_time_s at its start, duration_s of
    schedule + forward + sample), on the same clock (time.time) as the round's start
    and end here, so a round of `wall` seconds splits into
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
    """--breakdown: both sides' RoundAnatomy, fed after every throughput round; the
    worker's samples are read over `store` (connected by the caller, for the run)."""

    # the worker writes its samples with its snapshot, at most snapshot_interval_ms
    # (5 by default) after the step: wait this long before reading a round's last ones
    SAMPLES_SETTLE_S = 0.1

    def __init__(self, store: Any) -> None:  # shared.store.Store, namespace "bench"
        self.store = store
        self.sides = {"engine": RoundAnatomy(), "gateway": RoundAnatomy()}

    async def record(self, side: str, engine: EngineSide | None, t0: float, t1: float) -> None:
        """Add the round [t0, t1] of `side` ("engine": the in-process engine's samples,
        popped from `engine`; "gateway": the worker's newest, from Redis)."""
        if side == "engine":
            assert engine is not None
            samples = engine.engine.pop_batch_samples()
        else:
            await asyncio.sleep(self.SAMPLES_SETTLE_S)
            samples = await worker_samples(self.store, 2000)
        self.sides[side].add(samples, t0, t1)

    def summary(self) -> dict[str, dict[str, float]]:
        return {side: anatomy.summary() for side, anatomy in self.sides.items()}


CLIENTS = ("aiohttp", "httpx")
CLIENT_ERRORS = (OSError, aiohttp.ClientError, httpx.HTTPError)


class Client:
    """The benchmark's HTTP client: one connection pool of `kind` (CLIENTS)."""

    def __init__(self, kind: str, base_url: str, max_connections: int = 8) -> None:
        if kind not in CLIENTS:
            raise ValueError(f"client {kind!r}: use one of {', '.join(CLIENTS)}")
        self.kind, self.base_url, self.max_connections = kind, base_url, max_connections
        self._session: Any = None

    async def __aenter__(self) -> Client:
        if self.kind == "aiohttp":
            self._session = aiohttp.ClientSession(
                self.base_url,
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=600),
            )
        else:
            limits = httpx.Limits(
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
            )
            self._session = httpx.AsyncClient(base_url=self.base_url, timeout=600, limits=limits)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.kind == "aiohttp":
            await self._session.close()
        else:
            await self._session.aclose()

    @contextlib.asynccontextmanager
    async def post_stream(
        self, path: str, body: dict[str, Any]
    ) -> AsyncIterator[tuple[Mapping[str, str], AsyncIterator[bytes]]]:
        """POST `body` as JSON; yields the response headers and its lines (bytes)."""
        if self.kind == "aiohttp":
            async with self._session.post(path, json=body) as resp:
                resp.raise_for_status()
                yield resp.headers, resp.content.__aiter__()
        else:
            async with self._session.stream("POST", path, json=body) as resp:
                resp.raise_for_status()

                async def lines() -> AsyncIterator[bytes]:
                    async for line in resp.aiter_lines():
                        yield line.encode()

                yield resp.headers, lines()


async def stream_one(
    client: Client,
    i: int,
    max_tokens: int,
    observer: PathObserver | None = None,
    split: ServerSplit | None = None,
) -> tuple[float, int]:
    body = {
        "model": "bench-model",
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, num_tokens = 0.0, 0
    baton: dict[str, Any] | None = None
    async with client.post_stream("/v1/chat/completions", body) as (headers, lines):
        async for line in lines:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            # TTFT counts to the first chunk with content (not the empty role chunk)
            if not ttft and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            baton = chunk.get("baton", baton)
    if observer is not None and ttft:
        observer.record(headers["x-request-id"], t0, t0 + ttft)
    if split is not None and ttft:
        split.record(ttft, baton)
    return ttft or (time.perf_counter() - t0), num_tokens


async def gateway_streams(client: Client, num: int, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_one(client, i, max_tokens) for i in range(num)))
    return sum(n for _, n in results), time.perf_counter() - t0


async def measure(
    args: argparse.Namespace,
    engine: EngineSide,
    base_url: str,
    observer: PathObserver | None,
    rounds: RoundBreakdown | None = None,
) -> dict[str, dict[str, Any]]:
    """Alternate the two paths round by round, so background load drifts hit both alike."""
    ttft: dict[str, list[float]] = {"engine": [], "gateway": []}
    # the same requests back to back (no idle gap): warm processes, as under steady load
    warm: dict[str, list[float]] = {"engine": [], "gateway": []}
    tokens = {"engine": 0, "gateway": 0}
    wall = {"engine": 0.0, "gateway": 0.0}
    # per throughput round, in order: its tokens and its wall time, s
    round_tokens: dict[str, list[int]] = {"engine": [], "gateway": []}
    round_wall: dict[str, list[float]] = {"engine": [], "gateway": []}
    splits = {"after_idle": ServerSplit(), "back_to_back": ServerSplit()}
    engine_steps: list[float] = []  # each TTFT request's first step in process, s
    ttft_at: list[float] = []  # each gateway TTFT request's start, wall clock
    async with Client(args.client, base_url, args.streams + 4) as client:
        for i in range(3):  # warm-up both
            engine.ttft_s(i, args.ttft_tokens)
            await stream_one(client, i, args.ttft_tokens)
        # and one short round of all the streams each: the client opens its pool's
        # connections here (a client streaming at load keeps them open), not in round 1
        engine.streams(args.streams, 8)
        await gateway_streams(client, args.streams, 8)
        per_round = max(1, args.ttft_requests // args.rounds)
        for r in range(args.rounds):
            for i in range(per_round):
                # Both sides start from the same idle gap: a process that has slept
                # runs its first step on cold caches (measured: a random-tiny step
                # takes 1.7 ms back to back, 4.0 ms after 50 ms idle). Without the gap
                # the in-process engine would run hot and the worker cold.
                await asyncio.sleep(args.idle_ms / 1e3)
                ttft["engine"].append(engine.ttft_s(i, args.ttft_tokens))
                engine_steps.append(engine.first_steps_s[-1])
                await asyncio.sleep(args.idle_ms / 1e3)
                split = splits["after_idle"]
                ttft_at.append(time.time())  # (the worker's batch samples' clock)
                t, _ = await stream_one(client, i, args.ttft_tokens, observer, split)
                ttft["gateway"].append(t)
            for i in range(per_round):
                warm["engine"].append(engine.ttft_s(i, args.ttft_tokens))
                split = splits["back_to_back"]
                t, _ = await stream_one(client, i, args.ttft_tokens, None, split)
                warm["gateway"].append(t)
            for side in ("engine", "gateway") if r % 2 == 0 else ("gateway", "engine"):
                t_start = time.time()  # the batch samples' clock
                if side == "engine":
                    n, w = engine.streams(args.streams, args.new_tokens)
                else:
                    n, w = await gateway_streams(client, args.streams, args.new_tokens)
                if rounds is not None:
                    await rounds.record(side, engine, t_start, time.time())
                tokens[side] += n
                wall[side] += w
                round_tokens[side].append(n)
                round_wall[side].append(w)
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    out: dict[str, dict[str, Any]] = {
        side: {
            "ttft_ms_p50": 1e3 * percentile(ttft[side], 50),
            "ttft_ms_p50_back_to_back": 1e3 * percentile(warm[side], 50),
            "ttft_ms_p99_back_to_back": 1e3 * percentile(warm[side], 99),
            "ttft_ms_p99": 1e3 * percentile(ttft[side], 99),
            "tok_s": tokens[side] / wall[side],
            "round_tok_s": [
                n / w for n, w in zip(round_tokens[side], round_wall[side], strict=True)
            ],
            # the raw samples, for the confidence intervals and --pool
            "ttft_ms": [1e3 * t for t in ttft[side]],
            "round_tokens": round_tokens[side],
            "round_wall_s": round_wall[side],
            "num_tokens": tokens[side],
            "wall_s": wall[side],
        }
        for side in ("engine", "gateway")
    }
    out["gateway"]["ttft_split"] = {k: v.summary() for k, v in splits.items()}
    out["engine"]["first_step_ms"] = [1e3 * t for t in engine_steps]
    out["gateway"]["ttft_at_wall_s"] = ttft_at  # (run_measure matches the worker's steps)
    return out


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


async def worker_samples(store: Any, count: int) -> list[Any]:
    """The worker's newest `count` batch samples, oldest first, as it wrote them to
    Redis (Store.write_snapshot; the bench's namespace and instance id)."""
    return [SAMPLE_DECODER.decode(b) for b in await store.read_samples("bench-0", count)]


async def worker_first_steps(store: Any, gateway: dict[str, Any]) -> None:
    """Set gateway["first_step_ms"]: the worker's first step in each TTFT request (all
    its samples kept: 10,000 by default, a default run writes ~3,500)."""
    gateway["first_step_ms"] = first_steps_ms(
        await worker_samples(store, 1 << 20), gateway.pop("ttft_at_wall_s"), gateway["ttft_ms"]
    )


ECHO = """
import asyncio, sys
import nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await nc.publish(msg.reply, msg.data)
    await nc.subscribe("bench.echo", cb=echo)
    await asyncio.Event().wait()
asyncio.run(main())
"""


HTTP_FLOOR = """
import asyncio, os, socket, sys, time, uvloop
CHUNKS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\\n\\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\\n\\n',
    b'data: [DONE]\\n\\n',
]
HEAD = b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n"
STEP_US, CPUS = int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",") if c]
if STEP_US:  # a process that computes (spins) STEP_US for each request, as a worker's step
    here, there = socket.socketpair()
    if os.fork() == 0:
        here.close()
        if CPUS:
            os.sched_setaffinity(0, CPUS)
        while there.recv(1):  # (EOF: the server is gone)
            end = time.perf_counter() + STEP_US / 1e6
            while time.perf_counter() < end:
                pass
            there.send(b"k")
        os._exit(0)
    there.close()
WAITING = []  # transports whose answer waits for the step, in order
def answer(transport):
    # headers, role chunk and content chunk as separate writes, as the gateway sends them
    transport.write(HEAD)
    for c in CHUNKS:
        transport.write(b"%x\\r\\n" % len(c) + c + b"\\r\\n")
    transport.write(b"0\\r\\n\\r\\n")
class StepDone(asyncio.Protocol):
    def data_received(self, data):
        for _ in data:
            answer(WAITING.pop(0))
class Answer(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        while b"\\r\\n\\r\\n" in self.buf:
            head, _, rest = self.buf.partition(b"\\r\\n\\r\\n")
            length = 0
            for line in head.split(b"\\r\\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            if STEP_US:
                WAITING.append(self.transport)
                STEP.write(b"s")
            else:
                answer(self.transport)
async def main():
    global STEP
    loop = asyncio.get_running_loop()
    if STEP_US:
        STEP, _ = await loop.create_connection(StepDone, sock=here)
    server = await loop.create_server(Answer, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
uvloop.run(main())
"""


@contextlib.asynccontextmanager
async def floor_server(step_ms: float = 0.0, cpus: Sequence[int] = ()) -> AsyncIterator[str]:
    """The HTTP floor's server (uvloop, no framework): it answers a chat stream at once,
    or with `step_ms` once a process on `cpus` has computed that long (a worker's step,
    and its hop there and back). Yields its base URL."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HTTP_FLOOR,
            str(port),
            str(round(step_ms * 1e3)),
            ",".join(map(str, cpus)),
        ],
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(server, 5)


async def _first_answer(client: Client) -> None:
    """Wait until the server started by floor_server answers."""
    for _ in range(100):
        try:
            await stream_one(client, 0, 1)
            return
        except CLIENT_ERRORS:
            await asyncio.sleep(0.05)


async def http_floor_ms(args: argparse.Namespace, count: int = 100) -> dict[str, list[float]]:
    """TTFT of each client against a server that answers at once (no work): the part of
    the added TTFT that HTTP alone costs here. The clients alternate request by request."""
    async with (
        floor_server() as base,
        Client("aiohttp", base) as a,
        Client("httpx", base) as h,
    ):
        clients = {"aiohttp": a, "httpx": h}
        await _first_answer(a)
        ttfts: dict[str, list[float]] = {kind: [] for kind in clients}
        for i in range(count):
            for kind, client in clients.items():
                await asyncio.sleep(args.idle_ms / 1e3)  # the TTFT runs' idle gap
                ttfts[kind].append(1e3 * (await stream_one(client, i, 1))[0])
        return ttfts


async def http_floor_after_step_ms(
    args: argparse.Namespace, step_ms: float, count: int = 60
) -> list[float]:
    """args.client's TTFT, less `step_ms`, against a server that answers once a process
    on the worker's CPUs has computed for `step_ms` (floor_server): what one request's
    HTTP and a hop to that CPU and back cost when the answer takes a step that long. A
    wait idles the other CPUs, and waking from a longer idle costs more on a VM (a
    halted vCPU, caches taken by other guests): the floor that the added TTFT outside
    the 1st step compares with."""
    async with (
        floor_server(step_ms, args.worker_cpus) as base,
        Client(args.client, base) as client,
    ):
        await _first_answer(client)
        ttfts: list[float] = []
        for i in range(count):
            await asyncio.sleep(args.idle_ms / 1e3)  # the TTFT runs' idle gap
            ttfts.append(1e3 * (await stream_one(client, i, 1))[0] - step_ms)
        return ttfts


async def nats_rtt_ms(nats_url: str, count: int = 200) -> list[float]:
    """Round trips to an echo process: the price of one process hop on this machine now."""
    import nats

    echo = subprocess.Popen([sys.executable, "-c", ECHO, nats_url], start_new_session=True)
    nc = await nats.connect(nats_url)
    try:
        for _ in range(100):
            try:
                await nc.request("bench.echo", b"x", timeout=0.2)
                break
            except Exception:
                await asyncio.sleep(0.05)
        rtts = []
        for _ in range(count):
            t0 = time.perf_counter()
            await nc.request("bench.echo", b"x", timeout=2)
            rtts.append(1e3 * (time.perf_counter() - t0))
            await asyncio.sleep(0.002)
        return rtts
    finally:
        await nc.close()
        stop_process_group(echo, 5)


async def run_measure(
    args: argparse.Namespace, engine: EngineSide, stack: Stack
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """The measurements, and with --breakdown their split: {"ttft": PathObserver's,
    "rounds": RoundBreakdown's means, "rounds_each": each side's rounds}."""
    from shared.store import Store

    store = Store(stack.redis_url, "bench")  # the worker's batch samples
    await store.connect()
    try:
        if not args.breakdown:
            measured = await measure(args, engine, stack.base_url, None)
            await worker_first_steps(store, measured["gateway"])
            return measured, None
        observer, rounds = PathObserver(), RoundBreakdown(store)
        await observer.start(stack.nats_url)
        try:
            measured = await measure(args, engine, stack.base_url, observer, rounds)
            await worker_first_steps(store, measured["gateway"])
        finally:
            await observer.close()
    finally:
        await store.close()
    return measured, {
        "ttft": observer.summary() if observer.rows else {},
        "rounds": rounds.summary(),
        "rounds_each": {side: anatomy.rounds for side, anatomy in rounds.sides.items()},
    }


def cpu_layout(mode: str) -> tuple[list[int], list[int]]:
    """(the worker's CPUs, everyone else's) for --cpus; ([], []): no pinning.

    auto, with two CPUs or more: the worker on the last one alone (and the in-process
    engine when it runs: EngineSide), the gateway, the estimator, NATS, Redis and this
    process (the client, the anchors' servers) on the others, as a deployment that
    pins its workers runs them (shared.runtime.pin_cpus)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if mode == "none" or len(allowed) < 2:
        return [], []
    return allowed[-1:], allowed[:-1]


class Stack(NamedTuple):
    """The services run_stack started."""

    procs: list[subprocess.Popen[bytes]]  # NATS, Redis, estimator, worker, gateway
    base_url: str  # the gateway's
    nats_url: str
    redis_url: str


def run_stack(args: argparse.Namespace, work: Path) -> Stack:
    nats = start_nats("127.0.0.1", None, work / "nats", cpus=args.rest_cpus)
    # as the launcher starts it: the stack's processes on its Unix socket
    redis = start_redis("127.0.0.1", None, cpus=args.rest_cpus, unix_socket=work / "redis.sock")
    port = free_port()
    text = CLUSTER.format(
        nats=nats.url,
        redis=redis.url_here,
        port=port,
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=max(16, args.streams),
        num_kv_blocks=args.num_kv_blocks,
        worker_cpus=args.worker_cpus,
        rest_cpus=args.rest_cpus,
    )
    text = text.replace(
        "[estimator]", '[presets.bench-model]\nmodels = ["' + args.model + '"]\n[estimator]'
    )
    if args.worker:  # [worker] settings under test, e.g. max_inline_step_ms=0
        text += "\n[worker]\n" + "".join(f"{kv}\n" for kv in args.worker)
    cluster = work / "cluster.toml"
    cluster.write_text(text)
    env = {
        **os.environ,
        "BATON_CLUSTER": str(cluster),
        "OMP_NUM_THREADS": "1",
        "BATON_LOG_LEVEL": "warning",
    }
    procs = [nats.process, redis.process]
    try:
        for cmd in (
            ["services.estimator"],
            ["services.worker", "--model", args.model, "--instance-id", "bench-0"],
            ["services.gateway"],
        ):
            log = open(work / f"{cmd[0]}.log", "ab")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", *cmd],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    return Stack(procs, base, nats.url, redis.url_here)
            except httpx.HTTPError:
                pass
            for name, proc in zip(("estimator", "worker", "gateway"), procs[2:], strict=True):
                if proc.poll() is not None:  # e.g. a cluster setting the worker refuses
                    tail = (work / f"services.{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the {name} exited ({proc.returncode}) at start:\n{tail}")
            time.sleep(0.2)
        raise RuntimeError(f"the stack did not become ready; logs in {work}")
    except BaseException:  # a service that failed to start, a SIGTERM, Ctrl-C
        for p in reversed(procs):
            stop_process_group(p, 15)
        raise


def main() -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="random-tiny", help="random-tiny (default) | smollm2-135m | ..."
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="engine dtype on both sides (default float32, comparable across machines; "
        "auto = what a worker serves: bf16 where the CPU computes it, else fp32)",
    )
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams for tokens/s")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument(
        "--ttft-requests", type=int, default=50, help="sequential requests for TTFT"
    )
    parser.add_argument("--ttft-tokens", type=int, default=2, help="tokens per TTFT request")
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=50.0,
        help="idle gap before every TTFT request on both sides, ms (0 = back to back)",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument(
        "--rounds",
        type=int,
        default=24,
        help="alternating engine/gateway throughput rounds (default 24: a 16-stream round "
        "of random-tiny lasts ~0.3-0.5 s and one round pair's ratio spreads 0.79-1.05 on a "
        "noisy 2-core host; 6 gave run ratios of 0.79-0.96, 12 of 0.895-0.970)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also split the gateway TTFT at the two bus crossings (a passive NATS observer)",
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="aiohttp",
        help="the benchmark's HTTP client (default aiohttp; httpx: the openai SDK's)",
    )
    parser.add_argument(
        "--cpus",
        choices=("auto", "none"),
        default="auto",
        help="auto (default, with 2+ CPUs): the worker pinned to a CPU of its own, every "
        "other process of the run to the rest; none: the OS places them",
    )
    parser.add_argument("--out", type=Path, default=None, help="write JSON here")
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [worker] setting of the cluster file (TOML value), e.g. max_inline_step_ms=0",
    )
    parser.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="run nothing: combine earlier runs' --out files (same model, dtype, streams, "
        "tokens) into the two figures and their intervals over all their samples",
    )
    args = parser.parse_args()
    if args.pool:
        return pool(args.pool, args.out)
    args.worker_cpus, args.rest_cpus = cpu_layout(args.cpus)
    layout = "not pinned"
    if args.worker_cpus:
        os.sched_setaffinity(0, args.rest_cpus)  # this process; its children inherit it
        layout = (
            f"worker (and the in-process engine) on CPU {compact_cpus(args.worker_cpus)}, "
            f"everything else on CPU {compact_cpus(args.rest_cpus)}"
        )

    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        print(f"CPUs: {layout}", flush=True)
        print("starting nats, redis, estimator, worker, gateway ...", flush=True)
        stack = run_stack(args, Path(tmp))
        try:
            print(f"loading {args.model} ({args.dtype}) in process too ...", flush=True)
            engine_side = EngineSide(args)
            # As the services do once ready (shared/runtime.py): without it a full
            # collection here walked torch's and the model's objects for ~150 ms in the
            # middle of a round (seen in every 30-round run, mostly in a gateway round,
            # whose client allocates the most), a stall of this process's client or
            # in-process engine that neither path causes.
            freeze_heap()
            measured, breakdown = uvloop.run(run_measure(args, engine_side, stack))
            engine, gateway = measured["engine"], measured["gateway"]
            rtts = uvloop.run(nats_rtt_ms(stack.nats_url))
            floors = uvloop.run(http_floor_ms(args))
            step_ms = percentile(engine[STEPS], 50)  # the TTFT requests' prefills
            floor_after_step = uvloop.run(http_floor_after_step_ms(args, step_ms))
        finally:
            for p in reversed(stack.procs):
                stop_process_group(p, 15)
    floor = floors[args.client]
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "client": args.client,
        "streams": args.streams,
        "worker_settings": args.worker,
        "cpus": layout,
        "new_tokens": args.new_tokens,
        "idle_ms_before_ttft_request": args.idle_ms,
        "engine": engine,
        "gateway": gateway,
        "added_ttft_ms_p50": gateway["ttft_ms_p50"] - engine["ttft_ms_p50"],
        "added_ttft_ms_p99": gateway["ttft_ms_p99"] - engine["ttft_ms_p99"],
        "stream_tok_s_ratio": gateway["tok_s"] / engine["tok_s"],
        # each gateway round against the engine round next to it (they alternate): a
        # slow phase of the host that hits one side's rounds shows as a spread here
        "stream_tok_s_ratio_by_round": [
            g / e for g, e in zip(gateway["round_tok_s"], engine["round_tok_s"], strict=True)
        ],
        "added_ttft_ms_p50_back_to_back": gateway["ttft_ms_p50_back_to_back"]
        - engine["ttft_ms_p50_back_to_back"],
        "added_ttft_ms_p99_back_to_back": gateway["ttft_ms_p99_back_to_back"]
        - engine["ttft_ms_p99_back_to_back"],
        # anchor: one bare NATS request/reply between two processes, measured in this run
        "nats_rtt_ms_p50": percentile(rtts, 50),
        "nats_rtt_ms_p99": percentile(rtts, 99),
        # anchor: the same HTTP client against a server that answers at once
        "http_floor_ttft_ms_p50": percentile(floor, 50),
        "http_floor_ttft_ms_p99": percentile(floor, 99),
        "http_floor_ttft_ms_p50_by_client": {k: percentile(v, 50) for k, v in floors.items()},
        # the same, answered once a process on the worker's CPUs computed as long as the
        # in-process engine's 1st step p50 (http_floor_after_step_ms), less that step
        "http_floor_step_ms": step_ms,
        "http_floor_after_step_ms_p50": percentile(floor_after_step, 50),
        "http_floor_after_step_ms_p99": percentile(floor_after_step, 99),
        "load_average_1m": os.getloadavg()[0],
        # the gateway TTFT taken apart by the gateway's own stamps (ServerSplit)
        "gateway_ttft_split": gateway["ttft_split"],
        **intervals(engine, gateway),
    }
    if breakdown is not None:
        result["gateway_ttft_breakdown"] = breakdown["ttft"]
        result["round_breakdown"] = breakdown["rounds"]
        result["round_breakdown_each"] = breakdown["rounds_each"]  # per round, in order
    print(f"\n{'':24}{'engine':>12}{'gateway':>12}{'added/ratio':>14}")
    print(
        f"{'TTFT p50 (ms)':24}{engine['ttft_ms_p50']:12.2f}{gateway['ttft_ms_p50']:12.2f}"
        f"{result['added_ttft_ms_p50']:+14.2f}   target <= +2 ms"
    )
    print_ci("added_ttft_ms_p50_ci95", result, "+.2f", f"{len(engine['ttft_ms'])} request pairs")
    print_outside(result["outside_first_step"])
    print(
        f"{'TTFT p99 (ms)':24}{engine['ttft_ms_p99']:12.2f}{gateway['ttft_ms_p99']:12.2f}"
        f"{result['added_ttft_ms_p99']:+14.2f}"
    )
    print(
        f"{'  back to back, p50':24}{engine['ttft_ms_p50_back_to_back']:12.2f}"
        f"{gateway['ttft_ms_p50_back_to_back']:12.2f}"
        f"{result['added_ttft_ms_p50_back_to_back']:+14.2f}   (no idle gap: warm processes)"
    )
    print(
        f"{f'tok/s @ {args.streams} streams':24}{engine['tok_s']:12.1f}{gateway['tok_s']:12.1f}"
        f"{result['stream_tok_s_ratio']:14.3f}   target >= 0.90"
    )
    print_ci("stream_tok_s_ratio_ci95", result, ".3f", f"{args.rounds} round pairs")
    by_round = result["stream_tok_s_ratio_by_round"]
    print(
        f"{'  per round pair':24}{'':24}{percentile(by_round, 50):14.3f}   median; "
        f"{min(by_round):.3f}-{max(by_round):.3f} over {len(by_round)} pairs"
    )
    print(
        f"{'NATS RTT (ms), anchor':24}{'':12}{result['nats_rtt_ms_p50']:12.2f}"
        f"   p99 {result['nats_rtt_ms_p99']:.2f}; load average {result['load_average_1m']:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    print(
        f"{'HTTP floor TTFT (ms)':24}{'':12}{result['http_floor_ttft_ms_p50']:12.2f}"
        f"   p99 {result['http_floor_ttft_ms_p99']:.2f}; the client ({args.client}) against a "
        "server that answers at once; p50 by client: "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["http_floor_ttft_ms_p50_by_client"].items())
    )
    print(
        f"{'  after a step, less it':24}{'':12}{result['http_floor_after_step_ms_p50']:12.2f}"
        f"   p99 {result['http_floor_after_step_ms_p99']:.2f}; answered once a process on "
        f"the worker's CPU computed {result['http_floor_step_ms']:.2f} ms (the engine's 1st step p50): HTTP and "
        "a hop there and back, to set beside the added TTFT outside the 1st step"
    )
    for mode, parts in result["gateway_ttft_split"].items():
        if parts:
            print(
                f"gateway TTFT p50 parts, {mode.replace('_', ' ')} (ms): "
                + ", ".join(f"{k.removesuffix('_ms_p50')} {v:.2f}" for k, v in parts.items())
            )
    print(f"CPUs: {layout}")
    if breakdown is not None:
        split = breakdown["ttft"]
        print(
            "gateway TTFT p50 split (ms): "
            + ", ".join(f"{k.removesuffix('_ms_p50')} {v:.2f}" for k, v in split.items())
            if split
            else "gateway TTFT split: none (it times the NATS crossings; requests took the "
            "direct link: --worker link=false sends them over NATS)"
        )
        print_round_breakdown(breakdown["rounds"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    return 0


def intervals(engine: Mapping[str, Any], gateway: Mapping[str, Any]) -> dict[str, Any]:
    """The bootstrap intervals of the two targets' figures from a run's raw samples
    (null where too few)."""
    return {
        "added_ttft_ms_p50_ci95": added_p50_ci(engine["ttft_ms"], gateway["ttft_ms"]),
        "outside_first_step": outside_first_step(engine, gateway),
        "stream_tok_s_ratio_ci95": ratio_ci(
            engine["round_tokens"],
            engine["round_wall_s"],
            gateway["round_tokens"],
            gateway["round_wall_s"],
        ),
    }


def pool(paths: list[Path], out: Path | None) -> int:
    """--pool: the figures over several runs' samples together, each run's beside them.
    (The intervals treat every pair as drawn alike, so they do not widen for a run
    that ran in a slower phase than the others.)"""
    runs: list[dict[str, Any]] = []
    for path in paths:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"error: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if not all(k in run.get(side, {}) for side in ("engine", "gateway") for k in RAW):
            print(
                f"error: {path} holds no raw samples (written before bench_gateway kept "
                "them): run it again",
                file=sys.stderr,
            )
            return 2
        runs.append(run)
    kinds = {tuple(run[k] for k in SAME) for run in runs}
    if len(kinds) > 1:
        print(f"error: the runs differ in {', '.join(SAME)}: {sorted(kinds)}", file=sys.stderr)
        return 2
    raw = (
        (*RAW, STEPS)
        if all(STEPS in run[s] for run in runs for s in ("engine", "gateway"))
        else RAW
    )
    joined = {
        side: {k: [x for run in runs for x in run[side][k]] for k in raw}
        for side in ("engine", "gateway")
    }
    engine, gateway = joined["engine"], joined["gateway"]
    result: dict[str, Any] = {
        **dict(zip(SAME, kinds.pop(), strict=True)),
        "runs": [str(p) for p in paths],
        "added_ttft_ms_p50": float(_added_p50(*arrays(engine, gateway, "ttft_ms"))),
        "stream_tok_s_ratio": float(
            _rate_ratio(*arrays(engine, gateway, "round_tokens", "round_wall_s"))
        ),
        **intervals(engine, gateway),
    }
    print(f"{'run':40}{'added TTFT p50':>16}{'tok/s ratio':>14}")
    for path, run in zip(paths, runs, strict=True):
        print(
            f"{str(path)[-40:]:40}{run['added_ttft_ms_p50']:+16.2f}"
            f"{run['stream_tok_s_ratio']:14.3f}"
        )
    print(
        f"{f'pooled ({len(runs)} runs)':40}{result['added_ttft_ms_p50']:+16.2f}"
        f"{result['stream_tok_s_ratio']:14.3f}   targets <= +2 ms, >= 0.90"
    )
    interval = f"{CI_LEVEL:.0%} interval"
    print_ci(
        "added_ttft_ms_p50_ci95",
        result,
        "+.2f",
        f"{len(engine['ttft_ms'])} request pairs",
        label=f"  added TTFT, {interval}",
    )
    print_ci(
        "stream_tok_s_ratio_ci95",
        result,
        ".3f",
        f"{len(engine['round_tokens'])} round pairs",
        label=f"  tok/s ratio, {interval}",
    )
    if STEPS in raw:
        print_outside(result["outside_first_step"])
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out}")
    return 0


def arrays(engine: Mapping[str, Any], gateway: Mapping[str, Any], *keys: str) -> list[Any]:
    """The samples under `keys`, the engine's then the gateway's, as float arrays: the
    argument order of the statistics (_added_p50, _rate_ratio)."""
    return [np.asarray(side[k], dtype=float) for side in (engine, gateway) for k in keys]


def print_outside(outside: Mapping[str, Any] | None) -> None:
    """The added TTFT less each side's prefill step (outside_first_step)."""
    if outside is None:
        print("  outside the 1st step: no worker batch samples matched the TTFT requests")
        return
    ci, steps = outside["added_ttft_ms_p50_ci95"], outside["first_step_ms_p50"]
    interval = f"95% {ci[0]:+.2f} to {ci[1]:+.2f}; " if ci else ""
    print(
        f"{'  outside the 1st step':24}{'':24}{outside['added_ttft_ms_p50']:+14.2f}   "
        f"{interval}1st step p50 {steps['engine']:.2f} / {steps['gateway']:.2f} ms"
    )


def print_ci(key: str, result: Mapping[str, Any], fmt: str, over: str, label: str = "") -> None:
    """A figure's interval (result[key]) on a line of its own, in the table's columns."""
    ci = result[key]
    if ci is not None:
        text = f"{format(ci[0], fmt)} to {format(ci[1], fmt)}"
        label = label or f"  {CI_LEVEL:.0%} interval"
        print(f"{label:40}{'':8}{text:>14}   bootstrap over {over}")


def print_round_breakdown(sides: dict[str, dict[str, float]]) -> None:
    """RoundBreakdown's means per throughput round, the two sides side by side."""
    if not all(sides.values()):
        print("throughput rounds: no batch samples in the rounds' windows")
        return
    rows = (
        ("lead before the 1st step (ms)", "lead_ms", ".2f"),
        ("steps", "steps", ".1f"),
        ("compute per step (ms)", "step_ms", ".3f"),
        ("  decode-only, full batch p50", "decode_step_ms_p50", ".3f"),
        ("gap between steps p50 (us)", "gap_us_p50", ".0f"),
        ("gaps in all (ms)", "gaps_ms", ".1f"),
        ("tail after the last step (ms)", "tail_ms", ".2f"),
        ("round (ms)", "wall_ms", ".1f"),
        ("steps with prompt tokens", "prefill_steps", ".1f"),
        ("1st step -> last prompt's (ms)", "intake_ms", ".2f"),
    )
    print(
        f"{'throughput round, mean (batch samples)':34}{'engine':>12}{'gateway':>12}{'added':>14}"
    )
    for label, key, fmt in rows:
        e, g = sides["engine"][key], sides["gateway"][key]
        print(f"  {label:32}{e:12{fmt}}{g:12{fmt}}{g - e:+14{fmt}}")


if __name__ == "__main__":
    sys.exit(main())
