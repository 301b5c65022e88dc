"""Metrics math on hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.metrics import MetricsConfig, is_good, parse_goodput, summarize
from loadgen.records import RequestRecord, Status
from loadgen.report import write_detailed
from loadgen.utility import UtilityTable, load_utility_table
from loadgen.workloads import RequestSpec

MS = 1_000_000


def _spec(index: int, task: str = "alpaca", slo: float | None = 200.0) -> RequestSpec:
    return RequestSpec(
        index=index,
        task=task,
        text="x",
        input_tokens=10,
        max_tokens=8,
        model="m",
        slo_ttft_ms=slo,
        budget=None,
    )


def _record(
    index: int,
    start_ms: int,
    chunks_ms: list[int],
    status: Status = Status.OK,
    completion_tokens: int | None = None,
    task: str = "alpaca",
) -> RequestRecord:
    r = RequestRecord(_spec(index, task), scheduled_ns=start_ms * MS)
    r.dispatched_ns = r.scheduled_ns + MS
    r.start_ns = r.dispatched_ns
    r.chunk_ns = [(start_ms + 1 + c) * MS for c in chunks_ms]
    r.first_token_ns = r.chunk_ns[0] if r.chunk_ns else 0
    r.end_ns = r.chunk_ns[-1] if r.chunk_ns else r.start_ns + 10 * MS
    r.status = status
    r.completion_tokens = completion_tokens
    if status is not Status.OK:
        r.http_status, r.error = 500, "HTTP 500: boom"
    return r


def _records() -> list[RequestRecord]:
    return [
        _record(0, 0, [100, 150, 200, 250], completion_tokens=4),  # TTFT 100, TPOT 50
        _record(1, 1000, [300, 400]),  # TTFT 300, TPOT 100, tokens counted from chunks
        _record(2, 2000, [], status=Status.HTTP_ERROR),
    ]


def test_per_request_latencies() -> None:
    r0, r1, r2 = _records()
    assert r0.ttft_s == pytest.approx(0.1) and r0.e2el_s == pytest.approx(0.25)
    assert r0.tpot_s == pytest.approx(0.05) and r0.itls_s == pytest.approx([0.05] * 3)
    assert r1.output_tokens == 2 and r1.tpot_s == pytest.approx(0.1)
    assert r2.ttft_s is None and r2.met_slo is False and r2.itls_s == []
    assert (r0.met_slo, r1.met_slo) == (True, False)


def test_summary_uses_vllm_names_and_values() -> None:
    result = summarize(_records(), 2.0, MetricsConfig(percentiles=(50.0, 99.0)))
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["total_input_tokens"] == 20 and result["total_output_tokens"] == 6
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(3.0)
    assert result["total_token_throughput"] == pytest.approx(13.0)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["std_ttft_ms"] == pytest.approx(100.0)
    assert result["p50_ttft_ms"] == pytest.approx(200.0)
    assert result["p99_ttft_ms"] == pytest.approx(298.0)
    assert result["mean_tpot_ms"] == pytest.approx(75.0)
    assert result["mean_itl_ms"] == pytest.approx(62.5)
    assert result["mean_e2el_ms"] == pytest.approx(325.0)
    assert result["request_goodput"] is None
    assert result["max_output_tokens_per_s"] == pytest.approx(4.0)
    assert result["max_concurrent_requests"] == 1
    assert result["failed_by_http_status"] == {"500": 1}
    assert result["error_samples"] == ["HTTP 500: boom"]


def test_rates_and_schedule_lag() -> None:
    result = summarize(_records(), 2.0, MetricsConfig())
    assert result["scheduled_rate"] == pytest.approx(1.5)
    assert result["achieved_rate"] == pytest.approx(3 / 2.001)
    assert result["mean_schedule_lag_ms"] == pytest.approx(1.0)
    assert result["kept_up"] is True


def test_goodput_requires_every_slo() -> None:
    records = _records()
    assert parse_goodput(["ttft:250", "tpot:60"]) == {"ttft": 250.0, "tpot": 60.0}
    assert [is_good(r, {"ttft": 250.0}) for r in records] == [True, False, False]
    assert not is_good(records[0], {"ttft": 250.0, "tpot": 40.0})
    result = summarize(records, 2.0, MetricsConfig(goodput={"ttft": 250.0, "e2el": 300.0}))
    assert result["request_goodput"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_slo_attainment_and_ontime_utility() -> None:
    table = UtilityTable({("alpaca", "m"): 0.8})
    result = summarize(_records(), 2.0, MetricsConfig(utility=table))
    assert result["slo_attainment"] == pytest.approx(1 / 3)
    assert result["ontime_utility"] == pytest.approx(0.8 / 3)
    assert result["mean_utility"] == pytest.approx(1.6 / 3)
    no_table = summarize(_records(), 2.0, MetricsConfig())
    assert no_table["ontime_utility"] == pytest.approx(
        1 / 3
    )  # = attainment when every answer is worth 1


def test_served_model_is_what_utility_is_priced_on() -> None:
    records = _records()
    records[0].served_model = "big"
    table = UtilityTable({("alpaca", "big"): 1.0, ("*", "m"): 0.1})
    result = summarize(records, 2.0, MetricsConfig(utility=table))
    assert result["ontime_utility"] == pytest.approx(1.0 / 3)
    assert result["per_model"]["big"]["count"] == 1


def test_no_completed_requests_gives_nulls_not_zeros() -> None:
    result = summarize([_record(0, 0, [], status=Status.TIMEOUT)], 1.0, MetricsConfig())
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["mean_ttft_ms"] is None and result["p99_e2el_ms"] is None


def test_utility_table_files(tmp_path: Path) -> None:
    as_json = tmp_path / "u.json"
    as_json.write_text(json.dumps({"alpaca": {"small": 0.5, "*": 0.2}}))
    as_csv = tmp_path / "u.csv"
    as_csv.write_text("task,model,utility\nalpaca,small,0.5\n*,*,0.1\n")
    assert load_utility_table(as_json).lookup("alpaca", "large") == 0.2
    assert load_utility_table(as_json).lookup("aime", "small") is None
    assert load_utility_table(as_csv).lookup("aime", "small") == 0.1


def test_detailed_lines_have_epoch_ns(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    write_detailed(path, _records(), origin_epoch_ns=10**18)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 3
    assert lines[1]["scheduled_ns"] == 10**18 + 1000 * MS
    assert lines[1]["first_token_ns"] - lines[1]["start_ns"] == 300 * MS
    assert lines[2]["status"] == "http_error" and lines[2]["error"] == "HTTP 500: boom"
