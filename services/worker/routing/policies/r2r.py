"""R2R (Roads to Rome): a neural router predicts where the small model's token diverges.

Router inputs as R2R's HiddenStatesTokenLMHeadLogitsClassifier, scaled down:
hidden state, sampled-token embedding (projected), top-k log-probabilities. It
outputs P(the small model's token differs from the large model's); a token is
rewritten by the large model when P > threshold. The threshold is calibrated for
a recall of 0.95 of divergent tokens on validation, R2R's official rule.
"""

from __future__ import annotations

import torch

from services.worker.routing.api import RouteBatch
from services.worker.routing.policies.jump import OneTokenJumpPolicy


class R2RPolicy(OneTokenJumpPolicy):
    name = "r2r"
    threshold_arg = "threshold"

    def is_uncertain(self, batch: RouteBatch) -> torch.Tensor:
        return self.probabilities(batch) > self.threshold
