"""Wire types, one module per destination (who receives the message).

- `worker`:    gateway -> worker (submit, abort)
- `gateway`:   worker -> gateway (token deltas and failures, batched per engine iteration)
- `estimator`: gateway -> estimator (route request/reply, request-done events)
- `registry`:  worker -> Redis -> gateway/estimator (registration and heartbeat)
- `batcher`:   worker -> batcher (routing statistics), batcher -> workers (B* tables)

All are msgspec Structs encoded as msgpack; each module builds its decoders once.
"""

import msgspec

# One encoder for every wire type; encoding is stateless and thread-safe.
ENCODER = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return ENCODER.encode(message)
