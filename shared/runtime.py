"""Running a service process: uvloop, SIGTERM/SIGINT -> graceful stop, exit codes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Collection, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from shared.config import ClusterConfig, ConfigError, load_cluster
from shared.logging import configure_logging, get_logger


class StoppableService(Protocol):
    # set once the service's start is over (connected, subscribed, serving)
    started: asyncio.Event

    def request_stop(self) -> None: ...

    def run(self) -> Awaitable[None]: ...


@runtime_checkable
class ReloadableService(StoppableService, Protocol):
    """A service that takes some settings from a re-read cluster file (SIGHUP)."""

    def reload(self, cluster: ClusterConfig) -> None: ...


def exit_on_sigterm() -> None:
    """For a script that starts servers in sessions of their own (no signal sent to it
    reaches them): a SIGTERM (a CI timeout, `kill`) ends it as Ctrl-C does, through the
    finally blocks that stop them, instead of killing it and leaving them running."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def freeze_heap() -> None:
    """Put every object alive now (imported modules, a loaded model, long-lived state)
    out of the cyclic garbage collector's reach; later collections walk only newer ones.

    Why: a worker holds ~350k objects after start-up, and one full collection of them
    took ~0.4 s on a slow 2-core host: a stall of the loop, and of any step, at a random
    moment of serving. The last collection, at exit, kept a stopped worker alive 2.2 s
    (0.4 s frozen). vLLM freezes its engine's heap after start-up the same way. Only for
    a process's own entry point: frozen objects that later die in a reference cycle are
    never freed, which a test process starting stack after stack would pile up."""
    gc.collect()
    gc.freeze()


def compact_cpus(cpus: Iterable[int]) -> str:
    """CPU ids as ranges, as the kernel lists them: {0, 1, 2, 5} -> "0-2,5"."""
    ids = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def _parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-2,5") as ids."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            ids.update(range(int(low), int(high or low) + 1))
    return ids


def usable_cpus() -> set[int]:
    """The CPUs a process here may be pinned to: the container's cpuset where there is
    one, else the online CPUs. Not this process's own mask: a service may pin itself
    to CPUs its launcher (say, a benchmark pinned elsewhere) does not run on."""
    for path in (
        "/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
        "/sys/fs/cgroup/cpuset/cpuset.effective_cpus",  # cgroup v1
        "/sys/devices/system/cpu/online",
    ):
        try:
            ids = _parse_cpu_list(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if ids:
            return ids
    return set(range(os.cpu_count() or 1))


def check_cpus(cpus: Collection[int], where: str) -> None:
    """ConfigError unless every CPU in `cpus` is one a process here may run on."""
    if not cpus:
        return
    usable = usable_cpus()
    missing = set(cpus) - usable
    if missing:
        raise ConfigError(
            f"{where} cpus = {sorted(cpus)}: CPU {compact_cpus(missing)} is not available "
            f"here (CPUs {compact_cpus(usable)} are)"
        )


def pin_cpus(cpus: Collection[int], where: str) -> None:
    """Keep this process, every thread it has and every thread it starts later (torch's
    pool, `asyncio.to_thread`'s), on `cpus`; nothing when `cpus` is empty. ConfigError
    when a CPU is not available here; a warning where the OS has no CPU affinity.

    Why: on a 2-core host the OS scheduler moves a busy worker between the cores and
    wakes the gateway, NATS and the client on its core mid-step. A worker on a core of
    its own, the rest on the other, streams random-tiny at 7,466 / 8,120 tok/s against
    5,189 / 6,219 unpinned; in alternated benchmark runs pinning gives ~0.05 more of the
    engine's token rate and ~0.3 ms more TTFT, the first token's hops sharing one core."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        get_logger(component="runtime").warning(
            "cpus_ignored", where=where, reason="no CPU affinity on this platform"
        )
        return
    check_cpus(cpus, where)
    # sched_setaffinity(0) sets the calling thread's mask only: set every thread's
    # (threads started later inherit their starter's)
    try:
        thread_ids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        thread_ids = [0]
    try:
        for tid in thread_ids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cpus)
    except OSError as exc:  # EINVAL: none of them usable (a cpuset usable_cpus missed)
        raise ConfigError(f"{where} cpus = {sorted(cpus)}: {exc.strerror}") from None
    granted = os.sched_getaffinity(0)
    if granted != set(cpus):  # the kernel kept only the cpuset's part of the mask
        raise ConfigError(
            f"{where} cpus = {sorted(cpus)}: this process may run on CPUs "
            f"{compact_cpus(granted)} of them only"
        )


def run_service(
    service: StoppableService,
    name: str,
    ready: asyncio.Event | None = None,
    on_hangup: Callable[[], None] | None = None,
) -> int:
    """Run service on uvloop until it returns; signals begin its graceful stop. The heap
    is frozen (freeze_heap) once `ready` is set (best before the service can be sent
    work: the collection stalls the process once), or at once without one.

    A signal before `service.started` is set (the service still loading its model, or waiting
    for NATS or Redis to answer, which it does for as long as they do not) ends the
    start at once instead: nothing was accepted yet, so there is nothing to drain, and
    the graceful stop would only begin once the start is over (with NATS down, never:
    `docker stop` or the launcher had to kill the process).

    Returns the process exit code: 0 after a clean stop, 1 if the service failed
    (logged with its traceback; compose or the launcher restarts the process).
    """
    log = get_logger(component=name)

    async def freeze_when_ready() -> None:
        if ready is not None:
            await ready.wait()
        freeze_heap()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        cut_short = False

        def on_signal() -> None:
            nonlocal cut_short
            service.request_stop()
            if not service.started.is_set() and main is not None:
                cut_short = True
                main.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if on_hangup is not None:
            loop.add_signal_handler(signal.SIGHUP, on_hangup)
        freezing = asyncio.create_task(freeze_when_ready(), name="freeze-heap")
        try:
            await service.run()
        except asyncio.CancelledError:
            if not cut_short:
                raise
            log.info(f"{name}_stopped_while_starting")
        finally:
            freezing.cancel()

    try:
        import uvloop

        uvloop.run(run())
    except Exception:
        log.exception(f"{name}_failed")
        return 1
    return 0


__all__ = [
    "ReloadableService",
    "StoppableService",
    "check_cpus",
    "cluster_service_main",
    "compact_cpus",
    "exit_on_sigterm",
    "freeze_heap",
    "pin_cpus",
    "run_service",
    "usable_cpus",
]


def service_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The command line every `python -m services.<name>` shares: --cluster; a service
    adds its own flags."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}", description=description)
    parser.add_argument(
        "--cluster", help="cluster file (default $BATON_CLUSTER or configs/local.toml)"
    )
    return parser


def cluster_service_main(
    name: str,
    description: str,
    build: Callable[[ClusterConfig], StoppableService],
    argv: list[str] | None = None,
) -> int:
    """`python -m services.<name> [--cluster FILE]`: parse, load the cluster file, pin
    the process to the section's `cpus`, build the service and run it. Exit 2 for a bad
    cluster file, CPUs it cannot have or settings the service refuses (ValueError from
    `build`)."""
    args = service_parser(name, description).parse_args(argv)
    log = configure_logging(name)
    try:
        cluster = load_cluster(args.cluster)
        pin_cpus(cluster.service_cpus(name), f"[{name}]")
        service = build(cluster)
    except (ConfigError, ValueError) as exc:
        log.error("bad_config", error=str(exc))
        return 2
    if not isinstance(service, ReloadableService):
        return run_service(service, name)
    reloadable = service

    def hangup() -> None:
        """SIGHUP: the cluster file again; a file it refuses leaves everything as it was."""
        try:
            reloadable.reload(load_cluster(args.cluster))
        except (ConfigError, ValueError) as exc:
            log.error("reload_refused", error=str(exc))

    return run_service(service, name, on_hangup=hangup)
