"""Robust fitting of batch-time coefficients from recorded iterations.

Two-part fit (SFS public code, `two_part_fit.py`, with NNLS):

1. Huber regression (IRLS, epsilon = 1.35, scale = MAD of residuals) on all samples;
2. *stalls*: samples whose Huber residual (measured - predicted, seconds) exceeds
   the `stall_percentile`-th percentile of residuals, or `stall_z` robust standard
   deviations, are dropped (GC pauses, scheduler hiccups: one-sided, slow only);
3. non-negative least squares on the inliers (every coefficient >= 0, intercept too).

Columns are scaled to unit max before solving (S2 is ~1e8 times P), and unscaled after.
Fit error is reported as MAPE = mean(|predicted - measured| / measured) over inliers
and over all samples; the stall fraction and mean stall excess (seconds) are kept so
an expected time p_stall * mean_stall could be added (the replay uses typical times).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from shared.scheduling.batch_time import (
    SIX_TERM,
    BatchTimeModel,
    features_from_raw,
    num_features,
    raw_from_sample,
)
from shared.scheduling.snapshot import BatchSample

HUBER_EPSILON = 1.35


@dataclass(frozen=True, slots=True)
class FitResult:
    """A fitted model and how well it explains the samples."""

    model: BatchTimeModel
    num_samples: int
    num_stalls: int
    mape_inliers: float  # fraction
    mape_all: float  # fraction
    mean_stall_excess_s: float  # mean (measured - predicted) over stalls, seconds

    @property
    def stall_fraction(self) -> float:
        return self.num_stalls / self.num_samples if self.num_samples else 0.0


def huber_irls(
    x: np.ndarray, y: np.ndarray, epsilon: float = HUBER_EPSILON, max_iter: int = 100
) -> np.ndarray:
    """Huber M-estimate of y ~ x @ beta by iteratively reweighted least squares.

    Weights w_i = min(1, epsilon * s / |r_i|) with s = 1.4826 * MAD(r) re-estimated
    every iteration; stops when beta moves by less than 1e-10 relative. Each weighted
    solve goes through the k x k normal equations (x' W x) beta = x' W y rather than a
    least-squares solve of the n x k system: ~7x less work for a window of 8,192
    samples (an estimator refits every instance about once a second; the SVD solves
    were 70% of its CPU at 16 streams). Their conditioning is x's squared, fine for
    columns scaled to unit max; lstsq on the small system gives the minimum-norm
    solution where a column is all zero (a window without prefills), as on x itself.
    The weights only pick the stalls: the coefficients come from NNLS after.
    """
    xt = x.T
    beta = np.linalg.lstsq(xt @ x, xt @ y, rcond=None)[0]
    for _ in range(max_iter):
        r = y - x @ beta
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        if scale <= 1e-15:
            break
        w = np.minimum(1.0, epsilon * scale / np.maximum(np.abs(r), 1e-300))
        xtw = xt * w
        new = np.linalg.lstsq(xtw @ x, xtw @ y, rcond=None)[0]
        done = np.linalg.norm(new - beta) <= 1e-10 * max(1.0, float(np.linalg.norm(beta)))
        beta = new
        if done:
            break
    return np.asarray(beta, dtype=float)


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    ok = y > 0
    if not ok.any():
        return float("nan")
    return float(np.mean(np.abs(pred[ok] - y[ok]) / y[ok]))


def fit_features(
    feature_set: str,
    x: np.ndarray,
    y: np.ndarray,
    *,
    stall_percentile: float = 99.9,
    stall_z: float | None = 5.0,
) -> FitResult:
    """Two-part robust fit of durations y (seconds) on feature rows x (n x k)."""
    n, k = x.shape
    if k != num_features(feature_set):
        raise ValueError(f"{feature_set} has {num_features(feature_set)} features, got {k}")
    if n < k:
        raise ValueError(f"need at least {k} samples to fit {feature_set}, got {n}")
    scale = np.max(np.abs(x), axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale

    beta_h = huber_irls(xs, y)
    r = y - xs @ beta_h
    threshold = float(np.percentile(r, stall_percentile))
    if stall_z is not None:
        robust_sd = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        threshold = min(threshold, stall_z * robust_sd) if robust_sd > 0 else threshold
    stall = r > threshold
    if n - int(stall.sum()) < k:  # never trim below an identifiable system
        stall = np.zeros(n, dtype=bool)
    inl = ~stall

    beta_s, _ = nnls(xs[inl], y[inl])
    beta = beta_s / scale
    pred = x @ beta
    excess = y[stall] - pred[stall]
    return FitResult(
        model=BatchTimeModel(feature_set, tuple(float(b) for b in beta)),
        num_samples=n,
        num_stalls=int(stall.sum()),
        mape_inliers=_mape(pred[inl], y[inl]),
        mape_all=_mape(pred, y),
        mean_stall_excess_s=float(excess.mean()) if excess.size else 0.0,
    )


def sample_rows(feature_set: str, samples: Iterable[BatchSample]) -> tuple[np.ndarray, np.ndarray]:
    """Feature matrix and durations (seconds) of recorded iterations."""
    rows: list[list[float]] = []
    ys: list[float] = []
    for s in samples:
        rows.append(features_from_raw(feature_set, raw_from_sample(s)))
        ys.append(s.duration_s)
    k = num_features(feature_set)
    return np.asarray(rows, dtype=float).reshape(-1, k), np.asarray(ys, dtype=float)


def fit_batch_time(
    samples: Sequence[BatchSample],
    feature_set: str = SIX_TERM,
    *,
    stall_percentile: float = 99.9,
    stall_z: float | None = 5.0,
) -> FitResult:
    """Fit a batch-time model to recorded iterations (see module docstring)."""
    x, y = sample_rows(feature_set, samples)
    return fit_features(feature_set, x, y, stall_percentile=stall_percentile, stall_z=stall_z)


class OnlineBatchTimeFitter:
    """Accumulates one instance's samples and refits every `refit_every` new ones.

    Keeps the newest `window` samples (the engine's speed drifts with load and
    temperature); `model` is None until `min_samples` arrived.
    """

    def __init__(
        self,
        feature_set: str = SIX_TERM,
        *,
        refit_every: int = 256,
        window: int = 8192,
        min_samples: int = 64,
        stall_percentile: float = 99.9,
        stall_z: float | None = 5.0,
    ) -> None:
        num_features(feature_set)
        self.feature_set = feature_set
        self.refit_every = refit_every
        self.min_samples = max(min_samples, num_features(feature_set))
        self.stall_percentile = stall_percentile
        self.stall_z = stall_z
        self._rows: deque[list[float]] = deque(maxlen=window)
        self._ys: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.last_fit: FitResult | None = None

    @property
    def model(self) -> BatchTimeModel | None:
        return self.last_fit.model if self.last_fit is not None else None

    @property
    def num_samples(self) -> int:
        return len(self._ys)

    def add(self, samples: Iterable[BatchSample]) -> FitResult | None:
        """Take new samples; returns the new fit when this call refitted, else None."""
        for s in samples:
            self._rows.append(features_from_raw(self.feature_set, raw_from_sample(s)))
            self._ys.append(s.duration_s)
            self._since_fit += 1
        due = self._since_fit >= self.refit_every or self.last_fit is None
        if not due or len(self._ys) < self.min_samples:
            return None
        return self.refit()

    def refit(self) -> FitResult:
        x = np.asarray(self._rows, dtype=float)
        y = np.asarray(self._ys, dtype=float)
        self.last_fit = fit_features(
            self.feature_set,
            x,
            y,
            stall_percentile=self.stall_percentile,
            stall_z=self.stall_z,
        )
        self._since_fit = 0
        return self.last_fit
