"""Per-step decode latency of the SmolLM2 family as served by Baton's engine.

The engines take turns step by step, so background load hits them alike; prints
the median decode step at each batch size and the ratio to the first model.
A model is a name from shared/model_store.py or a path to a baton-delta-v1 file
over smollm2-135m (a candidate student not yet in models/).

    python scripts/family_latency.py [--models ...] [--batches 1 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.worker.engine.config import EngineConfig
from services.worker.engine.delta import apply_delta, read_delta
from services.worker.engine.engine import LLMEngine
from services.worker.engine.loader import build_model, load_gguf
from shared.model_store import smollm2_gguf_path
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig


def decode_steps(
    engines: dict[str, LLMEngine], batch: int, prompt_len: int, steps: int
) -> dict[str, float]:
    """Median decode-step seconds per engine with `batch` running requests."""
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0)
    for engine in engines.values():
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", list(range(100, 100 + prompt_len)), params)
        engine.step()  # prefill (with the first token)
        engine.step()  # warm-up decode
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
    for engine in engines.values():
        while engine.has_unfinished():
            engine.step()
    return {name: statistics.median(ts) for name, ts in times.items()}


def make_engine(model: str, config: EngineConfig) -> LLMEngine:
    """An engine for a model name, or for a delta file over the SmolLM2 base built the
    way LLMEngine.create builds a named student (fp32 merge, cast, pack)."""
    if not model.endswith(".safetensors"):
        return LLMEngine.create(dataclasses.replace(config, model=model))
    torch.set_num_threads(config.threads)
    cfg, state = load_gguf(smollm2_gguf_path(), torch.float32)
    delta = read_delta(model)
    state = apply_delta(state, delta)
    cfg = dataclasses.replace(
        cfg,
        num_hidden_layers=len(delta.layers),
        max_position_embeddings=config.scheduler.max_model_len,
    )
    built = build_model(cfg, state, config.torch_dtype, torch.device(config.device))
    if config.pack_weights:
        built.pack_for_cpu(
            batch_hint=config.scheduler.max_num_seqs, fp16_weights=config.fp16_weights
        )
    return LLMEngine(config, built)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models", nargs="+", default=["smollm2-135m", "smollm2-medium", "smollm2-small"]
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "same", "float16"],
        help="auto: fp16 weights where fp32 runs on an x86 CPU (as workers serve it)",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    config = EngineConfig(
        model=args.models[0],
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        scheduler=SchedulerConfig(max_num_seqs=max(args.batches)),
    )
    print(f"dtype {config.resolved_dtype}, weights {config.resolved_weight_dtype}")
    engines = {name: make_engine(name, config) for name in args.models}
    results = {b: decode_steps(engines, b, args.prompt_len, args.steps) for b in args.batches}
    base = args.models[0]
    print(f"| model | {' | '.join(f'decode step b{b}' for b in args.batches)} |")
    print(f"|---|{'---|' * len(args.batches)}")
    for name in args.models:
        cells = [
            f"{results[b][name] * 1000:.1f} ms ({results[b][name] / results[b][base]:.2f}x)"
            for b in args.batches
        ]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
