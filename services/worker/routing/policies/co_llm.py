"""Co-LLM: a learned deferral score (a linear head on the small model's hidden state).

Trained as Co-LLM's latent-variable model with both models frozen: the
reference token's likelihood is (1 - d) p_small + d p_large, d = sigmoid(score);
maximizing it teaches d -> 1 where the large model explains the reference far
better. A token is rewritten by the large model when d > eta.
"""

from __future__ import annotations

import torch

from services.worker.routing.api import RouteBatch
from services.worker.routing.policies.jump import OneTokenJumpPolicy


class CoLLMPolicy(OneTokenJumpPolicy):
    name = "co-llm"
    threshold_arg = "eta"

    def is_uncertain(self, batch: RouteBatch) -> torch.Tensor:
        return self.probabilities(batch) > self.threshold
