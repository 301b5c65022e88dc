"""What the engine hands out after each iteration. Torch-free at import time, so the
simulated engine and the services can use these types without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class RequestError(ValueError):
    """A request the engine refuses; the message is meant for the client."""


class FinishReason:
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or the caller aborted


@dataclass(slots=True)
class RequestOutput:
    """New tokens of one request from one iteration (deltas, not the whole answer)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    new_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class StepOutputs:
    """Per-step tensors for the route hook: one row per request that sampled a token."""

    request_ids: list[str]
    token_ids: list[int]  # the sampled tokens
    logits: torch.Tensor  # [N, vocab] fp32, last position
    hidden: torch.Tensor  # [N, hidden] last hidden state (after the final norm)


class StepHook(Protocol):
    """Called after every forward that sampled; token-level routing plugs in here."""

    def __call__(self, outputs: StepOutputs) -> None: ...
