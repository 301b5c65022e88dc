"""Token-level routing messages between workers, through the relay (TokenRouter's PeerReq).

    {ns}.relay.in                  PeerReq | PeerRelease   worker -> relay (queue group)
    {ns}.worker.{instance}.peer    PeerReq | PeerRelease   relay -> worker
    {ns}.relay.query               PeerQuery -> PeerQueryReply  worker -> relay (request/reply)

Every worker of a token-level preset keeps its own KV for a request, so a
PeerReq carries only the tokens its receiver has not seen: tokens [0, loc) of the
sequence are known to both sides, `suffix` holds tokens [loc, loc + len(suffix)).
A receiver that already holds more than `loc` tokens checks the overlap and skips
it; one that holds fewer rejects the message (the relay then hands the request
back to its origin).
"""

from __future__ import annotations

import msgspec

from shared.sampling import SamplingParams


class PeerReq(msgspec.Struct, tag="peer", frozen=True, kw_only=True):
    """Hand the pen for one request to another model of its preset."""

    request_id: str  # minted by the gateway
    preset: str  # the token-level preset (names the policy and its models)
    origin_instance: str  # the worker that owns the request and streams it to the client
    sender_instance: str  # the worker that sent this message
    from_model: int  # index in the preset's models of the sender
    to_model: int  # index in the preset's models of the receiver
    loc: int  # tokens: the anchor; tokens before it are known to both sides
    suffix: list[int]  # token ids [loc, loc + len(suffix)) of the sequence
    num_prompt_tokens: int  # tokens of the sequence that are the prompt
    max_tokens: int  # output tokens at most, for the whole answer
    params: SamplingParams  # the client's decoding settings (hold across the switch)
    seq_no: int  # per request, increases with every PeerReq anyone sends for it
    rewrites_last: bool = False  # the sender took back its last sampled token for the receiver
    finished: bool = False  # the sender ended the answer; finish_reason says why
    finish_reason: str | None = None  # "stop" | "length" when finished
    num_active: int = 0  # the preset's requests active at the origin (N of the B* tables)
    failed: str | None = None  # set by the relay: the peer is gone; continue alone (reason)
    tokens_by_model: list[int] = []  # output tokens written per model index so far


class PeerRelease(msgspec.Struct, tag="release", frozen=True, kw_only=True):
    """The request ended at its origin (finished or aborted): free every copy of it."""

    request_id: str  # as in PeerReq
    preset: str  # the token-level preset
    origin_instance: str  # the worker that owned it


PeerMessage = PeerReq | PeerRelease

PEER_MESSAGE_DECODER = msgspec.msgpack.Decoder(PeerMessage)


class PeerQuery(msgspec.Struct, frozen=True, kw_only=True):
    """An origin's requests away at peers for long: is the relay still waiting on
    them? (It bounds each hand-off with its peer timeout; a relay that restarted or
    died knows nothing of them.)"""

    origin_instance: str
    request_ids: list[str]


class PeerQueryReply(msgspec.Struct, frozen=True, kw_only=True):
    """The subset of the asked ids with a hand-off the relay is timing now."""

    pending: list[str]


class RelayStarted(msgspec.Struct, frozen=True, kw_only=True):
    """A relay is serving (sent once it has subscribed): it knows no hand-off sent
    before, so an origin with requests away asks about them now (PeerQuery) instead of
    after `[relay] origin_wait_s`; those it is not timing come back to their origin."""

    started_at_s: float  # wall clock (time.time()) of the relay's start


PEER_QUERY_DECODER = msgspec.msgpack.Decoder(PeerQuery)
PEER_QUERY_REPLY_DECODER = msgspec.msgpack.Decoder(PeerQueryReply)
RELAY_STARTED_DECODER = msgspec.msgpack.Decoder(RelayStarted)
