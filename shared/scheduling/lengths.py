"""How far finished requests' output lengths landed from their predictions.

An engine records actual / predicted output length for every request that finished
normally (not aborted) and had a prediction; its snapshots carry the ratio's
quantiles, so the estimator's replay can end each running request at one of the
ends still ahead of it, drawn by its id (`OutputPolicy` in
`services/estimator/sfs/replay.py`), instead of at the bare prediction, which biases
every queued TTFT estimate low (docs/sfs.md, "Bias from length predictions").

Pure and cheap: a bounded window of floats, quantiles recomputed only after new
records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator


class LengthRatios:
    """A sliding window of actual / predicted output lengths and its quantiles."""

    def __init__(self, window: int = 512, min_samples: int = 32, num_quantiles: int = 16) -> None:
        if window < 1 or min_samples < 1 or num_quantiles < 1:
            raise ValueError("window, min_samples and num_quantiles must be >= 1")
        self.min_samples = min_samples
        self.num_quantiles = num_quantiles
        self._ratios: deque[float] = deque(maxlen=window)
        self._quantiles: list[float] | None = []  # None: stale, recompute on read

    def __len__(self) -> int:
        return len(self._ratios)

    def __iter__(self) -> Iterator[float]:
        """The window's ratios, oldest first."""
        return iter(self._ratios)

    def record(self, predicted: int | None, actual: int, max_tokens: int) -> None:
        """One finished request. The prediction is clamped to max_tokens first (the
        replay clamps it too), so a request cut at max_tokens reads as ratio >= 1."""
        if predicted is None or predicted < 1 or actual < 1:
            return
        self._ratios.append(actual / min(predicted, max_tokens))
        self._quantiles = None

    def quantiles(self) -> list[float]:
        """Midpoint quantiles (k + 1/2) / n of the window, ascending, rounded to 4
        digits; [] until min_samples requests were recorded."""
        if self._quantiles is None:
            if len(self._ratios) < self.min_samples:
                self._quantiles = []
            else:
                s = sorted(self._ratios)
                n, q = len(s), self.num_quantiles
                self._quantiles = [
                    round(s[min(n - 1, int((k + 0.5) * n / q))], 4) for k in range(q)
                ]
        return list(self._quantiles)  # a copy: every snapshot gets its own list
