"""Online correction of the SFS replay's TTFT estimate, from measured TTFTs.

The replay is unbiased on a simulated engine (-1.5% mean signed error with exact
lengths, `just sfs-bias`) but under-predicts a real one by ~6-11% (`just bench-sfs`
part 1): requests that arrive after the probe and join its batches once it runs, and a
sum of batch times a little below the fit, neither of which a snapshot can show. The
bias is steady per instance, so each finished request's measured TTFT against the
estimate its decision used (`RouteReply.predicted_ttft_ms`, echoed back in
`RequestDoneEvent`) updates a per-instance factor f:

    log f <- (1 - alpha) log f + alpha log(measured / replay),  replay = estimate / f_used

an exponentially weighted mean of the log ratio to the uncorrected replay (f_used: the
factor the estimate carried), so f tracks the typical ratio (in log space, close to
its median: what minimises the absolute percentage error of a multiplicative bias).
A factor applies once `min_samples` were seen, and is clamped to
[1 / max_factor, max_factor] so a burst of odd requests cannot run away with it.

f_used is the factor in force when the decision was made, which `note` records per
request id. A TTFT is measured seconds after its decision, and under a queue dozens of
decisions fall in between: un-applying the factor in force at feedback time instead
fed the loop its own moves back and made it oscillate between the clamps (bench_sfs
part 1 with snapshots read every 20 ms: 0.52-2.0, served MAPE 19.6% on estimates
whose bare replay was 10.7%).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

# Feedback only from TTFTs well above the bus's own latency: the measured TTFT runs
# from the gateway's submit to its first token there, two NATS hops (~1 ms)
# the replay does not model; on a 2 ms request they would read as a 1.5x bias.
MIN_TTFT_S = 0.02


@dataclass(slots=True)
class TtftCorrection:
    """Per-instance multiplicative correction of SFS TTFT estimates (module docstring)."""

    alpha: float = 0.05  # weight of each new residual
    min_samples: int = 20  # residuals seen before the factor applies
    max_factor: float = 2.0  # the factor stays in [1 / max_factor, max_factor]
    max_noted: int = 65_536  # decisions whose factor is kept until their feedback
    _log_f: dict[str, float] = field(default_factory=dict)
    _count: dict[str, int] = field(default_factory=dict)
    # request id -> log of the factor its estimate carried (oldest first)
    _noted: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.min_samples < 0:
            raise ValueError(f"min_samples must be >= 0, got {self.min_samples}")
        if self.max_factor < 1.0:
            raise ValueError(f"max_factor must be >= 1, got {self.max_factor}")
        if self.max_noted < 0:
            raise ValueError(f"max_noted must be >= 0, got {self.max_noted}")

    def factor(self, instance_id: str) -> float:
        """What to multiply the instance's replay estimate by (1.0 until warmed up)."""
        return math.exp(self._applied_log(instance_id))

    def _applied_log(self, instance_id: str) -> float:
        if self._count.get(instance_id, 0) < self.min_samples:
            return 0.0
        return self._log_f.get(instance_id, 0.0)

    def is_noted(self, request_id: str) -> bool:
        """Whether a decision's factor waits for its feedback."""
        return request_id in self._noted

    def note(self, request_id: str, instance_id: str) -> None:
        """A decision sent `request_id` to the instance with an estimate corrected by
        the factor in force now: kept for its feedback (at most `max_noted`, oldest
        dropped first)."""
        self._noted[request_id] = self._applied_log(instance_id)
        self._noted.move_to_end(request_id)
        while len(self._noted) > self.max_noted:
            self._noted.popitem(last=False)

    def observe(
        self,
        instance_id: str,
        estimated_s: float,
        measured_s: float,
        request_id: str | None = None,
    ) -> None:
        """A finished request: its measured TTFT against the (corrected) estimate its
        decision used. Both in seconds; non-finite or tiny values are ignored. The
        factor the estimate carried is the one `note`d for `request_id`, else (a
        decision this object did not make) the one in force now."""
        noted = self._noted.pop(request_id, None) if request_id is not None else None
        if not (math.isfinite(estimated_s) and math.isfinite(measured_s)):
            return
        if estimated_s < MIN_TTFT_S or measured_s < MIN_TTFT_S:
            return
        log_f = self._log_f.get(instance_id, 0.0)
        count = self._count.get(instance_id, 0)
        used = noted if noted is not None else self._applied_log(instance_id)
        log_ratio = math.log(measured_s) - math.log(estimated_s) + used  # to the bare replay
        log_f = log_ratio if count == 0 else log_f + self.alpha * (log_ratio - log_f)
        bound = math.log(self.max_factor)
        self._log_f[instance_id] = min(bound, max(-bound, log_f))
        self._count[instance_id] = count + 1

    def num_observed(self, instance_id: str) -> int:
        """Measured TTFTs taken for the instance so far."""
        return self._count.get(instance_id, 0)

    def forget(self, instance_id: str) -> None:
        self._log_f.pop(instance_id, None)
        self._count.pop(instance_id, None)
