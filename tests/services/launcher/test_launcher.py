"""The launcher as a user runs it: starts NATS, Redis and every service, serves, stops with no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.launcher.servers import MAX_UNIX_PATH, free_port, start_redis, stop_process_group
from shared.store import Store
from tests.support.builders import worker_info
from tests.support.stack import tiny_cluster_text


def children_of(pid: int) -> set[int]:
    kids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry.name))
    return kids


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_no_orphans(pids: set[int], timeout_s: float = 5.0) -> None:
    """Every one of `pids` (a stopped launcher's children) is gone within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while any(is_alive(k) for k in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in pids if is_alive(k)], "orphaned processes"


def write_own_servers_cluster(tmp_path: Path) -> int:
    """tmp_path/cluster.toml with NATS and Redis URLs nothing answers at (the launcher
    starts both) and a free gateway port, which it returns."""
    nats_url, redis_url = f"nats://127.0.0.1:{free_port()}", f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    (tmp_path / "cluster.toml").write_text(tiny_cluster_text(nats_url, redis_url, port=port))
    return port


def launcher_cmd(tmp_path: Path) -> list[str]:
    """`python -m services.launcher` on tmp_path/cluster.toml, logs in tmp_path/logs."""
    cluster, logs = str(tmp_path / "cluster.toml"), str(tmp_path / "logs")
    return [sys.executable, "-m", "services.launcher", cluster, "--log-dir", logs]


def run_launcher(
    tmp_path: Path, repo_root: Path, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """The launcher on tmp_path/cluster.toml, no BATON_ variables, run to its end (a
    refusal), its output captured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    return subprocess.run(
        launcher_cmd(tmp_path),
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_launcher(tmp_path: Path, repo_root: Path) -> subprocess.Popen[str]:
    """The launcher on tmp_path/cluster.toml, no BATON_ variables, output piped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    return subprocess.Popen(
        launcher_cmd(tmp_path),
        cwd=repo_root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@contextlib.contextmanager
def launched(tmp_path: Path, repo_root: Path) -> Iterator[subprocess.Popen[str]]:
    """start_launcher for the block; stopped at its end if the test left it running (as
    Ctrl-C would, so that a failing test leaves no servers behind; killed if that hangs)."""
    proc = start_launcher(tmp_path, repo_root)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def exit_and_rest(proc: subprocess.Popen[str], timeout_s: float = 30) -> tuple[int, str]:
    """Its exit status and what it printed after read_until_serving (and its services'
    logs are in tmp_path/logs): what a failing assertion on the status should show."""
    code = proc.wait(timeout_s)
    assert proc.stdout is not None
    return code, proc.stdout.read()


def read_until_serving(proc: subprocess.Popen[str]) -> str:
    """Its output up to "serving" (or an error, or 50 lines)."""
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "serving the OpenAI API" in line or "error" in line or len(lines) > 50:
            break
    return "".join(lines)


def test_launcher_serves_and_stops_cleanly(tmp_path: Path, repo_root: Path) -> None:
    port = write_own_servers_cluster(tmp_path)
    with launched(tmp_path, repo_root) as proc:
        out = read_until_serving(proc)
        assert f"http://127.0.0.1:{port}/v1" in out, out
        assert "started nats-server" in out and "started redis-server" in out
        # the Redis it started: its services reach it over a Unix socket, one per port
        redis_port = re.findall(
            r"redis://127.0.0.1:(\d+)", (tmp_path / "cluster.toml").read_text()
        )[0]
        sock = tmp_path / "logs" / ".redis" / f"redis-{redis_port}.sock"
        assert f"its services use unix://{sock}?db=0" in out, out
        kids = children_of(proc.pid)
        assert len(kids) == 6  # nats, redis, estimator, 2 workers, gateway
        assert any(f"BATON_REDIS_URL=unix://{sock}" in environ_of(k) for k in kids)
        # "serving" is printed once every worker it started is ready, not just the first.
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert set(health["workers"]) == {"random-tiny-0", "random-tiny-1"}, health
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "random-tiny", "prompt": "Hi", "max_tokens": 3},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        # SIGHUP: the estimator re-reads the file's routing settings
        proc.send_signal(signal.SIGHUP)
        Lines(proc).wait_for("asked the estimator to reload")
        estimator_log = tmp_path / "logs" / "estimator.log"
        deadline = time.monotonic() + 30
        while '"event": "routing_reloaded"' not in estimator_log.read_text():
            assert time.monotonic() < deadline, estimator_log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(30) == 0
        assert_no_orphans(kids)
        logs = {p.name for p in (tmp_path / "logs").iterdir()}
        assert {
            "gateway.log",
            "estimator.log",
            "worker-random-tiny-0.log",
            "worker-random-tiny-1.log",
        } <= logs
        assert (
            '"event": "worker_closed"'
            in (tmp_path / "logs" / "worker-random-tiny-0.log").read_text()
        )
        # the servers stopped on SIGTERM, not by the SIGKILL after a timeout (a server
        # started with the launcher's signals held inherited the mask)
        assert "ready to exit" in (tmp_path / "logs" / "redis.log").read_text()
        assert "Server Exiting" in (tmp_path / "logs" / "nats.log").read_text()


def environ_of(pid: int) -> str:
    """A process's environment, one VAR=value a line ("" if it is gone)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode()
    except OSError:
        return ""


def test_a_started_redis_listens_on_a_unix_socket_where_the_path_fits(tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    server = start_redis("127.0.0.1", None, unix_socket=sock)
    try:
        assert server.local_url == server.url_here == f"unix://{sock}?db=0"
        assert server.url.startswith("redis://127.0.0.1:")  # for clients elsewhere

        async def ping() -> bool:
            store = Store(server.url_here, "unix")
            await store.connect()
            try:  # snapshot writes, on the socket
                await store.write_snapshot("w", 1, b"s", ttl_s=5)
                blob = (await store.read_snapshots(["w"]))["w"]
                return blob is not None and blob.data == b"s"
            finally:
                await store.close()

        assert asyncio.run(ping())
    finally:
        server.stop()
    # a relative path: made absolute (a unix:// URL's path is absolute)
    with contextlib.chdir(tmp_path):
        server = start_redis("127.0.0.1", None, unix_socket=Path("rel") / "r.sock")
    try:
        assert server.local_url == f"unix://{tmp_path / 'rel' / 'r.sock'}?db=0"
    finally:
        server.stop()
    # a socket another live server listens on is never taken over (nor deleted): TCP alone
    first = start_redis("127.0.0.1", None, unix_socket=sock)
    try:
        second = start_redis("127.0.0.1", None, unix_socket=sock)
        try:
            assert second.local_url == "" and second.url_here == second.url
            assert first.local_url == f"unix://{sock}?db=0" and sock.exists()
        finally:
            second.stop()
        assert sock.exists()
    finally:
        first.stop()
    long = tmp_path / ("d" * (MAX_UNIX_PATH - len(str(tmp_path)))) / "r.sock"
    server = start_redis("127.0.0.1", None, unix_socket=long)
    try:  # a path too long for a socket: TCP alone
        assert server.local_url == "" and server.url_here == server.url
    finally:
        server.stop()


def service_pid(launcher_pid: int, *needles: str) -> int:
    """The launcher's child whose command line holds every needle."""
    for pid in children_of(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(n in cmdline for n in needles) and is_alive(pid):
            return pid
    raise AssertionError(f"no live child with {needles}")


class Lines:
    """The launcher's output after "serving", read by a thread (a pipe read blocks)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: [self._q.put(x) for x in stdout], daemon=True).start()

    def wait_for(self, needle: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no line with {needle!r} in {''.join(self.seen)}")


def wait_healthy_with(port: int, worker: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if health.status_code == 200 and worker in health.json()["workers"]:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health never listed {worker}")


def wait_unhealthy(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "/health stayed 200"
        time.sleep(0.02)


def served(port: int, body: dict[str, object], timeout_s: float = 30.0) -> None:
    """A completion answers 200 within timeout_s (retried: a restarted server's clients
    reconnect on their own schedule)."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert resp.status_code == 200, resp.text


def test_launcher_restarts_a_service_that_dies(tmp_path: Path, repo_root: Path) -> None:
    """A worker, the gateway, then the Redis and NATS servers the launcher started are
    SIGKILLed: each is started again (the servers on their ports) and the deployment
    serves again. Then the workers drain on SIGTERM, one after the other: neither is
    restarted, and with none left the launcher stops, leaving no process behind."""
    port = write_own_servers_cluster(tmp_path)
    with launched(tmp_path, repo_root) as proc:
        out = read_until_serving(proc)
        assert "serving the OpenAI API" in out, out
        lines = Lines(proc)
        body = {"model": "random-tiny", "prompt": "Hi", "max_tokens": 3}
        for needles, name in (
            (("services.worker", "random-tiny-0"), "worker random-tiny-0"),
            (("services.gateway",), "gateway"),
            (("redis-server",), "redis-server"),  # its keys are gone: workers register again
            (("nats-server",), "nats-server"),  # every client reconnects
        ):
            os.kill(service_pid(proc.pid, *needles), signal.SIGKILL)
            if name == "nats-server":  # the gateway says so, rather than time out
                wait_unhealthy(port)  # it has seen the connection drop
                unavailable = httpx.post(
                    f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30
                )
                if unavailable.status_code != 200:  # not reconnected yet
                    assert unavailable.status_code == 503, unavailable.text
                    assert unavailable.headers["retry-after"]
                    assert "NATS" in unavailable.json()["error"]["message"], unavailable.text
            said = lines.wait_for(f"{name} exited with -9")
            assert "restarting in" in said and "1 of 5 restarts" in said, said
            lines.wait_for(f"restarted {name}")
            wait_healthy_with(port, "random-tiny-0")
            served(port, body)
        assert proc.poll() is None  # still serving
        kids = children_of(proc.pid)
        os.kill(service_pid(proc.pid, "services.worker", "random-tiny-1"), signal.SIGTERM)
        lines.wait_for("worker random-tiny-1 exited cleanly (drained): not restarted")
        served(port, body)  # the other one serves
        os.kill(service_pid(proc.pid, "services.worker", "random-tiny-0"), signal.SIGTERM)
        lines.wait_for("no worker is left: stopping")
        assert proc.wait(30) == 1
        assert_no_orphans(kids)


def test_launcher_with_no_restarts_stops_at_the_first_death(
    tmp_path: Path, repo_root: Path
) -> None:
    write_own_servers_cluster(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    proc = subprocess.Popen(
        [*launcher_cmd(tmp_path), "--max-restarts", "0"],
        cwd=repo_root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert "serving the OpenAI API" in read_until_serving(proc)
        kids = children_of(proc.pid)
        os.kill(service_pid(proc.pid, "services.worker", "random-tiny-1"), signal.SIGKILL)
        assert proc.wait(60) == 1
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert "worker random-tiny-1 exited with -9" in rest and "stopping" in rest, rest
        assert "restarting" not in rest
        assert_no_orphans(kids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def register_worker(redis_url: str, namespace: str, instance_id: str, *, ttl_s: float) -> None:
    """Register a worker as a deployment's would (nothing behind it), for ttl_s."""
    info = worker_info(
        instance_id, "random-tiny", namespace=namespace, max_model_len=256, at_s=time.time()
    )

    async def register() -> None:
        store = Store(redis_url, namespace)
        await store.connect()
        await store.register(info, ttl_s=ttl_s)
        await store.close()

    asyncio.run(register())


def test_launcher_refuses_a_taken_gateway_port_before_starting_any_server(
    tmp_path: Path, repo_root: Path
) -> None:
    """The gateway's port is in use: the launcher says so before it starts NATS or
    Redis (a Redis it started would have replaced a running deployment's socket)."""
    port = write_own_servers_cluster(tmp_path)
    with socket.create_server(("127.0.0.1", port)):
        run = run_launcher(tmp_path, repo_root, 60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"port {port} on 127.0.0.1 is in use" in run.stdout, run.stdout
    assert "started" not in run.stdout, run.stdout
    assert not (tmp_path / "logs" / ".redis").exists()


def test_launcher_refuses_a_namespace_with_live_workers(
    tmp_path: Path, repo_root: Path, redis_url: str
) -> None:
    """A second deployment on the same Redis and namespace would share the first one's
    workers without knowing it: the launcher says so and starts nothing."""
    namespace = f"ns{uuid.uuid4().hex[:8]}"
    register_worker(redis_url, namespace, "other-0", ttl_s=60)
    nats_url = f"nats://127.0.0.1:{free_port()}"
    port = free_port()
    (tmp_path / "cluster.toml").write_text(
        tiny_cluster_text(nats_url, redis_url, namespace=namespace, port=port)
    )
    run = run_launcher(tmp_path, repo_root, 120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "other-0" in run.stdout and "BATON_NAMESPACE" in run.stdout, run.stdout
    assert "waiting" in run.stdout  # it gave a stopped deployment's registrations time
    assert not (tmp_path / "logs" / "gateway.log").exists()  # no service was started
    assert "nats-server" not in run.stdout  # nor NATS: the check comes first
    with httpx.Client() as client:  # nothing serves on the port
        try:
            client.get(f"http://127.0.0.1:{port}/health", timeout=1)
            serving = True
        except httpx.TransportError:
            serving = False
    assert not serving


def test_launcher_starts_once_a_stopped_deployments_registrations_expire(
    tmp_path: Path, repo_root: Path, redis_url: str
) -> None:
    """A registration left by a killed deployment (not renewed) expires within the
    heartbeat TTL: the launcher waits it out and then serves."""
    namespace = f"ns{uuid.uuid4().hex[:8]}"
    register_worker(
        redis_url, namespace, "killed-0", ttl_s=2.4
    )  # gone by the re-read: TTL 2 s + 0.5 after the first
    nats_url = f"nats://127.0.0.1:{free_port()}"
    (tmp_path / "cluster.toml").write_text(
        tiny_cluster_text(nats_url, redis_url, namespace=namespace, port=free_port())
    )
    with launched(tmp_path, repo_root) as proc:
        out = read_until_serving(proc)
        assert "killed-0" in out and "waiting" in out, out
        assert "serving the OpenAI API" in out, out
        proc.send_signal(signal.SIGINT)
        code, rest = exit_and_rest(proc)
        logs = {p.name: p.read_text()[-1500:] for p in (tmp_path / "logs").glob("*.log")}
        assert code == 0, f"{out}{rest}\n{logs}"


def test_launcher_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.launcher", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "BATON_PORT" in out.stdout and "cluster" in out.stdout


def test_launcher_refuses_an_unknown_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preset naming a policy Baton does not have is refused before anything starts,
    with the preset and the name, instead of an estimator that dies at start."""
    from services.launcher.__main__ import main

    path = tmp_path / "cluster.toml"
    path.write_text(
        '[models.a]\n[[instances]]\nmodel = "a"\n'
        '[presets.auto]\nmodels = ["a"]\npolicy = "best-route"\n'
    )
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "[presets.auto]" in err and "'best-route'" in err


@pytest.mark.parametrize("text", ["", '[models.a]\n[[instances]]\nmodel = "a"\nreplicas = 0\n'])
def test_launcher_refuses_a_cluster_file_that_starts_no_worker(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file (all defaults) or one whose instances have no replicas: refused at
    once, not served after the whole ready timeout with "0 of 0 ready"."""
    from services.launcher.__main__ import main

    path = tmp_path / "cluster.toml"
    path.write_text(text)
    assert main([str(path)]) == 2
    assert "starts no worker" in capsys.readouterr().err


def test_launcher_runs_the_shipped_sim_testbed(tmp_path: Path, repo_root: Path) -> None:
    """configs/sim-sfs.toml as shipped (its servers, port and namespace moved aside):
    model names with dots ("qwen3-0.6b") give workers ids that are subject tokens."""
    text = (repo_root / "configs" / "sim-sfs.toml").read_text()
    port = free_port()
    for key, value in (
        ("namespace", f'"t{uuid.uuid4().hex[:8]}"'),
        ("nats_url", f'"nats://127.0.0.1:{free_port()}"'),
        ("redis_url", f'"redis://127.0.0.1:{free_port()}/0"'),
        ("port", str(port)),
    ):
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.M)
    (tmp_path / "cluster.toml").write_text(text)
    with launched(tmp_path, repo_root) as proc:
        out = read_until_serving(proc)
        assert f"http://127.0.0.1:{port}/v1" in out, out
        for worker in ("qwen3-0-6b-0", "qwen3-8b-0", "qwen3-32b-0"):  # the gateway's view
            wait_healthy_with(port, worker, timeout_s=10)  # lags the launcher's by a refresh
        served(port, {"model": "auto", "prompt": "Hi", "max_tokens": 3})  # the SFS preset
        kids = children_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert_no_orphans(kids)


def test_a_killed_launcher_leaves_no_process_behind(tmp_path: Path, repo_root: Path) -> None:
    """SIGKILL gives the launcher no chance to stop anything: its services and the NATS
    and Redis servers it started end on their own (they die with their parent)."""
    write_own_servers_cluster(tmp_path)
    with launched(tmp_path, repo_root) as proc:
        out = read_until_serving(proc)
        assert "started nats-server" in out and "started redis-server" in out, out
        kids = children_of(proc.pid)
        assert len(kids) == 6  # nats, redis, estimator, 2 workers, gateway
        proc.kill()
        proc.wait()
        assert_no_orphans(kids, timeout_s=15)


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU masks of the threads of `pid` (one element: every thread has the same)."""
    masks = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            masks.add(frozenset(os.sched_getaffinity(int(task.name))))
    return masks


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell masks apart")
def test_launcher_pins_what_the_cluster_file_pins(tmp_path: Path, repo_root: Path) -> None:
    """`cpus` and `server_cpus`: each worker (all its threads, torch's too) on its CPU, the
    gateway, the estimator and the servers the launcher starts on theirs; it serves."""
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    port = write_own_servers_cluster(tmp_path)
    path = tmp_path / "cluster.toml"
    text = path.read_text()
    text = re.sub(r"^(redis_url = .*)$", rf"\1\nserver_cpus = [{first}]", text, flags=re.M)
    for section in ("[gateway]", "[estimator]"):
        text = text.replace(section, f"{section}\ncpus = [{first}]")
    text = text.replace("[[instances]]", f"[[instances]]\ncpus = [{last}]")
    path.write_text(text)
    with launched(tmp_path, repo_root) as proc:
        out = read_until_serving(proc)
        assert f"http://127.0.0.1:{port}/v1" in out, out
        served(port, {"model": "random-tiny", "prompt": "Hi", "max_tokens": 3})
        for needles in (
            ("nats-server",),
            ("redis-server",),
            ("services.gateway",),
            ("services.estimator",),
        ):
            assert thread_cpus(service_pid(proc.pid, *needles)) == {frozenset([first])}, needles
        for iid in ("random-tiny-0", "random-tiny-1"):
            worker = service_pid(proc.pid, "services.worker", iid)
            assert thread_cpus(worker) == {frozenset([last])}, iid


def test_launcher_refuses_cpus_this_machine_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before anything starts, the setting named."""
    from services.launcher.__main__ import main

    beyond = max(os.sched_getaffinity(0)) + 64
    path = tmp_path / "cluster.toml"
    path.write_text(f'[models.a]\n[[instances]]\nmodel = "a"\ncpus = [{beyond}]\n')
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"[[instances]] of 'a' cpus = [{beyond}]: CPU {beyond} is not available" in err


def test_a_process_that_outlives_its_kill_does_not_stop_the_stopping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process still unreaped 5 s after SIGKILL (a stalled host) must not raise out of
    stop_process_group: the launcher stops the servers after it all the same."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    real_wait = proc.wait

    def never(timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired(proc.args, timeout or 0)

    monkeypatch.setattr(proc, "wait", never)
    stop_process_group(proc, 0.1)  # SIGTERM, "no exit", SIGKILL, "no exit": returns
    assert real_wait(5) in (-signal.SIGTERM, -signal.SIGKILL)  # it was stopped all the same


@pytest.mark.parametrize(
    ("file_keys", "env_key", "header"),
    [
        ([], None, None),
        ([], "sekret", '-H "Authorization: Bearer $BATON_API_KEY"'),
        (["k1"], None, "-H 'Authorization: Bearer <a key of [gateway] api_keys>'"),
    ],
)
def test_the_printed_curl_sends_a_key_when_the_gateway_wants_one(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    file_keys: list[str],
    env_key: str | None,
    header: str | None,
) -> None:
    """With API keys the banner's curl names the header (a curl without it got a 401);
    the key itself is never printed."""
    from services.launcher.launcher import Launcher
    from shared.config import parse_cluster

    environ = {} if env_key is None else {"BATON_API_KEY": env_key}
    text = f"[gateway]\napi_keys = {file_keys!r}\n[models.a]\n".replace("'", '"')
    cluster = parse_cluster(text, environ=environ)
    if env_key is None:
        monkeypatch.delenv("BATON_API_KEY", raising=False)
    else:
        monkeypatch.setenv("BATON_API_KEY", env_key)
    Launcher(cluster, tmp_path / "cluster.toml", tmp_path).print_banner()
    out = capsys.readouterr().out
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in out
    if header is None:
        assert "Authorization" not in out
    else:
        assert header in out
    assert "sekret" not in out and "k1" not in out


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4").is_dir(), reason="reads Linux's port range")
def test_free_ports_are_drawn_below_the_ephemeral_range() -> None:
    """A port the kernel may hand to an outgoing connection meanwhile is not drawn (a
    test's gateway found its port so taken); each drawn port can be bound."""
    from services.launcher.servers import EPHEMERAL_RANGE, LOWEST_DRAWN_PORT

    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    for port in ports:
        assert LOWEST_DRAWN_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
