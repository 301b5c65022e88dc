"""CITER: a confidence router (MLP on the small model's hidden state).

It outputs P(the small model's token is acceptable), here: equals the large
model's; a token is rewritten by the large model when that confidence < tau.
"""

from __future__ import annotations

import torch

from services.worker.routing.api import RouteBatch
from services.worker.routing.policies.jump import OneTokenJumpPolicy


class CiterPolicy(OneTokenJumpPolicy):
    name = "citer"
    threshold_arg = "tau"

    def is_uncertain(self, batch: RouteBatch) -> torch.Tensor:
        return self.probabilities(batch) < self.threshold
