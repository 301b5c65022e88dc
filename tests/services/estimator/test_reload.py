"""The estimator takes a re-read cluster file's routing knobs on SIGHUP, without a
restart; a file it refuses leaves it as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.estimator.routebalance.score import Weights
from services.estimator.service import EstimatorService
from shared.config import parse_cluster
from shared.messages.estimator import RouteRequest

TESTBED = """
namespace = "{ns}"
nats_url = "{nats}"
redis_url = "{redis}"
[estimator]
predictors = ""
[models.a]
quality = {{ default = 0.5 }}
[presets.p]
models = ["a"]
policy = "routebalance"
routebalance_weights = {weights}
"""


def text(nats_url: str, redis_url: str, weights: str, ns: str = "reload") -> str:
    return TESTBED.format(ns=ns, nats=nats_url, redis=redis_url, weights=weights)


def test_reload_swaps_the_policies_and_their_weights() -> None:
    service = EstimatorService(parse_cluster(text("nats://x:1", "redis://x:1", "[1, 0, 0]")))
    request = RouteRequest(request_id="r", model="p", num_prompt_tokens=1, max_tokens=1)
    assert service.policies.for_request(request) == Weights(1.0, 0.0, 0.0)
    service.reload(parse_cluster(text("nats://x:1", "redis://x:1", "[0, 0, 1]")))
    assert service.policies.for_request(request) == Weights(0.0, 0.0, 1.0)


def test_sighup_rereads_the_file_and_a_bad_one_changes_nothing(
    nats_url: str, redis_url: str, tmp_path: Path, repo_root: Path
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text(nats_url, redis_url, "[1, 0, 0]"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.estimator", "--cluster", str(path)],
        cwd=repo_root,
        env={**os.environ, "BATON_LOG_LEVEL": "info"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()

    def wait_for(event: str, count: int = 1) -> None:
        deadline = time.monotonic() + 60
        while sum(event in line for line in lines) < count:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, f"no {event}: {''.join(lines)}"
            time.sleep(0.05)

    try:
        wait_for("estimator_ready")
        # 1. new weights: taken
        path.write_text(text(nats_url, redis_url, "[0, 0, 1]"))
        proc.send_signal(signal.SIGHUP)
        wait_for("routing_reloaded")
        # 2. weights off the simplex: refused, the process serves on
        path.write_text(text(nats_url, redis_url, "[0.5, 0.6, 0.1]"))
        proc.send_signal(signal.SIGHUP)
        wait_for("reload_refused")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
