"""R-Stitch: entropy-based switching both ways between a small and a large model.

Uncertainty is the normalized entropy of the current model's next-token
distribution at temperature 1: H = -sum p log p / log |V|, in [0, 1].

  * on the small model (index 0): H > tau -> the large model rewrites this token
    (hand_rewrite(1)) and keeps the pen;
  * on the large model (index 1): H <= tau -> its token stands and the small
    model continues (hand_after(0)); otherwise the large model keeps writing.

So the large model holds the pen for as long as it is itself unsure. The default
tau is the calibrated one in `models/routers/r-stitch.json` (see
docs/token-routing.md); the preset argument `tau` overrides it.
"""

from __future__ import annotations

import math

import torch

from services.worker.routing.api import STAY, RouteBatch, TokenPolicy, hand_after, hand_rewrite
from services.worker.routing.policies.routers import load_router_meta
from services.worker.routing.policy_args import check_keys, float_arg

SMALL, LARGE = 0, 1


def normalized_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[n] entropy of softmax(logits) divided by log(vocab), in [0, 1]."""
    # entr(p) = -p log p with 0 at p = 0: a trimmed-vocabulary head (-inf logits) adds
    # nothing instead of 0 * -inf = nan.
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.special.entr(probs).sum(dim=-1) / math.log(logits.shape[-1])


class RStitchPolicy(TokenPolicy):
    name = "r-stitch"

    def configure(self) -> None:
        check_keys(self.name, self.args, ("tau",))
        meta = load_router_meta(self.artifacts_dir, self.name)
        self.tau = float_arg(self.name, self.args, "tau", float(meta["threshold"]), 0.0, 1.0)

    def route(self, batch: RouteBatch) -> list[int]:
        with torch.inference_mode():
            entropy = normalized_entropy(batch.logits)
        if self.model_index == SMALL:
            return [hand_rewrite(LARGE) if h else STAY for h in (entropy > self.tau).tolist()]
        return [hand_after(SMALL) if c else STAY for c in (entropy <= self.tau).tolist()]
