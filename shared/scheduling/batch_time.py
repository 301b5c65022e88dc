"""Batch-time models: the modeled duration of one engine iteration from its composition.

Every feature set is linear in a handful of *raw sums* over the chunks of one batch,
so the replay kernel accumulates those sums once and any feature set prices them:

    P   = sum of prefill tokens             (chunks that are not one-token decodes)
    PP  = sum of squared prefill chunk sizes
    D   = decode tokens (one per decoding request)
    S   = sum of context lengths after the step, over every scheduled request (tokens)
    S2  = sum of squared context lengths after the step
    DC  = sum over decode chunks of the context *before* the step (tokens)
    PC  = sum over prefill chunks of (chunk * context_before + chunk * (chunk + 1) / 2)
    DD  = D squared
    HP  = 1 when the batch holds a prefill chunk, else 0

Feature sets (coefficients in seconds per feature unit):

* ``"six-term"`` (the SFS public code's "legacy" model):
  T = b0 + b_p*P + b_p2*PP + b_d*D + b_s*S + b_s2*S2
* ``"four-term"`` (the SFS paper, eq. 11):
  T = b0 + b1*(P + D) + b2*DC + b3*PC
* ``"seven-term"``: six-term + b_d2*DD. On a CPU the linears are bandwidth-bound for
  a few rows and compute-bound from ~8, so a decode batch's cost is convex in its
  size: on smollm2-small (10,875 iterations, batches of 1-32) the six-term fit prices
  batches of 25-32 requests 21% short, the D^2 term 9% (overall error 5.1% -> 4.2%).
* ``"eight-term"`` (Baton's CPU default): seven-term + b_hp*HP, a fixed cost of every
  iteration that prefills. The engine's prefill path (its own attention call, the
  chunk's metadata, the prompt's first tokens in the sampler) costs the same whatever
  the chunk's size; without the term the fit spreads it over P and b0 and prices
  prefill iterations 3.4% short in sum (1.1% with it; bench_sfs part 1, smollm2-small).
  A queued request waits through prefill iterations.

Context "after the step" is what `BatchSample.context_lens` records (chunk end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import mul

from shared.scheduling.scheduler import ScheduledBatch
from shared.scheduling.snapshot import BatchSample, WorkloadSnapshot

SIX_TERM = "six-term"
FOUR_TERM = "four-term"
SEVEN_TERM = "seven-term"
EIGHT_TERM = "eight-term"

# Raw sums, in this order, are what the replay kernel accumulates per step.
RAW_SUMS = ("one", "P", "PP", "D", "S", "S2", "DC", "PC", "DD", "HP")
NUM_RAW = len(RAW_SUMS)

FEATURE_SETS: dict[str, tuple[str, ...]] = {
    SIX_TERM: ("b0", "b_p", "b_p2", "b_d", "b_s", "b_s2"),
    FOUR_TERM: ("b0", "b1", "b2", "b3"),
    SEVEN_TERM: ("b0", "b_p", "b_p2", "b_d", "b_s", "b_s2", "b_d2"),
    EIGHT_TERM: ("b0", "b_p", "b_p2", "b_d", "b_s", "b_s2", "b_d2", "b_hp"),
}


def num_features(feature_set: str) -> int:
    """Number of coefficients of a named feature set (ValueError if unknown)."""
    try:
        return len(FEATURE_SETS[feature_set])
    except KeyError:
        raise ValueError(f"unknown batch-time feature set {feature_set!r}") from None


def features_from_raw(feature_set: str, raw: Sequence[float]) -> list[float]:
    """Feature vector of one batch from its raw sums (order of RAW_SUMS)."""
    one, p, pp, d, s, s2, dc, pc, dd, hp = raw
    if feature_set == SIX_TERM:
        return [one, p, pp, d, s, s2]
    if feature_set == SEVEN_TERM:
        return [one, p, pp, d, s, s2, dd]
    if feature_set == EIGHT_TERM:
        return [one, p, pp, d, s, s2, dd, hp]
    if feature_set == FOUR_TERM:
        return [one, p + d, dc, pc]
    raise ValueError(f"unknown batch-time feature set {feature_set!r}")


def raw_coefs(feature_set: str, coefs: Sequence[float]) -> tuple[float, ...]:
    """The same model expressed over the raw sums: T = dot(raw_coefs, raw)."""
    if len(coefs) != num_features(feature_set):
        raise ValueError(f"{feature_set} takes {num_features(feature_set)} coefficients")
    if feature_set == SIX_TERM:
        b0, bp, bpp, bd, bs, bs2 = coefs
        return (b0, bp, bpp, bd, bs, bs2, 0.0, 0.0, 0.0, 0.0)
    if feature_set == SEVEN_TERM:
        b0, bp, bpp, bd, bs, bs2, bd2 = coefs
        return (b0, bp, bpp, bd, bs, bs2, 0.0, 0.0, bd2, 0.0)
    if feature_set == EIGHT_TERM:
        b0, bp, bpp, bd, bs, bs2, bd2, bhp = coefs
        return (b0, bp, bpp, bd, bs, bs2, 0.0, 0.0, bd2, bhp)
    b0, b1, b2, b3 = coefs
    return (b0, b1, 0.0, b1, 0.0, 0.0, b2, b3, 0.0, 0.0)


def raw_from_chunks(chunks: Sequence[tuple[int, int, bool]]) -> list[float]:
    """Raw sums of one batch from (context_before, num_new_tokens, is_decode) per chunk."""
    p = pp = d = s = s2 = dc = pc = 0
    for start, n, is_decode in chunks:
        end = start + n
        s += end
        s2 += end * end
        if is_decode:
            d += 1
            dc += start
        else:
            p += n
            pp += n * n
            pc += n * start + n * (n + 1) // 2
    return [1.0, p, pp, d, s, s2, dc, pc, d * d, float(p > 0)]


def raw_from_batch(batch: ScheduledBatch) -> list[float]:
    """Raw sums of a batch the scheduler just planned."""
    return raw_from_chunks([(c.start, c.num_new_tokens, c.is_decode) for c in batch.chunks])


def raw_from_sample(sample: BatchSample) -> list[float]:
    """Raw sums of a recorded iteration.

    A sample lists context lengths of all scheduled requests but prefill chunk sizes
    only for prefill chunks, without saying which context belongs to which chunk. The
    scheduler schedules decodes before prefills (running requests are oldest first and
    at most the newest is still prefilling; admissions come last), so the prefill
    chunks are paired with the *last* len(chunk_sizes) contexts. DC and PC rely on that
    pairing; P, PP, D, S, S2 do not.
    """
    ctx = sample.context_lens
    s = sum(ctx)
    s2 = sum(map(mul, ctx, ctx))  # (a worker prices every iteration: ~2x a generator's speed)
    d = sample.num_decode_tokens
    if not sample.chunk_sizes:  # decode only (most iterations): P = PP = PC = 0
        return [1.0, sample.num_prefill_tokens, 0, d, s, s2, s - len(ctx), 0, d * d, 0.0]
    n_pre = len(sample.chunk_sizes)
    decode_ends = ctx[: len(ctx) - n_pre]
    prefill_ends = ctx[len(ctx) - n_pre :]
    dc = sum(decode_ends) - len(decode_ends)
    pc = 0
    for n, end in zip(sample.chunk_sizes, prefill_ends, strict=True):
        pc += n * (end - n) + n * (n + 1) // 2
    pp = sum(map(mul, sample.chunk_sizes, sample.chunk_sizes))
    return [1.0, sample.num_prefill_tokens, pp, d, s, s2, dc, pc, d * d, 1.0]


def _dot(coefs: Sequence[float], x: Sequence[float]) -> float:
    if len(coefs) != len(x):
        raise ValueError(f"{len(x)} features for {len(coefs)} coefficients")
    return float(sum(map(mul, coefs, x)))  # (the same sum, in the same order, as a loop)


def features(feature_set: str, batch: BatchSample | ScheduledBatch) -> list[float]:
    """Feature vector of a recorded sample or a planned batch under `feature_set`."""
    raw = raw_from_sample(batch) if isinstance(batch, BatchSample) else raw_from_batch(batch)
    return features_from_raw(feature_set, raw)


@dataclass(frozen=True, slots=True)
class BatchTimeModel:
    """T(batch) in seconds = dot(coefs, features(feature_set, batch))."""

    feature_set: str
    coefs: tuple[float, ...]  # seconds per feature unit, names in FEATURE_SETS
    # raw_coefs(feature_set, coefs), made once: the replay and a worker's speed price
    # with it on every decision and every written iteration
    _raw: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefs", tuple(float(c) for c in self.coefs))
        num_features(self.feature_set)  # validates the name
        if len(self.coefs) != num_features(self.feature_set):
            raise ValueError(f"{self.feature_set} takes {num_features(self.feature_set)} coefs")
        object.__setattr__(self, "_raw", raw_coefs(self.feature_set, self.coefs))

    @property
    def raw(self) -> tuple[float, ...]:
        """Coefficients over RAW_SUMS (what the replay kernel multiplies)."""
        return self._raw

    def predict(self, batch: BatchSample | ScheduledBatch) -> float:
        """Modeled seconds of one iteration."""
        return self.predict_features(features(self.feature_set, batch))

    def predict_features(self, x: Sequence[float]) -> float:
        return _dot(self.coefs, x)

    def predict_raw(self, raw: Sequence[float]) -> float:
        return _dot(self._raw, raw)

    def predict_sample(self, sample: BatchSample) -> float:
        """`predict` of a recorded iteration, over its raw sums: the same sums in the
        same order (a zero coefficient adds nothing), but for four-term, whose
        b1 * (P + D) becomes b1 * P + b1 * D (the last bit may differ)."""
        return float(sum(map(mul, self._raw, raw_from_sample(sample))))

    @classmethod
    def from_snapshot(cls, snapshot: WorkloadSnapshot) -> BatchTimeModel | None:
        """The publisher's calibration, if the snapshot carries one."""
        if not snapshot.carries_calibration:
            return None
        return cls(snapshot.batch_time_features, tuple(snapshot.batch_time_coefs))


# The SFS paper's public code: H100, Qwen3, vLLM; six-term, seconds.
SFS_H100_QWEN3: dict[str, BatchTimeModel] = {
    "qwen3-0.6b": BatchTimeModel(
        SIX_TERM, (2.582e-3, 2.034e-6, 1.893e-10, 1.689e-5, 3.543e-8, 1.575e-13)
    ),
    "qwen3-8b": BatchTimeModel(
        SIX_TERM, (7.296e-3, 2.079e-5, 5.120e-10, 2.563e-5, 4.649e-8, 2.685e-13)
    ),
    "qwen3-32b": BatchTimeModel(
        SIX_TERM, (1.435e-2, 5.294e-5, 8.774e-10, 6.305e-5, 3.686e-8, 4.520e-13)
    ),
}
