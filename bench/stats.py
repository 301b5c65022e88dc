"""Statistics the benchmarks share."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation between order statistics."""
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    if math.isinf(s[lo]) or math.isinf(s[hi]):
        return s[hi] if pos > lo else s[lo]
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
