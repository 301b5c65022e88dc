"""Online estimates of one two-model preset's chain inputs from the workers' RoutingStats.

    p                 hand-offs per entry-model token (sampled tokens, taken-back ones too)
    rewrite_fraction  share of those hand-offs whose entry token the peer rewrites
    tokens_per_visit  large-model tokens per hand-off back (mean geometric run)
    t_m(b)            step seconds of model m at batch b, an affine least-squares fit

Every count and every fit sum decays with a half life (exponential forgetting), so
the estimates follow a drifting workload; "samples" below are decayed weights.
Pure: time comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.batcher.dtmc import AffineLatency
from shared.messages.batcher import RoutingStats
from shared.subjects import check_token


@dataclass
class DecayedAffineFit:
    """Weighted least squares of seconds = intercept + per_request * batch, with forgetting."""

    weight: float = 0.0  # decayed number of samples
    sum_b: float = 0.0
    sum_bb: float = 0.0
    sum_t: float = 0.0
    sum_bt: float = 0.0

    def scale(self, factor: float) -> None:
        self.weight *= factor
        self.sum_b *= factor
        self.sum_bb *= factor
        self.sum_t *= factor
        self.sum_bt *= factor

    def add(self, batch_size: int, seconds: float) -> None:
        self.weight += 1.0
        self.sum_b += batch_size
        self.sum_bb += batch_size * batch_size
        self.sum_t += seconds
        self.sum_bt += batch_size * seconds

    def fit(self) -> AffineLatency:
        """The fit; a slope that cannot be estimated (one batch size) or is negative is 0,
        and a negative intercept is 0, so t(b) > 0 for every b >= 1."""
        assert self.weight > 0
        mean_b, mean_t = self.sum_b / self.weight, self.sum_t / self.weight
        var_b = self.sum_bb / self.weight - mean_b * mean_b
        slope = 0.0
        if var_b > 1e-9:
            slope = max(0.0, (self.sum_bt / self.weight - mean_b * mean_t) / var_b)
        intercept = mean_t - slope * mean_b
        if intercept < 0.0:  # keep the line through the mean, pivoting it to the origin
            intercept, slope = 0.0, mean_t / mean_b
        return AffineLatency(intercept_s=intercept, per_request_s=slope)


@dataclass
class ModelCounts:
    """One model's decayed counters within a preset."""

    num_tokens: float = 0.0  # tokens sampled
    num_handoffs: float = 0.0  # hand-offs sent
    num_taken_back: float = 0.0  # hand-offs whose sampled token the peer rewrites
    steps: DecayedAffineFit = field(default_factory=DecayedAffineFit)

    def scale(self, factor: float) -> None:
        self.num_tokens *= factor
        self.num_handoffs *= factor
        self.num_taken_back *= factor
        self.steps.scale(factor)


@dataclass(frozen=True)
class ChainInputs:
    """What the chain needs, as estimated now."""

    p: float  # hand-offs per entry-model token
    rewrite_fraction: float  # of those hand-offs
    tokens_per_visit: float  # large-model tokens per visit (>= 1)
    latency_small: AffineLatency  # entry model's step time
    latency_large: AffineLatency  # large model's step time

    def moved_from(self, other: ChainInputs, rel: float, max_n: int) -> bool:
        """Did any input move by more than `rel` (relative) since `other`?"""

        def far(a: float, b: float) -> bool:
            return abs(a - b) > rel * max(abs(a), abs(b), 1e-12)

        pairs = [
            (self.p, other.p),
            (self.rewrite_fraction, other.rewrite_fraction),
            (self.tokens_per_visit, other.tokens_per_visit),
        ]
        for mine, theirs in (
            (self.latency_small, other.latency_small),
            (self.latency_large, other.latency_large),
        ):
            pairs += [(mine(1), theirs(1)), (mine(max_n), theirs(max_n))]
        return any(far(a, b) for a, b in pairs)


@dataclass(frozen=True)
class Thresholds:
    """Decayed sample counts needed before the estimates are used."""

    min_tokens: float  # entry-model tokens
    min_handoffs: float  # hand-offs each way
    min_step_samples: float  # step samples per model


class PresetEstimator:
    """The estimates of one preset; fed RoutingStats, asked for ChainInputs."""

    def __init__(self, models: list[str], half_life_s: float, now_s: float) -> None:
        self.models = list(models)
        self.half_life_s = half_life_s
        self.counts = [ModelCounts() for _ in models]
        self._decayed_at_s = now_s
        self.num_reports = 0
        self.last_num_active = 0  # the newest N a worker reported

    @property
    def is_two_model(self) -> bool:
        return len(self.models) == 2

    def _decay_to(self, now_s: float) -> None:
        dt = max(0.0, now_s - self._decayed_at_s)
        if dt > 0:
            factor = 0.5 ** (dt / self.half_life_s)
            for c in self.counts:
                c.scale(factor)
        self._decayed_at_s = max(self._decayed_at_s, now_s)

    def add(self, stats: RoutingStats, now_s: float) -> None:
        """Fold one report in (the caller checked it: see `check_stats`)."""
        self._decay_to(now_s)
        c = self.counts[stats.model_index]
        c.num_tokens += stats.num_tokens
        c.num_handoffs += stats.num_handoffs
        c.num_taken_back += stats.num_taken_back
        for b, t in zip(stats.step_batch_sizes, stats.step_seconds, strict=True):
            c.steps.add(b, t)
        self.num_reports += 1
        if stats.num_active > 0:
            self.last_num_active = stats.num_active

    def inputs(self, now_s: float, need: Thresholds) -> ChainInputs | None:
        """The chain inputs, or None while some count is below its threshold."""
        self._decay_to(now_s)
        if not self.is_two_model:
            return None
        small, large = self.counts
        if (
            small.num_tokens < need.min_tokens
            or small.num_handoffs < need.min_handoffs
            or large.num_handoffs < need.min_handoffs
            or small.steps.weight < need.min_step_samples
            or large.steps.weight < need.min_step_samples
        ):
            return None
        return ChainInputs(
            p=min(1.0, small.num_handoffs / small.num_tokens),
            rewrite_fraction=min(1.0, small.num_taken_back / small.num_handoffs),
            tokens_per_visit=max(1.0, large.num_tokens / large.num_handoffs),
            latency_small=small.steps.fit(),
            latency_large=large.steps.fit(),
        )


def check_stats(stats: RoutingStats) -> str | None:
    """Why a report cannot be used (bad input from outside), or None."""
    if not stats.models:
        return "models is empty"
    try:
        check_token(stats.preset)
    except ValueError as exc:
        return str(exc)
    if not 0 <= stats.model_index < len(stats.models):
        return f"model_index {stats.model_index} is outside models ({len(stats.models)})"
    if len(stats.step_batch_sizes) != len(stats.step_seconds):
        return "step_batch_sizes and step_seconds differ in length"
    if min(stats.num_tokens, stats.num_handoffs, stats.num_taken_back) < 0:
        return "negative counts"
    if stats.num_taken_back > stats.num_handoffs:
        return "num_taken_back exceeds num_handoffs"
    if any(b < 1 for b in stats.step_batch_sizes):
        return "a step batch size < 1"
    if any(not 0.0 < t < 3600.0 for t in stats.step_seconds):
        return "a step time outside (0, 3600) s"
    return None
