"""Start a whole deployment on this machine and stop it cleanly.

1. infrastructure: Redis, then NATS (JetStream), each started from local binaries
   only when nothing answers at the cluster file's URLs (a Redis started here also
   listens on a Unix socket, which the services use); between the two, refuse a
   namespace whose workers are live on that Redis (two deployments would share them)
2. services: estimator, relay and batcher (when a preset routes per token), one
   worker per instance replica, gateway, each
   `python -m services.<name>` in its own process group, logging JSON lines
   to logs/<name>.log
3. wait until the gateway's /health is ready and lists every worker started (so
   the printed curl example, or any model of the cluster, answers at once), print
   the URL and a curl example
4. supervise: a service (or a server started in step 1) that dies is started again
   after a backoff (a worker that exited cleanly, drained on request, is not; when
   no worker is left the deployment stops) and each restart is printed with its
   log; one that dies more than `max_restarts` times within `RESTART_WINDOW_S`
   stops the deployment (a crash loop: nothing fails silently). max_restarts 0:
   any exit stops it
5. Ctrl-C / SIGTERM: stop gateway, workers (they drain), estimator/relay/batcher, then the
   servers started in step 1; every step bounded, stragglers SIGKILLed
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher.children import (
    DEFAULT_MAX_RESTARTS,
    RESTART_WINDOW_S,
    Child,
    Restarts,
    signals_held,
)
from services.launcher.preflight import check_gateway_port, check_namespace_free
from services.launcher.servers import (
    ServerError,
    ServerProcess,
    host_port,
    is_reachable,
    start_nats,
    start_redis,
    stop_process_group,
)
from shared.config import ClusterConfig, Env


@dataclass
class Launcher:
    cluster: ClusterConfig
    cluster_path: Path
    log_dir: Path
    ready_timeout_s: float = 600.0
    max_restarts: int = DEFAULT_MAX_RESTARTS
    servers: list[ServerProcess] = field(default_factory=list)
    # how to start each server of `servers` again (same port), and its restarts
    _server_starts: dict[str, tuple[Callable[[], ServerProcess], Path, Restarts]] = field(
        default_factory=dict
    )
    children: list[Child] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)  # instance ids of the workers started
    nats_url: str = ""
    redis_url: str = ""
    _stopping: bool = False

    def say(self, text: str) -> None:
        print(f"baton: {text}", flush=True)

    def run(self) -> int:
        # Explicit handlers: a launcher started in the background inherits SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, lambda *_: self._raise_stop())
        signal.signal(signal.SIGHUP, lambda *_: self._forward_hangup())
        try:
            if not self.start():
                return 1
            self.print_banner()
            return self._supervise(self._child_env())
        except KeyboardInterrupt:
            self.say("stopping")
            return 0
        except ServerError as exc:
            self.say(f"error: {exc}")
            return 1
        finally:
            self.stop()

    def start(self) -> bool:
        """Steps 1 to 3: the servers, the services, the wait until they serve; False when
        none does (a service exited during start-up, no worker ready in time). ServerError:
        a refusal, or a server that did not start. run() does this, then supervises; a
        caller that only needs the deployment started (a benchmark's, in its own process:
        the processes are its children) calls start() and, whatever it did, stop()."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        check_gateway_port(self.cluster)  # before any server: a refusal starts nothing
        self._start_redis()
        check_namespace_free(  # before NATS: a refusal starts nothing
            self.cluster, self.redis_url, any(s.name == "redis" for s in self.servers), self.say
        )
        self._start_nats()
        self._start_services()
        return self._wait_ready()

    def _forward_hangup(self) -> None:
        """SIGHUP: the estimator re-reads the cluster file's routing settings (it runs in
        a process group of its own, which the launcher's signals do not reach)."""
        for child in self.children:
            if child.name == "estimator" and child.returncode is None and child.process:
                child.process.send_signal(signal.SIGHUP)
                self.say(f"asked the estimator to reload its routing settings ({child.log_path})")

    def _raise_stop(self) -> None:
        raise KeyboardInterrupt

    # 1. infrastructure ------------------------------------------------------

    def _start_nats(self) -> None:
        host, port = host_port(self.cluster.nats_url, 4222)
        if is_reachable(host, port):
            self.say(f"using the NATS server at {self.cluster.nats_url}")
            self.nats_url = self.cluster.nats_url
        else:
            log_path = self.log_dir / "nats.log"
            # (one store per port: a second deployment from this checkout on other
            # ports has its own)
            work_dir = self.log_dir / ".nats" / str(port)
            server = self._start_server(
                lambda: start_nats(host, port, work_dir, log_path, self.cluster.server_cpus),
                log_path,
            )
            self.nats_url = server.url
            self.say(f"started nats-server (JetStream) at {server.url}")

    def _start_redis(self) -> None:
        host, port = host_port(self.cluster.redis_url, 6379)
        if is_reachable(host, port):
            self.say(f"using the Redis server at {self.cluster.redis_url}")
            self.redis_url = self.cluster.redis_url
        else:
            log_path = self.log_dir / "redis.log"
            # the services, all on this host, reach it over a Unix socket too (servers.py);
            # one per port, so that a second deployment from this checkout on another
            # port neither takes this one's socket nor deletes it when it stops
            sock = self.log_dir / ".redis" / f"redis-{port}.sock"
            server = self._start_server(
                lambda: start_redis(host, port, log_path, self.cluster.server_cpus, sock),
                log_path,
            )
            self.redis_url = server.url_here
            where = "" if not server.local_url else f"; its services use {server.local_url}"
            self.say(f"started redis-server at {self.cluster.redis_url}{where}")

    def _start_server(self, start: Callable[[], ServerProcess], log_path: Path) -> ServerProcess:
        """Start a server of step 1 and keep `start` to restart it on its port (step 4)."""
        with signals_held():
            server = start()
            self.servers.append(server)
        self._server_starts[server.name] = (start, log_path, Restarts())
        return server

    # 2. services ------------------------------------------------------------

    def _start_services(self) -> None:
        check_gateway_port(self.cluster)  # (again: it may have been taken while servers started)
        env = self._child_env()
        py = [sys.executable, "-m"]
        self.children.append(
            Child("estimator", [*py, "services.estimator"], self.log_dir / "estimator.log")
        )
        if self.cluster.token_presets():  # token-level routing: hand-offs and B* tables
            for name in ("relay", "batcher"):
                self.children.append(
                    Child(name, [*py, f"services.{name}"], self.log_dir / f"{name}.log")
                )
        for inst in self.cluster.instances:
            is_torch = self.cluster.models[inst.model].engine == "torch"
            problem = _model_problem(inst.model) if is_torch else None  # sim models load nothing
            if problem is not None:
                self.say(f"skipping {inst.model}: {problem}")
                continue
            for iid in self.cluster.replica_ids(inst):
                self.worker_ids.append(iid)
                self.children.append(
                    Child(
                        f"worker {iid}",
                        [*py, "services.worker", "--model", inst.model, "--instance-id", iid],
                        self.log_dir / f"worker-{iid}.log",
                    )
                )
        self.children.append(
            Child("gateway", [*py, "services.gateway"], self.log_dir / "gateway.log")
        )
        for child in self.children:
            child.start(env)
        self.say(f"started {len(self.children)} services; logs in {self.log_dir}/")

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            BATON_CLUSTER=str(self.cluster_path),
            BATON_NATS_URL=self.nats_url,
            BATON_REDIS_URL=self.redis_url,
            PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    # 3. readiness -----------------------------------------------------------

    def _wait_ready(self) -> bool:
        """Until /health is ready and lists every worker started. A deployment where some
        workers are still missing at the timeout serves anyway (and says which)."""
        url = self._base_url() + "/health"
        deadline = time.monotonic() + self.ready_timeout_s
        last_note = 0.0
        missing: list[str] = list(self.worker_ids)
        is_ready = False
        while time.monotonic() < deadline:
            dead = self._dead_child()
            if dead is not None:
                self.say(
                    f"{dead.name} exited with {dead.returncode} during start-up: see {dead.log_path}"
                )
                return False
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    live = set(json.loads(resp.read()).get("workers", []))
                    is_ready = resp.status == 200
                    missing = [w for w in self.worker_ids if w not in live]
                    if is_ready and not missing:
                        return True
            except (OSError, ValueError):  # not up yet (503 is an OSError), or a torn body
                pass
            if time.monotonic() - last_note > 10:
                done = len(self.worker_ids) - len(missing)
                self.say(
                    f"waiting for the models to load ({done} of {len(self.worker_ids)} ready) ..."
                )
                last_note = time.monotonic()
            time.sleep(0.5)
        if is_ready:
            self.say(f"still loading after {self.ready_timeout_s:.0f} s: {', '.join(missing)}")
            return True
        self.say(
            f"no worker became ready within {self.ready_timeout_s:.0f} s: see the logs in {self.log_dir}/"
        )
        return False

    def _base_url(self) -> str:
        gw = self.cluster.gateway
        host = "127.0.0.1" if gw.host in ("0.0.0.0", "") else gw.host
        return f"http://{host}:{gw.port}"

    def print_banner(self) -> None:
        base = self._base_url()
        model = next(iter(self.cluster.models), "auto")
        self.say(f"serving the OpenAI API at {base}/v1   (Ctrl-C stops everything)")
        auth = ""
        if self.cluster.gateway.api_keys:  # (the key itself is not printed)
            auth = (
                '-H "Authorization: Bearer $BATON_API_KEY" '
                if Env.API_KEY.get() is not None
                else "-H 'Authorization: Bearer <a key of [gateway] api_keys>' "
            )
        print(
            f"\n  curl {base}/v1/chat/completions {auth}-H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
            f'"max_tokens": 32}}\'\n',
            flush=True,
        )

    # 4. supervision ---------------------------------------------------------

    def _dead_child(self) -> Child | None:
        for child in self.children:
            if (
                child.restarts.restart_at is None
                and child.process is not None
                and child.process.poll() is not None
            ):
                return child
        return None

    def _supervise(self, env: dict[str, str]) -> int:
        """Restart what dies (module docstring, step 4); returns when something crash-loops
        or no worker is left."""
        while True:
            now = time.monotonic()
            # 1. a service's death: give up on a crash loop, else schedule the restart
            while (dead := self._dead_child()) is not None:
                code = dead.returncode
                if dead.is_worker and code == 0 and self.max_restarts > 0:
                    self.say(f"{dead.name} exited cleanly (drained): not restarted")
                    dead.restarts.restart_at = math.inf
                    if all(c.restarts.restart_at == math.inf for c in self._workers()):
                        self.say("no worker is left: stopping")
                        return 1
                elif not self._schedule(
                    dead.name, f"exited with {code}", dead.log_path, dead.restarts, now
                ):
                    return 1
            # 2. a server's (started in step 1): the same, on its own port again
            for server in self.servers:
                _, log_path, restarts = self._server_starts[server.name]
                code = server.process.poll()
                if (
                    code is not None
                    and restarts.restart_at is None
                    and not self._schedule(
                        f"{server.name}-server", f"exited with {code}", log_path, restarts, now
                    )
                ):
                    return 1
            # 3. restarts that are due
            for child in self.children:
                if child.restarts.is_due(now):
                    child.start(env)
                    self.say(f"restarted {child.name}")
            for i, server in enumerate(self.servers):
                start, log_path, restarts = self._server_starts[server.name]
                if not restarts.is_due(now):
                    continue
                try:
                    with signals_held():
                        self.servers[i] = start()
                except ServerError as exc:  # its next death: retried after the next backoff
                    name = f"{server.name}-server"
                    if not self._schedule(
                        name, f"failed to start ({exc})", log_path, restarts, now
                    ):
                        return 1
                else:
                    self.say(f"restarted {server.name}-server at {self.servers[i].url}")
            time.sleep(0.2)

    def _workers(self) -> list[Child]:
        return [c for c in self.children if c.is_worker]

    def _schedule(
        self, name: str, what: str, log_path: Path, restarts: Restarts, now: float
    ) -> bool:
        """Say that `name` `what` (exited with N, failed to start) and schedule its
        restart; False: one death too many within the window, stop."""
        delay = restarts.schedule(now, self.max_restarts)
        if delay is None:
            loop = (
                f"{len(restarts.deaths)} exits within {RESTART_WINDOW_S:.0f} s, "
                if self.max_restarts
                else ""
            )
            self.say(f"{name} {what}: see {log_path}; {loop}stopping")
            return False
        self.say(
            f"{name} {what}: see {log_path}; restarting in {delay:.1f} s "
            f"({len(restarts.deaths)} of {self.max_restarts} restarts within "
            f"{RESTART_WINDOW_S:.0f} s)"
        )
        return True

    # 5. shutdown ------------------------------------------------------------

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan anything
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        back = ("estimator", "relay", "batcher")
        tiers = [
            [c for c in self.children if c.name == "gateway"],
            self._workers(),
            [c for c in self.children if c.name in back],
        ]
        for group in tiers:
            for child in group:  # SIGTERM a whole tier at once, then wait for each
                if child.process is not None and child.process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.process.pid, signal.SIGTERM)
            for child in group:
                if child.process is not None:
                    stop_process_group(child.process, timeout_s=15.0)
        for server in reversed(self.servers):
            server.stop()
        if self.children or self.servers:
            self.say("stopped")


def _model_problem(model: str) -> str | None:
    """Why a model cannot load on this machine (missing files), or None."""
    try:
        from shared.model_store import resolve

        resolve(model)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None
