"""A service process freezes its heap once it is ready (shared.runtime.freeze_heap), so
the cyclic garbage collector no longer walks its start-up objects. Run in a child
process: freezing belongs to a process's own entry point, not to the test's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SERVICE = textwrap.dedent(
    """
    import asyncio, gc, sys
    from shared.runtime import run_service

    class Service:
        def __init__(self, with_ready):
            self.ready = asyncio.Event() if with_ready else None

        def request_stop(self):
            pass

        async def run(self):
            await asyncio.sleep(0.05)
            print("before ready", gc.get_freeze_count(), flush=True)
            if self.ready is not None:
                self.ready.set()
            await asyncio.sleep(0.05)
            garbage = []
            garbage.append(garbage)  # a cycle made after the freeze: collectable
            del garbage
            print("after ready", gc.get_freeze_count(), gc.collect(), flush=True)

    with_ready = sys.argv[1] == "ready"
    service = Service(with_ready)
    sys.exit(run_service(service, "probe", ready=service.ready))
    """
)


def run_probe(mode: str) -> dict[str, list[int]]:
    proc = subprocess.run(
        [sys.executable, "-c", SERVICE, mode], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = {}
    for line in proc.stdout.splitlines():
        label, _, numbers = line.rpartition("ready")
        out[label.strip() + " ready"] = [int(n) for n in numbers.split()]
    return out


def test_the_heap_is_frozen_once_the_service_is_ready() -> None:
    out = run_probe("ready")
    assert out["before ready"] == [0]  # start-up still running: nothing frozen yet
    frozen, collected = out["after ready"]
    assert frozen > 1000  # the interpreter's and the imported modules' objects
    assert collected >= 1  # what dies later in a cycle is still collected


def test_a_service_without_a_ready_event_is_frozen_as_it_starts() -> None:
    out = run_probe("none")
    assert out["before ready"][0] > 1000
