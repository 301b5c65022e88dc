"""The hold rule a model's step loop obeys (pure; the worker, the check script and the
simulator's timeout semantics agree on it).

A model steps when any of:
  1. at least B_m(N) of the preset's requests are ready at it,
  2. every active request is at it (nothing else can arrive; also covers B_m > N),
  3. its oldest ready request has waited hold_timeout_s (the safety net: a table
     that is stale, wrong or torn between versions can never stall a request).
With nothing ready it never steps.
"""

from __future__ import annotations


def may_step(
    num_ready: int, num_active: int, hold: int, oldest_wait_s: float, hold_timeout_s: float
) -> bool:
    """num_ready: requests ready at this model; num_active: N; hold: B_m(N);
    oldest_wait_s: seconds the oldest ready request has been ready."""
    if num_ready <= 0:
        return False
    return num_ready >= hold or num_ready >= num_active or oldest_wait_s >= hold_timeout_s


def wait_left_s(num_ready: int, oldest_wait_s: float, hold_timeout_s: float) -> float | None:
    """Seconds until rule 3 fires (None with nothing ready): how long a loop may sleep."""
    if num_ready <= 0:
        return None
    return max(0.0, hold_timeout_s - oldest_wait_s)
