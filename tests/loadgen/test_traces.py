"""Trace parsers on the shared sample files, and the replay window."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from loadgen.data import data_dir, has_files
from loadgen.plan import detect_trace_format
from loadgen.traces import TraceRow, TraceWindow, native_rate, read_trace, select_rows

TRACES = data_dir() / "traces"
pytestmark = pytest.mark.skipif(
    not has_files(
        "traces/azure_llm_2023_conv.csv",
        "traces/burstgpt1_first400.csv",
        "traces/mooncake_fast25_conversation_trace.jsonl",
    ),
    reason="no data directory (`just data`)",
)


def test_azure_conversation_trace() -> None:
    rows = read_trace(TRACES / "azure_llm_2023_conv.csv", "azure")
    assert len(rows) == 19_366
    assert rows[0] == TraceRow(0.0, 374, 44)
    assert rows[1].offset_s == pytest.approx(4.3145790, abs=1e-6)  # 7-digit fractions
    assert rows[-1].offset_s / 60 == pytest.approx(58.4, abs=0.1)
    assert native_rate(rows) == pytest.approx(5.5, abs=0.05)
    assert all(a.offset_s <= b.offset_s for a, b in itertools.pairwise(rows))


def test_burstgpt_trace_keeps_the_model_label() -> None:
    rows = read_trace(TRACES / "burstgpt1_first400.csv", "burstgpt")
    assert len(rows) == 400
    assert rows[0] == TraceRow(0.0, 472, 18, label="ChatGPT")
    assert rows[1].offset_s == pytest.approx(40.0)
    assert {r.label for r in rows} == {"ChatGPT", "GPT-4"}


def test_mooncake_trace_keeps_prefix_blocks() -> None:
    rows = read_trace(TRACES / "mooncake_fast25_conversation_trace.jsonl", "mooncake")
    assert len(rows) == 12_031
    assert rows[0].input_tokens == 6758 and rows[0].output_tokens == 500
    assert rows[0].hash_ids[:3] == (0, 1, 2)
    assert rows[1].hash_ids[0] == 0  # shared first block
    assert native_rate(rows) == pytest.approx(3.4, abs=0.05)


def test_format_detection_and_unknown_format() -> None:
    assert detect_trace_format("x/azure_llm_2023_conv.csv") == "azure"
    assert detect_trace_format("burstgpt1_first400.csv") == "burstgpt"
    assert detect_trace_format("mooncake_trace.jsonl") == "mooncake"
    with pytest.raises(ValueError):
        read_trace(TRACES / "azure_llm_2023_conv.csv", "sharegpt")


def _rows() -> list[TraceRow]:
    return [TraceRow(float(i), 100 * (i + 1), 10 * (i + 1)) for i in range(10)]


def test_time_scale_below_one_compresses() -> None:
    rows, scale = select_rows(_rows(), TraceWindow(time_scale=0.5))
    assert scale == 0.5
    assert [r.offset_s for r in rows][:3] == [0.0, 0.5, 1.0]


def test_target_rate_picks_the_scale() -> None:
    rows, scale = select_rows(_rows(), TraceWindow(target_rate=10.0 / 0.9))
    assert scale == pytest.approx(0.1)
    assert rows[-1].offset_s == pytest.approx(0.9)


def test_window_start_count_duration_and_caps() -> None:
    window = TraceWindow(start_s=2.0, num_prompts=5, duration_s=3.0, time_scale=1.0)
    capped = dataclasses.replace(window, max_input_tokens=450, max_output_tokens=45)
    rows, _ = select_rows(_rows(), capped)
    assert [r.offset_s for r in rows] == [0.0, 1.0, 2.0]  # rebased, cut at 3 s
    assert [r.input_tokens for r in rows] == [300, 400, 450]
    assert [r.output_tokens for r in rows] == [30, 40, 45]


def test_empty_window_is_an_error() -> None:
    with pytest.raises(ValueError):
        select_rows(_rows(), TraceWindow(start_s=100.0))


def test_trace_duration_counts_trace_seconds_before_scaling() -> None:
    window = TraceWindow(start_s=2.0, trace_duration_s=3.0, time_scale=10.0)
    rows, scale = select_rows(_rows(), window)
    assert scale == 10.0
    assert [r.offset_s for r in rows] == [0.0, 10.0, 20.0]  # trace seconds 2, 3, 4
    rows, scale = select_rows(_rows(), TraceWindow(trace_duration_s=4.5, target_rate=2.0))
    assert len(rows) == 5 and scale == pytest.approx((5 / 4.0) / 2.0)
