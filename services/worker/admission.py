"""Admission: what the loop does with the inbox before a step. Submits become engine
requests (or a RequestFailed for their gateway: draining, a duplicate id, a preset
this worker cannot enter, parameters the engine refuses); aborts reach the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.answers import Answers, Dest
from services.worker.engine.protocol import Engine
from services.worker.inbox import Inbox
from services.worker.registration import Registration
from shared.link import FrameLink
from shared.logging import get_logger
from shared.messages.gateway import GatewayEvent, RequestFailed
from shared.messages.worker import AbortRequest, SubmitRequest

if TYPE_CHECKING:
    from services.worker.routing.runtime import TokenRouting

log = get_logger(component="worker")


class Admission:
    """Takes the inbox into one engine; counts what it admitted."""

    def __init__(
        self,
        engine: Engine,
        answers: Answers,
        registration: Registration,
        routing: TokenRouting | None,
    ) -> None:
        self.engine = engine
        self.answers = answers
        self.registration = registration
        self.routing = routing
        # prompt tokens admitted since the last step: the size of an inline step's prefill
        self.num_new_prompt_tokens = 0
        self.num_link_requests = 0  # requests admitted from a direct link (not NATS)

    def take(self, inbox: Inbox) -> list[tuple[Dest, GatewayEvent]]:
        """Hand new requests and aborts to the engine; return the rejections to send."""
        failures: list[tuple[Dest, GatewayEvent]] = []
        while (item := inbox.take()) is not None:
            msg, link = item
            match msg:
                case SubmitRequest():
                    failure = self._admit(msg, link)
                    if failure is not None:
                        failures.append((self.answers.dest(msg.reply_to, link), failure))
                case AbortRequest():
                    if msg.request_id in self.answers.owners:
                        self.engine.abort_request(msg.request_id)
        return failures

    def _refusal(self, msg: SubmitRequest) -> RequestFailed | None:
        if self.registration.is_draining:
            return RequestFailed(msg.request_id, 503, "the worker is shutting down; retry")
        if msg.request_id in self.answers.owners:
            return RequestFailed(msg.request_id, 400, f"duplicate request id {msg.request_id}")
        if msg.preset is None:
            return None
        reason = (
            f"model {msg.preset!r} is not a token-level preset here"
            if self.routing is None
            else self.routing.check_origin(msg.preset)
        )
        if reason is None and msg.params.logprobs is not None:
            # A peer's tokens come back without their logprobs.
            reason = f"logprobs are not available for the token-level preset {msg.preset!r}"
        return None if reason is None else RequestFailed(msg.request_id, 400, reason)

    def _admit(self, msg: SubmitRequest, link: FrameLink | None) -> RequestFailed | None:
        refusal = self._refusal(msg)
        if refusal is not None:
            return refusal
        try:
            msg.params.validate()
            if msg.predicted_output_tokens is None:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
            else:
                self.engine.add_request(
                    msg.request_id,
                    msg.prompt_token_ids,
                    msg.params,
                    predicted_output_tokens=msg.predicted_output_tokens,
                )
        except ValueError as exc:  # RequestError is a ValueError: the loop goes on
            log.info("request_rejected", request_id=msg.request_id, error=str(exc))
            return RequestFailed(msg.request_id, 400, str(exc))
        self.answers.add(msg.request_id, msg.reply_to, msg.owner, link)
        self.num_new_prompt_tokens += len(msg.prompt_token_ids)
        self.num_link_requests += link is not None
        if msg.preset is not None and self.routing is not None:
            self.routing.add_origin(msg.request_id, msg.preset, msg.prompt_token_ids, msg.params)
        return None
