"""How long each request of a replay runs: its predicted output length, or one of the
ends its measured length ratios allow, drawn per request."""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

from shared.scheduling.lengths import predicted_capped
from shared.scheduling.snapshot import WorkloadSnapshot


def ratio_draw(key: str) -> int:
    """A request's fixed draw among its possible ends (stable across processes and
    decisions: CRC-32 of its id)."""
    return zlib.crc32(key.encode())


@dataclass(frozen=True, slots=True)
class OutputPolicy:
    """How many output tokens each simulated request produces before it finishes.

    With `length_ratios` (quantiles of actual / predicted output length, as measured
    on finished requests) each request with a prediction ends at one of its possible
    ends still ahead of it, min(predicted x r, max_tokens) for the quantiles r that
    put the end past the tokens it has, the one its id draws (`ratio_draw`). Point
    predictions bias queued estimates low: a request past its prediction was replayed
    as ending at the next step, so slots and budget freed too early. A point estimate
    per request (its conditional mean or median) overshoots instead: a queued probe
    waits for the *earliest* of the running requests to end, and the earliest of
    their expected ends is later than their expected earliest end. A fixed draw per
    request keeps the running set's spread of ends, so its earliest one, unbiased
    (docs/sfs.md, "Bias from length predictions"). A request predicted at or past its
    max_tokens draws from `capped_length_ratios` instead, measured on such requests
    (`shared.scheduling.lengths` says why the two are kept apart).
    """

    default_output_tokens: int = 128  # for requests without a prediction
    min_remaining_tokens: int = 1  # for requests past every ratio's end
    length_ratios: tuple[float, ...] = ()  # quantiles of actual / predicted; () = trust it
    use_measured_ratios: bool = True  # for_snapshot takes the snapshot's measured ratios
    # the same for requests predicted at or past their max_tokens; () = trust it
    capped_length_ratios: tuple[float, ...] = ()

    def __post_init__(self) -> None:  # ascending, so a request's possible ends are too
        object.__setattr__(self, "length_ratios", tuple(sorted(self.length_ratios)))
        object.__setattr__(self, "capped_length_ratios", tuple(sorted(self.capped_length_ratios)))

    def for_snapshot(self, snapshot: WorkloadSnapshot) -> OutputPolicy:
        """This policy with the ratios the instance measured (its snapshot's
        `output_length_ratios` and `output_length_ratios_capped`), unless ratios were
        given or measuring is off."""
        if self.length_ratios or self.capped_length_ratios or not self.use_measured_ratios:
            return self
        if not (snapshot.output_length_ratios or snapshot.output_length_ratios_capped):
            return self
        return dataclasses.replace(
            self,
            length_ratios=tuple(snapshot.output_length_ratios),
            capped_length_ratios=tuple(snapshot.output_length_ratios_capped),
        )

    def target(
        self, predicted: int | None, max_tokens: int, num_output: int, request_id: str = ""
    ) -> int:
        """Output count at which the request finishes: at most max_tokens (unless it
        already has more), always > num_output."""
        t = self.default_output_tokens if predicted is None else predicted
        t = min(max(t, 1), max_tokens)
        ratios: tuple[float, ...] = ()
        if predicted is not None:
            capped = predicted_capped(predicted, max_tokens)
            ratios = self.capped_length_ratios if capped else self.length_ratios
        if ratios:
            if num_output <= 0:  # every end (>= 1) is ahead: the drawn one alone
                r = ratios[ratio_draw(request_id) % len(ratios)]
                return min(max(1, round(t * r)), max_tokens)
            alive = [e for r in ratios if (e := min(max(1, round(t * r)), max_tokens)) > num_output]
            if alive:
                return alive[ratio_draw(request_id) % len(alive)]
        return max(t, num_output + self.min_remaining_tokens)
