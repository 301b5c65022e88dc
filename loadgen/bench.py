"""One benchmark run end to end: plan, send, summarize, report, save, plot."""

from __future__ import annotations

import gc
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from loadgen.client import ClientConfig, OpenAIClient
from loadgen.config import BenchConfig
from loadgen.metrics import LATENCY_METRICS, MetricsConfig, parse_goodput, summarize
from loadgen.plan import Plan, build_plan
from loadgen.records import RequestRecord
from loadgen.report import print_summary, write_detailed, write_result
from loadgen.runner import BenchmarkRunner, RunLimits, RunResult
from loadgen.tokens import create_token_counter
from loadgen.utility import load_utility_table
from loadgen.workloads import RequestPolicy


def slo_policy(value: str) -> tuple[str, float | None]:
    """--slo-ttft-ms value -> (mode, fixed ms)."""
    lowered = value.strip().lower()
    if lowered in ("paper", "none"):
        return lowered, None
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(
            f"--slo-ttft-ms {value!r}: expected a number of ms, paper or none"
        ) from None
    if ms <= 0:
        raise ValueError("--slo-ttft-ms must be > 0")
    return "fixed", ms


def validate(config: BenchConfig) -> None:
    """Reject contradictory options before anything runs."""
    if config.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if config.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    if config.arrival != "gamma" and math.isinf(config.request_rate):
        raise ValueError(f"--arrival {config.arrival} needs a finite --request-rate (the mean)")
    if config.ramp_up_strategy and not math.isinf(config.request_rate):
        raise ValueError("a ramp sets the rate: drop --request-rate")
    if config.time_scale is not None and config.time_scale <= 0:
        raise ValueError("--time-scale must be > 0")
    if config.trace_duration_s is not None and config.trace_duration_s <= 0:
        raise ValueError("--trace-duration-s must be > 0")
    if config.trace_duration_s is not None and not config.trace:
        raise ValueError("--trace-duration-s needs --trace")
    if config.high_share is not None and not 0 < config.high_share < 1:
        raise ValueError("--high-share must be in (0, 1)")
    if config.rate_ratio < 1:
        raise ValueError("--rate-ratio must be >= 1")
    if config.max_concurrency is not None and config.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if config.num_prompts is not None and config.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if config.extra_body is not None and not isinstance(config.extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    unknown = set(config.percentile_metric_names) - set(LATENCY_METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; use {LATENCY_METRICS}")
    if any(not 0 < p <= 100 for p in config.percentiles):
        raise ValueError("--metric-percentiles must be in (0, 100]")


def result_path(config: BenchConfig, model: str, stamp: str) -> Path | None:
    """Where --save-result writes, or None."""
    if config.save_result is None:
        return None
    if config.save_result:
        return Path(config.save_result)
    rate = "trace" if config.trace else f"{config.request_rate}qps"
    conc = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    name = (
        config.result_filename
        or f"{config.label or 'loadgen'}-{rate}{conc}-{model.split('/')[-1]}-{stamp}.json"
    )
    return Path(config.result_dir or ".") / name


def detailed_path(config: BenchConfig, result_file: Path | None) -> Path | None:
    """Where --save-detailed writes, or None."""
    if config.save_detailed is None:
        return None
    if config.save_detailed:
        return Path(config.save_detailed)
    base = result_file or Path(config.result_dir or ".") / f"{config.label or 'loadgen'}.json"
    return base.with_suffix(".requests.jsonl")


async def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark the config describes; print, save and plot; return the result."""
    validate(config)
    mode, fixed_ms = slo_policy(config.slo_ttft_ms)
    goodput = parse_goodput(config.goodput) if config.goodput else None
    utility = load_utility_table(config.utility_table) if config.utility_table else None
    counter = create_token_counter(config.tokenizer)
    plan = build_plan(config, counter)
    ignore_eos = config.ignore_eos
    if ignore_eos is None:
        ignore_eos = bool(config.trace) or config.dataset == "random"
    client = OpenAIClient(
        ClientConfig(
            base_url=config.base_url,
            endpoint=config.endpoint,
            api_key=config.api_key,
            timeout_s=config.timeout,
            ignore_eos=ignore_eos,
            temperature=config.temperature,
            headers=config.headers,
            extra_body=config.extra_body or {},
            keep_text=config.keep_text,
        )
    )
    try:
        model = config.model or next(iter(await client.list_models()), "default")
        policy = RequestPolicy(
            model=model,
            slo_mode=mode,
            slo_fixed_ms=fixed_ms,
            budget=config.budget,
            max_tokens=config.max_tokens,
            max_input_tokens=config.max_input_tokens,
            max_output_tokens=config.max_output_tokens,
        )
        limits = RunLimits(
            max_concurrency=config.max_concurrency,
            is_closed_loop=plan.is_closed_loop,
            duration_s=config.duration,
            show_progress=not config.disable_tqdm,
        )
        _announce(plan, config, model, counter.name)
        # What is alive now (the imports, the plan's prompts and trace) lives through the
        # run: out of the collector's reach, a full collection during the run walks only
        # what the run allocates. Without it each one stalled the client's loop for
        # 28-48 ms (five in a 10 s run of 3,000 requests), and the TTFTs, ITLs and arrival
        # times it was measuring with them. Undone after, for a caller in a longer-lived
        # process (frozen objects that later die in a reference cycle are never freed);
        # a caller that froze its own heap keeps it as it is.
        is_ours = gc.get_freeze_count() == 0
        if is_ours:
            gc.collect()
            gc.freeze()
        try:
            run = await BenchmarkRunner(client, limits).run(
                plan.offsets_s, plan.specs(policy, counter), plan.total
            )
        finally:
            if is_ours:
                gc.unfreeze()
    finally:
        await client.close()
    metrics = MetricsConfig(config.percentiles, config.percentile_metric_names, goodput, utility)
    result = assemble_result(config, plan, run, model, counter.name, ignore_eos, metrics)
    print_summary(result, sys.stdout)
    save_outputs(config, result, run.records, run.origin_epoch_ns)
    return result


def _announce(plan: Plan, config: BenchConfig, model: str, counter_name: str) -> None:
    total = plan.total if plan.total is not None else "until --duration"
    print(
        f"loadgen: {total} requests, arrivals {plan.arrival}, model {model!r}, "
        f"{config.base_url} ({config.endpoint}); prompt lengths by {counter_name}",
        flush=True,
    )


def assemble_result(
    config: BenchConfig,
    plan: Plan,
    run: RunResult,
    model: str,
    counter_name: str,
    ignore_eos: bool,
    metrics: MetricsConfig,
) -> dict[str, Any]:
    """Run settings + summary, vLLM's field names first."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if config.endpoint == "chat" else "openai",
        "backend": "openai-chat" if config.endpoint == "chat" else "openai",
        "label": config.label,
        "model_id": model,
        "tokenizer_id": counter_name,
        "num_prompts": len(run.records),
        "request_rate": config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
    }
    if config.ramp_up_strategy:
        result.update(
            ramp_up_strategy=config.ramp_up_strategy,
            ramp_up_start_rps=config.ramp_up_start_rps,
            ramp_up_end_rps=config.ramp_up_end_rps,
        )
    result.update(config.metadata_fields)
    result.update(summarize(run.records, run.duration_s, metrics))
    result.update(
        requested_rate=plan.requested_rate,
        arrival=plan.arrival,
        base_url=config.base_url,
        dataset=config.dataset,
        seed=config.seed,
        ignore_eos=ignore_eos,
        slo_ttft_ms=config.slo_ttft_ms,
        budget=config.budget,
        metric_percentiles=list(config.percentiles),
        interrupted=run.is_interrupted,
        command=" ".join(sys.argv),
    )
    if config.save_detailed is not None:
        result.update(vllm_arrays(run.records))
    return result


def vllm_arrays(records: list[RequestRecord]) -> dict[str, Any]:
    """`vllm bench serve --save-detailed`'s per-request arrays (seconds, as vLLM stores them)."""
    return {
        "input_lens": [r.input_tokens for r in records],
        "output_lens": [r.output_tokens if r.is_ok else 0 for r in records],
        "ttfts": [r.ttft_s or 0.0 for r in records],
        "itls": [r.itls_s for r in records],
        "start_times": [r.start_ns / 1e9 for r in records],
        "errors": [r.error for r in records],
        "generated_texts": [r.text for r in records],  # empty unless --keep-text
    }


def save_outputs(
    config: BenchConfig, result: dict[str, Any], records: list[RequestRecord], origin_epoch_ns: int
) -> None:
    """--save-result, --save-detailed, --plot."""
    stamp = result["date"]
    result_file = result_path(config, str(result["model_id"]), stamp)
    if result_file is not None:
        write_result(result_file, result)
        print(f"result: {result_file}")
    detail_file = detailed_path(config, result_file)
    if detail_file is not None:
        write_detailed(detail_file, records, origin_epoch_ns)
        print(f"per-request details: {detail_file}")
    if config.plot:
        from loadgen.plots import plot_run  # matplotlib only when asked

        title = config.label or str(result["model_id"])
        rate = result.get("requested_rate")
        for path in plot_run(
            records, Path(config.plot), title, rate if isinstance(rate, float) else None
        ):
            print(f"plot: {path}")
