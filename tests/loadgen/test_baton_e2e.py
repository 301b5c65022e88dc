"""loadgen against a real Baton stack: gateway on real HTTP, estimator, two random-tiny workers.

loadgen runs as its own process (`python -m loadgen`, as a user runs it) while
the stack serves from the test's event loop; NATS and Redis are real servers on
free ports (tests/loadgen/conftest.py). The end-to-end check of the load generator:
200 requests of the Azure conversation trace, time-compressed and capped to what
the tiny stack holds, and a run of bad requests that must end as failures.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from loadgen.data import data_dir
from loadgen.traces import read_trace
from tests.support.stack import Stack

REPO_ROOT = Path(__file__).resolve().parents[2]
AZURE = data_dir() / "traces" / "azure_llm_2023_conv.csv"
pytestmark = pytest.mark.skipif(not AZURE.is_file(), reason="no data directory (`just data`)")

NUM_REQUESTS = 200
TIME_SCALE = 0.15  # the first 200 rows span 61 s (3.3 req/s): replayed in ~9 s (~22 req/s)
MAX_INPUT_TOKENS = 96  # + the chat template stays well inside max_model_len = 256
MAX_OUTPUT_TOKENS = 8  # every one of the first 200 rows asks for more, so each gets 8
WORKERS = {"w0", "w1"}  # instance ids start_stack gives the workers
LOADGEN_TIMEOUT_S = 120.0

# The report's fields that must all be numbers after a run where everything completed.
REQUIRED_NUMBERS = (
    "completed",
    "failed",
    "duration",
    "num_prompts",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p90", "p95", "p99")
    ),
    "requested_rate",
    "scheduled_rate",
    "achieved_rate",
    "achieved_to_scheduled",
    "mean_schedule_lag_ms",
    "median_schedule_lag_ms",
    "p99_schedule_lag_ms",
    "max_schedule_lag_ms",
    "num_with_slo",
    "mean_slo_ttft_ms",
    "slo_attainment",
    "ontime_utility",
    "mean_utility",
    "num_with_usage",
    "num_with_baton",
    "num_with_server_request_id",
)


async def run_loadgen(*args: str) -> tuple[int, str]:
    """`python -m loadgen ARGS --disable-tqdm` in a child process; (exit code, output)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadgen",
        *args,
        "--disable-tqdm",
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), LOADGEN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    text = out.decode("utf-8", "replace")
    print(text)  # the summary table, shown by pytest -rP or on failure
    return proc.returncode, text


async def saved_run(stem: Path, *args: str) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """run_loadgen saving its result to `stem`.json and its per-request lines to
    `stem`.jsonl; it must exit 0. (The result, the lines, the output.)"""
    result_file, detail_file = stem.with_suffix(".json"), stem.with_suffix(".jsonl")
    rc, out = await run_loadgen(
        *args, "--save-result", str(result_file), "--save-detailed", str(detail_file)
    )
    assert rc == 0, out
    details = [json.loads(line) for line in detail_file.read_text().splitlines()]
    return json.loads(result_file.read_text()), details, out


async def test_azure_trace_replay_against_baton(baton_stack: Stack, tmp_path: Path) -> None:
    result, lines, out = await saved_run(
        tmp_path / "azure",
        "--base-url",
        baton_stack.base_url,
        "--model",
        "auto",  # a routing preset: the estimator picks the instance
        "--trace",
        str(AZURE),
        "--num-prompts",
        str(NUM_REQUESTS),
        "--time-scale",
        str(TIME_SCALE),
        "--max-input-tokens",
        str(MAX_INPUT_TOKENS),
        "--max-output-tokens",
        str(MAX_OUTPUT_TOKENS),
        "--goodput",
        "ttft:5000",
        "tpot:1000",
        "--label",
        "baton-azure",
    )

    for name in REQUIRED_NUMBERS:
        value = result[name]
        assert isinstance(value, int | float) and not isinstance(value, bool), (name, value)
        assert value >= 0, (name, value)
    assert result["completed"] == NUM_REQUESTS and result["failed"] == 0, result["error_samples"]
    assert result["num_prompts"] == NUM_REQUESTS
    assert result["failed_by_status"] == {} and result["interrupted"] is False

    # lengths: the server's usage on every response; ignore_eos pins each output to its cap
    rows = read_trace(AZURE, "azure")[:NUM_REQUESTS]
    assert result["num_with_usage"] == NUM_REQUESTS
    assert result["total_output_tokens"] == sum(
        min(r.output_tokens, MAX_OUTPUT_TOKENS) for r in rows
    )
    assert NUM_REQUESTS * 20 < result["total_input_tokens"] < NUM_REQUESTS * 250

    # latencies: ordered and within what a tiny model on two busy cores gives
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] < 30_000
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"] < 60_000
    assert 0 < result["mean_tpot_ms"] < 10_000 and 0 < result["mean_itl_ms"] < 10_000
    assert result["p90_itl_ms"] <= result["p95_itl_ms"] <= result["p99_itl_ms"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["max_concurrent_requests"] >= 1

    # rates: the trace's first 200 rows, compressed
    arrival = result["arrival"]
    assert arrival["process"] == "trace" and arrival["trace_format"] == "azure"
    assert arrival["time_scale"] == pytest.approx(TIME_SCALE)
    span_s = (rows[-1].offset_s - rows[0].offset_s) * TIME_SCALE
    assert result["requested_rate"] == pytest.approx(NUM_REQUESTS / span_s, rel=1e-6)
    assert result["scheduled_rate"] == pytest.approx(result["requested_rate"], rel=1e-6)
    # how closely the client kept the schedule depends on the machine: reported, not judged
    assert result["achieved_to_scheduled"] == pytest.approx(
        result["achieved_rate"] / result["scheduled_rate"]
    )
    assert result["achieved_rate"] <= 1.05 * result["scheduled_rate"]  # never ahead of it

    # SLOs: the paper's rule from loadgen's own length estimate
    assert result["num_with_slo"] == NUM_REQUESTS
    assert 150.0 <= result["mean_slo_ttft_ms"] <= 1120.0
    assert 0.0 <= result["slo_attainment"] <= 1.0
    assert result["ontime_utility"] == pytest.approx(result["slo_attainment"])
    assert result["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 1000.0}

    # routing: the preset resolved to the real model; round-robin used both workers
    assert result["model_id"] == "auto"
    assert result["served_model_counts"] == {"random-tiny": NUM_REQUESTS}
    assert set(result["per_model"]) == {"random-tiny"}
    instances = result["instance_counts"]
    assert sum(instances.values()) == NUM_REQUESTS and len(instances) == len(WORKERS)
    assert set(result["per_instance"]) == set(instances)
    assert all(v["completed"] > 0 for v in result["per_instance"].values())
    assert result["num_with_server_request_id"] == NUM_REQUESTS

    assert len(lines) == NUM_REQUESTS
    assert all(x["status"] == "ok" and x["served_model"] == "random-tiny" for x in lines)
    assert all(x["end_ns"] >= x["first_token_ns"] > x["start_ns"] > 10**18 for x in lines)
    assert all(x["completion_tokens"] == MAX_OUTPUT_TOKENS for x in lines)
    assert all(x["request_id"].endswith(f"-{x['index']}") for x in lines)
    server_ids = [x["server_request_id"] for x in lines]
    assert all(i.startswith("chatcmpl-") for i in server_ids) and len(set(server_ids)) == 200
    header_instances = {x["instance"] for x in lines}
    assert header_instances == set(instances)

    # Baton's `baton` object, once the gateway sends it: then on every response
    if result["num_with_baton"]:
        assert result["num_with_baton"] == NUM_REQUESTS
        if any(x["router_overhead_ms"] is not None for x in lines):
            assert 0 <= result["mean_router_overhead_ms"] < 10_000
        if any(x["predicted_ttft_ms"] is not None for x in lines):
            assert result["mean_predicted_ttft_ms"] >= 0
            assert result["mean_abs_ttft_prediction_error_ms"] is not None
    else:
        assert header_instances == WORKERS  # X-Instance-Id alone names them

    assert "Serving Benchmark Result" in out and "Instance " in out


async def test_bad_requests_are_failures_not_crashes(baton_stack: Stack, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(line)
            for line in (
                {"prompt": "Say hello.", "max_tokens": 4, "task": "good"},
                {"prompt": "Say hello.", "max_tokens": 4, "model": "no-such-model", "task": "404"},
                {"prompt": "Say hello.", "max_tokens": 100_000, "task": "too-long"},
            )
        )
        + "\n"
    )
    options = "--model random-tiny --dataset jsonl --num-prompts 12 --request-rate 40"
    result, lines, out = await saved_run(
        tmp_path / "bad",
        *("--base-url", baton_stack.base_url, "--dataset-path", str(prompts)),
        *options.split(),
    )
    assert result["completed"] == 4 and result["failed"] == 8
    assert result["failed_by_status"] == {"http_error": 8}
    assert result["failed_by_http_status"] == {"404": 4, "400": 4}
    samples = " | ".join(result["error_samples"])
    assert "no-such-model" in samples and "context length" in samples
    per_task = result["per_task"]
    assert per_task["good"]["completed"] == 4
    assert per_task["404"]["completed"] == 0 and per_task["too-long"]["completed"] == 0
    assert result["mean_ttft_ms"] is not None and result["slo_attainment"] <= 4 / 12
    assert {x["http_status"] for x in lines if x["status"] == "http_error"} == {400, 404}
    assert all(x["ttft_ms"] is None for x in lines if x["status"] != "ok")
    assert "Failed requests:" in out and "http_error" in out

    # a model nobody serves, for the whole run: every request fails, the run still reports
    rc, out = await run_loadgen(
        "--base-url",
        baton_stack.base_url,
        "--model",
        "no-such-model",
        "--num-prompts",
        "5",
        "--max-tokens",
        "4",
        "--save-result",
        str(tmp_path / "unknown.json"),
    )
    assert rc == 0, out
    unknown = json.loads((tmp_path / "unknown.json").read_text())
    assert unknown["completed"] == 0 and unknown["failed_by_http_status"] == {"404": 5}
    assert unknown["mean_ttft_ms"] is None and unknown["slo_attainment"] == 0.0
