"""`loadgen compare A.json B.json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.__main__ import main
from loadgen.compare import compare_rows


def test_rows_have_ratios_and_skip_missing() -> None:
    a = {"completed": 100, "mean_ttft_ms": 50.0, "request_rate": "inf", "label": "a", "only_a": 1.0}
    b = {"completed": 100, "mean_ttft_ms": 25.0, "request_rate": "inf", "label": "b"}
    rows = {name: (va, vb, ratio) for name, va, vb, ratio in compare_rows(a, b)}
    assert rows["mean_ttft_ms"] == (50.0, 25.0, 0.5)
    assert rows["completed"][2] == 1.0
    assert rows["request_rate"][2] is None  # inf / inf has no ratio
    assert "label" not in rows
    assert rows["only_a"] == (1.0, None, None)


def test_compare_command_prints_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"label": "vllm", "output_throughput": 100.0, "p99_ttft_ms": 80.0}))
    b.write_text(json.dumps({"label": "baton", "output_throughput": 150.0, "p99_ttft_ms": 40.0}))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "A: vllm" in out and "B: baton" in out
    line = next(x for x in out.splitlines() if x.startswith("output_throughput"))
    assert line.split()[1:] == ["100", "150", "1.5"]
    line = next(x for x in out.splitlines() if x.startswith("p99_ttft_ms"))
    assert line.split()[-1] == "0.5"
