"""The model-family build chain in scripts/build_models.py: each student is built after
the one it starts from, its starting delta keeps every one of its layers, and a missing
starting delta is refused before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import SCRIPTS, load_script

REPO = SCRIPTS.parent
bm = load_script("build_models")


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
    small, stage = bm.SPECS["smollm2-small"], bm.SPECS["smollm2-small-12"]
    # an intermediate stage is read back from the cache
    assert bm.starting_delta(small, args) == tmp_path / "smollm2-small-12.safetensors"
    assert bm.starting_delta(bm.SPECS["smollm2-medium"], args) is None
    with pytest.raises(SystemExit, match="starts from smollm2-small-12"):
        bm.check_starts([small], args)
    # built earlier in the same run: not an error (the medium it starts from is shipped)
    bm.check_starts([stage, small], args)
    missing = bm.parse_args(["--init-from", str(tmp_path / "x.safetensors")])
    with pytest.raises(SystemExit, match="no such file"):
        bm.check_starts([small], missing)


def test_an_explicit_start_must_keep_the_students_layers_and_rank(tmp_path: Path) -> None:
    # The shipped medium (rank 16) keeps layers 0-5 and 20-29: every layer of the small
    # model, so it is a valid start; a student keeping layer 10, or of another rank, is not.
    medium = REPO / "models" / "smollm2-medium.safetensors"
    small = bm.SPECS["smollm2-small"]
    args = bm.parse_args(["--models", "smollm2-small", "--init-from", str(medium)])
    assert bm.starting_delta(small, args) == medium
    bm.check_starts([small], args)
    odd = bm.StudentSpec("odd", (0, 10, 29), rank=16, lr=1e-3, steps=1, minutes=1.0)
    with pytest.raises(SystemExit, match=r"not odd's \[10\]"):
        bm.check_starts([odd], args)
    wide = bm.StudentSpec("wide", (0, 29), rank=32, lr=1e-3, steps=1, minutes=1.0)
    with pytest.raises(SystemExit, match="rank"):
        bm.check_starts([wide], args)


def test_main_refuses_before_loading_anything(tmp_path: Path) -> None:
    # No base model in this cache: reaching the loading step would fail differently.
    cache = ["--cache-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="starts from smollm2-small-12"):
        bm.main(["--models", "smollm2-small", *cache])
    with pytest.raises(SystemExit, match="--layers applies to one model"):
        bm.main(["--models", "smollm2-medium", "smollm2-small", "--layers", "[0, 29]", *cache])
    with pytest.raises(SystemExit, match="--init-from applies to one model"):
        bm.main(["--init-from", "x.safetensors", *cache])
    assert not (tmp_path / "smollm2-135m").exists()  # the base was never loaded
    default = bm.parse_args([])
    assert default.models == list(bm.BUILD_ORDER)  # all three, in the order they build
