"""How far finished requests' output lengths landed from their predictions.

An engine records actual / predicted output length for every request that finished
normally (not aborted) and had a prediction, in one of two windows by whether the
prediction reached the request's max_tokens; its snapshots carry each window's
quantiles, so the estimator's replay can end each running request at one of the
ends still ahead of it, drawn by its id (`OutputPolicy` in
`services/estimator/sfs/replay.py`), instead of at the bare prediction, which biases
every queued TTFT estimate low (docs/sfs.md, "Bias from length predictions").

Pure and cheap: two bounded windows of floats, quantiles recomputed only after new
records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator


def predicted_capped(predicted: int, max_tokens: int) -> bool:
    """Whether a request's ratio belongs to the capped window: its prediction reached
    its max_tokens. The recorder and the replay (`OutputPolicy.target`, and its
    compiled mirror `kernel.build_state`) split requests by this one test."""
    return predicted >= max_tokens


class _Window:
    """A sliding window of ratios and its midpoint quantiles, cached until a record."""

    def __init__(self, window: int, min_samples: int, num_quantiles: int) -> None:
        self.min_samples = min_samples
        self.num_quantiles = num_quantiles
        self.ratios: deque[float] = deque(maxlen=window)
        self._quantiles: list[float] | None = []  # None: stale, recompute on read

    def add(self, ratio: float) -> None:
        self.ratios.append(ratio)
        self._quantiles = None

    def quantiles(self) -> list[float]:
        if self._quantiles is None:
            if len(self.ratios) < self.min_samples:
                self._quantiles = []
            else:
                s = sorted(self.ratios)
                n, q = len(s), self.num_quantiles
                self._quantiles = [
                    round(s[min(n - 1, int((k + 0.5) * n / q))], 4) for k in range(q)
                ]
        return list(self._quantiles)  # a copy: every snapshot gets its own list


class LengthRatios:
    """Sliding windows of actual / predicted output lengths and their quantiles, one for
    requests predicted to end below their max_tokens and one for those predicted at or
    past it (`capped`).

    Why two: a request predicted past its cap ends at the cap unless it stops first,
    so its ratio (against the prediction clamped to the cap) is at most 1 and often
    exactly 1; one predicted below its cap can run long. In one window the two mix,
    and the replay drew the capped ones' "1" for requests predicted short too: on a
    max_tokens-bound sim (lengths predicted +-30%, every request cut at its true
    length) queued estimates came out 10% low in deep queues. The replay picks each
    request's window by the same test (`OutputPolicy.target`). Until a window holds
    `min_samples` ratios it has no quantiles and its requests end at their bare
    predictions (clamped to max_tokens): a request predicted past its cap at the cap,
    as before any ratio was measured, rather than at ratios of the other kind.

    `window`, `min_samples` and `num_quantiles` apply to each window alike (so
    `len()` counts up to twice `window`).
    """

    def __init__(self, window: int = 512, min_samples: int = 32, num_quantiles: int = 16) -> None:
        if window < 1 or min_samples < 1 or num_quantiles < 1:
            raise ValueError("window, min_samples and num_quantiles must be >= 1")
        self._below = _Window(window, min_samples, num_quantiles)
        self._capped = _Window(window, min_samples, num_quantiles)

    def __len__(self) -> int:
        return len(self._below.ratios) + len(self._capped.ratios)

    def __iter__(self) -> Iterator[float]:
        """Every ratio held: the below-cap window's, then the capped one's, oldest first."""
        yield from self._below.ratios
        yield from self._capped.ratios

    def record(self, predicted: int | None, actual: int, max_tokens: int) -> None:
        """One finished request, into the capped window when its prediction reached
        max_tokens, else the other. The prediction is clamped to max_tokens first (the
        replay clamps it too), so a request cut at max_tokens reads as ratio >= 1."""
        if predicted is None or predicted < 1 or actual < 1:
            return
        window = self._capped if predicted_capped(predicted, max_tokens) else self._below
        window.add(actual / min(predicted, max_tokens))

    def quantiles(self) -> list[float]:
        """Midpoint quantiles (k + 1/2) / n of the below-cap window, ascending, rounded
        to 4 digits; [] until min_samples such requests were recorded."""
        return self._below.quantiles()

    def capped_quantiles(self) -> list[float]:
        """The same for requests predicted at or past their max_tokens."""
        return self._capped.quantiles()
