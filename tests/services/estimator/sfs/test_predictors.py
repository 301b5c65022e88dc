"""Output-length and quality predictors: features, loading, prediction, fallbacks.

The boosters here are real xgboost fits on small synthetic data with a known rule, so
a prediction can be checked against what the rule says; nothing depends on the
project's trained files in models/predictors/.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xgboost as xgb

from services.estimator.predictors import (
    LENGTH_FILE,
    META_FILE,
    QUALITY_FILE,
    FeatureSpec,
    Predictors,
    TreeEnsemble,
)
from tests.scripts import load_script

SPEC = FeatureSpec(num_buckets=16, tasks=("alpaca", "aime"), models=("big", "small"))
LONG_PROMPT = 80  # tokens: the synthetic rules switch here


def rule_quality(model: str, num_tokens: int) -> float:
    """big is better on long prompts, small on short ones."""
    is_long = num_tokens >= LONG_PROMPT
    return (0.9 if is_long else 0.1) if model == "big" else (0.1 if is_long else 0.9)


def rule_length(model: str, num_tokens: int) -> float:
    """Output tokens: a constant per model."""
    return 5.0 if model == "big" else 11.0


def write_predictors(
    directory: Path,
    spec: FeatureSpec = SPEC,
    quality: Callable[[str, int], float] = rule_quality,
    length: Callable[[str, int], float] = rule_length,
    max_new_tokens: int = 256,
) -> Path:
    """Fit both boosters on prompts of 10-200 random tokens labelled by the rules; save
    them as train_predictors.py does."""
    rng = np.random.default_rng(0)
    rows, y_len, y_q = [], [], []
    for _ in range(300):
        ids = rng.integers(0, 49152, size=int(rng.integers(10, 200))).tolist()
        for model in spec.models:
            rows.append(spec.rows(ids, None, [model])[0])
            y_len.append(length(model, len(ids)))
            y_q.append(quality(model, len(ids)))
    x = np.array(rows, dtype=np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    params = {"max_depth": 3, "eta": 0.3, "nthread": 1, "seed": 0}
    for name, y in ((LENGTH_FILE, y_len), (QUALITY_FILE, y_q)):
        booster = xgb.train(params, xgb.DMatrix(x, label=np.array(y)), 60)
        booster.save_model(str(directory / name))
    meta = {"features": spec.to_json(), "labels": {"max_new_tokens": max_new_tokens}}
    (directory / META_FILE).write_text(json.dumps(meta))
    return directory


@pytest.fixture(scope="module")
def predictor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_predictors(tmp_path_factory.mktemp("predictors"))


# ---- features ------------------------------------------------------------------------


def test_features_are_deterministic_and_laid_out_as_documented() -> None:
    ids = [1, 2, 2, 49151, 7, 7, 7, 0]
    a = SPEC.rows(ids, "aime", ["small", "big"])
    b = FeatureSpec.from_json(json.loads(json.dumps(SPEC.to_json()))).rows(
        list(ids), "aime", ["small", "big"]
    )
    assert a.dtype == np.float32 and a.shape == (2, 1 + 16 + 2 + 2)
    assert np.array_equal(a, b)
    assert a[0, 0] == len(ids)
    bag = a[0, 1:17]
    assert bag.sum() == pytest.approx(1.0)
    # Token 7 is 3 of the 8 tokens; its bucket is the top 4 bits of 7 * 2654435761 mod 2^32.
    bucket = ((7 * 2654435761) % 2**32) >> 28
    assert bag[bucket] >= 3 / 8
    assert list(a[0, 17:19]) == [0.0, 1.0]  # task one hot: aime
    assert list(a[0, 19:]) == [0.0, 1.0] and list(a[1, 19:]) == [1.0, 0.0]  # small, big
    assert np.array_equal(a[0, :19], a[1, :19])  # only the model columns differ


def test_unknown_or_missing_task_hint_sets_no_task_column() -> None:
    for task in (None, "poetry"):
        row = SPEC.prompt_row([5, 6], task)
        assert not row[17:19].any()
    assert SPEC.prompt_row([], None)[0] == 0 and not SPEC.prompt_row([], None)[1:].any()


def test_spec_rejects_bad_bucket_counts_and_versions() -> None:
    with pytest.raises(ValueError, match="power of two"):
        FeatureSpec(num_buckets=100, tasks=(), models=("m",))
    with pytest.raises(ValueError, match="version"):
        FeatureSpec(num_buckets=16, tasks=(), models=("m",), version=99)


# ---- prediction ----------------------------------------------------------------------


def test_predicts_what_it_learned(predictor_dir: Path) -> None:
    pred = Predictors.load(predictor_dir)
    assert pred is not None
    short, long = list(range(100, 130)), list(range(100, 250))
    p_short = pred.predict(short, None, ["big", "small"])
    p_long = pred.predict(long, "alpaca", ["small", "big"])
    assert p_short["big"].output_tokens == 5 and p_short["small"].output_tokens == 11
    assert p_short["small"].quality == pytest.approx(0.9, abs=0.05)
    assert p_short["big"].quality == pytest.approx(0.1, abs=0.05)
    assert p_long["big"].quality == pytest.approx(0.9, abs=0.05)
    assert p_long["small"].quality == pytest.approx(0.1, abs=0.05)


def test_unknown_models_are_left_out(predictor_dir: Path) -> None:
    pred = Predictors.load(predictor_dir)
    assert pred is not None
    assert pred.knows("big") and not pred.knows("medium")
    assert set(pred.predict([1, 2, 3], None, ["medium", "big"])) == {"big"}
    assert pred.predict([1, 2, 3], None, ["medium"]) == {}


def test_predictions_are_clipped_to_their_ranges(tmp_path: Path) -> None:
    d = write_predictors(
        tmp_path / "wild",
        quality=lambda m, n: 1.7 if m == "big" else -0.4,
        length=lambda m, n: 900.0 if m == "big" else -20.0,
        max_new_tokens=256,
    )
    pred = Predictors.load(d)
    assert pred is not None
    p = pred.predict(list(range(50)), None, ["big", "small"])
    assert p["big"].quality == 1.0 and p["small"].quality == 0.0
    assert p["big"].output_tokens == 256 and p["small"].output_tokens == 1


@pytest.mark.parametrize(
    ("objective", "depth"), [("reg:squarederror", 6), ("reg:absoluteerror", 3)]
)
def test_numpy_tree_walk_equals_xgboost(objective: str, depth: int) -> None:
    rng = np.random.default_rng(1)
    x = rng.random((400, 12), dtype=np.float32)
    x[:, 3] = rng.integers(0, 2, 400)  # one-hot-like column: thresholds between 0 and 1
    y = 50 * x[:, 0] + 20 * (x[:, 3] > 0) + rng.normal(0, 1, 400)
    params = {"objective": objective, "max_depth": depth, "eta": 0.2, "nthread": 1}
    booster = xgb.train(params, xgb.DMatrix(x, label=y), 80)
    trees = TreeEnsemble(booster)
    assert trees.depth <= depth and trees.num_features == 12
    probe = rng.random((64, 12), dtype=np.float32)
    probe[:, 3] = rng.integers(0, 2, 64)
    np.testing.assert_allclose(trees.predict(probe), booster.inplace_predict(probe), rtol=1e-5)


def test_tree_walk_refuses_link_functions() -> None:
    x = np.random.default_rng(2).random((50, 3), dtype=np.float32)
    booster = xgb.train(
        {"objective": "binary:logistic", "nthread": 1},
        xgb.DMatrix(x, label=(x[:, 0] > 0.5).astype(float)),
        3,
    )
    with pytest.raises(ValueError, match="link"):
        TreeEnsemble(booster)


# ---- loading falls back cleanly ------------------------------------------------------


def test_missing_or_broken_files_load_as_none(tmp_path: Path, predictor_dir: Path) -> None:
    assert Predictors.load(tmp_path / "nowhere") is None
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in (META_FILE, LENGTH_FILE, QUALITY_FILE):
        (broken / name).write_bytes((predictor_dir / name).read_bytes())
    (broken / QUALITY_FILE).write_bytes(b"not a model")
    assert Predictors.load(broken) is None
    # Boosters trained for another feature layout than meta.json describes.
    other = FeatureSpec(num_buckets=32, tasks=SPEC.tasks, models=SPEC.models)
    meta = {"features": other.to_json(), "labels": {"max_new_tokens": 256}}
    (broken / QUALITY_FILE).write_bytes((predictor_dir / QUALITY_FILE).read_bytes())
    (broken / META_FILE).write_text(json.dumps(meta))
    assert Predictors.load(broken) is None


def test_models_with_other_weights_than_their_labels_are_left_out(tmp_path: Path) -> None:
    from shared.model_store import model_digest

    spec = FeatureSpec(num_buckets=16, tasks=("alpaca",), models=("smollm2-135m", "smollm2-small"))
    d = write_predictors(tmp_path, spec=spec)
    meta = json.loads((d / META_FILE).read_text())
    meta["labels"]["model_digests"] = {
        "smollm2-135m": model_digest("smollm2-135m"),
        "smollm2-small": "sha256:the-weights-before-a-rebuild",
    }
    (d / META_FILE).write_text(json.dumps(meta))
    pred = Predictors.load(d)
    assert pred is not None
    assert pred.knows("smollm2-135m") and not pred.knows("smollm2-small")
    assert set(pred.predict([1, 2, 3], None, ["smollm2-small", "smollm2-135m"])) == {"smollm2-135m"}


def test_training_falls_back_to_the_task_model_table_when_prompts_say_nothing() -> None:
    """Labels that depend only on (task, model), plus noise: cross-validation must not
    pick a booster that splits on the prompt's tokens or length."""
    tp = load_script("train_predictors")

    rng = np.random.default_rng(1)
    means = {("alpaca", "big"): 0.2, ("alpaca", "small"): 0.05}
    means |= {("aime", "big"): 0.1, ("aime", "small"): 0.01}
    rows, quality, length, models, tasks, keys = [], [], [], [], [], []
    for i in range(80):
        task = "alpaca" if i % 2 else "aime"
        ids = rng.integers(0, 49152, size=int(rng.integers(10, 200))).tolist()
        for model in SPEC.models:
            for hint in (task, None):
                rows.append(SPEC.rows(ids, hint, [model])[0])
                quality.append(means[(task, model)] + rng.normal(0, 0.03))
                length.append(50.0)
                models.append(model)
                tasks.append(task)
                keys.append(f"p{i}")
    dev = tp.Matrix(
        np.array(rows, dtype=np.float32),
        np.array(length, dtype=np.float32),
        np.array(quality, dtype=np.float32),
        np.array(models),
        np.array(tasks),
        np.array(keys),
    )
    folds = np.array([int(k[1:]) % 4 for k in keys])
    booster, info = tp.fit_booster(dev, folds, "quality", SPEC, seed=0)
    assert info["columns"] == "task_model"
    pred = booster.predict(xgb.DMatrix(dev.x[:4]))
    assert pred[0] == pytest.approx(0.1, abs=0.02)  # aime, big, with the hint
