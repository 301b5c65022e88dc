"""The hello that opens a direct link (shared/link.py), one each way.

A gateway dials a worker's `WorkerInfo.link_addr` and sends its hello first; the worker
answers with its own. Each side checks the other's before any request crosses: the
namespace (two stacks sharing hosts never mix), and on the gateway's side the worker's
identity (an address a restarted or other worker took over is not the one routed to).
"""

from __future__ import annotations

import msgspec


class LinkHello(msgspec.Struct, frozen=True, kw_only=True):
    """The first frame each way on a direct link."""

    namespace: str  # the deployment's (ClusterConfig.namespace)
    sender: str  # the gateway's owner token, or the worker's instance id
    started_at_s: float = 0.0  # the worker's WorkerInfo.started_at_s (0 from a gateway)


LINK_HELLO_DECODER = msgspec.msgpack.Decoder(LinkHello)
