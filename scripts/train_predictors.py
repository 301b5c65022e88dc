"""Train the output-length and quality predictors (xgboost) from the models' own labels.

Labels, per model of the family and per prompt of a mix of the shared prompt sets
(the data directory's prompts/: alpaca, hotpotqa, writingprompts, govreport, aime):

* quality: the geometric-mean token probability of the prompt set's reference answer
  under the model, exp(mean log p(ref_t | chat prompt, ref_<t)), teacher forced, over
  the first --max-ref-tokens reference tokens (the end-of-turn token excluded). It lies
  in [0, 1] and is comparable across models (one tokenizer, the same reference tokens).
* output length: the number of tokens of the model's own greedy answer (Baton's engine,
  bf16), at most --max-new-tokens (rows that hit the cap are marked: a censored label).

Prompts are what the gateway sees: the chat template applied to the prompt text as the
load generator builds it (`loadgen.workloads.load_prompt_set`). Alpaca prompts come from
indices 4500+ only (the students were distilled on 0-4499). A prompt must leave room
for the answer in --max-model-len: longer hotpotqa prompts are skipped, govreport
reports are cut (at a token boundary) to fit; the counts are printed and kept in
meta.json. Labels are cached under .cache/predictors/ (per model and setting), so a
rerun only trains.

Training: prompts are split by prompt (per task 20% test, the rest in 4 folds, seeded by
--split-seed; a prompt's rows for every model stay together). One booster per target with
the model as a one-hot feature: the models share the prompt's difficulty, so they learn
from each other's rows, and one call predicts every candidate. Dev rows appear twice,
with and without the task hint, so a request without x-baton-task is in distribution.
Objective, depth, leaf size and whether to use the bag of tokens are chosen by 4-fold
cross-validation (by prompt, early stopping), then the booster is refit on all dev rows;
test rows are never trained on. Writes models/predictors/{length,quality}.ubj and
meta.json (feature spec, label settings, test metrics vs baselines, predict() timing).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python scripts/train_predictors.py
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import xgboost as xgb
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loadgen.data import data_dir  # noqa: E402
from loadgen.workloads import load_prompt_set  # noqa: E402
from services.estimator.predictors import (  # noqa: E402
    LENGTH_FILE,
    META_FILE,
    QUALITY_FILE,
    FeatureSpec,
    Predictors,
)
from services.worker.engine.config import EngineConfig  # noqa: E402
from services.worker.engine.delta import apply_delta, read_delta  # noqa: E402
from services.worker.engine.engine import LLMEngine  # noqa: E402
from services.worker.engine.hf_twin import build_hf_twin  # noqa: E402
from services.worker.engine.loader import build_model, load_gguf  # noqa: E402
from services.worker.engine.model import CausalLM  # noqa: E402
from shared.model_store import Tokenizer, load_tokenizer, model_digest, resolve  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.scheduling.scheduler import SchedulerConfig  # noqa: E402

MODELS = ("smollm2-135m", "smollm2-medium", "smollm2-small")
TASKS = ("alpaca", "hotpotqa", "writingprompts", "govreport", "aime")
DEFAULT_COUNTS = "alpaca=90,hotpotqa=12,writingprompts=24,govreport=0,aime=16"
ALPACA_HELDOUT_START = 4500  # scripts/build_models.py distilled on alpaca[0:4500]
LONG_PROMPT_TOKENS = 512  # prompts longer than this are answered in their own batches
LONG_CONCURRENCY = 6  # ... of at most this many
TEST_SHARE = 0.2  # of each task's prompts, held out; the rest is cut into folds
NUM_FOLDS = 4  # cross-validation folds (by prompt) that choose the hyperparameters


@dataclass(frozen=True, slots=True)
class Item:
    """One prompt, tokenized as the gateway would, with its reference answer."""

    task: str
    key: str  # "<task>/<index in the prompt set>"
    prompt_ids: list[int]  # chat template applied
    ref_ids: list[int]  # first max_ref_tokens tokens of the reference answer
    is_truncated: bool  # the prompt text was cut to fit the context


@dataclass(slots=True)
class Label:
    model: str
    key: str
    task: str
    num_prompt_tokens: int  # tokens
    num_ref_tokens: int  # tokens scored
    mean_logprob: float  # nats per reference token
    quality: float  # exp(mean_logprob), in [0, 1]
    num_output_tokens: int  # tokens of the greedy answer
    hit_cap: bool  # stopped by max_new_tokens, not by EOS


# ---- prompts -------------------------------------------------------------------------


def parse_counts(spec: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for part in spec.split(","):
        name, _, n = part.partition("=")
        name = name.strip()
        if name not in TASKS:
            raise SystemExit(f"--counts: unknown task {name!r}; expected some of {TASKS}")
        try:
            counts[name] = int(n)
        except ValueError:
            raise SystemExit(f"--counts: {part!r} is not task=count") from None
    return counts


def fit_text(tok: Tokenizer, head: str, body: str, max_prompt_tokens: int) -> tuple[str, bool]:
    """head + body, the body cut at a token boundary so the chat prompt fits."""
    text = head + body
    if len(tok.apply_chat_template([{"role": "user", "content": text}])) <= max_prompt_tokens:
        return text, False
    body_ids = tok.encode(body)
    keep = max_prompt_tokens - len(tok.apply_chat_template([{"role": "user", "content": head}]))
    while keep > 0:
        text = head + tok.decode(body_ids[:keep])
        if len(tok.apply_chat_template([{"role": "user", "content": text}])) <= max_prompt_tokens:
            return text, True
        keep -= 16  # re-tokenizing the cut text can merge differently: back off a little
    raise ValueError("the prompt's head alone does not fit")


def select_prompts(
    tok: Tokenizer,
    data_dir: Path,
    counts: dict[str, int],
    seed: int,
    max_prompt_tokens: int,
    max_ref_tokens: int,
) -> tuple[list[Item], dict[str, dict[str, int]]]:
    """A seeded sample per task; returns the items and per-task counts of what was done."""
    items: list[Item] = []
    report: dict[str, dict[str, int]] = {}
    for task, want in counts.items():
        prompts = load_prompt_set(task, data_dir)
        start = ALPACA_HELDOUT_START if task == "alpaca" else 0
        order = list(range(start, len(prompts)))
        random.Random(f"{seed}/{task}").shuffle(order)
        stats = {"selected": 0, "skipped_too_long": 0, "truncated": 0, "skipped_no_reference": 0}
        for index in order:
            if stats["selected"] >= want:
                break
            p = prompts[index]
            text, cut = p.text, False
            if task == "govreport":  # "<instruction>\n\n<report>": cut the report
                head, _, body = p.text.partition("\n\n")
                text, cut = fit_text(tok, head + "\n\n", body, max_prompt_tokens)
            prompt_ids = tok.apply_chat_template([{"role": "user", "content": text}])
            if len(prompt_ids) > max_prompt_tokens:
                stats["skipped_too_long"] += 1
                continue
            ref_ids = tok.encode(p.reference.strip())[:max_ref_tokens]
            if not ref_ids:
                stats["skipped_no_reference"] += 1
                continue
            items.append(Item(task, f"{task}/{index}", prompt_ids, ref_ids, cut))
            stats["selected"] += 1
            stats["truncated"] += int(cut)
        report[task] = stats
    return items, report


# ---- labels ----------------------------------------------------------------------------


def token_batches(items: list[Item], batch_tokens: int) -> Iterator[list[Item]]:
    """Items sorted by length, grouped so that rows x longest row <= batch_tokens."""
    ordered = sorted(items, key=lambda it: len(it.prompt_ids) + len(it.ref_ids))
    batch: list[Item] = []
    for it in ordered:
        width = len(it.prompt_ids) + len(it.ref_ids)
        if batch and (len(batch) + 1) * width > batch_tokens:
            yield batch
            batch = []
        batch.append(it)
    if batch:
        yield batch


@torch.inference_mode()
def reference_logprobs(
    hf: Any, items: list[Item], batch_tokens: int, desc: str
) -> dict[str, tuple[float, int]]:
    """Mean log-probability (nats/token) of each item's reference tokens, teacher forced."""
    out: dict[str, tuple[float, int]] = {}
    bar = tqdm(
        total=sum(len(it.prompt_ids) + len(it.ref_ids) for it in items),
        desc=desc,
        unit="tok",
        leave=False,
    )
    for batch in token_batches(items, batch_tokens):
        seqs = [it.prompt_ids + it.ref_ids for it in batch]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        # Right padding: a real position never attends a pad (causal), positions start at 0.
        hidden = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for r, it in enumerate(batch):
            start = len(it.prompt_ids) - 1  # the position that predicts the first ref token
            h = hidden[r, start : start + len(it.ref_ids)]
            logp = torch.log_softmax(hf.lm_head(h).float(), dim=-1)
            gold = torch.tensor(it.ref_ids)
            lp = logp.gather(1, gold[:, None]).squeeze(1)
            out[it.key] = (float(lp.mean()), len(it.ref_ids))
        bar.update(sum(len(s) for s in seqs))
    bar.close()
    return out


def greedy_lengths(
    engine: LLMEngine, items: list[Item], max_new_tokens: int, desc: str
) -> dict[str, tuple[int, bool]]:
    """Output tokens of each item's greedy answer, and whether it hit the cap.

    Short prompts run first, many at a time, then long ones few at a time: a decode step
    gathers every running request's KV up to the longest context, so mixing a 1,800-token
    prompt into a batch of 60-token ones would make every step pay for it.
    """
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    short = [it for it in items if len(it.prompt_ids) <= LONG_PROMPT_TOKENS]
    long = [it for it in items if len(it.prompt_ids) > LONG_PROMPT_TOKENS]
    out: dict[str, tuple[int, bool]] = {}
    with tqdm(total=len(items), desc=desc, unit="answer", leave=False) as bar:
        for group, concurrency in (
            (short, engine.config.scheduler.max_num_seqs),
            (long, LONG_CONCURRENCY),
        ):
            queue = sorted(group, key=lambda it: len(it.prompt_ids))
            in_flight: dict[str, Item] = {}
            while queue or in_flight:
                while queue and len(in_flight) < concurrency:  # 1. keep the batch full
                    it = queue.pop(0)
                    in_flight[f"len-{it.key}"] = it
                    engine.add_request(f"len-{it.key}", it.prompt_ids, params)
                for o in engine.step():  # 2. one iteration; 3. record finished answers
                    if o.finished:
                        done = in_flight.pop(o.request_id)
                        out[done.key] = (o.num_output_tokens, o.finish_reason == "length")
                        bar.update(1)
    return out


def plain_model(name: str, dtype: torch.dtype) -> CausalLM:
    """The served weights in a plain CausalLM (the engine may repack its own for speed,
    which leaves no HF-convertible state): base GGUF, delta merged in fp32, cast."""
    source = resolve(name)
    if source.kind != "gguf" or source.path is None:
        raise SystemExit(f"{name}: only the GGUF-based SmolLM2 family is supported here")
    cfg, state = load_gguf(source.path, torch.float32)
    if source.delta is not None:
        delta = read_delta(source.delta)
        state = apply_delta(state, delta)
        cfg = dataclasses.replace(cfg, num_hidden_layers=len(delta.layers))
    return build_model(cfg, state, dtype, torch.device("cpu"))


def label_model(
    model: str, items: list[Item], args: argparse.Namespace, cache: Path
) -> list[Label]:
    """Labels of one model: cached rows are reused, only missing prompts are computed."""
    cached: dict[tuple[str, int], Label] = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            row = Label(**json.loads(line))
            cached[(row.key, row.num_prompt_tokens)] = row
    todo = [it for it in items if (it.key, len(it.prompt_ids)) not in cached]
    if todo:
        for row in compute_labels(model, todo, args):
            cached[(row.key, row.num_prompt_tokens)] = row
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text("".join(json.dumps(asdict(r)) + "\n" for r in cached.values()))
    return [cached[(it.key, len(it.prompt_ids))] for it in items]


def compute_labels(model: str, items: list[Item], args: argparse.Namespace) -> list[Label]:
    """Teacher-forced reference log-probabilities, then greedy answers, of one model."""
    longest = max(len(it.prompt_ids) for it in items) + args.max_new_tokens
    blocks = args.max_num_seqs * math.ceil(longest / 16) + 64
    engine = LLMEngine.create(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            threads=1,
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_model_len,
                num_kv_blocks=blocks,
                max_model_len=args.max_model_len,
            ),
        )
    )
    hf = build_hf_twin(plain_model(model, engine.config.torch_dtype), engine.config.torch_dtype)
    logprobs = reference_logprobs(hf, items, args.batch_tokens, f"{model}: reference logprobs")
    del hf
    lengths = greedy_lengths(engine, items, args.max_new_tokens, f"{model}: greedy answers")
    rows = []
    for it in items:
        mean_lp, n_ref = logprobs[it.key]
        n_out, capped = lengths[it.key]
        rows.append(
            Label(
                model,
                it.key,
                it.task,
                len(it.prompt_ids),
                n_ref,
                mean_lp,
                math.exp(mean_lp),
                n_out,
                capped,
            )
        )
    return rows


def cache_path(args: argparse.Namespace, model: str) -> Path:
    """One file per model and label setting; rows are keyed by prompt (and its length)."""
    sig = hashlib.sha256(
        json.dumps(
            [
                model,
                model_digest(model),  # a rebuilt model must not reuse its old labels
                args.dtype,
                args.max_new_tokens,
                args.max_ref_tokens,
                args.max_model_len,
            ]
        ).encode()
    ).hexdigest()[:12]
    return args.cache_dir / f"labels-{model}-{sig}.jsonl"


# ---- training ------------------------------------------------------------------------


def split_keys(items: list[Item], seed: int) -> dict[str, str]:
    """key -> "test" | "fold<i>", per task and by prompt (every fold holds every task)."""
    out: dict[str, str] = {}
    for task in TASKS:
        keys = sorted(it.key for it in items if it.task == task)
        random.Random(f"{seed}/split/{task}").shuffle(keys)
        n_test = round(TEST_SHARE * len(keys))
        for i, k in enumerate(keys):
            out[k] = "test" if i < n_test else f"fold{(i - n_test) % NUM_FOLDS}"
    return out


@dataclass
class Matrix:
    x: np.ndarray
    length: np.ndarray  # tokens
    quality: np.ndarray
    model: np.ndarray  # model name per row
    task: np.ndarray  # task per row
    key: np.ndarray  # prompt key per row


def matrix(spec: FeatureSpec, items: dict[str, Item], labels: list[Label], hint: bool) -> Matrix:
    xs = [
        spec.rows(items[lb.key].prompt_ids, lb.task if hint else None, [lb.model])[0]
        for lb in labels
    ]
    return Matrix(
        np.array(xs, dtype=np.float32),
        np.array([lb.num_output_tokens for lb in labels], dtype=np.float32),
        np.array([lb.quality for lb in labels], dtype=np.float32),
        np.array([lb.model for lb in labels]),
        np.array([lb.task for lb in labels]),
        np.array([lb.key for lb in labels]),
    )


def stack(a: Matrix, b: Matrix) -> Matrix:
    return Matrix(*(np.concatenate([getattr(a, f), getattr(b, f)]) for f in Matrix.__annotations__))


# Which feature columns a candidate booster may split on (the others are zeroed, so
# it never splits on them; the saved booster still reads the full row).
COLUMN_SETS = ("all", "no_bag", "task_model")


def restrict(x: np.ndarray, spec: FeatureSpec, columns: str) -> np.ndarray:
    """x with the columns outside `columns` zeroed: "no_bag" drops the bag of tokens,
    "task_model" also the prompt length (the booster is then a table of means per
    (task hint, model), with the model's mean for rows without a hint)."""
    if columns == "all":
        return x
    out = x.copy()
    out[:, 1 : 1 + spec.num_buckets] = 0.0
    if columns == "task_model":
        out[:, 0] = 0.0
    return out


def fit_booster(
    dev: Matrix, folds: np.ndarray, target: str, spec: FeatureSpec, seed: int
) -> tuple[xgb.Booster, dict[str, Any]]:
    """Hyperparameters chosen by cross-validation over the dev prompts (mean held-out MAE
    over the folds, one early-stopped number of rounds for all folds); refit on all dev
    rows with that number of rounds. Test rows are never seen here.

    Also chosen: which columns to use (COLUMN_SETS). With ~100 dev prompts and noisy
    labels the bag of tokens can overfit; without it the booster has the prompt length,
    the task hint and the model; with only the hint and the model it is the table of
    per-(task, model) means, the strongest baseline, so the booster is never chosen
    worse than that baseline in cross-validation. The saved booster reads the full row
    either way.
    """
    objectives = (
        ["reg:squarederror", "reg:absoluteerror"] if target == "length" else ["reg:squarederror"]
    )
    # A leaf of min_child_weight 4 can hold one prompt (its rows with and without the
    # hint, of two models); 16 needs several.
    grid = [(o, d, w) for o in objectives for d in (2, 3, 4) for w in (4, 16)]
    y = getattr(dev, target)
    splits = [(np.flatnonzero(folds != f), np.flatnonzero(folds == f)) for f in np.unique(folds)]
    best: tuple[float, dict[str, Any], int, str] | None = None
    for columns in COLUMN_SETS:
        x = restrict(dev.x, spec, columns)
        for objective, depth, min_child_weight in grid:
            params = {
                "objective": objective,
                "eval_metric": "mae",
                "max_depth": depth,
                "eta": 0.05,
                "subsample": 0.8,
                "min_child_weight": min_child_weight,
                "nthread": 1,
                "seed": seed,
            }
            # One number of rounds for all folds, stopped on the folds' mean held-out
            # MAE (xgb.cv): stopping each fold on its own held-out rows made the score
            # optimistic, most for the flexible column sets, and picked them wrongly.
            curve = xgb.cv(
                params,
                xgb.DMatrix(x, label=y),
                num_boost_round=2000,
                folds=splits,
                early_stopping_rounds=50,
                verbose_eval=False,
                as_pandas=False,
            )
            # per round, cut at the best one (a dict of lists without pandas)
            held_out = cast(list[float], curve["test-mae-mean"])
            score = float(held_out[-1])
            if best is None or score < best[0]:
                best = (score, params, len(held_out), columns)
    assert best is not None
    cv_mae, params, num_rounds, columns = best
    x = restrict(dev.x, spec, columns)
    final = xgb.train(params, xgb.DMatrix(x, label=y), num_rounds)
    info = {**params, "rounds": num_rounds, "columns": columns, "cv_mae": round(cv_mae, 5)}
    return final, info


def rank(a: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (so a constant predictor has no rank correlation)."""
    ranks = np.empty(len(a))
    ranks[np.argsort(a, kind="stable")] = np.arange(len(a))
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def pairwise_order(pred: np.ndarray, m: Matrix) -> float:
    """Share of (prompt, model pair) where the predicted quality order is the true one
    (a tie in the prediction counts as wrong)."""
    hits = total = 0
    for key in np.unique(m.key):
        idx = np.flatnonzero(m.key == key)
        for i in range(len(idx)):
            for j in range(i + 1, len(idx)):
                a, b = idx[i], idx[j]
                if m.quality[a] == m.quality[b]:
                    continue
                total += 1
                hits += (pred[a] - pred[b]) * (m.quality[a] - m.quality[b]) > 0
    return hits / total if total else float("nan")


def scores(pred: np.ndarray, m: Matrix, target: str) -> dict[str, float]:
    y = getattr(m, target)
    out = {
        "mae": float(np.abs(pred - y).mean()),
        "pearson": pearson(pred, y),
        "spearman": pearson(rank(pred), rank(y)),
    }
    # Within one model: does it tell this model's easy prompts from its hard ones?
    # (nan for predictors constant within a model)
    within = [pearson(pred[m.model == name], y[m.model == name]) for name in np.unique(m.model)]
    out["pearson_within_model"] = (
        float(np.mean(within)) if not any(math.isnan(w) for w in within) else math.nan
    )
    if target == "quality":
        out["pairwise_order"] = pairwise_order(pred, m)
    return {k: round(v, 4) for k, v in out.items()}


def baselines(train: Matrix, test: Matrix, target: str) -> dict[str, np.ndarray]:
    """Constant predictors fitted on the training labels."""
    y = getattr(train, target)
    per_model = {n: y[train.model == n].mean() for n in np.unique(train.model)}
    per_task_model = {
        (t, n): y[(train.task == t) & (train.model == n)].mean()
        for t in np.unique(train.task)
        for n in np.unique(train.model)
    }
    return {
        "mean": np.full(len(test.model), y.mean()),
        "model mean": np.array([per_model[n] for n in test.model]),
        "task x model mean": np.array(
            [per_task_model[(t, n)] for t, n in zip(test.task, test.model, strict=True)]
        ),
    }


def evaluate(
    boosters: dict[str, xgb.Booster], train: Matrix, test_hint: Matrix, test_blind: Matrix
) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for target, booster in boosters.items():
        rows = {
            name: scores(pred, test_hint, target)
            for name, pred in baselines(train, test_hint, target).items()
        }
        rows["xgboost, task hint"] = scores(booster.inplace_predict(test_hint.x), test_hint, target)
        rows["xgboost, no hint"] = scores(booster.inplace_predict(test_blind.x), test_blind, target)
        out[target] = rows
    return out


def markdown(metrics: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = []
    for target, rows in metrics.items():
        cols = list(next(iter(rows.values())))
        lines += [
            f"\n{target} (test rows)\n",
            "| predictor | " + " | ".join(cols) + " |",
            "|---" * (len(cols) + 1) + "|",
        ]
        lines += [
            f"| {name} | " + " | ".join(f"{v:.4g}" for v in r.values()) + " |"
            for name, r in rows.items()
        ]
    return "\n".join(lines)


def label_summary(labels: list[Label]) -> dict[str, dict[str, dict[str, float]]]:
    """Per model and task: mean quality, mean length, share of answers at the cap."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model in sorted({lb.model for lb in labels}):
        out[model] = {}
        for task in [*TASKS, "all"]:
            rows = [lb for lb in labels if lb.model == model and task in (lb.task, "all")]
            if rows:
                out[model][task] = {
                    "quality": round(float(np.mean([r.quality for r in rows])), 4),
                    "output_tokens": round(float(np.mean([r.num_output_tokens for r in rows])), 1),
                    "at_cap": round(float(np.mean([r.hit_cap for r in rows])), 3),
                    "rows": len(rows),
                }
    return out


def time_predict(out: Path, items: list[Item], models: list[str]) -> dict[str, float]:
    """µs per Predictors.predict call (every model at once), as the estimator loads them."""
    pred = Predictors.load(out)
    assert pred is not None, f"{out} did not load"
    calls: list[float] = []
    for _ in range(5):
        for it in items:
            t = time.perf_counter()
            pred.predict(it.prompt_ids, it.task, models)
            calls.append((time.perf_counter() - t) * 1e6)
    calls.sort()
    return {
        "p50_us": round(calls[len(calls) // 2], 1),
        "p99_us": round(calls[int(len(calls) * 0.99)], 1),
        "calls": len(calls),
        "load_average_1m": os.getloadavg()[0],
    }


# ---- main ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=list(MODELS), help="models to label")
    p.add_argument(
        "--counts",
        default=DEFAULT_COUNTS,
        help=f"prompts per task, task=count,... (default {DEFAULT_COUNTS})",
    )
    p.add_argument(
        "--data-dir", type=Path, default=data_dir(), help="the data directory (`just data`)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "models" / "predictors",
        help="where the boosters and meta.json go",
    )
    p.add_argument(
        "--cache-dir", type=Path, default=REPO / ".cache" / "predictors", help="label cache"
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="greedy answer cap, tokens")
    p.add_argument(
        "--max-ref-tokens", type=int, default=128, help="reference tokens scored per prompt"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="context of the served models, tokens (prompt + answer must fit)",
    )
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch for the answers")
    p.add_argument(
        "--batch-tokens", type=int, default=4096, help="padded tokens per teacher-forced forward"
    )
    p.add_argument("--dtype", default="bfloat16", help="engine dtype (as served)")
    p.add_argument("--buckets", type=int, default=256, help="hashed bag-of-tokens buckets")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and xgboost seed")
    p.add_argument(
        "--split-seed", type=int, default=0, help="test/fold split seed (labels stay cached)"
    )
    p.add_argument("--labels-only", action="store_true", help="compute the labels, do not train")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok = load_tokenizer(args.models[0])
    max_prompt = args.max_model_len - args.max_new_tokens
    items, selection = select_prompts(
        tok, args.data_dir, parse_counts(args.counts), args.seed, max_prompt, args.max_ref_tokens
    )
    print(f"{len(items)} prompts (prompt <= {max_prompt} tokens): {json.dumps(selection)}")
    labels: list[Label] = []
    for model in tqdm(args.models, desc="models"):
        labels += label_model(model, items, args, cache_path(args, model))
    label_s = time.perf_counter() - t0
    summary = label_summary(labels)
    for model, tasks in summary.items():
        print(model, json.dumps(tasks["all"]))
    if args.labels_only:
        return

    spec = FeatureSpec(args.buckets, tuple(TASKS), tuple(args.models))
    by_key = {it.key: it for it in items}
    split = split_keys(items, args.split_seed)
    dev_rows = [lb for lb in labels if split[lb.key] != "test"]
    test_rows = [lb for lb in labels if split[lb.key] == "test"]
    # Dev rows twice, with and without the task hint; the fold goes with the prompt.
    dev = stack(
        matrix(spec, by_key, dev_rows, hint=True), matrix(spec, by_key, dev_rows, hint=False)
    )
    folds = np.array([split[k] for k in dev.key])
    boosters: dict[str, xgb.Booster] = {}
    training: dict[str, Any] = {}
    for target in tqdm(("length", "quality"), desc="cross-validated fits", leave=False):
        boosters[target], training[target] = fit_booster(dev, folds, target, spec, args.seed)
    metrics = evaluate(
        boosters,
        matrix(spec, by_key, dev_rows, hint=True),
        matrix(spec, by_key, test_rows, hint=True),
        matrix(spec, by_key, test_rows, hint=False),
    )
    print(markdown(metrics))

    args.out.mkdir(parents=True, exist_ok=True)
    boosters["length"].save_model(str(args.out / LENGTH_FILE))
    boosters["quality"].save_model(str(args.out / QUALITY_FILE))
    meta = {
        "features": spec.to_json(),
        "labels": {
            "quality": "exp(mean log p(reference token)) = geometric-mean token probability "
            "of the prompt set's reference answer (first max_ref_tokens tokens, teacher "
            "forced after the chat prompt), in [0, 1]",
            "length": "output tokens of the model's greedy answer (EOS counted), capped",
            "models": list(args.models),
            # The weights the labels came from: the estimator ignores a model whose
            # weights differ (its predictions would describe another model).
            "model_digests": {m: model_digest(m) for m in args.models},
            "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens,
            "max_ref_tokens": args.max_ref_tokens,
            "max_model_len": args.max_model_len,
            "alpaca_indices_from": ALPACA_HELDOUT_START,
            "selection": selection,
            "summary": summary,
        },
        "split": {
            "dev_prompts": len({lb.key for lb in dev_rows}),
            "folds": NUM_FOLDS,
            "test_prompts": len({lb.key for lb in test_rows}),
            "split_seed": args.split_seed,
        },
        "training": training,
        "test_metrics": metrics,
        "command": "python scripts/train_predictors.py " + " ".join(argv or sys.argv[1:]),
        "label_seconds_this_run": round(label_s, 1),  # ~0 when every label was cached
        "xgboost": xgb.__version__,
    }
    (args.out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    speed = time_predict(args.out, items, list(args.models))
    meta["predict_speed"] = speed
    (args.out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"predict(): {json.dumps(speed)} for {len(args.models)} models per call")
    sizes = {f: (args.out / f).stat().st_size for f in (LENGTH_FILE, QUALITY_FILE, META_FILE)}
    print(f"\nwrote {args.out}: {sizes} bytes; labels took {label_s:.0f} s")


if __name__ == "__main__":
    main()
