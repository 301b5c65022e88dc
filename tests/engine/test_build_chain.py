"""The model-family build chain in scripts/build_models.py: each student is built after
the one it starts from, its starting delta keeps every one of its layers, and a missing
starting delta is refused before any model is loaded."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_models", REPO / "scripts" / "build_models.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_models"] = mod
    spec.loader.exec_module(mod)
    return mod


bm = _load()


def test_every_start_keeps_the_students_layers_and_comes_first() -> None:
    for i, name in enumerate(bm.BUILD_ORDER):
        spec = bm.SPECS[name]
        if spec.init_from is None:
            continue
        start = bm.SPECS[spec.init_from]
        assert bm.BUILD_ORDER.index(start.name) < i
        assert set(spec.layers) <= set(start.layers), name
        assert start.rank == spec.rank
    shipped = [n for n in bm.BUILD_ORDER if not bm.SPECS[n].intermediate]
    assert sorted(shipped) == ["smollm2-medium", "smollm2-small"]
    assert len(bm.SPECS["smollm2-small"].layers) == 11


def test_a_missing_start_is_named_and_a_start_built_first_is_not(tmp_path: Path) -> None:
    args = bm.parse_args(["--models", "smollm2-small", "--cache-dir", str(tmp_path)])
    small = bm.SPECS["smollm2-small"]
    with pytest.raises(SystemExit, match="starts from smollm2-small-12"):
        bm.starting_delta(small, args)
    # Built earlier in the same run: its path, not an error.
    path = bm.starting_delta(small, args, frozenset({"smollm2-small-12"}))
    assert path == tmp_path / "smollm2-small-12.safetensors"  # an intermediate: in the cache
    # --init-from wins over the spec's start.
    explicit = bm.parse_args(["--models", "smollm2-small", "--init-from", "x.safetensors"])
    assert bm.starting_delta(small, explicit) == Path("x.safetensors")
    assert bm.starting_delta(bm.SPECS["smollm2-medium"], args) is None


def test_default_builds_the_whole_chain_in_order() -> None:
    args = bm.parse_args([])
    assert sorted(set(args.models), key=bm.BUILD_ORDER.index) == list(bm.BUILD_ORDER)
    with pytest.raises(SystemExit, match="one model"):
        bm.main(["--models", "smollm2-medium", "smollm2-small", "--layers", "[0, 29]"])
