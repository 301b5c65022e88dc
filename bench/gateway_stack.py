"""The gateway benchmark's deployment, started by the launcher (services/launcher: what
`./baton up` runs) in this process, from a cluster file written to the run's work dir.

NATS and Redis on free ports, the estimator, one worker and the gateway, each a process
of its own, children of this one: the cluster file pins them (the worker's `cpus`, the
rest's and the servers' `server_cpus`) and its [gateway] routes the one instance
itself (route_single_locally). Nothing restarts a service that dies here: its requests
fail, and the run with them.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.gateway_settings import Settings
from services.launcher.launcher import Launcher
from services.launcher.servers import free_port
from shared.config import load_cluster
from shared.model_store import resolve

NAMESPACE = "bench"
PRESET = "bench-model"  # what the client asks for: the one model

CLUSTER = """
namespace = "{namespace}"
nats_url = "nats://127.0.0.1:{nats_port}"
redis_url = "redis://127.0.0.1:{redis_port}/0"
server_cpus = {rest_cpus}
[gateway]
port = {port}
max_in_flight = 1024
cpus = {rest_cpus}
[presets.{preset}]
models = ["{model}"]
[estimator]
policy = "shortest-queue"
cpus = {rest_cpus}
[models.{model}]
dtype = "{dtype}"
[[instances]]
model = "{model}"
replicas = 1
cpus = {worker_cpus}
[instances.scheduler]
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = 512
num_kv_blocks = {num_kv_blocks}
max_model_len = 1024
"""

# For the services (the launcher passes this process's environment on): one OpenMP
# thread each, and no log line per request on the measured path.
SERVICE_ENV = {"OMP_NUM_THREADS": "1", "BATON_LOG_LEVEL": "warning"}


@dataclass(frozen=True)
class Stack:
    """A started deployment's addresses."""

    base_url: str  # the gateway's
    nats_url: str
    redis_url: str  # what its services use (Redis's Unix socket)
    worker_id: str  # the instance id of its one worker


def cluster_text(settings: Settings, port: int) -> str:
    """The cluster file of a run whose gateway listens on `port`."""
    ports = {"port": port, "nats_port": free_port(), "redis_port": free_port()}
    text = CLUSTER.format(
        **asdict(settings),
        **ports,
        namespace=NAMESPACE,
        preset=PRESET,
        max_num_seqs=settings.max_num_seqs,
    )
    if settings.worker:  # [worker] settings under test, e.g. max_inline_step_ms=0
        text += "\n[worker]\n" + "".join(f"{kv}\n" for kv in settings.worker)
    return text


@contextlib.contextmanager
def launched_stack(settings: Settings, work: Path) -> Iterator[Stack]:
    """The deployment for the block, its files (cluster.toml, logs/) in `work`; stopped
    at the block's end as the launcher stops it on Ctrl-C. RuntimeError, with the log's
    end, when a service exits during start-up or no worker is ready within 600 s."""
    resolve(settings.model)  # a model that is not here: said before anything starts
    port = free_port()
    path = work / "cluster.toml"
    path.write_text(cluster_text(settings, port))
    launcher = Launcher(load_cluster(path), path, work / "logs")
    # Launcher.stop ignores SIGINT and SIGTERM from then on: as they were, after it
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    env = {k: os.environ.get(k) for k in SERVICE_ENV}
    os.environ.update(SERVICE_ENV)
    try:
        if not launcher.start():
            raise RuntimeError(f"the stack did not start:\n{_dead_log_tail(launcher)}")
        yield Stack(
            f"http://127.0.0.1:{port}",
            launcher.nats_url,
            launcher.redis_url,
            launcher.worker_ids[0],
        )
    finally:
        launcher.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _dead_log_tail(launcher: Launcher) -> str:
    """The end of the log of a service that exited (e.g. for a cluster setting the
    worker refuses), else where the logs are."""
    for child in launcher.children:
        if child.process is not None and child.process.poll() is not None:
            tail = child.log_path.read_text(errors="replace")[-2000:]
            return f"the {child.name} exited ({child.returncode}):\n{tail}"
    return f"no worker became ready; logs in {launcher.log_dir}"
