"""Per-(prompt, model) predictions of output length and quality, from cheap prompt features.

    prompt token ids (+ task hint) -> features (FeatureSpec.rows: one row per candidate model)
        -> length booster  -> output tokens of the model's own greedy answer (tokens)
        -> quality booster -> geometric-mean token probability of the prompt set's
                              reference answer under the model (in [0, 1])

Both boosters are xgboost regressors trained by `scripts/train_predictors.py` on labels the
project computes from its own models (see docs/predictors.md); the model is a feature (one
hot), so one call predicts every candidate of a request. At load, each booster's trees are
copied into flat arrays (`TreeEnsemble`) and evaluated with numpy: xgboost's
inplace_predict spends ~140 µs of fixed cost per call on three rows, the numpy walk of
every tree at once ~20-60 µs, with the same float32 thresholds (tested equal).

Feature row (FeatureSpec, version 1), float32:
    [0]                   number of prompt tokens (after the chat template)
    [1, 1 + B)            hashed bag of token ids: share of the prompt's tokens per bucket
                          (multiplicative hash of the id, B = num_buckets, a power of two)
    [1 + B, 1 + B + T)    task hint one hot (x-baton-task); all zero when none or unknown
    [1 + B + T, ... + M)  model one hot

The same code builds the features for training and for serving, so they cannot drift.
Loading reads the directory once; `Predictors.load` returns None (and the estimator keeps
the cluster file's quality table and the default length) when the files are missing or do
not load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.logging import get_logger

log = get_logger(component="predictors")

FEATURE_VERSION = 1
META_FILE = "meta.json"
LENGTH_FILE = "length.ubj"
QUALITY_FILE = "quality.ubj"
_HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash (golden ratio * 2^32)


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """Layout of a feature row; travels in meta.json with the boosters it was trained for."""

    num_buckets: int  # hashed bag-of-tokens buckets, a power of two
    tasks: tuple[str, ...]  # task hints with a one-hot column, in column order
    models: tuple[str, ...]  # models with a one-hot column, in column order
    version: int = FEATURE_VERSION

    def __post_init__(self) -> None:
        b = self.num_buckets
        if b < 2 or b & (b - 1):
            raise ValueError(f"num_buckets must be a power of two >= 2, got {b}")
        if self.version != FEATURE_VERSION:
            raise ValueError(f"feature version {self.version}, this code builds {FEATURE_VERSION}")

    @property
    def num_features(self) -> int:
        return 1 + self.num_buckets + len(self.tasks) + len(self.models)

    @property
    def model_offset(self) -> int:
        return 1 + self.num_buckets + len(self.tasks)

    def buckets(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Bucket of each token id (uint32 multiplicative hash, top log2(B) bits)."""
        ids = np.asarray(token_ids, dtype=np.uint64)
        shift = np.uint64(32 - (self.num_buckets.bit_length() - 1))
        return ((ids * np.uint64(_HASH_MULTIPLIER)) & np.uint64(0xFFFFFFFF)) >> shift

    def prompt_row(self, token_ids: Sequence[int] | np.ndarray, task: str | None) -> np.ndarray:
        """The model-independent part of a row (model one hot left zero), float32."""
        row = np.zeros(self.num_features, dtype=np.float32)
        n = len(token_ids)
        row[0] = n
        if n:
            counts = np.bincount(self.buckets(token_ids), minlength=self.num_buckets)
            row[1 : 1 + self.num_buckets] = counts / n
        if task is not None and task in self.tasks:
            row[1 + self.num_buckets + self.tasks.index(task)] = 1.0
        return row

    def rows(
        self, token_ids: Sequence[int] | np.ndarray, task: str | None, models: Sequence[str]
    ) -> np.ndarray:
        """One row per model (each must be in `self.models`): [len(models), num_features]."""
        base = self.prompt_row(token_ids, task)
        out = np.tile(base, (len(models), 1))
        for i, m in enumerate(models):
            out[i, self.model_offset + self.models.index(m)] = 1.0
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "num_buckets": self.num_buckets,
            "tasks": list(self.tasks),
            "models": list(self.models),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FeatureSpec:
        return cls(
            num_buckets=int(raw["num_buckets"]),
            tasks=tuple(raw["tasks"]),
            models=tuple(raw["models"]),
            version=int(raw["version"]),
        )


class TreeEnsemble:
    """An xgboost tree regressor (identity link) as flat arrays, evaluated with numpy.

    All rows walk all trees at once, one level per step; a leaf points at itself, so
    after `depth` steps every walk rests on a leaf. Splits test `x < threshold` in
    float32 as xgboost does; our rows have no missing values, so default directions
    never apply.
    """

    LINEAR_OBJECTIVES = ("reg:squarederror", "reg:absoluteerror", "reg:pseudohubererror")

    def __init__(self, booster: Any) -> None:
        raw = json.loads(booster.save_raw("json"))
        learner = raw["learner"]
        objective = learner["objective"]["name"]
        if objective not in self.LINEAR_OBJECTIVES:
            raise ValueError(f"objective {objective!r} has a link function; not supported")
        if learner["gradient_booster"]["name"] != "gbtree":
            raise ValueError("only gbtree boosters are supported")
        if learner["learner_model_param"]["num_target"] != "1":
            raise ValueError("only single-target boosters are supported")
        self.base_score = float(learner["learner_model_param"]["base_score"].strip("[]"))
        left, right, feature, value, roots = [], [], [], [], []
        offset, depth = 0, 0
        for tree in learner["gradient_booster"]["model"]["trees"]:
            if any(tree["split_type"]):
                raise ValueError("categorical splits are not supported")
            lc, rc = np.array(tree["left_children"]), np.array(tree["right_children"])
            n = len(lc)
            is_leaf = lc == -1
            own = np.arange(n)
            left.append(np.where(is_leaf, own, lc) + offset)
            right.append(np.where(is_leaf, own, rc) + offset)
            feature.append(np.where(is_leaf, 0, np.array(tree["split_indices"])))
            # A split's condition is its threshold; a leaf's is its value.
            value.append(np.array(tree["split_conditions"], dtype=np.float32))
            roots.append(offset)
            level = np.zeros(n, dtype=np.int64)
            stack = [0]
            while stack:  # depth of every node, from the root
                i = stack.pop()
                if not is_leaf[i]:
                    level[lc[i]] = level[rc[i]] = level[i] + 1
                    stack += [int(lc[i]), int(rc[i])]
            depth = max(depth, int(level.max()))
            offset += n
        self.left, self.right = np.concatenate(left), np.concatenate(right)
        self.feature = np.concatenate(feature)
        self.value = np.concatenate(value)
        self.roots = np.array(roots, dtype=np.int64)
        self.depth = depth
        self.num_features = int(learner["learner_model_param"]["num_feature"])

    def predict(self, x: np.ndarray) -> np.ndarray:
        """One prediction per row of x ([rows, num_features], float32)."""
        rows = np.arange(len(x))[:, None]
        node = np.broadcast_to(self.roots, (len(x), len(self.roots)))
        for _ in range(self.depth):
            go_left = x[rows, self.feature[node]] < self.value[node]
            node = np.where(go_left, self.left[node], self.right[node])
        return self.base_score + self.value[node].sum(axis=1, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What one model is expected to do with one prompt."""

    output_tokens: int  # tokens of its greedy answer, in [1, max_output_tokens]
    quality: float  # geometric-mean token probability of a reference answer, in [0, 1]


def stale_models(digests: dict[str, str] | None, models: Sequence[str]) -> list[str]:
    """Models whose weights differ from the ones their labels came from (meta.json's
    `model_digests`; files written before digests were recorded are trusted)."""
    if not digests:
        return []
    from shared.model_store import model_digest

    out = []
    for m in models:
        try:
            now = model_digest(m)
        except (OSError, ValueError, KeyError):  # the model cannot be resolved here
            continue
        if m in digests and digests[m] != now:
            out.append(m)
    return out


class Predictors:
    """The two boosters and their feature spec, loaded once; `predict` is pure."""

    def __init__(
        self,
        spec: FeatureSpec,
        length: TreeEnsemble,
        quality: TreeEnsemble,
        max_output_tokens: int,
        ignore: Sequence[str] = (),
    ) -> None:
        self.spec = spec
        self._length = length
        self._quality = quality
        self.max_output_tokens = max_output_tokens  # the labels' generation cap, tokens
        # Models predicted for; `ignore`d ones (stale labels) fall back like unknown ones.
        self._known = frozenset(spec.models) - frozenset(ignore)

    @classmethod
    def load(cls, directory: str | Path) -> Predictors | None:
        """Read meta.json and the boosters; None (logged) when absent or unreadable."""
        path = Path(directory)
        files = [path / META_FILE, path / LENGTH_FILE, path / QUALITY_FILE]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            log.warning("predictors_missing", directory=str(path), missing=missing)
            return None
        try:
            import xgboost as xgb

            meta = json.loads(files[0].read_text())
            spec = FeatureSpec.from_json(meta["features"])
            ensembles = []
            for f in files[1:]:
                booster = xgb.Booster()
                booster.load_model(str(f))
                trees = TreeEnsemble(booster)
                if trees.num_features != spec.num_features:
                    raise ValueError(
                        f"{f.name} expects {trees.num_features} features, "
                        f"meta.json describes {spec.num_features}"
                    )
                ensembles.append(trees)
            cap = int(meta["labels"]["max_new_tokens"])
            stale = stale_models(meta["labels"].get("model_digests"), spec.models)
        except Exception as exc:  # OSError, ValueError, KeyError, xgboost's XGBoostError
            log.error("predictors_unreadable", directory=str(path), error=repr(exc))
            return None
        if stale:
            log.warning(
                "predictors_stale",
                directory=str(path),
                models=stale,
                hint="labels came from other weights: rerun `just predictors`",
            )
        log.info("predictors_loaded", directory=str(path), models=list(spec.models))
        return cls(spec, ensembles[0], ensembles[1], cap, ignore=stale)

    def knows(self, model: str) -> bool:
        return model in self._known

    def predict(
        self, token_ids: Sequence[int] | np.ndarray, task: str | None, models: Sequence[str]
    ) -> dict[str, Prediction]:
        """Predictions for the models this predictor knows (others are left out)."""
        known = [m for m in models if m in self._known]
        if not known:
            return {}
        x = self.spec.rows(token_ids, task, known)
        lengths = self._length.predict(x)
        qualities = self._quality.predict(x)
        out: dict[str, Prediction] = {}
        for m, n, q in zip(known, lengths, qualities, strict=True):
            n_tokens = round(float(n)) if math.isfinite(n) else self.max_output_tokens
            out[m] = Prediction(
                output_tokens=min(self.max_output_tokens, max(1, n_tokens)),
                quality=min(1.0, max(0.0, float(q))),
            )
        return out
