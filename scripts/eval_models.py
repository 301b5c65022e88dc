"""Evaluate SmolLM2-135M-Instruct and its delta students on held-out alpaca prompts.

For the full model and each ``<models-dir>/<name>.safetensors`` delta:

* agreement: fraction of reference-answer positions (teacher forced: chat prompt
  + alpaca reference answer) where the model's argmax equals the full model's;
* perplexity of the reference answers (for a student with a trimmed LM head,
  over the positions whose reference token it keeps: it gives the others
  probability 0; ``ref_coverage`` says how many those are);
* ``argmax_coverage``: fraction of the full model's argmaxes inside a trimmed
  head's kept ids, the ceiling on that student's agreement;
* per-step decode latency at batch 1 and 8 (bf16, 1 thread, context ~128,
  manual KV-cache loop, the models taking turns step by step, median over steps).

Prints a markdown table; ``--out`` also writes JSON.

Example::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/eval_models.py --out results/models.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_models import (
    DEFAULT_PROMPTS,
    HELDOUT_START,
    REPO,
    SPECS,
    Sequence,
    TrimmedHead,
    batches,
    forward_logits,
    load_base,
    load_prompts,
    make_model,
    reference_sequence,
    student_from_base,
    student_path,
)

from services.worker.engine.delta import read_delta
from services.worker.engine.hf_twin import cache_kwarg


@dataclass
class Row:
    """One model's results."""

    name: str
    layers: list[int]
    agreement: float
    perplexity: float
    ms_b1: float
    ms_b8: float
    rel_b1: float = 1.0
    rel_b8: float = 1.0
    file_mb: float = 0.0
    vocab: int = 0  # ids its LM head scores (the full vocabulary unless trimmed)
    ref_coverage: float = 1.0  # reference-answer tokens inside the kept ids
    argmax_coverage: float = 1.0  # full model's argmax tokens inside the kept ids
    note: str = ""


@torch.inference_mode()
def answer_stats(
    model: LlamaForCausalLM, seqs: list[Sequence], ref: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], float, float, float]:
    """Argmax per answer position, agreement with ``ref`` (1.0 if None), reference
    perplexity (over the positions whose reference token the model can emit) and the
    fraction of such positions."""
    keep = model.lm_head.keep if isinstance(model.lm_head, TrimmedHead) else None
    argmax: list[torch.Tensor] = []
    nll, count, scored, hits = 0.0, 0, 0, 0
    for chunk in batches(seqs, 8):
        logits = forward_logits(model, chunk).float()
        for r, s in enumerate(chunk):
            lg = logits[r, s.start - 1 : len(s.ids) - 1]
            gold = torch.tensor(s.ids[s.start :])
            ok = torch.ones_like(gold, dtype=torch.bool) if keep is None else torch.isin(gold, keep)
            nll += F.cross_entropy(lg[ok], gold[ok], reduction="sum").item()
            count += len(gold)
            scored += int(ok.sum())
            argmax.append(lg.argmax(-1))
    if ref is not None:
        hits = sum(int((a == b).sum()) for a, b in zip(argmax, ref, strict=True))
    agree = 1.0 if ref is None else hits / count
    return argmax, agree, math.exp(nll / scored), scored / count


@torch.inference_mode()
def decode_ms(
    models: list[LlamaForCausalLM], batch: int, context: int, steps: int, warmup: int
) -> list[float]:
    """Median milliseconds per decode step of each model after a ``context``-token prefill.

    The models take turns step by step, so load from other processes on a shared
    machine hits all of them alike and their ratios stay meaningful.
    """
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (batch, context), generator=g)
    caches = [DynamicCache() for _ in models]
    kwarg = cache_kwarg(models[0])
    nxt = [
        m(input_ids=ids, use_cache=True, **{kwarg: c}).logits[:, -1:].argmax(-1)
        for m, c in zip(models, caches, strict=True)
    ]
    times: list[list[float]] = [[] for _ in models]
    for i in range(warmup + steps):
        for k, (m, c) in enumerate(zip(models, caches, strict=True)):
            t = time.perf_counter()
            nxt[k] = m(input_ids=nxt[k], use_cache=True, **{kwarg: c}).logits[:, -1:].argmax(-1)
            if i >= warmup:
                times[k].append((time.perf_counter() - t) * 1000)
    return [statistics.median(t) for t in times]


def latency(models: list[LlamaForCausalLM], args: argparse.Namespace) -> list[tuple[float, float]]:
    """bf16 decode-step latency (batch 1, batch 8) per model; the models are cast to bf16."""
    bf16 = [m.to(torch.bfloat16) for m in models]  # type: ignore[arg-type]
    b1 = decode_ms(bf16, 1, args.context, args.steps, args.warmup)
    b8 = decode_ms(bf16, 8, args.context, args.steps, args.warmup)
    return list(zip(b1, b8, strict=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=[n for n in sorted(SPECS, reverse=True) if not SPECS[n].intermediate],
        help="delta names to evaluate (besides the full model; default: the shipped ones)",
    )
    p.add_argument("--models-dir", type=Path, default=REPO / "models")
    p.add_argument("--cache-dir", type=Path, default=REPO / ".cache")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("-n", "--n", type=int, default=100, help="held-out prompts (from index 4500)")
    p.add_argument("--max-len", type=int, default=256, help="sequence length cap")
    p.add_argument("--context", type=int, default=128, help="decode context length")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    p.add_argument("--no-latency", action="store_true", help="skip the latency measurement")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    return p.parse_args(argv)


def markdown(rows: list[Row]) -> str:
    """The results as a markdown table."""
    lines = [
        "| model | layers | vocab | decode b1 ms (rel) | decode b8 ms (rel) | agreement "
        "| argmax coverage | ref. ppl | ref. coverage | file MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def step(ms: float, rel: float) -> str:
        return f"{ms:.1f} ({rel:.2f}x)" if ms > 0 else "-"  # "-": not measured (--no-latency)

    for r in rows:
        lines.append(
            f"| {r.name} | {len(r.layers)} | {r.vocab} | {step(r.ms_b1, r.rel_b1)} "
            f"| {step(r.ms_b8, r.rel_b8)} | {r.agreement:.3f} | {r.argmax_coverage:.4f} "
            f"| {r.perplexity:.2f} | {r.ref_coverage:.4f} | {r.file_mb:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    base, config, tok = load_base(args.cache_dir)
    prompts = load_prompts(args.prompts)
    seqs = [
        reference_sequence(tok, prompts[i], args.max_len)
        for i in range(HELDOUT_START, HELDOUT_START + args.n)
    ]
    models: list[tuple[str, list[int], Path | None]] = [
        ("smollm2-135m (full)", list(range(30)), None)
    ]
    for name in args.models:
        path = (
            student_path(SPECS[name], args.models_dir, args.cache_dir)  # a stage: the cache
            if name in SPECS
            else args.models_dir / f"{name}.safetensors"
        )
        models.append((name, read_delta(path).layers, path))
    rows: list[Row] = []
    ref: list[torch.Tensor] | None = None
    loaded: list[LlamaForCausalLM] = []
    for name, layers, path in tqdm(models, desc="models"):
        delta = read_delta(path) if path else None
        model = (
            student_from_base(config, base, delta, torch.float32)
            if delta
            else make_model(config, base)
        )
        argmax, agree, ppl, ref_cov = answer_stats(model, seqs, ref)
        ref = argmax if ref is None else ref
        loaded.append(model)
        size = path.stat().st_size / 1e6 if path else 0.0
        head = model.lm_head
        rows.append(
            Row(
                name,
                layers,
                agree,
                ppl,
                0.0,
                0.0,
                file_mb=size,
                vocab=len(head.keep) if isinstance(head, TrimmedHead) else config.vocab_size,
                ref_coverage=ref_cov,
                argmax_coverage=(
                    float(torch.isin(torch.cat(ref), head.keep).float().mean())
                    if isinstance(head, TrimmedHead)
                    else 1.0
                ),
                note=delta.note if delta else "",
            )
        )
    if not args.no_latency:
        for r, (b1, b8) in zip(rows, latency(loaded, args), strict=True):
            r.ms_b1, r.ms_b8 = b1, b8
    for r in rows:
        r.rel_b1 = r.ms_b1 / rows[0].ms_b1 if rows[0].ms_b1 else 0.0
        r.rel_b8 = r.ms_b8 / rows[0].ms_b8 if rows[0].ms_b8 else 0.0
    n_tok = sum(len(s.ids) - s.start for s in seqs)
    print(
        f"\n{args.n} held-out prompts (alpaca[{HELDOUT_START}:{HELDOUT_START + args.n}]), {n_tok} answer tokens\n"
    )
    print(markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "n_prompts": args.n,
            "answer_tokens": n_tok,
            "context": args.context,
            "models": [asdict(r) for r in rows],
        }
        args.out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
