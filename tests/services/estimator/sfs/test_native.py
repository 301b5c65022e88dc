"""The mypyc build of the replay kernel: keyed by its source so a stale build never
loads, built for real (mypyc + the C compiler), and replaying exactly as the plain
module does."""

from __future__ import annotations

import random
import shutil
import sysconfig
from pathlib import Path

import pytest

from services.estimator.sfs import kernel, native, replay
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import Probe, estimate, kernel_state
from shared.scheduling.snapshot import take_snapshot
from tests.services.estimator.sfs.builders import MODEL, random_live


def test_build_key_follows_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited kernel.py gets another build directory."""
    copy = tmp_path / "kernel.py"
    copy.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", copy)
    key = native.source_key()
    copy.write_bytes(copy.read_bytes() + b"\n# edited\n")
    assert native.source_key() != key


def test_baton_native_0_forces_the_plain_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_NATIVE", "0")
    module, note = native.load()
    assert module is kernel and "BATON_NATIVE=0" in note


CC = (sysconfig.get_config_var("CC") or "cc").split()[0]


@pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler ({CC}): no native build")
def test_built_kernel_loads_and_replays_as_the_plain_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compile into an empty cache (about 10 s), load it, and replay random
    snapshots with both: identical estimates, step counts included. An edited
    kernel.py never loads that build."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BATON_NATIVE", raising=False)
    path = native.build()
    assert path.is_file() and path.parent == native.build_dir()
    module, note = native.load()
    assert module is not kernel and note.startswith("native")
    edited = tmp_path / "kernel.py"
    edited.write_bytes(native.SOURCE.read_bytes() + b"\n# edited\n")
    with monkeypatch.context() as m:
        m.setattr(native, "SOURCE", edited)
        stale, stale_note = native.load()
        assert stale is kernel and "no native build" in stale_note
    rng = random.Random(5)
    policy = OutputPolicy(default_output_tokens=25, length_ratios=(0.7, 1.0, 1.6))
    for trial in range(40):
        snap = take_snapshot(random_live(rng, predicted=trial % 2 == 0), trial, 0.0)
        probe = Probe(rng.randint(1, 70), rng.randint(1, 30), 50)
        results = []
        for impl in (kernel, module):
            monkeypatch.setattr(replay, "kernel_impl", impl)
            assert type(kernel_state(snap, policy)) is impl.KernelState
            results.append(estimate(snap, MODEL, probe, want_e2e=True, policy=policy))
        assert results[0] == results[1], trial
