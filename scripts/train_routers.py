"""Train the token-level routers (R2R, CITER, Co-LLM) and calibrate R-Stitch from the family's own labels.

Data: chat-formatted alpaca prompts with their reference answers, teacher forced
through both models as Baton's engine serves them (same loader, same model code,
same dtype; hidden state after the final norm, fp32 logits from the LM head).
Training prompts come from [0, 4000), validation from [4000, 4500); the held-out
range [4500, 5000) is never read. At every answer position:

  * features = the small model's hidden state, its argmax token, its top-k
    log-probabilities (what a RouteBatch row holds when it samples greedily);
  * diverges = small argmax != large argmax;
  * log-probabilities of the reference token under both models (Co-LLM).

Then it fits the three routers, calibrates each threshold on validation, checks
that teacher-forced features equal what the engine's route hook sees while
decoding, and writes models/routers/{r2r,citer,co-llm}.{safetensors,json} and
models/routers/r-stitch.json. Features are cached under .cache/routers/.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_routers.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.router_training import (  # noqa: E402
    Features,
    FitConfig,
    fit_router,
    roc_auc,
    serving_probabilities,
    threshold_for_recall,
    threshold_for_share,
    youden_threshold,
)
from loadgen.data import data_dir  # noqa: E402
from services.worker.engine.attention import AttentionPlan  # noqa: E402
from services.worker.engine.config import EngineConfig  # noqa: E402
from services.worker.engine.engine import LLMEngine  # noqa: E402
from services.worker.engine.outputs import StepOutputs  # noqa: E402
from services.worker.routing.policies.r_stitch import normalized_entropy  # noqa: E402
from services.worker.routing.policies.routers import (  # noqa: E402
    RouterNet,
    RouterSpec,
    save_router,
    topk_logprobs,
)
from shared.model_store import load_tokenizer, model_digest  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.scheduling.scheduler import SchedulerConfig  # noqa: E402

DEFAULT_PROMPTS = data_dir() / "prompts" / "alpaca_5000_random.json"
TRAIN_RANGE = (0, 4000)
VAL_RANGE = (4000, 4500)
PAPER = {"r2r": 0.95, "citer": 0.98, "co-llm": 0.15, "r-stitch": 0.03}  # R2R: min recall


@dataclass
class Sequence:
    ids: list[int]
    start: int  # first answer token; positions start-1 .. len-2 predict the answer


@dataclass
class ModelView:
    """Per answer position, what one model says (teacher forced)."""

    argmax: torch.Tensor  # [n] int64
    logp_ref: torch.Tensor  # [n] fp32 log-prob of the reference token
    entropy: torch.Tensor  # [n] fp32 normalized entropy (R-Stitch)
    hidden: torch.Tensor | None = None  # [n, hidden] model dtype (small model only)
    topk: torch.Tensor | None = None  # [n, k] fp32 (small model only)


def sequences(prompts: list[dict[str, str]], lo: int, hi: int, max_answer: int) -> list[Sequence]:
    """Chat prompt + reference answer + <|im_end|>, the answer capped at max_answer tokens."""
    tok = load_tokenizer("smollm2-135m")
    out = []
    for ex in prompts[lo:hi]:
        user = ex["instruction"] + ("\n\n" + ex["input"] if ex.get("input") else "")
        prompt = tok.apply_chat_template([{"role": "user", "content": user}])
        answer = tok.encode(ex["output"] + "<|im_end|>")[:max_answer]
        out.append(Sequence(prompt + answer, len(prompt)))
    return out


def prefill_hidden(engine: LLMEngine, batch: list[Sequence]) -> list[torch.Tensor]:
    """Hidden states of every position, one prefill of all sequences (the engine's model code)."""
    model, bs = engine.model, engine.config.scheduler.block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    plan = AttentionPlan(slot_mapping=torch.empty(0))
    next_block = 0
    for s in batch:
        n = len(s.ids)
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        plan.query_starts.append(len(ids))
        plan.query_lens.append(n)
        plan.context_lens.append(n)
        plan.block_tables.append(torch.tensor(blocks))
        ids.extend(s.ids)
        positions.extend(range(n))
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(n))
    assert next_block <= engine.config.scheduler.num_kv_blocks, "batch exceeds the KV cache"
    plan.slot_mapping = torch.tensor(slots)
    hidden = model(torch.tensor(ids), torch.tensor(positions), engine.runner.kv_caches, plan)
    return list(hidden.split([len(s.ids) for s in batch]))


def token_batches(seqs: list[Sequence], max_tokens: int) -> list[list[Sequence]]:
    """Consecutive groups of at most max_tokens tokens (one sequence if it alone is longer)."""
    groups: list[list[Sequence]] = [[]]
    used = 0
    for s in seqs:
        if groups[-1] and used + len(s.ids) > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += len(s.ids)
    return [g for g in groups if g]


@torch.inference_mode()
def model_view(
    engine: LLMEngine, seqs: list[Sequence], keep_features: bool, topk: int, desc: str
) -> ModelView:
    """Teacher-forced answer positions of all seqs through one engine's model."""
    argmax, logp, ent, hid, top = [], [], [], [], []
    batches = token_batches(seqs, 1024)
    for batch in tqdm(batches, desc=desc, leave=False):
        for s, h in zip(batch, prefill_hidden(engine, batch), strict=True):
            h = h[s.start - 1 : len(s.ids) - 1]
            logits = engine.model.compute_logits(h)  # fp32, as the runner computes them
            ref = torch.tensor(s.ids[s.start :])
            lsm = torch.log_softmax(logits, dim=-1)
            argmax.append(logits.argmax(-1))
            logp.append(lsm.gather(1, ref.view(-1, 1)).squeeze(1))
            ent.append(normalized_entropy(logits))
            if keep_features:
                hid.append(h.clone())
                top.append(topk_logprobs(logits, topk))
    return ModelView(
        torch.cat(argmax),
        torch.cat(logp),
        torch.cat(ent),
        torch.cat(hid) if keep_features else None,
        torch.cat(top) if keep_features else None,
    )


def weight_dtype(args: argparse.Namespace) -> str:
    """How the small model's engine holds its weights (resolved: the hidden states the
    routers read depend on it; recorded beside the dtype and in the feature cache key)."""
    return EngineConfig(model=args.small, dtype=args.dtype).resolved_weight_dtype


def create_engine(model: str, dtype: str) -> LLMEngine:
    return LLMEngine.create(
        EngineConfig(
            model=model,
            dtype=dtype,
            scheduler=SchedulerConfig(max_num_seqs=16, num_kv_blocks=160, max_model_len=2048),
        )
    )


CACHE_BLOCK = 100  # prompts per cache file: a larger --train reuses the blocks it has


def cached_views(
    args: argparse.Namespace, split: str, seqs: list[Sequence]
) -> tuple[ModelView, ModelView]:
    """(small, large) views of one split, from .cache/routers/ where the inputs match
    (model files, dtype, top-k and the token ids of each block of prompts)."""
    blocks = [seqs[b : b + CACHE_BLOCK] for b in range(0, len(seqs), CACHE_BLOCK)]
    paths = []
    for b, block in enumerate(blocks):
        key = json.dumps(
            [
                # The weights' digests, not file times: a fresh clone reuses a cache.
                [args.small, model_digest(args.small)],
                [args.large, model_digest(args.large)],
                args.dtype,
                weight_dtype(args),
                args.topk,
                [s.ids for s in block],
            ]
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        paths.append(args.cache_dir / f"features-{split}-{b * CACHE_BLOCK}-{digest}.pt")
    missing = [b for b, path in enumerate(paths) if args.refresh or not path.is_file()]
    if missing:
        computed: dict[int, list[ModelView]] = {b: [] for b in missing}
        for model, keep in ((args.small, True), (args.large, False)):
            engine = create_engine(model, args.dtype)
            for b in tqdm(missing, desc=f"{split} {model} (blocks of {CACHE_BLOCK})"):
                computed[b].append(model_view(engine, blocks[b], keep, args.topk, f"block {b}"))
            del engine
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        for b, views in computed.items():
            raw = [{k: v for k, v in vars(view).items() if v is not None} for view in views]
            torch.save(raw, paths[b])
    # Always read back: plain tensors (not inference-mode ones), the same on a cache hit.
    loaded = [[ModelView(**raw) for raw in torch.load(path, weights_only=True)] for path in paths]
    return concat_views([pair[0] for pair in loaded]), concat_views([pair[1] for pair in loaded])


def concat_views(views: list[ModelView]) -> ModelView:
    """One view of several blocks, in order."""

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(v, name) for v in views]
        return None if parts[0] is None else torch.cat(parts)

    argmax, logp_ref, entropy = cat("argmax"), cat("logp_ref"), cat("entropy")
    assert argmax is not None and logp_ref is not None and entropy is not None
    return ModelView(argmax, logp_ref, entropy, cat("hidden"), cat("topk"))


def features(small: ModelView, large: ModelView) -> Features:
    assert small.hidden is not None and small.topk is not None
    return Features(
        small.hidden,
        small.argmax,
        small.topk,
        small.argmax != large.argmax,
        small.logp_ref,
        large.logp_ref,
    )


def stitch_share(
    seqs: list[Sequence], small: ModelView, large: ModelView, tau: float
) -> tuple[float, int]:
    """Share of answer positions the large model writes under R-Stitch (teacher forced),
    and the number of hand-offs. Position t is written by the large model if it holds
    the pen, or if the small model holds it and its entropy at t exceeds tau; the large
    model hands back after a position where its own entropy is <= tau."""
    large_tokens, handoffs, offset = 0, 0, 0
    hs, hl = small.entropy.tolist(), large.entropy.tolist()
    for s in seqs:
        on_large = False
        for t in range(offset, offset + len(s.ids) - s.start):
            if not on_large and hs[t] > tau:
                on_large, handoffs = True, handoffs + 1
            if on_large:
                large_tokens += 1
                if hl[t] <= tau:
                    on_large, handoffs = False, handoffs + 1
        offset += len(s.ids) - s.start
    return large_tokens / max(offset, 1), handoffs


def calibrate_stitch(
    seqs: list[Sequence], small: ModelView, large: ModelView, target_share: float
) -> float:
    """tau whose simulated large-model share is closest to target_share (bisection:
    the share falls as tau rises)."""
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if stitch_share(seqs, small, large, mid)[0] > target_share:
            lo = mid
        else:
            hi = mid
    return hi


def routing_metrics(route: torch.Tensor, f: Features) -> dict[str, float]:
    """What routing `route` (bool per row) does on validation, teacher forced."""
    div = f.diverges
    n = len(div)
    kept_wrong = int((~route & div).sum())
    return {
        "routed_fraction": float(route.float().mean()),
        "recall": float((route & div).sum()) / max(int(div.sum()), 1),
        "precision": float((route & div).sum()) / max(int(route.sum()), 1),
        # The answer token then equals the large model's argmax unless a divergent token stayed.
        "agreement_after_routing": 1.0 - kept_wrong / n,
        # A random router with the same share, for comparison.
        "agreement_random_same_share": 1.0
        - float(div.float().mean()) * (1.0 - float(route.float().mean())),
    }


SHARES = (0.2, 0.4, 0.6, 0.8)  # routed shares of the operating-point table


def operating_points(score: torch.Tensor, f: Features, sign: float) -> list[dict[str, float]]:
    """Routing the rows with the highest `score` at each share in SHARES; `threshold` is
    in the router's own scale (sign -1: the router routes below it, as CITER does)."""
    points = []
    for share in SHARES:
        t = threshold_for_share(score, share, route_below=False)
        points.append({"threshold": sign * t, **routing_metrics(score > t, f)})
    return points


@torch.no_grad()
def serving_check(
    args: argparse.Namespace, seqs: list[Sequence], small: ModelView, nets: dict[str, RouterNet]
) -> dict[str, float]:
    """Decode through the engine with the route hook and compare its rows with the
    teacher-forced features at the same positions.

    For answer positions q where the small model's greedy token is the reference
    token, the request's prompt is ids[:q]: the first step (prefill) samples ids[q],
    the second is a decode step over ids[q] whose row must match position q.
    """
    assert small.hidden is not None and small.topk is not None
    engine = create_engine(args.small, args.dtype)
    seen: dict[str, list[StepOutputs]] = {}

    def hook(outputs: StepOutputs) -> list[int] | None:
        for i, rid in enumerate(outputs.request_ids):
            row = slice(i, i + 1)
            seen.setdefault(rid, []).append(
                StepOutputs([rid], [outputs.token_ids[i]], outputs.logits[row], outputs.hidden[row])
            )
        return None  # everyone stays

    engine.hook = hook
    # (request id, row of position q-1, row of position q); row r of a sequence is
    # position start - 1 + r and predicts ids[start + r].
    picks: list[tuple[str, int, int]] = []
    offset = 0
    for si, s in enumerate(seqs):
        n = len(s.ids) - s.start
        for j in range(max(1, n // 2), n - 1):
            q = s.start + j  # the prefill of ids[:q] predicts ids[q] from row j
            if int(small.argmax[offset + j]) == s.ids[q]:
                picks.append((f"check-{si}-{j}", offset + j, offset + j + 1))
                params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
                engine.add_request(picks[-1][0], s.ids[:q], params)
                break
        offset += n
        if len(picks) >= args.check:
            break
    while engine.has_unfinished():
        engine.step()
    hidden_diff, topk_diff, prob_diff = [], [], []
    same_argmax = 0
    skipped = 0
    for rid, prefill_row, row in picks:
        first, out = seen[rid][0], seen[rid][1]  # the prefill's sample, then the decode step
        if first.token_ids[0] != int(small.argmax[prefill_row]):
            skipped += 1  # the prefill chose another token: the decode input differs
            continue
        hidden_diff.append(float((out.hidden.float() - small.hidden[row].float()).abs().max()))
        top = topk_logprobs(out.logits, args.topk)[0]
        topk_diff.append(float((top - small.topk[row]).abs().max()))
        same_argmax += int(out.logits.argmax(-1)) == int(small.argmax[row])
        for net in nets.values():
            live = float(net(out.hidden, torch.tensor(out.token_ids), out.logits))
            cached = float(
                torch.sigmoid(
                    net.score(
                        net.features(
                            small.hidden[row : row + 1],
                            small.argmax[row : row + 1],
                            topk_features=small.topk[row : row + 1],
                        )
                    )
                )
            )
            prob_diff.append(abs(live - cached))
    return {
        "positions": len(picks) - skipped,
        "skipped_prefill_token_differs": skipped,
        "same_argmax": same_argmax / max(len(picks) - skipped, 1),
        "max_abs_hidden_diff": max(hidden_diff, default=0.0),
        "median_abs_hidden_diff": sorted(hidden_diff)[len(hidden_diff) // 2]
        if hidden_diff
        else 0.0,
        "max_abs_topk_logprob_diff": max(topk_diff, default=0.0),
        "max_abs_router_prob_diff": max(prob_diff, default=0.0),
    }


SMALL_STEP_B8_MS = 33.2  # smollm2-small's engine decode step at batch 8 (docs/models.md)


def bench_policies(args: argparse.Namespace, batch: int = 8) -> dict[str, float]:
    """Median microseconds of one route() call per policy at `batch` rows, on the side
    that does the work (the small model's; ME on its first model)."""
    import statistics

    from services.worker.routing.api import RouteBatch, RouteState
    from services.worker.routing.policies import create_token_policy

    g = torch.Generator().manual_seed(args.seed)
    vocab, hidden_size = 49152, 576
    logits = 3.0 * torch.randn(batch, vocab, generator=g)
    hidden = torch.randn(batch, hidden_size, generator=g).to(torch.bfloat16)
    states = [RouteState(f"bench-{i}", 0, 100, num_output_tokens=20) for i in range(batch)]
    route_batch = RouteBatch(states, logits.argmax(-1), logits, hidden)
    medium = "smollm2-medium"
    presets = {
        "r2r": [args.small, args.large],
        "citer": [args.small, args.large],
        "co-llm": [args.small, args.large],
        "r-stitch": [args.small, args.large],
        "me": [args.small, medium, args.large],
    }
    result = {}
    for name, models in tqdm(presets.items(), desc="bench", leave=False):
        policy = create_token_policy(name, models, 0, {}, args.out)
        for _ in range(20):  # warm-up
            policy.route(route_batch)
        times = []
        for _ in range(args.bench):
            t0 = time.perf_counter()
            policy.route(route_batch)
            times.append(time.perf_counter() - t0)
        result[name] = statistics.median(times) * 1e6
    print(f"\nroute() at batch {batch}, median of {args.bench} calls, 1 thread:")
    print("| policy | route µs | anchor: small b8 decode step | ratio |")
    print("|---|---|---|---|")
    for name, us in result.items():
        print(f"| {name} | {us:.0f} | {SMALL_STEP_B8_MS} ms | {us / 1000 / SMALL_STEP_B8_MS:.3f} |")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--small", default="smollm2-small", help="the model the routers read")
    p.add_argument("--large", default="smollm2-135m", help="the model whose argmax is the label")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the engine dtype the routers read (workers log router_dtype_differs when "
        "they serve another; dtype auto serves fp32 on CPUs without native bf16)",
    )
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="alpaca JSON list")
    p.add_argument("--train", type=int, default=1600, help="training prompts, from index 0")
    p.add_argument("--val", type=int, default=200, help="validation prompts, from index 4000")
    p.add_argument("--max-answer", type=int, default=96, help="answer tokens per prompt at most")
    p.add_argument("--topk", type=int, default=32, help="top-k log-probabilities (R2R input)")
    p.add_argument("--epochs", type=int, default=8, help="passes over the training rows")
    p.add_argument("--seed", type=int, default=0, help="init, shuffling and bench seed")
    p.add_argument("--recall", type=float, default=PAPER["r2r"], help="R2R's min recall")
    p.add_argument("--check", type=int, default=16, help="positions of the serving check (0: skip)")
    p.add_argument(
        "--bench", type=int, default=200, help="route() calls timed per policy (0: skip)"
    )
    p.add_argument("--bench-only", action="store_true", help="only time the policies in --out")
    p.add_argument(
        "--out", type=Path, default=REPO / "models" / "routers", help="router files go here"
    )
    p.add_argument(
        "--cache-dir", type=Path, default=REPO / ".cache" / "routers", help="feature cache"
    )
    p.add_argument(
        "--refresh", action="store_true", help="recompute the cached features (model code changed)"
    )
    args = p.parse_args(argv)
    if not 0 < args.train <= TRAIN_RANGE[1] - TRAIN_RANGE[0]:
        p.error(f"--train must be in 1..{TRAIN_RANGE[1] - TRAIN_RANGE[0]}")
    if not 0 < args.val <= VAL_RANGE[1] - VAL_RANGE[0]:
        p.error(f"--val must be in 1..{VAL_RANGE[1] - VAL_RANGE[0]}")
    if not 0 < args.recall < 1:
        p.error("--recall must be in (0, 1)")
    return args


SPECS: dict[str, dict[str, Any]] = {
    # R2R's HiddenStatesTokenLMHeadLogitsClassifier, 2 x 256 instead of 6 x 1024.
    "r2r": dict(inputs=("hidden", "token", "topk"), widths=(256, 256), token_dim=32, dropout=0.3),
    # CITER's ConfidenceModel is an MLP on the hidden state.
    "citer": dict(inputs=("hidden",), widths=(256, 256), dropout=0.3),
    # Co-LLM's deferral is one extra logit, a linear head on the hidden state.
    "co-llm": dict(inputs=("hidden",), widths=()),
}
# Chosen on the validation loss of the 800-prompt run (docs/token-routing.md): the
# MLPs overfit within 1-2 epochs at lr 1e-3 without weight decay.
FIT: dict[str, dict[str, float]] = {
    "r2r": dict(lr=3e-4, weight_decay=1e-2),
    "citer": dict(lr=3e-4, weight_decay=1e-2),
    "co-llm": dict(lr=1e-2, weight_decay=0.0),
}
OBJECTIVE = {"r2r": "diverges", "citer": "acceptable", "co-llm": "deferral"}
PREDICTS = {
    "r2r": "P(small argmax != large argmax); route if > threshold",
    "citer": "P(small argmax == large argmax); route if < threshold (tau)",
    "co-llm": "deferral probability d; route if > threshold (eta)",
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.bench_only:
        bench_policies(args)
        return
    t_start = time.perf_counter()
    prompts = json.loads(args.prompts.read_text())
    train_seqs = sequences(prompts, TRAIN_RANGE[0], TRAIN_RANGE[0] + args.train, args.max_answer)
    val_seqs = sequences(prompts, VAL_RANGE[0], VAL_RANGE[0] + args.val, args.max_answer)

    # 1. Teacher-forced views of both models (cached).
    tr_small, tr_large = cached_views(args, "train", train_seqs)
    va_small, va_large = cached_views(args, "val", val_seqs)
    train, val = features(tr_small, tr_large), features(va_small, va_large)
    t_features = time.perf_counter() - t_start
    print(
        f"features: {len(train)} train / {len(val)} val positions, divergent "
        f"{float(train.diverges.float().mean()):.3f} / {float(val.diverges.float().mean()):.3f} "
        f"({t_features:.0f} s)"
    )

    # 2. Fit the three routers.
    engine = create_engine(args.small, args.dtype)
    embedding = engine.model.embed_tokens.weight.detach().clone()
    hidden_size, vocab = engine.model.config.hidden_size, engine.model.config.vocab_size
    del engine
    nets: dict[str, RouterNet] = {}
    fits: dict[str, Any] = {}
    for name in tqdm(SPECS, desc="routers"):
        spec = RouterSpec(
            hidden_size=hidden_size,
            vocab_size=vocab if "token" in SPECS[name]["inputs"] else 0,
            topk=args.topk if "topk" in SPECS[name]["inputs"] else 0,
            **SPECS[name],
        )
        torch.manual_seed(args.seed)
        nets[name] = RouterNet(spec)
        t0 = time.perf_counter()
        cfg = FitConfig(
            epochs=args.epochs,
            seed=args.seed,
            lr=FIT[name]["lr"],
            weight_decay=FIT[name]["weight_decay"],
        )
        fits[name] = fit_router(nets[name], OBJECTIVE[name], train, val, cfg, embedding, name)
        fits[name].seconds = time.perf_counter() - t0

    # 3. Calibrate on validation, through the serving path.
    probs = {name: serving_probabilities(net, val) for name, net in nets.items()}
    div = val.diverges
    thresholds = {"r2r": threshold_for_recall(probs["r2r"], div, args.recall)}
    r2r_share = float((probs["r2r"] > thresholds["r2r"]).float().mean())
    thresholds["citer"] = threshold_for_share(probs["citer"], r2r_share, route_below=True)
    thresholds["co-llm"] = youden_threshold(probs["co-llm"], div)
    rules = {
        "r2r": f"largest threshold with recall >= {args.recall} of divergent validation tokens (R2R's official rule)",
        "citer": "tau at which the routed share of validation tokens equals R2R's (same cost point)",
        "co-llm": "eta maximizing Youden's J (TPR - FPR) against divergence on validation (Co-LLM's find_optimal_deferral_threshold)",
    }
    routes = {
        "r2r": lambda p, t: p > t,
        "citer": lambda p, t: p < t,
        "co-llm": lambda p, t: p > t,
    }
    check = serving_check(args, val_seqs, va_small, nets) if args.check else {}
    report: dict[str, dict[str, Any]] = {}
    for name, net in nets.items():
        p, t = probs[name], thresholds[name]
        target = div if name != "citer" else ~div
        metrics: dict[str, Any] = {
            "val_auc": roc_auc(p, target),
            "val_auc_note": "vs divergence" if name != "citer" else "vs agreement",
            "threshold": t,
            **routing_metrics(routes[name](p, t), val),
        }
        if name == "co-llm":
            metrics["val_auc_large_better"] = roc_auc(p, val.logp_large > val.logp_small)
        if name != "r2r":
            paper = routing_metrics(routes[name](p, PAPER[name]), val)
            metrics["at_paper_threshold"] = {"threshold": PAPER[name], **paper}
        sign = -1.0 if name == "citer" else 1.0
        metrics["operating_points"] = operating_points(sign * p, val, sign)
        report[name] = metrics
        save_router(
            args.out,
            name,
            net,
            {
                "policy": name,
                "predicts": PREDICTS[name],
                "small_model": args.small,
                "small_model_digest": model_digest(args.small),
                "large_model": args.large,
                "dtype": args.dtype,
                "weight_dtype": weight_dtype(args),
                "threshold": t,
                "threshold_rule": rules[name],
                "objective": OBJECTIVE[name],
                "metrics": metrics,
                "serving_check": check,
                "train": {
                    "prompts": args.prompts.name,
                    "train_range": [TRAIN_RANGE[0], TRAIN_RANGE[0] + args.train],
                    "val_range": [VAL_RANGE[0], VAL_RANGE[0] + args.val],
                    "max_answer_tokens": args.max_answer,
                    "train_positions": len(train),
                    "val_positions": len(val),
                    "epochs": args.epochs,
                    **FIT[name],
                    "best_epoch": fits[name].best_epoch,
                    "val_losses": fits[name].val_losses,
                    "seed": args.seed,
                    "seconds": round(fits[name].seconds, 1),
                },
            },
        )

    # 4. R-Stitch: no training; tau for the same large-model share as R2R (simulated).
    tau = calibrate_stitch(val_seqs, va_small, va_large, r2r_share)
    share, handoffs = stitch_share(val_seqs, va_small, va_large, tau)
    paper_share, paper_handoffs = stitch_share(val_seqs, va_small, va_large, PAPER["r-stitch"])
    stitch = {
        "policy": "r-stitch",
        "small_model": args.small,
        "large_model": args.large,
        "threshold": tau,
        "threshold_rule": "tau (normalized entropy) at which the simulated large-model share of validation answer tokens equals R2R's routed share",
        "metrics": {
            "large_share": share,
            "handoffs_per_token": handoffs / len(val),
            "small_entropy_median": float(va_small.entropy.median()),
            "large_entropy_median": float(va_large.entropy.median()),
            "at_paper_threshold": {
                "threshold": PAPER["r-stitch"],
                "large_share": paper_share,
                "handoffs_per_token": paper_handoffs / len(val),
            },
        },
    }
    (args.out / "r-stitch.json").write_text(json.dumps(stitch, indent=2) + "\n")
    report["r-stitch"] = stitch["metrics"] | {"threshold": tau}

    # 5. Summary.
    total = time.perf_counter() - t_start
    print(f"\nvalidation: {len(val)} positions of alpaca[{VAL_RANGE[0]}:{VAL_RANGE[0] + args.val}]")
    print(
        "| router | val AUC | threshold | routed | recall | agreement after | random, same share |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in nets:
        m = report[name]
        print(
            f"| {name} | {m['val_auc']:.3f} | {m['threshold']:.4f} | {m['routed_fraction']:.3f} "
            f"| {m['recall']:.3f} | {m['agreement_after_routing']:.3f} | {m['agreement_random_same_share']:.3f} |"
        )
    print(
        f"| r-stitch | - | {tau:.4f} | {share:.3f} (large share) | - | - | - |"
        f"  (paper tau 0.03: large share {paper_share:.3f})"
    )
    # No learned router: the small model's own top-1 probability (low -> route).
    baseline = -val.topk[:, 0]
    print(f"confidence baseline (small top-1 prob) AUC vs divergence: {roc_auc(baseline, div):.3f}")
    base_points = operating_points(baseline, val, -1.0)
    print("\nagreement with the large model's argmax after routing, by routed share:")
    print("| routed share | r2r | citer | co-llm | top-1 prob baseline | random |")
    print("|---|---|---|---|---|---|")
    for i, share in enumerate(SHARES):
        cells = [f"{report[n]['operating_points'][i]['agreement_after_routing']:.3f}" for n in nets]
        print(
            f"| {share:.1f} | {' | '.join(cells)} | {base_points[i]['agreement_after_routing']:.3f} "
            f"| {base_points[i]['agreement_random_same_share']:.3f} |"
        )
    if check:
        print(f"serving check: {json.dumps(check)}")
    print(f"total {total:.0f} s (features {t_features:.0f} s); wrote {args.out}")
    if args.bench:
        bench_policies(args)
    if not math.isfinite(report["r2r"]["val_auc"]):
        raise SystemExit("validation has no divergent or no agreeing token: AUC undefined")


if __name__ == "__main__":
    main()
