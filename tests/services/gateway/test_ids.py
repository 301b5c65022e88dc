"""Request ids: OpenAI's shape, unique in a process, and a forked process draws its own."""

from __future__ import annotations

import itertools
import os
import re

from services.gateway.ids import new_request_id


def test_ids_have_openai_shape_and_never_repeat() -> None:
    ids = [new_request_id("chatcmpl-") for _ in range(10_000)]
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    suffixes = [int(i[-16:], 16) for i in ids[:100]]
    steps = {b - a for a, b in itertools.pairwise(suffixes)}
    assert len(steps) > 1  # the counter does not show through,
    # not even in the low bits (a bare multiplier repeats its last digit every 16 ids)
    assert any(a[-1] != b[-1] for a, b in zip(ids[:100], ids[16:116], strict=True))
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", new_request_id("cmpl-"))


def test_a_forked_process_draws_another_prefix() -> None:
    """A gateway forked after import (a process manager's workers) must not hand out
    its parent's ids: the child's first id differs from the parent's next one."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id to the parent, then out at once
        os.close(read)
        os.write(write, new_request_id("cmpl-").encode())
        os._exit(0)
    os.close(write)
    try:
        child_id = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    parent_id = new_request_id("cmpl-")
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", child_id)
    assert child_id[5:21] != parent_id[5:21]  # the 64-bit prefixes
