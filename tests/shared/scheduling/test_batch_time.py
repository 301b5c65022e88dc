"""Batch-time features agree between planned batches and recorded samples; the robust
fit recovers known coefficients despite stall outliers; the online fitter refits."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.estimator.sfs.fit import OnlineBatchTimeFitter, fit_batch_time, huber_irls
from shared.scheduling.batch_time import (
    EIGHT_TERM,
    FEATURE_SETS,
    FOUR_TERM,
    SEVEN_TERM,
    SFS_H100_QWEN3,
    SIX_TERM,
    BatchTimeModel,
    features,
)
from shared.scheduling.snapshot import BatchSample, describe_batch
from tests.services.estimator.sfs.builders import make_scheduler, step


@pytest.mark.parametrize("feature_set", [SIX_TERM, FOUR_TERM, SEVEN_TERM, EIGHT_TERM])
def test_sample_and_batch_give_the_same_features(feature_set: str) -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    s.add("a", 5, 20)
    s.add("b", 3, 20)
    step(s)
    s.add("c", 40, 4)  # chunked behind the two decodes, then decodes only
    num_decode_only = 0
    for _ in range(6):
        batch = s.schedule()
        planned = features(feature_set, batch)
        sample = describe_batch(batch, s, 0.0, 0.01)
        assert features(feature_set, sample) == planned
        num_decode_only += not sample.chunk_sizes
        s.commit(batch)
    assert num_decode_only >= 2  # (raw_from_sample's own path for those)


@pytest.mark.parametrize("feature_set", [SIX_TERM, FOUR_TERM, SEVEN_TERM, EIGHT_TERM])
def test_a_sample_priced_over_its_raw_sums_is_priced_as_its_features(feature_set: str) -> None:
    coefs = (2e-3, 3e-6, 4e-10, 5e-5, 6e-8, 7e-13, 8e-7, 9e-4)[: len(FEATURE_SETS[feature_set])]
    model = BatchTimeModel(feature_set, coefs)
    s = make_scheduler(max_num_batched_tokens=16)
    s.add("a", 5, 20)
    s.add("b", 3, 20)
    step(s)
    s.add("c", 40, 4)
    for _ in range(6):
        batch = s.schedule()
        sample = describe_batch(batch, s, 0.0, 0.01)
        # the same sum in the same order (four-term: b1 * P + b1 * D, last bit aside)
        assert model.predict_sample(sample) == pytest.approx(model.predict(sample), rel=1e-12)
        if feature_set != FOUR_TERM:
            assert model.predict_sample(sample) == model.predict(sample)
        s.commit(batch)


def test_six_term_features_by_hand() -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    s.add("a", 5, 20)
    step(s)  # a: 5 prompt tokens computed, 1 sampled
    s.add("c", 40, 4)
    batch = s.schedule()  # a decodes (ends at 6), c prefills 15 (ends at 15)
    assert features(SIX_TERM, batch) == [1, 15, 225, 1, 21, 36 + 225]
    # four-term: P + D, decode context before (5), prefill 15 * 0 + 15 * 16 / 2
    assert features(FOUR_TERM, batch) == [1, 16, 5, 120]
    # eight-term: six-term, D^2, and HP = 1 (the batch prefills)
    assert features(EIGHT_TERM, batch) == [1, 15, 225, 1, 21, 36 + 225, 1, 1]
    s.commit(batch)
    s.commit(s.schedule())  # c's two more prefill chunks (15, 10)
    s.commit(s.schedule())
    decode_only = s.schedule()
    assert not decode_only.num_prefill_tokens
    assert features(EIGHT_TERM, decode_only)[-1] == 0


def test_a_prediction_is_the_dot_product_and_refuses_a_wrong_length() -> None:
    model = BatchTimeModel(SIX_TERM, (1e-3, 2e-6, 3e-10, 4e-5, 5e-8, 6e-13))
    x = [1.0, 15.0, 225.0, 1.0, 21.0, 261.0]
    assert model.predict_features(x) == sum(c * v for c, v in zip(model.coefs, x, strict=True))
    raw = [1.0, 15.0, 225.0, 1.0, 21.0, 261.0, 5.0, 120.0, 1.0, 1.0]
    assert model.predict_raw(raw) == model.predict_features(x)  # zeros on the extra sums
    with pytest.raises(ValueError, match="5 features for 6 coefficients"):
        model.predict_features(x[:5])


def synthetic_samples(
    model: BatchTimeModel, n: int, stall_fraction: float, seed: int, noise: float = 0.01
) -> tuple[list[BatchSample], int]:
    """Random batch compositions, durations from `model` with relative Gaussian noise;
    a fraction of them get +50..300% (stalls)."""
    rng = random.Random(seed)
    samples = []
    stalls = 0
    for _ in range(n):
        num_dec = rng.randint(0, 64)
        chunks = [rng.randint(1, 2048) for _ in range(rng.choice((0, 0, 1, 2)))]
        if num_dec == 0 and not chunks:
            num_dec = 1
        ctx = [rng.randint(16, 4096) for _ in range(num_dec)] + [
            n + rng.choice((0, rng.randint(0, 2048))) for n in chunks
        ]
        s = BatchSample(0.0, 0.0, sum(chunks), num_dec, chunks, ctx, num_dec + len(chunks), 0)
        t = model.predict(s) * (1 + rng.gauss(0, noise))
        if rng.random() < stall_fraction:
            t *= 1.5 + 2.5 * rng.random()
            stalls += 1
        samples.append(BatchSample(0.0, t, s.num_prefill_tokens, num_dec, chunks, ctx, 0, 0))
    return samples, stalls


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b"])
def test_fit_recovers_coefficients_despite_stalls(name: str) -> None:
    true = SFS_H100_QWEN3[name]
    samples, stalls = synthetic_samples(true, 3000, 0.03, seed=1)
    fit = fit_batch_time(samples, SIX_TERM)
    assert fit.num_stalls >= stalls  # every injected stall is among the dropped rows
    assert fit.stall_fraction < 0.1
    # Times, not raw coefficients, are what matter (b_p2 and b_s2 are weakly identified):
    clean, _ = synthetic_samples(true, 500, 0.0, seed=2)
    pred = np.array([fit.model.predict(s) for s in clean])
    want = np.array([true.predict(s) for s in clean])
    assert float(np.mean(np.abs(pred - want) / want)) < 0.01
    for got, exp in zip(fit.model.coefs[:2], true.coefs[:2], strict=True):  # b0, b_p
        assert got == pytest.approx(exp, rel=0.05)
    assert fit.mape_inliers < 0.02
    assert all(c >= 0 for c in fit.model.coefs)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
def test_fit_recovers_every_coefficient_with_low_noise(name: str) -> None:
    """With 0.02% timing noise all six terms are identifiable: each within 3%."""
    true = SFS_H100_QWEN3[name]
    samples, stalls = synthetic_samples(true, 3000, 0.03, seed=6, noise=2e-4)
    fit = fit_batch_time(samples, SIX_TERM)
    assert fit.num_stalls >= stalls
    for got, exp in zip(fit.model.coefs, true.coefs, strict=True):
        assert got == pytest.approx(exp, rel=0.03)


def test_fit_without_stall_trimming_is_pulled_by_stalls() -> None:
    true = SFS_H100_QWEN3["qwen3-8b"]
    samples, _ = synthetic_samples(true, 2000, 0.05, seed=3)
    robust = fit_batch_time(samples, SIX_TERM)
    naive = fit_batch_time(samples, SIX_TERM, stall_percentile=100.0, stall_z=None)
    assert abs(naive.model.coefs[0] - true.coefs[0]) > abs(robust.model.coefs[0] - true.coefs[0])


def test_four_term_fit_recovers_coefficients() -> None:
    true = BatchTimeModel(FOUR_TERM, (5e-3, 2e-5, 3e-9, 4e-9))
    samples, _ = synthetic_samples(true, 2000, 0.02, seed=4, noise=2e-3)
    fit = fit_batch_time(samples, FOUR_TERM)
    for got, exp in zip(fit.model.coefs, true.coefs, strict=True):
        assert got == pytest.approx(exp, rel=0.05)


def test_eight_term_fit_prices_a_fixed_prefill_cost() -> None:
    """Iterations that prefill pay a fixed cost: the eight-term fit recovers it and prices
    prefill iterations right in sum; the seven-term fit, which cannot express it, fits
    worse (on a CPU engine it priced them 3.4% short: batch_time.py)."""
    b0, bp, bpp, bd, bs, bs2, bd2 = 0.016, 1.4e-4, 3e-8, 3e-4, 4e-6, 8e-10, 2e-6
    true = BatchTimeModel(EIGHT_TERM, (b0, bp, bpp, bd, bs, bs2, bd2, 0.007))
    samples, _ = synthetic_samples(true, 3000, 0.0, seed=7, noise=0.005)
    eight = fit_batch_time(samples, EIGHT_TERM)
    seven = fit_batch_time(samples, SEVEN_TERM)
    assert eight.model.coefs[-1] == pytest.approx(0.007, rel=0.1)
    prefill = [x for x in samples if x.num_prefill_tokens]

    def sum_ratio(model: BatchTimeModel) -> float:
        return sum(model.predict(x) for x in prefill) / sum(x.duration_s for x in prefill)

    assert sum_ratio(eight.model) == pytest.approx(1.0, abs=0.01)
    assert eight.mape_inliers < seven.mape_inliers


def test_a_feature_constant_over_the_window_is_left_to_the_intercept() -> None:
    """Every iteration prefilled (HP = 1 throughout, a sustained queue): the data cannot
    tell b_hp from b0. NNLS, which takes columns in order, gives the whole of it to the
    intercept, so a decode-only batch is priced with it rather than with an arbitrary
    split (a least-squares solve would split it evenly)."""
    true = BatchTimeModel(EIGHT_TERM, (0.016, 1.4e-4, 3e-8, 3e-4, 4e-6, 8e-10, 2e-6, 0.007))
    samples, _ = synthetic_samples(true, 2000, 0.0, seed=8, noise=0.005)
    prefilling = [x for x in samples if x.num_prefill_tokens]
    fit = fit_batch_time(prefilling, EIGHT_TERM)
    assert fit.model.coefs[-1] == 0.0
    assert fit.model.coefs[0] == pytest.approx(0.016 + 0.007, rel=0.1)


def test_huber_resists_outliers() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.uniform(0, 10, 200)])
    y = x @ np.array([1.0, 2.0]) + rng.normal(0, 0.01, 200)
    y[:10] += 50.0
    assert huber_irls(x, y) == pytest.approx([1.0, 2.0], abs=0.05)


def reference_huber(x: np.ndarray, y: np.ndarray, max_iter: int = 100) -> np.ndarray:
    """The same IRLS with each weighted solve on the n x k system itself (an SVD)."""
    beta = np.linalg.lstsq(x, y, rcond=None)[0]
    for _ in range(max_iter):
        r = y - x @ beta
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        if scale <= 1e-15:
            break
        sw = np.sqrt(np.minimum(1.0, 1.35 * scale / np.maximum(np.abs(r), 1e-300)))
        new = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)[0]
        done = np.linalg.norm(new - beta) <= 1e-10 * max(1.0, float(np.linalg.norm(beta)))
        beta = new
        if done:
            break
    return beta


def test_huber_through_the_normal_equations_solves_as_the_full_system() -> None:
    # Columns scaled to unit max as fit_features scales them, correlated as a decode
    # window's are (S grows with D), one all zero (no prefill in the window), stalls.
    rng = np.random.default_rng(3)
    n = 4096
    d = rng.integers(1, 17, n).astype(float)
    s = d * rng.uniform(30, 300, n)
    x = np.column_stack([np.ones(n), np.zeros(n), d, s, s * s, d * d])
    x /= np.max(np.abs(x), axis=0) + (np.max(np.abs(x), axis=0) == 0)
    y = x @ np.array([2e-3, 0.0, 8e-4, 5e-4, 1e-4, 3e-4]) * rng.normal(1.0, 0.03, n)
    y[rng.random(n) < 0.01] += 0.01
    got, want = huber_irls(x, y), reference_huber(x, y)
    assert abs(got[1]) < 1e-12 and abs(want[1]) < 1e-12  # minimum norm: nothing on it
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_online_fitter_refits_every_k_samples() -> None:
    true = SFS_H100_QWEN3["qwen3-0.6b"]
    samples, _ = synthetic_samples(true, 300, 0.0, seed=5)
    fitter = OnlineBatchTimeFitter(SIX_TERM, refit_every=100, min_samples=50)
    assert fitter.add(samples[:40]) is None and fitter.model is None
    assert fitter.add(samples[40:60]) is not None  # first fit once min_samples arrived
    assert fitter.add(samples[60:150]) is None  # 90 new < 100
    refit = fitter.add(samples[150:160])
    assert refit is not None and refit.num_samples == 160
    assert fitter.model == refit.model


def test_model_rejects_wrong_shapes() -> None:
    with pytest.raises(ValueError):
        BatchTimeModel(SIX_TERM, (1.0, 2.0))
    with pytest.raises(ValueError):
        BatchTimeModel("seven-term", (1.0,))
