"""A service process freezes its heap once it is ready (shared.runtime.freeze_heap), so
the cyclic garbage collector does not walk its start-up objects. Run in a child
process: freezing belongs to a process's own entry point, not to the test's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.stack import tiny_cluster_text

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


GATEWAY = textwrap.dedent(
    """
    import asyncio, gc, sys
    from services.gateway.app import create_app
    from services.gateway.config import GatewayServiceConfig
    from shared.config import load_cluster

    async def main():
        cfg = GatewayServiceConfig.from_cluster(load_cluster(sys.argv[1]), "gw-freeze")
        app = create_app(cfg, freeze_heap_when_started=sys.argv[2] == "freeze")
        async with app.router.lifespan_context(app):
            print(gc.get_freeze_count(), flush=True)

    asyncio.run(main())
    """
)


def test_the_gateway_process_freezes_its_heap_once_started(
    nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text(tiny_cluster_text(nats_url, redis_url))
    frozen = {}
    for mode in ("freeze", "in-process"):
        proc = subprocess.run(
            [sys.executable, "-c", GATEWAY, str(cluster_file), mode],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        frozen[mode] = int(proc.stdout.split()[-1])
    assert frozen["freeze"] > 1000
    assert frozen["in-process"] == 0  # create_app's default, as the tests' stacks use it
