"""`python -m bench.gateway_nats_echo NATS_URL`: answers every request on `bench.echo`
with its own payload, for gateway_anchors.nats_rtt_ms (one process hop there and back)."""

from __future__ import annotations

import asyncio
import sys

import nats
from nats.aio.msg import Msg

SUBJECT = "bench.echo"


async def echo_forever(nats_url: str) -> None:
    nc = await nats.connect(nats_url)

    async def echo(msg: Msg) -> None:
        await nc.publish(msg.reply, msg.data)

    await nc.subscribe(SUBJECT, cb=echo)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(echo_forever(sys.argv[1]))
