"""The cluster file's `cpus` settings: parsed and checked when the file is read, applied
by each service process to all of its threads (shared.runtime.pin_cpus), and by the
launcher to the NATS and Redis servers it starts (end to end in test_launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shared.config import ConfigError, parse_cluster
from shared.runtime import _parse_cpu_list, check_cpus, compact_cpus, usable_cpus
from tests.support.stack import run_service_process

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform"
)


def test_cpu_lists_read_and_print_as_the_kernel_writes_them() -> None:
    assert _parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}
    assert _parse_cpu_list("3") == {3}
    assert compact_cpus([5, 0, 2, 1, 1]) == "0-2,5"
    assert compact_cpus([7]) == "7"
    assert os.sched_getaffinity(0) <= usable_cpus()


def test_cluster_file_cpus_are_checked_when_it_is_read() -> None:
    base = '[models.a]\n[[instances]]\nmodel = "a"\n'
    with pytest.raises(ConfigError, match=r"Expected `int` >= 0 - at `\$.gateway.cpus\[0\]`"):
        parse_cluster("[gateway]\ncpus = [-1]\n", environ={})
    with pytest.raises(ConfigError, match="threads = 2 but cpus \\[0, 0\\] gives it 1"):
        parse_cluster(base + "threads = 2\ncpus = [0, 0]\n", environ={})
    cluster = parse_cluster(
        "server_cpus = [0]\n[estimator]\ncpus = [0]\n" + base + "cpus = [1]\n", environ={}
    )
    assert cluster.cpu_settings() == [
        ("server_cpus", [0]),
        ("[estimator]", [0]),
        ("[[instances]] of 'a'", [1]),
    ]
    assert parse_cluster(base, environ={}).cpu_settings() == []  # nothing pinned by default


def test_a_cpu_this_machine_lacks_is_refused_by_name() -> None:
    beyond = max(usable_cpus()) + 1
    with pytest.raises(ConfigError, match=rf"\[gateway\] cpus = \[0, {beyond}\]: CPU {beyond} "):
        check_cpus([0, beyond], "[gateway]")
    check_cpus([min(usable_cpus())], "[gateway]")
    check_cpus([], "[gateway]")


PIN = textwrap.dedent(
    """
    import os, sys, threading
    from shared.runtime import pin_cpus

    started = threading.Event()
    ready = threading.Event()
    def early():  # a thread alive before pinning
        started.set()
        ready.wait()
    t = threading.Thread(target=early); t.start(); started.wait()
    pin_cpus([int(sys.argv[1])], "[gateway]")
    later = []
    t2 = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0))); t2.start(); t2.join()
    masks = [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")]
    ready.set(); t.join()
    print(len(masks), all(m == [int(sys.argv[1])] for m in masks), sorted(later[0]))
    """
)


def test_pin_cpus_moves_every_thread_and_the_threads_started_later() -> None:
    cpu = max(usable_cpus())
    out = subprocess.run(
        [sys.executable, "-c", PIN, str(cpu)], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    num_threads, all_pinned, later = out.stdout.split()
    assert (all_pinned, later) == ("True", f"[{cpu}]")
    assert int(num_threads) >= 2  # the early thread among them


def test_a_service_refuses_cpus_it_cannot_have(tmp_path: Path) -> None:
    """The estimator's own process checks its [estimator] cpus: exit 2, the reason logged."""
    beyond = max(usable_cpus()) + 1
    path = tmp_path / "cluster.toml"
    path.write_text(f"[estimator]\ncpus = [{beyond}]\n")
    out = run_service_process("estimator", path, timeout_s=60)
    logged = out.stdout + out.stderr
    assert out.returncode == 2, logged
    assert f"[estimator] cpus = [{beyond}]: CPU {beyond} is not available" in logged
