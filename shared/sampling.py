"""Sampling parameters: how one request turns logits into tokens and when it stops.

Travels on the wire (gateway -> worker, worker -> relay -> peer) so it is a msgspec
Struct. Validation lives here so the gateway can reject bad input with a 4xx before
anything is scheduled, and the engine can re-check what arrives from the bus.
"""

from __future__ import annotations

import msgspec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
SEED_RANGE = (-(2**63), 2**63 - 1)  # what a torch.Generator accepts
MAX_TOP_LOGPROBS = 20


class InvalidParam(ValueError):
    """A sampling parameter out of range; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request decoding settings (OpenAI semantics where OpenAI defines them)."""

    max_tokens: int = 16  # new tokens at most; the context limit may cut it sooner
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, [0, 1]; 0 keeps only the most likely token
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int | None = None  # per-request RNG seed: same seed, same tokens
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per previous occurrence
    presence_penalty: float = 0.0  # [-2, 2], subtracted once if the token occurred
    stop: list[str] = []  # stop strings; the matched string is not returned
    stop_token_ids: list[int] = []  # extra token ids that end the answer
    ignore_eos: bool = False  # keep going past EOS (benchmarks pin output length)
    logprobs: int | None = None  # None = off; k >= 0 = sampled token's logprob + top-k

    @property
    def is_greedy(self) -> bool:
        """Only the most likely token can be drawn. top_p 0 is OpenAI's range's low end
        (clients send it to ask for greedy; vLLM refuses it): the nucleus is the first
        token alone, as the sampler keeps the first token of any nucleus."""
        return self.temperature <= 1e-5 or self.top_k == 1 or self.top_p == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        """Raise InvalidParam (a ValueError naming the field) if any field is out of range."""
        if self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParam(
                "temperature", f"temperature must be in [0, 2], got {self.temperature}"
            )
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidParam("top_p", f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidParam("top_k", f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {value}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParam(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        if any(not s for s in self.stop):
            raise InvalidParam("stop", "stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidParam(
                "stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidParam("seed", f"seed must be a signed 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam(
                "logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
            )
