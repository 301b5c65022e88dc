"""Launcher.start() without run(): the deployment started in the caller's process (its
children; a benchmark's stack), ready when it returns True, ended by stop()."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.launcher.launcher import Launcher
from shared.config import load_cluster
from tests.services.launcher.test_launcher import (
    assert_no_orphans,
    children_of,
    write_own_servers_cluster,
)


@pytest.fixture(autouse=True)
def signals_kept() -> Iterator[None]:
    """stop() ignores SIGINT and SIGTERM from then on (a second Ctrl-C must not orphan
    anything): this process's handlers as they were after each test."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def one_worker_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ready_timeout_s: float = 600.0
) -> tuple[Launcher, int]:
    """A launcher of the tiny cluster with one worker (no BATON_ variables), and its
    gateway's port."""
    for name in [k for k in os.environ if k.startswith("BATON_")]:
        monkeypatch.delenv(name)
    port = write_own_servers_cluster(tmp_path)
    path = tmp_path / "cluster.toml"
    path.write_text(path.read_text().replace("replicas = 2", "replicas = 1"))
    launcher = Launcher(
        load_cluster(path), path, tmp_path / "logs", ready_timeout_s=ready_timeout_s
    )
    return launcher, port


def test_start_returns_once_every_worker_serves_and_stop_ends_it_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher, port = one_worker_launcher(tmp_path, monkeypatch)
    before = children_of(os.getpid())
    started: set[int] = set()
    try:
        assert launcher.start()
        started = children_of(os.getpid()) - before
        assert len(started) == 5  # nats, redis, estimator, worker, gateway
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["workers"] == launcher.worker_ids == ["random-tiny-0"]
        assert launcher.redis_url.startswith("unix://") and launcher.nats_url
    finally:
        launcher.stop()
    assert_no_orphans(started, timeout_s=15)


def test_start_gives_up_at_the_ready_timeout_and_stop_ends_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher, _ = one_worker_launcher(tmp_path, monkeypatch, ready_timeout_s=0.2)
    before = children_of(os.getpid())
    started: set[int] = set()
    try:
        assert not launcher.start()  # (the worker is still loading its model)
        started = children_of(os.getpid()) - before
        assert len(started) == 5
    finally:
        launcher.stop()
    assert_no_orphans(started, timeout_s=15)
