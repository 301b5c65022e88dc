"""A service that is still starting (NATS and Redis not answering, which it waits out
for as long as they do not) stops at once on SIGTERM, exit code 0, instead of noting
the signal for a graceful stop that would begin only once the start is over (with NATS
down, never: `docker stop` or the launcher had to kill it). shared.runtime.run_service
and services.gateway.server.GatewayServer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.launcher.servers import free_port

REPO = Path(__file__).resolve().parents[3]

SERVICES = {
    "worker": ["--model", "random-tiny", "--instance-id", "starting"],
    "estimator": [],
    "relay": [],
    "batcher": [],
    "gateway": [],
}


@pytest.mark.parametrize("name", list(SERVICES))
def test_a_sigterm_while_waiting_for_nats_stops_the_service(name: str, tmp_path: Path) -> None:
    # ports nothing listens on: the service keeps trying to connect
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'nats_url = "nats://127.0.0.1:{free_port()}"\n'
        f'redis_url = "redis://127.0.0.1:{free_port()}/0"\n'
        f"[gateway]\nport = {free_port()}\n"
        '[models.random-tiny]\ndtype = "float32"\n'
        '[[instances]]\nmodel = "random-tiny"\nreplicas = 1\n'
    )
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}", "--cluster", str(cluster), *SERVICES[name]],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # 1. Wait until it tries NATS (the worker loads its model first).
        deadline = time.monotonic() + 60
        while b"nats_error" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        # 2. SIGTERM: it stops at once, cleanly.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()[-2000:]
        assert f"{name}_stopped_while_starting" in log.read_text()
    finally:
        proc.kill()
        proc.wait()
