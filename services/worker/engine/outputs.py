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


# The logit a trimmed head (CausalLM.set_vocab_keep) gives every token outside its kept
# ids. Finite on purpose: softmax still gives those tokens probability exactly 0 in
# fp32 (exp underflows), but p * log p stays 0 instead of 0 * -inf = NaN in
# entropy-style reads of the logits, and it survives temperature scaling by 1e-8
# without overflowing.
TRIMMED_LOGIT = -1e30


class StepLogits:
    """Last-position logits of one forward, one row per sampling request.

    A full head's rows are the vocabulary. A trimmed head computes only its kept
    columns; `full` spreads them over the vocabulary (TRIMMED_LOGIT elsewhere) the
    first time something asks, and greedy sampling (`sampler.greedy_tokens`) never
    needs the full rows: the first maximal kept column, mapped through the sorted
    kept ids, is the first maximal token of the full row. On the small model's
    serving path that skips a [N, vocab] write and a 4x wider argmax every step.
    """

    __slots__ = ("_full", "keep", "rows", "vocab_size")

    def __init__(self, rows: torch.Tensor, keep: torch.Tensor | None, vocab_size: int) -> None:
        self.rows = rows  # [N, K] fp32: K = vocab_size, or the kept ids' columns
        self.keep = keep  # [K] sorted kept token ids; None for a full head
        self.vocab_size = vocab_size
        self._full: torch.Tensor | None = rows if keep is None else None

    @property
    def is_spread(self) -> bool:
        """Whether the [N, vocab] rows exist (a full head, or `full()` was called)."""
        return self._full is not None

    def full(self) -> torch.Tensor:
        """[N, vocab] fp32 (computed once)."""
        if self._full is None:
            assert self.keep is not None
            full = self.rows.new_full((self.rows.shape[0], self.vocab_size), TRIMMED_LOGIT)
            self._full = full.index_copy_(1, self.keep, self.rows)
        return self._full


class StepOutputs:
    """Per-step tensors for the route hook: one row per request that sampled a token.

    `logits` is [N, vocab] fp32; given a StepLogits it is built on first access only
    (a hook that routes none of this step's requests never pays for it)."""

    __slots__ = ("_logits", "hidden", "request_ids", "token_ids")

    def __init__(
        self,
        request_ids: list[str],
        token_ids: list[int],
        logits: torch.Tensor | StepLogits,
        hidden: torch.Tensor,
    ) -> None:
        self.request_ids = request_ids
        self.token_ids = token_ids  # the sampled tokens
        self._logits = logits
        self.hidden = hidden  # [N, hidden] last hidden state (after the final norm)

    @property
    def logits(self) -> torch.Tensor:
        lg = self._logits
        return lg.full() if isinstance(lg, StepLogits) else lg


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
