"""The route hook API: what a token-level routing policy sees and what it returns.

A policy is a small class; R2R, CITER, Co-LLM, R-Stitch and ME differ only in
`route`. One instance runs on each worker of a routing preset, built with the
index of that worker's model in the preset's `models` list (index 0 is where the
request enters and which streams it to the client). After every forward the
runtime groups the rows of the requests that follow the preset and calls

    route(batch) -> one destination per row
        STAY (0)                  keep writing here
        hand_after(i)   (= i+1)   model i continues after the token sampled here
        hand_rewrite(i) (= -(i+1)) model i rewrites the token sampled here (it is
                                  taken back unseen; the peer regenerates it)

`send` and `receive` have defaults that fit all five policies: the PeerReq carries
the suffix the peer has not seen, and a receiver accepts every transferred token.

Invariant: a policy never returns its own model index (that is STAY) and never an
index outside the preset; the runtime checks and treats a bad value as STAY.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from services.worker.routing.policy_args import check_keys

if TYPE_CHECKING:
    import torch

STAY = 0


def hand_after(model_index: int) -> int:
    """Destination: model `model_index` continues after the token sampled now."""
    return model_index + 1


def hand_rewrite(model_index: int) -> int:
    """Destination: model `model_index` rewrites the token sampled now."""
    return -(model_index + 1)


def target_of(destination: int) -> tuple[int, bool]:
    """(model index, rewrites_last) of a non-zero destination."""
    return (abs(destination) - 1, destination < 0)


@dataclass(slots=True)
class RouteState:
    """One request as this worker's policy sees it; lives as long as the request does here."""

    request_id: str
    model_index: int  # this worker's model in the preset's `models`
    num_prompt_tokens: int  # tokens
    num_output_tokens: int = 0  # output tokens so far, the one sampled this step included
    run_length: int = 0  # tokens this model wrote in a row since it last took the pen
    # output tokens written per model index
    tokens_by_model: list[int] = field(default_factory=list)
    temperature: float = 0.0  # the request's sampling temperature (0 = greedy)
    # what seeded draws are keyed on (tracked.draw_key: its seed, its prompt when
    # greedy, else its id); "": the request id
    draw_key: str = ""
    scratch: dict[str, float] = field(default_factory=dict)  # per-policy state across steps


@dataclass(slots=True)
class RouteBatch:
    """The rows of one forward that belong to one policy: row i is states[i]."""

    states: list[RouteState]
    token_ids: torch.Tensor  # [n] int64, the tokens just sampled
    logits: torch.Tensor  # [n, vocab] fp32, last position
    hidden: torch.Tensor  # [n, hidden] last hidden state after the final norm


class TokenPolicy(ABC):
    """Base class of the token-level routing policies."""

    name: ClassVar[str]
    min_models: ClassVar[int] = 2  # how many models the preset must list
    max_models: ClassVar[int] = 2

    def __init__(
        self,
        models: list[str],
        model_index: int,
        args: Mapping[str, float | str],
        artifacts_dir: Path,
    ) -> None:
        """models: the preset's models (index 0 = entry); model_index: this worker's;
        args: the preset's policy arguments (thresholds, weights); artifacts_dir:
        where trained routers live (`models/routers/`)."""
        if not self.min_models <= len(models) <= self.max_models:
            raise ValueError(
                f"policy {self.name!r} needs {self.min_models}-{self.max_models} models, "
                f"got {len(models)}"
            )
        self.models = list(models)
        self.model_index = model_index
        self.args = dict(args)
        self.artifacts_dir = artifacts_dir
        self.configure()

    def configure(self) -> None:
        """Check and read the policy's own arguments and artifacts (ValueError, OSError
        for a preset it cannot run); called once by __init__. This one takes none."""
        check_keys(self.name, self.args, ())

    @abstractmethod
    def route(self, batch: RouteBatch) -> list[int]:
        """One destination per row of `batch` (STAY, hand_after(i) or hand_rewrite(i))."""

    def send(self, state: RouteState, suffix: list[int]) -> list[int]:
        """The tokens the PeerReq carries (default: the whole unseen suffix)."""
        return suffix

    def receive(self, state: RouteState, tokens: list[int]) -> list[int]:
        """The transferred tokens this side accepts (default: all of them)."""
        return tokens
