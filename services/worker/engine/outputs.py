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
    """Called after every forward that sampled; token-level routing plugs in here.

    Returns None (everyone stays) or one destination per row of outputs: 0 = stay,
    i > 0 = hand the request to peer i after this token, -i = hand it to peer i to
    rewrite this very token (it is taken back before anyone sees it). A handed-off
    request is parked (its KV kept, skipped by the scheduler) until
    `LLMEngine.resume_request` brings it back.
    """

    def __call__(self, outputs: StepOutputs) -> list[int] | None: ...


@dataclass(slots=True)
class Handoff:
    """A request the route hook sent to a peer; the worker turns it into a PeerReq."""

    request_id: str
    destination: int  # peer index chosen by the hook (> 0)
    token_ids: list[int]  # the whole sequence the peer continues, prompt first
    num_prompt_tokens: int
    num_output_tokens: int  # output tokens in token_ids
    rewrites_last: bool  # the token sampled at this step was taken back for the peer to rewrite
    seq_no: int  # handoffs of this request so far (1 for the first)


@dataclass(slots=True)
class Resume:
    """Tokens a peer wrote for a parked request (queued by resume_request)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # the peer ended the answer
