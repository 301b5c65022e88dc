"""ME: a mixture of 2-3 models; after every token the next writer is drawn by ensemble weights.

The weights w (default the paper's 0.5 / 0.3 / 0.2, in the preset's model
order; for two models the first two, renormalized) are a prior over which model
should write the next token. The only evidence at hand is the current model i's
confidence c = softmax(logits)[sampled token] at temperature 1, read as the
chance that i is right; the posterior is

    P(i) ∝ w_i * c,    P(j) ∝ w_j * (1 - c) for every other model j.

A confident model keeps the pen (c -> 1), an unsure one passes it on in
proportion to the others' weights (c -> 0). The draw uses a uniform number
hashed from (the preset's seed, the request's draw key, output tokens so far), so
it does not depend on batching and a run is reproducible under the preset's `seed`.
The draw key (RouteState.draw_key) is the request's own `seed` when it has one, its
prompt when it is greedy (temperature 0), else its id: a client that pins `seed` or
asks for temperature 0 gets the same answer again, as from a single model. The
sampled token always stands (hand_after(j)).
"""

from __future__ import annotations

import hashlib

import torch

from services.worker.routing.api import STAY, RouteBatch, TokenPolicy, hand_after
from services.worker.routing.policy_args import check_keys, float_arg, floats_arg

PAPER_WEIGHTS = (0.5, 0.3, 0.2)


def seeded_uniform(seed: int, key: str, position: int) -> float:
    """A number in [0, 1) fixed by (seed, key, position)."""
    digest = hashlib.blake2b(f"{seed}:{key}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class MEPolicy(TokenPolicy):
    name = "me"
    min_models = 2
    max_models = 3

    def configure(self) -> None:
        check_keys(self.name, self.args, ("weights", "seed"))
        weights = floats_arg(self.name, self.args, "weights", PAPER_WEIGHTS[: len(self.models)])
        if len(weights) != len(self.models) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"policy 'me': weights must be {len(self.models)} non-negative numbers with a "
                f"positive sum, got {weights}"
            )
        total = sum(weights)
        self.weights = torch.tensor([w / total for w in weights])
        self.seed = int(float_arg(self.name, self.args, "seed", 0.0))

    def posterior(self, confidence: torch.Tensor) -> torch.Tensor:
        """[n, models] probability that each model writes the next token."""
        c = confidence.unsqueeze(1)
        evidence = (1.0 - c).expand(-1, len(self.weights)).clone()
        evidence[:, self.model_index] = c.squeeze(1)
        post = self.weights.unsqueeze(0) * evidence
        # The sum is 0 only if the current model has weight 0 and c = 1 (or every
        # other weight is 0 and c = 0): then the prior decides alone.
        norm = post.sum(dim=1, keepdim=True)
        prior = self.weights.unsqueeze(0).expand_as(post)
        return torch.where(norm > 0, post / norm.clamp_min(1e-30), prior)

    def route(self, batch: RouteBatch) -> list[int]:
        with torch.inference_mode():
            logits = batch.logits.float()
            chosen = logits.gather(1, batch.token_ids.view(-1, 1).long()).squeeze(1)
            confidence = (chosen - torch.logsumexp(logits, dim=-1)).exp()
            cdf = self.posterior(confidence).cumsum(dim=1)
        u = torch.tensor(
            [
                seeded_uniform(self.seed, s.draw_key or s.request_id, s.num_output_tokens)
                for s in batch.states
            ],
            dtype=cdf.dtype,
        )
        # Inverse CDF: the first model whose cumulative probability exceeds u.
        writer = (cdf <= u.unsqueeze(1)).sum(dim=1).clamp_max(len(self.weights) - 1)
        return [STAY if j == self.model_index else hand_after(j) for j in writer.tolist()]
