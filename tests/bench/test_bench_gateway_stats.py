"""The gateway benchmark's precision (bench/gateway_stats.py): bootstrap intervals over
paired samples, and `bench_gateway.py --pool`, which combines earlier runs' samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import gateway_stats as stats
from bench.gateway_samples import first_steps_ms
from tests.scripts import load_script

script = load_script("bench_gateway")

ROUND_TOKENS = 16 * 128


def noisy_rounds(ratio: float, n: int = 24, seed: int = 1) -> tuple[list[float], ...]:
    """Round pairs whose engine rate swings +-25% with the host, the gateway's round
    at `ratio` of the engine's beside it: (engine tokens, engine wall, gateway tokens,
    gateway wall)."""
    rate = 4800 * np.random.default_rng(seed).uniform(0.75, 1.25, n)
    tokens = [float(ROUND_TOKENS)] * n
    return tokens, list(ROUND_TOKENS / rate), tokens, list(ROUND_TOKENS / (ratio * rate))


def test_the_ratio_interval_pairs_rounds_so_a_shared_slow_phase_is_no_difference() -> None:
    ci = stats.ratio_ci(*noisy_rounds(0.92))
    assert ci is not None
    # every pair has the ratio 0.92: resampled pairs still do (an unpaired resample
    # would mix one side's fast rounds with the other's slow ones: ~0.85-1.0)
    assert ci[0] == pytest.approx(0.92, abs=0.005)
    assert ci[1] == pytest.approx(0.92, abs=0.005)


def test_the_ratio_interval_widens_with_noise_in_the_pairs_and_holds_the_ratio() -> None:
    ne, we, ng, wg = noisy_rounds(0.92)
    jitter = np.random.default_rng(2).uniform(0.85, 1.15, len(wg))
    wg = list(np.asarray(wg) * jitter)
    point = stats.rate_ratio(np.asarray(ne), np.asarray(we), np.asarray(ng), np.asarray(wg))
    ci = stats.ratio_ci(ne, we, ng, wg)
    assert ci is not None
    assert ci[0] < point < ci[1]
    assert 0.02 < ci[1] - ci[0] < 0.2


def test_the_added_ttft_interval_pairs_requests() -> None:
    engine = list(np.random.default_rng(3).uniform(2.5, 4.0, 50))
    gateway = [e + 1.5 for e in engine]
    ci = stats.added_p50_ci(engine, gateway)
    assert ci is not None
    assert ci[0] <= 1.5 + 1e-9 and ci[1] >= 1.5 - 1e-9
    assert ci[1] - ci[0] < 0.4  # unpaired, the 2.5-4.0 ms spread would show


def test_no_interval_from_one_pair() -> None:
    assert stats.added_p50_ci([3.0], [4.5]) is None
    assert stats.ratio_ci([2048.0], [0.4], [2048.0], [0.44]) is None


def run_file(path: Path, ratio: float, added_ms: float, seed: int, **over: Any) -> Path:
    ne, we, ng, wg = noisy_rounds(ratio, n=6, seed=seed)
    engine_ttft = list(np.random.default_rng(seed).uniform(2.5, 3.5, 10))
    gateway_ttft = [t + added_ms for t in engine_ttft]
    side = {"engine": (engine_ttft, ne, we), "gateway": (gateway_ttft, ng, wg)}
    run: dict[str, Any] = {
        "model": "random-tiny",
        "dtype": "float32",
        "streams": 16,
        "new_tokens": 128,
        "added_ttft_ms_p50": added_ms,
        "stream_tok_s_ratio": ratio,
        **{
            name: {"ttft_ms": t, "round_tokens": n, "round_wall_s": w}
            for name, (t, n, w) in side.items()
        },
        **over,
    }
    path.write_text(json.dumps(run))
    return path


def test_pool_combines_the_runs_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = run_file(tmp_path / "a.json", 0.90, 1.5, seed=4)
    b = run_file(tmp_path / "b.json", 0.95, 1.5, seed=5)
    out = tmp_path / "pooled.json"
    assert script.pool([a, b], out) == 0
    got = json.loads(out.read_text())
    runs = [json.loads(p.read_text()) for p in (a, b)]

    def total(side: str, key: str) -> float:
        return sum(sum(r[side][key]) for r in runs)

    expected = (total("gateway", "round_tokens") / total("gateway", "round_wall_s")) / (
        total("engine", "round_tokens") / total("engine", "round_wall_s")
    )
    assert got["stream_tok_s_ratio"] == pytest.approx(expected)
    assert 0.90 < got["stream_tok_s_ratio"] < 0.95
    assert got["added_ttft_ms_p50"] == pytest.approx(1.5)
    lo, hi = got["stream_tok_s_ratio_ci95"]
    assert 0.90 - 1e-9 <= lo < got["stream_tok_s_ratio"] < hi <= 0.95 + 1e-9
    assert got["runs"] == [str(a), str(b)]
    printed = capsys.readouterr().out
    assert "pooled (2 runs)" in printed and "12 round pairs" in printed


def test_pool_refuses_runs_it_cannot_combine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = run_file(tmp_path / "a.json", 0.92, 1.5, seed=6)
    smol = run_file(tmp_path / "smol.json", 0.97, 1.8, seed=7, model="smollm2-135m")
    assert script.pool([a, smol], None) == 2
    assert "differ in model" in capsys.readouterr().err
    old = tmp_path / "old.json"
    run = json.loads(a.read_text())
    del run["engine"]["ttft_ms"]
    old.write_text(json.dumps(run))
    assert script.pool([a, old], None) == 2
    assert "no raw samples" in capsys.readouterr().err
    assert script.pool([tmp_path / "missing.json"], None) == 2
    assert "cannot read" in capsys.readouterr().err


def with_steps(path: Path, engine_ms: float, gateway_ms: float) -> Path:
    """The run at `path` with each TTFT request's first step kept, on both sides."""
    run = json.loads(path.read_text())
    for side, ms in (("engine", engine_ms), ("gateway", gateway_ms)):
        run[side]["first_step_ms"] = [ms] * len(run[side]["ttft_ms"])
    path.write_text(json.dumps(run))
    return path


def test_pool_takes_the_first_steps_out_where_every_run_kept_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = with_steps(run_file(tmp_path / "a.json", 0.92, 1.5, seed=9), 1.0, 1.2)
    b = with_steps(run_file(tmp_path / "b.json", 0.93, 1.5, seed=10), 1.0, 1.2)
    got = stats.pooled({"a": json.loads(a.read_text()), "b": json.loads(b.read_text())})
    assert got["runs"] == ["a", "b"]
    outside = got["outside_first_step"]
    assert outside["pairs"] == 20
    assert outside["added_ttft_ms_p50"] == pytest.approx(1.5 - 0.2)
    assert script.pool([a, b], None) == 0
    assert "outside the 1st step" in capsys.readouterr().out
    # one run without them: the others' are not pooled alone
    c = run_file(tmp_path / "c.json", 0.94, 1.5, seed=11)
    assert script.pool([a, c], None) == 0
    assert "outside the 1st step" not in capsys.readouterr().out


def test_each_ttft_request_finds_the_first_step_that_began_inside_it() -> None:
    class Step:
        def __init__(self, at: float, ms: float) -> None:
            self.wall_time_s, self.duration_s = at, ms / 1e3

    steps = [Step(10.0, 1.0), Step(10.0015, 0.5), Step(20.002, 3.0), Step(5.0, 9.0)]
    starts = [9.9995, 20.0, 30.0]  # the third: its step was trimmed away
    got = first_steps_ms(steps, starts, [2.0, 4.0, 3.0])
    assert got[0] == pytest.approx(1.0)  # the earliest inside, not the second
    assert got[1] == pytest.approx(3.0)
    assert got[2] is None
    # a step that began after the request's first token is not its prefill
    assert first_steps_ms(steps, [19.990], [5.0]) == [None]


def test_the_added_ttft_outside_the_first_step_sets_the_prefill_noise_aside() -> None:
    rng = np.random.default_rng(8)
    e_step = rng.uniform(70.0, 100.0, 48)  # a long prefill that drifts with the host
    g_step = rng.uniform(70.0, 100.0, 48)
    engine = {"ttft_ms": list(e_step + 0.3), "first_step_ms": list(e_step)}
    gateway = {"ttft_ms": list(g_step + 1.8), "first_step_ms": list(g_step)}
    plain = stats.added_p50_ci(engine["ttft_ms"], gateway["ttft_ms"])
    assert plain is not None and plain[1] - plain[0] > 5  # the prefill noise
    got = stats.outside_first_step(engine, gateway)
    assert got is not None
    assert got["added_ttft_ms_p50"] == pytest.approx(1.5)
    lo, hi = got["added_ttft_ms_p50_ci95"]
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)
    assert got["first_step_ms_p50"]["engine"] == pytest.approx(np.percentile(e_step, 50))
    assert got["pairs"] == 48
    # pairs without the worker's step are left out; none at all: no figure
    gateway["first_step_ms"] = [None] * 47 + [g_step[-1]]
    assert stats.outside_first_step(engine, gateway)["pairs"] == 1  # type: ignore[index]
    gateway["first_step_ms"] = [None] * 48
    assert stats.outside_first_step(engine, gateway) is None
