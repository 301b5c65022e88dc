"""The gateway benchmark's figures and how precise they are: the added TTFT and the
token-rate ratio, their bootstrap intervals over a run's pairs, the added TTFT outside
the first step, and the figures pooled over several runs.

On a shared 2-core VM one 16-stream round of the in-process engine alone ran at
3,760-6,070 tok/s within a run (random-tiny, 24 rounds), and a pure matmul loop pinned
to one core varied 7% (CV) from one 0.3 s slice to the next: a run's ratio carries that
noise. The intervals say how much: a percentile bootstrap over what was measured in
pairs (scipy.stats.bootstrap, paired: each resample keeps a round's engine and gateway
halves, or a TTFT request's two sides, together, so a slow phase of the host that hit
both is not counted as a difference).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import scipy.stats

from bench.stats import percentile

CI_LEVEL = 0.95
CI_RESAMPLES = 9999
SIDES = ("engine", "gateway")
RAW = ("ttft_ms", "round_tokens", "round_wall_s")  # a run's samples, per side
STEPS = "first_step_ms"  # and each TTFT request's first step, where every run has them
SAME = ("model", "dtype", "streams", "new_tokens")  # what pooled runs must share


class PoolError(ValueError):
    """Runs that cannot be pooled (no raw samples, or measured differently)."""


def p50_by_name(rows: Sequence[tuple[float, ...]], names: tuple[str, ...]) -> dict[str, float]:
    """{name_ms_p50: the p50 of that column of rows}, ms; {} without rows."""
    if not rows:
        return {}
    return {f"{name}_ms_p50": percentile([r[i] for r in rows], 50) for i, name in enumerate(names)}


def bootstrap_ci(
    samples: tuple[Sequence[float] | Any, ...], statistic: Any
) -> tuple[float, float] | None:
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


def rate_ratio(ne: Any, we: Any, ng: Any, wg: Any, axis: int = -1) -> Any:
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
    return bootstrap_ci((engine_tokens, engine_wall_s, gateway_tokens, gateway_wall_s), rate_ratio)


def added_p50(engine: Any, gateway: Any, axis: int = -1) -> Any:
    """The gateway's TTFT p50 less the engine's."""
    return np.percentile(gateway, 50, axis=axis) - np.percentile(engine, 50, axis=axis)


def added_p50_outside(e_ttft: Any, e_step: Any, g_ttft: Any, g_step: Any, axis: int = -1) -> Any:
    """added_p50 of each side's TTFT less its first step."""
    return added_p50(e_ttft - e_step, g_ttft - g_step, axis)


def added_p50_ci(
    engine_ms: Sequence[float], gateway_ms: Sequence[float]
) -> tuple[float, float] | None:
    """The interval of the added TTFT p50, resampling request pairs (the engine's i-th
    TTFT request and the gateway's ran back to back)."""
    return bootstrap_ci((engine_ms, gateway_ms), added_p50)


def outside_first_step(
    engine: Mapping[str, Any], gateway: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The added TTFT without the prefill's own time: each side's TTFT less its first
    step's compute (the request pairs where the worker's step was found), p50 and its
    interval, and each side's first step p50. Where the prefill is long (SmolLM2's
    ~80-130 ms here) its run-to-run noise buries the path's ~2 ms in the plain
    figure; this one is what the path adds around the compute. None without steps."""
    if STEPS not in engine or STEPS not in gateway:  # (a run that kept no steps)
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
        "added_ttft_ms_p50": float(added_p50_outside(e_ttft, e_step, g_ttft, g_step)),
        "added_ttft_ms_p50_ci95": bootstrap_ci((e_ttft, e_step, g_ttft, g_step), added_p50_outside),
        "first_step_ms_p50": {
            "engine": float(np.percentile(e_step, 50)),
            "gateway": float(np.percentile(g_step, 50)),
        },
        "pairs": len(pairs),
    }


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


def arrays(engine: Mapping[str, Any], gateway: Mapping[str, Any], *keys: str) -> list[Any]:
    """The samples under `keys`, the engine's then the gateway's, as float arrays: the
    argument order of the statistics (added_p50, rate_ratio)."""
    return [np.asarray(side[k], dtype=float) for side in (engine, gateway) for k in keys]


def has_steps(runs: Sequence[Mapping[str, Any]]) -> bool:
    """Whether every run kept each side's first steps (outside_first_step can pool)."""
    return all(STEPS in run[side] for run in runs for side in SIDES)


def pooled(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The figures over several runs' samples together ({name: a run's JSON}, in
    order) and their intervals. (The intervals treat every pair as drawn alike, so they
    do not widen for a run that ran in a slower phase than the others.) PoolError for
    a run without raw samples, or runs that differ in SAME."""
    for name, run in runs.items():
        if not all(k in run.get(side, {}) for side in SIDES for k in RAW):
            raise PoolError(f"{name} holds no raw samples: run it again")
    kinds = {tuple(run[k] for k in SAME) for run in runs.values()}
    if len(kinds) > 1:
        raise PoolError(f"the runs differ in {', '.join(SAME)}: {sorted(kinds)}")
    raw = (*RAW, STEPS) if has_steps(list(runs.values())) else RAW
    engine, gateway = (
        {k: [x for run in runs.values() for x in run[side][k]] for k in raw} for side in SIDES
    )
    return {
        **dict(zip(SAME, kinds.pop(), strict=True)),
        "runs": list(runs),
        "added_ttft_ms_p50": float(added_p50(*arrays(engine, gateway, "ttft_ms"))),
        "stream_tok_s_ratio": float(
            rate_ratio(*arrays(engine, gateway, "round_tokens", "round_wall_s"))
        ),
        **intervals(engine, gateway),
    }
