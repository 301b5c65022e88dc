"""Benchmark: what the service path costs over calling the engine directly.

Same model, same prompts, side by side in one run:

  engine   an LLMEngine in this process: add_request, step() until done
  gateway  HTTP -> gateway -> worker process -> gateway -> SSE, over the gateway's
           direct link to the worker (a Unix socket; --worker link=false: NATS),
           the gateway routing the one instance itself ([gateway]
           route_single_locally), with NATS, Redis, the estimator, one worker and
           the gateway each a separate process on free ports (started and stopped
           here by the launcher, services/launcher, as `./baton up` starts them)

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
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import uvloop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gateway_anchors import measure_anchors  # noqa: E402
from bench.gateway_client import CLIENTS  # noqa: E402
from bench.gateway_engine import EngineSide  # noqa: E402
from bench.gateway_measure import run_measure, run_result  # noqa: E402
from bench.gateway_settings import Settings, cpu_layout  # noqa: E402
from bench.gateway_stack import launched_stack  # noqa: E402
from bench.gateway_stats import CI_LEVEL, STEPS, PoolError, has_steps, pooled  # noqa: E402
from bench.stats import percentile  # noqa: E402
from shared.runtime import compact_cpus, exit_on_sigterm, freeze_heap  # noqa: E402

DEFAULTS = Settings()

# (flag, help) of the options that set the Settings field of their name, with its
# type and default
FIELD_OPTIONS = (
    ("--model", "random-tiny (default) | smollm2-135m | ..."),
    (
        "--dtype",
        "engine dtype on both sides (default float32, comparable across machines; "
        "auto = what a worker serves: bf16 where the CPU computes it, else fp32)",
    ),
    ("--streams", "concurrent streams for tokens/s (default 16)"),
    ("--new-tokens", "tokens per stream (default 128)"),
    ("--ttft-requests", "sequential requests for TTFT (default 50)"),
    ("--ttft-tokens", "tokens per TTFT request (default 2)"),
    (
        "--idle-ms",
        "idle gap before every TTFT request on both sides, ms (default 50; 0 = back to back)",
    ),
    ("--num-kv-blocks", "KV cache blocks of both engines (default 1024)"),
    (
        "--rounds",
        "alternating engine/gateway throughput rounds (default 24: a 16-stream round "
        "of random-tiny lasts ~0.3-0.5 s and one round pair's ratio spreads 0.79-1.05 on a "
        "noisy 2-core host; 6 gave run ratios of 0.79-0.96, 12 of 0.895-0.970)",
    ),
)


def field_name(flag: str) -> str:
    """The Settings field (and argparse dest) of a FIELD_OPTIONS flag."""
    return flag.removeprefix("--").replace("-", "_")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag, text in FIELD_OPTIONS:
        default = getattr(DEFAULTS, field_name(flag))
        p.add_argument(flag, type=type(default), default=default, help=text)
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also split the gateway TTFT at the two bus crossings (a passive NATS observer)",
    )
    p.add_argument(
        "--client",
        choices=CLIENTS,
        default=DEFAULTS.client,
        help="the benchmark's HTTP client (default aiohttp; httpx: the openai SDK's)",
    )
    p.add_argument(
        "--cpus",
        choices=("auto", "none"),
        default="auto",
        help="auto (default, with 2+ CPUs): the worker pinned to a CPU of its own, every "
        "other process of the run to the rest; none: the OS places them",
    )
    p.add_argument("--out", type=Path, default=None, help="write JSON here")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [worker] setting of the cluster file (TOML value), e.g. max_inline_step_ms=0",
    )
    p.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="run nothing: combine earlier runs' --out files (same model, dtype, streams, "
        "tokens) into the two figures and their intervals over all their samples",
    )
    return p


def main() -> int:
    exit_on_sigterm()
    args = parser().parse_args()
    if args.pool:
        return pool(args.pool, args.out)
    worker_cpus, rest_cpus = cpu_layout(args.cpus)
    settings = Settings(
        **{field_name(flag): getattr(args, field_name(flag)) for flag, _ in FIELD_OPTIONS},
        client=args.client,
        breakdown=args.breakdown,
        worker=tuple(args.worker),
        worker_cpus=worker_cpus,
        rest_cpus=rest_cpus,
    )
    layout = "not pinned"
    if worker_cpus:
        os.sched_setaffinity(0, rest_cpus)  # this process; its children inherit it
        layout = (
            f"worker (and the in-process engine) on CPU {compact_cpus(worker_cpus)}, "
            f"everything else on CPU {compact_cpus(rest_cpus)}"
        )
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        print(f"CPUs: {layout}", flush=True)
        print("starting nats, redis, estimator, worker, gateway (the launcher) ...", flush=True)
        with launched_stack(settings, Path(tmp)) as stack:
            print(f"loading {settings.model} ({settings.dtype}) in process too ...", flush=True)
            engine_side = EngineSide(settings)
            # As the services do once ready (shared/runtime.py): without it a full
            # collection here walked torch's and the model's objects for ~150 ms in the
            # middle of a round (seen in every 30-round run, mostly in a gateway round,
            # whose client allocates the most), a stall of this process's client or
            # in-process engine that neither path causes.
            freeze_heap()
            measured, breakdown = uvloop.run(run_measure(settings, engine_side, stack))
            step_ms = percentile(measured["engine"][STEPS], 50)  # the TTFT requests' prefills
            anchors = measure_anchors(settings, stack.nats_url, step_ms)
    result = run_result(settings, layout, measured, breakdown, anchors)
    print_run(result, settings)
    print(f"CPUs: {layout}")
    if breakdown is not None:
        print_breakdown(breakdown)
    write(result, args.out)
    return 0


def write(result: Mapping[str, Any], out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out}")


def print_run(result: Mapping[str, Any], settings: Settings) -> None:
    """The run's table: each side's figures, the added TTFT and the ratio, the anchors."""
    engine, gateway = result["engine"], result["gateway"]
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
        f"{f'tok/s @ {settings.streams} streams':24}{engine['tok_s']:12.1f}"
        f"{gateway['tok_s']:12.1f}{result['stream_tok_s_ratio']:14.3f}   target >= 0.90"
    )
    print_ci("stream_tok_s_ratio_ci95", result, ".3f", f"{settings.rounds} round pairs")
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
        f"   p99 {result['http_floor_ttft_ms_p99']:.2f}; the client ({settings.client}) against "
        "a server that answers at once; p50 by client: "
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
            print(f"gateway TTFT p50 parts, {mode.replace('_', ' ')} (ms): " + p50_parts(parts))


def p50_parts(parts: Mapping[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_ms_p50')} {v:.2f}" for k, v in parts.items())


def print_breakdown(breakdown: Mapping[str, Any]) -> None:
    """--breakdown: the TTFT split at the bus crossings and the throughput rounds."""
    split = breakdown["ttft"]
    print(
        "gateway TTFT p50 split (ms): " + p50_parts(split)
        if split
        else "gateway TTFT split: none (it times the NATS crossings; requests took the "
        "direct link: --worker link=false sends them over NATS)"
    )
    print_round_breakdown(breakdown["rounds"])


def pool(paths: list[Path], out: Path | None) -> int:
    """--pool: the figures over several runs' samples together, each run's beside them."""
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            runs[str(path)] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"error: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    try:
        result = pooled(runs)
    except PoolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{'run':40}{'added TTFT p50':>16}{'tok/s ratio':>14}")
    for name, run in runs.items():
        print(f"{name[-40:]:40}{run['added_ttft_ms_p50']:+16.2f}{run['stream_tok_s_ratio']:14.3f}")
    print(
        f"{f'pooled ({len(runs)} runs)':40}{result['added_ttft_ms_p50']:+16.2f}"
        f"{result['stream_tok_s_ratio']:14.3f}   targets <= +2 ms, >= 0.90"
    )
    interval = f"{CI_LEVEL:.0%} interval"
    for key, fmt, samples, what, label in (
        ("added_ttft_ms_p50_ci95", "+.2f", "ttft_ms", "request pairs", "added TTFT"),
        ("stream_tok_s_ratio_ci95", ".3f", "round_tokens", "round pairs", "tok/s ratio"),
    ):
        pairs = sum(len(run["engine"][samples]) for run in runs.values())
        print_ci(key, result, fmt, f"{pairs} {what}", label=f"  {label}, {interval}")
    if has_steps(list(runs.values())):
        print_outside(result["outside_first_step"])
    write(result, out)
    return 0


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
