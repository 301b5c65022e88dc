"""An in-process Baton stack over real NATS and Redis (tests/support/servers.py).

Nothing is mocked: the services talk through the real servers exactly as in
production; only the process boundary is folded (gateway, estimator and
workers share the test's event loop) to keep start-up to a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

os.environ.setdefault("OMP_NUM_THREADS", "1")

from services.estimator.service import EstimatorService
from services.gateway.app import create_app
from services.gateway.config import GatewayServiceConfig
from services.gateway.server import server_config
from services.gateway.service import GatewayService
from services.launcher.servers import free_port
from services.worker.config import WorkerServiceConfig
from services.worker.service import WorkerService
from shared.config import ClusterConfig
from shared.messages.registry import WorkerInfo
from tests.support.builders import worker_info

TINY_CLUSTER = """
namespace = "{namespace}"
nats_url = "{nats_url}"
redis_url = "{redis_url}"

[gateway]
host = "127.0.0.1"
port = {port}
max_in_flight = 32
event_timeout_s = 60.0
registry_refresh_s = 0.2

[estimator]
policy = "shortest-queue"
registry_refresh_s = 0.2

[worker]
heartbeat_interval_s = 0.3
# 2 s: every in-process service shares the test's loop, and a stall of TTL less one
# interval (GC, a slow inline step, a fixture's sync work) made both workers "gone"
heartbeat_ttl_s = 2.0
drain_timeout_s = 3.0

[models.random-tiny]
dtype = "float32"

[[instances]]
model = "random-tiny"
replicas = 2
[instances.scheduler]
max_num_seqs = 8
max_num_batched_tokens = 256
num_kv_blocks = 64
max_model_len = 256

[presets.auto]
models = ["random-tiny"]
policy = "round-robin"
"""


REPO_ROOT = Path(__file__).resolve().parents[2]


def run_service_process(
    module: str, cluster_file: Path, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """`python -m services.<module> --cluster FILE` run to its exit, output captured."""
    return subprocess.run(
        [sys.executable, "-m", f"services.{module}", "--cluster", str(cluster_file)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@contextlib.contextmanager
def worker_process(
    cluster_file: Path, instance_id: str, model: str = "random-tiny"
) -> Iterator[subprocess.Popen[bytes]]:
    """A worker in a process group of its own, for a test that kills the group
    (os.killpg); killed at the block's end if it still runs."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.worker", "--cluster", str(cluster_file)),
            *("--model", model, "--instance-id", instance_id),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tiny_cluster_text(
    nats_url: str, redis_url: str, namespace: str | None = None, port: int | None = None
) -> str:
    return TINY_CLUSTER.format(
        namespace=namespace or f"t{uuid.uuid4().hex[:8]}",
        nats_url=nats_url,
        redis_url=redis_url,
        port=port or free_port(),
    )


def _await_chain(coro: object) -> list[str]:
    out = []
    while coro is not None:
        frame = (
            getattr(coro, "cr_frame", None)
            or getattr(coro, "ag_frame", None)
            or getattr(coro, "gi_frame", None)
        )
        if frame is not None:
            out.append(f"{frame.f_code.co_filename.split('site-packages/')[-1]}:{frame.f_lineno}")
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "ag_await", None)
            or getattr(coro, "gi_yieldfrom", None)
        )
    return out


@dataclass
class Stack:
    """An in-process deployment: gateway (real uvicorn on a free port), estimator, workers."""

    cluster: ClusterConfig
    base_url: str
    gateway: GatewayService
    estimator: EstimatorService
    workers: list[WorkerService]
    worker_tasks: list[asyncio.Task]  # workers[i]'s run()
    estimator_task: asyncio.Task
    server: uvicorn.Server
    server_task: asyncio.Task

    def add_worker(self, worker: WorkerService, task: asyncio.Task) -> None:
        """A worker the test started (start_worker): stopped with the rest."""
        self.workers.append(worker)
        self.worker_tasks.append(task)

    def metric(self, name: str, **labels: str) -> float:
        """The gateway's Prometheus sample `name` (as /metrics names it) with these
        labels; 0 before the first observation."""
        return self.gateway.metrics.registry.get_sample_value(name, labels) or 0.0

    def requests_counted(self, status: str, model: str = "random-tiny") -> float:
        """The gateway's `baton_requests_total` for `model` and `status` so far."""
        return self.metric("baton_requests_total", model=model, status=status)

    async def wait_idle(self) -> None:
        """Until every snapshot the estimator holds shows no request and its ledger is
        empty (a test that routes a burst must not see an earlier test's leftovers)."""
        for _ in range(400):
            states = self.estimator.instances.values()
            if len(self.estimator.ledger) == 0 and all(
                s.snapshot is not None and s.snapshot.num_requests == 0 for s in states
            ):
                return
            await asyncio.sleep(0.02)
        raise TimeoutError("the cluster did not go idle")

    async def stop(self) -> None:
        self.server.should_exit = True
        for w in self.workers:
            w.request_stop()
        self.estimator.request_stop()
        tasks = [*self.worker_tasks, self.estimator_task, self.server_task]
        _, pending = await asyncio.wait(tasks, timeout=30)
        if pending:
            for t in asyncio.all_tasks():
                print("TASK", t.get_name(), _await_chain(t.get_coro()))
            for t in pending:
                t.cancel()
            raise AssertionError(f"services did not stop: {[t.get_coro() for t in pending]}")


async def kill(task: asyncio.Task, timeout_s: float = 10.0) -> None:  # type: ignore[type-arg]
    """Cancel a service's task (its process dying) and wait until it is done.

    Cancelled again while it runs on: on Python 3.11 `asyncio.wait_for` (redis-py
    wraps every send in one) returns the inner result when a cancellation lands in
    the same loop pass as its completion, so one cancel can be lost and a service's
    loop would run on (a test awaiting it once hung for good)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not task.done():
        assert asyncio.get_running_loop().time() < deadline, "the task did not stop"
        task.cancel()
        await asyncio.wait([task], timeout=0.1)
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


async def start_worker(
    cluster: ClusterConfig, instance_id: str, model: str = "random-tiny"
) -> tuple[WorkerService, asyncio.Task]:
    worker = WorkerService(WorkerServiceConfig.from_cluster(cluster, model, instance_id))
    task = asyncio.create_task(worker.run())
    ready = asyncio.create_task(worker.ready.wait())
    done, _ = await asyncio.wait({task, ready}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if ready not in done:
        ready.cancel()
        if task.done():
            task.result()
        raise TimeoutError("worker did not become ready")
    return worker, task


def hand_worker_info(namespace: str, instance_id: str) -> WorkerInfo:
    """The registration of a random-tiny worker that a test plays by hand (its inbox is
    the real subject; nothing reads it unless the test does)."""
    return worker_info(
        instance_id,
        "random-tiny",
        namespace=namespace,
        max_model_len=256,
        max_num_seqs=8,
        at_s=time.time(),
    )


@contextlib.asynccontextmanager
async def running(
    cluster: ClusterConfig, num_workers: int, models: list[str] | None = None
) -> AsyncIterator[Stack]:
    """start_stack's deployment, stopped when the block ends."""
    stack = await start_stack(cluster, num_workers, models)
    try:
        yield stack
    finally:
        await stack.stop()


async def start_stack(
    cluster: ClusterConfig, num_workers: int, models: list[str] | None = None
) -> Stack:
    """Workers w0.. (serving `models[i]`, default random-tiny), the estimator and the gateway."""
    names = models or ["random-tiny"] * num_workers
    assert len(names) == num_workers
    started = await asyncio.gather(
        *(start_worker(cluster, f"w{i}", names[i]) for i in range(num_workers))
    )
    estimator = EstimatorService(cluster)
    estimator_task = asyncio.create_task(estimator.run())
    app = create_app(GatewayServiceConfig.from_cluster(cluster, "gw-test"))
    server = uvicorn.Server(server_config(app, cluster.gateway))
    server_task = asyncio.create_task(server.serve())
    for _ in range(600):
        if server.started:
            break
        await asyncio.sleep(0.05)
    else:
        raise TimeoutError("gateway did not start")
    stack = Stack(
        cluster,
        f"http://127.0.0.1:{cluster.gateway.port}",
        app.state.service,
        estimator,
        [w for w, _ in started],
        [t for _, t in started],
        estimator_task,
        server,
        server_task,
    )
    for _ in range(200):  # wait until the gateway and estimator see every worker
        if len(stack.gateway.workers) == num_workers and len(estimator.workers) == num_workers:
            return stack
        await asyncio.sleep(0.05)
    raise TimeoutError("services did not discover the workers")
