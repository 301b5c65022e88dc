"""Benchmark: our continuous-batching engine vs HF transformers generate() on SmolLM2.

A closed loop of N concurrent requests (alpaca prompts, chat template, exactly
--new-tokens output tokens each) through the engine, against HF `generate()` with
static batches of the same N prompts, side by side in one run. Prints output
tokens/s for both and their ratio; also bf16 vs fp32, fp32 with fp16 vs fp32
weights, and torch threads 1 vs 2 for the engine, how often each faster numeric
reproduces fp32 greedy decoding, and the peak RSS of a worker-sized engine. The
engine runs as workers serve it (dtype and weight_dtype "auto" unless given); HF runs
the same compute dtype with its weights as they load (fp32 weights where the engine
holds fp16 ones: the ratio is then also printed with the engine's weights as HF's).
JSON to --out.

    python scripts/bench_engine.py --out results/bench_engine.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loadgen.data import data_dir  # noqa: E402
from services.worker.engine.config import EngineConfig, resolve_dtype  # noqa: E402
from services.worker.engine.cpu_kernels import fp16_weights_supported  # noqa: E402
from services.worker.engine.engine import LLMEngine  # noqa: E402
from services.worker.engine.loader import build_model, load_gguf  # noqa: E402
from shared.model_store import load_tokenizer, smollm2_gguf_path  # noqa: E402
from shared.runtime import freeze_heap  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.scheduling.scheduler import SchedulerConfig  # noqa: E402

ALPACA = data_dir() / "prompts" / "alpaca_5000_random.json"


def alpaca_prompts(count: int, seed: int, path: Path) -> list[list[int]]:
    tok = load_tokenizer("smollm2-135m")
    rows = json.loads(path.read_text())
    rng = random.Random(seed)
    picked = rng.sample(rows, count)
    out = []
    for r in picked:
        text = r["instruction"] + (("\n\n" + r["input"]) if r.get("input") else "")
        out.append(tok.apply_chat_template([{"role": "user", "content": text}]))
    return out


def engine_closed_loop(
    engine: LLMEngine, prompts: list[list[int]], concurrency: int, new_tokens: int, desc: str
) -> float:
    """Keep `concurrency` requests in flight until every prompt is served; output tok/s."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    queue = list(enumerate(prompts))
    in_flight, produced = 0, 0
    bar = tqdm(total=len(prompts) * new_tokens, desc=desc, unit="tok", leave=False)
    t0 = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i, p = queue.pop(0)
            engine.add_request(f"{desc}-{i}", p, params)
            in_flight += 1
        for out in engine.step():
            produced += len(out.new_token_ids)
            bar.update(len(out.new_token_ids))
            if out.finished:
                in_flight -= 1
    elapsed = time.perf_counter() - t0
    bar.close()
    assert produced == len(prompts) * new_tokens
    return produced / elapsed


def hf_static_batches(
    hf: torch.nn.Module, prompts: list[list[int]], batch: int, new_tokens: int, desc: str
) -> float:
    """HF generate() on consecutive static batches (left-padded); output tok/s."""
    produced = 0
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(prompts), batch), desc=desc, leave=False):
        group = prompts[s : s + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = hf.generate(  # type: ignore[operator]
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        produced += (out.shape[1] - width) * len(group)
    return produced / (time.perf_counter() - t0)


def greedy_agreement(
    cfg: object,
    state: dict[str, torch.Tensor],
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str,
    weight_dtype: str,
) -> dict[str, float]:
    """How often greedy decoding in (dtype, weight_dtype) reproduces plain fp32's."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = []
    for dt, wd in (("float32", "same"), (dtype, weight_dtype)):
        conf = EngineConfig(
            model="smollm2-135m",
            dtype=dt,
            weight_dtype=wd,
            scheduler=SchedulerConfig(
                max_num_seqs=len(prompts), num_kv_blocks=256, max_model_len=2048
            ),
        )
        model = build_model(cfg, dict(state), conf.torch_dtype, torch.device("cpu"))  # type: ignore[arg-type]
        if conf.fp16_weights:
            model.pack_for_cpu(batch_hint=conf.scheduler.max_num_seqs, fp16_weights=True)
        engine = LLMEngine(conf, model)  # fp32 and bf16: the plain model
        outs.append(engine.generate(prompts, params))
        del engine
    same_tokens = same_prefix = identical = 0
    for a, b in zip(outs[0], outs[1], strict=True):
        same_tokens += sum(x == y for x, y in zip(a, b, strict=True))
        prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same_prefix += prefix
        identical += prefix == len(a)
    total = len(prompts) * new_tokens
    return {
        "position_match": same_tokens / total,
        "prefix_match": same_prefix / total,
        "identical_answers": identical / len(prompts),
    }


def rss_probe(num_kv_blocks: int, dtype: str, weight_dtype: str) -> dict[str, float]:
    """Run in a child process: peak RSS of one SmolLM2 engine with its KV capacity."""
    # A child's peak RSS starts at its parent's size at fork (the high-water mark
    # survives exec): reset it first (writing 5 to clear_refs), then read VmHWM.
    code = (
        "open('/proc/self/clear_refs','w').write('5');"
        "import torch;from services.worker.engine.engine import LLMEngine;"
        "from services.worker.engine.config import EngineConfig;"
        "from shared.sampling import SamplingParams;"
        "from shared.scheduling.scheduler import SchedulerConfig;"
        f"s=SchedulerConfig(num_kv_blocks={num_kv_blocks},max_model_len=2048);"
        f"e=LLMEngine.create(EngineConfig(model='smollm2-135m',dtype='{dtype}',weight_dtype='{weight_dtype}',scheduler=s));"
        "e.generate([[1,2,3]*50]*8,SamplingParams(max_tokens=16,ignore_eos=True));"
        "hwm=[l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1];"
        "print(e.runner.kv_cache_bytes, hwm)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout.split()
    return {"kv_cache_mib": int(out[0]) / 2**20, "peak_rss_mib": int(out[1]) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument(
        "--requests-per-slot", type=int, default=2, help="requests = this x N (default 2)"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="alternate engine and HF runs this many times per N; report medians "
        "(shared machines drift: alternating keeps the comparison fair)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto (as workers run): bf16 where the CPU computes it natively, else fp32",
    )
    ap.add_argument(
        "--weight-dtype",
        default="auto",
        choices=["auto", "same", "float16"],
        help="auto (as workers run): fp16 weights where fp32 runs on an x86 CPU",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--variants-at", type=int, default=8, help="N for the dtype/threads variants (0 = skip)"
    )
    ap.add_argument(
        "--agreement-prompts",
        type=int,
        default=16,
        help="prompts for the greedy agreement checks against fp32 (0 = skip)",
    )
    ap.add_argument("--prompts", type=Path, default=ALPACA)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_engine.json")
    args = ap.parse_args()
    args.dtype = resolve_dtype(args.dtype, "cpu")  # args.weight_dtype stays as given

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg, state = load_gguf(smollm2_gguf_path())
    max_n = max(args.concurrency)
    prompts = alpaca_prompts(max_n * args.requests_per_slot, args.seed, args.prompts)
    max_len = max(len(p) for p in prompts) + args.new_tokens + 16
    econf = EngineConfig(
        model="smollm2-135m",
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        threads=args.threads,
        scheduler=SchedulerConfig(
            max_num_seqs=max_n,
            num_kv_blocks=max(128, -(-max_len // EngineConfig().scheduler.block_size) * max_n + 4),
            max_model_len=2048,
        ),
    )

    def make_engine(conf: EngineConfig) -> LLMEngine:
        """The engine as a worker serves it (packed as LLMEngine.create packs it)."""
        model = build_model(cfg, dict(state), conf.torch_dtype, torch.device("cpu"))
        if conf.pack_weights:
            model.pack_for_cpu(
                batch_hint=conf.scheduler.max_num_seqs, fp16_weights=conf.fp16_weights
            )
        return LLMEngine(conf, model)

    def label(conf: EngineConfig) -> str:
        fp16w = " (fp16 weights)" if conf.fp16_weights else ""
        return f"{conf.resolved_dtype}{fp16w}, {torch.get_num_threads()} thread(s)"

    from services.worker.engine.hf_twin import build_hf_twin

    engine = make_engine(econf)
    # The twin needs plain weights: built from an unpacked copy of the same model.
    hf = build_hf_twin(build_model(cfg, dict(state), dtype, torch.device("cpu")), dtype)
    engine.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    hf_static_batches(hf, prompts[:1], 1, 4, "warm-up")
    # Out of the collector's reach for the timed runs: torch, transformers and both
    # models (a full collection of them took 80-170 ms here: a stall of whichever side
    # was being timed when one came), as the services and bench_gateway do.
    freeze_heap()

    result: dict[str, object] = {
        "model": "smollm2-135m",
        "dtype": args.dtype,
        "weight_dtype": econf.resolved_weight_dtype,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "engine_tok_s": {},
        "hf_tok_s": {},
        "ratio": {},
    }
    print(
        f"SmolLM2-135M, engine {label(econf)} vs HF {args.dtype}, {args.new_tokens} new tokens per request"
    )
    print(f"{'N':>4} {'requests':>9} {'engine tok/s':>13} {'HF tok/s':>10} {'ratio':>7}")
    for n in args.concurrency:
        group = prompts[: n * args.requests_per_slot]
        es, hs = [], []
        for _ in range(args.repeats):
            es.append(engine_closed_loop(engine, group, n, args.new_tokens, f"engine N={n}"))
            hs.append(hf_static_batches(hf, group, n, args.new_tokens, f"hf N={n}"))
        e, h = statistics.median(es), statistics.median(hs)
        result["engine_tok_s"][str(n)] = round(e, 2)  # type: ignore[index]
        result["hf_tok_s"][str(n)] = round(h, 2)  # type: ignore[index]
        result["ratio"][str(n)] = round(e / h, 3)  # type: ignore[index]
        print(f"{n:>4} {len(group):>9} {e:>13.1f} {h:>10.1f} {e / h:>7.2f}")
    del hf

    if args.variants_at:
        n = args.variants_at
        group = prompts[: n * args.requests_per_slot]
        variants: dict[str, float] = {}
        variants[label(econf)] = result["engine_tok_s"].get(  # type: ignore[union-attr,attr-defined]
            str(n)
        ) or engine_closed_loop(engine, group, n, args.new_tokens, "base")
        del engine
        other = "float32" if args.dtype == "bfloat16" else "bfloat16"
        alts = [dataclasses.replace(econf, dtype=other, weight_dtype="same")]
        if args.dtype == "float32":  # the other weight storage of the served dtype
            wd = "same" if econf.fp16_weights else "float16"
            if wd == "same" or fp16_weights_supported():
                alts.append(dataclasses.replace(econf, weight_dtype=wd))
        for conf in alts:
            alt = make_engine(conf)
            variants[label(conf)] = engine_closed_loop(alt, group, n, args.new_tokens, label(conf))
            del alt
        other_threads = 2 if args.threads == 1 else 1
        torch.set_num_threads(other_threads)
        alt = make_engine(econf)
        variants[label(econf)] = engine_closed_loop(alt, group, n, args.new_tokens, "threads")
        torch.set_num_threads(args.threads)
        del alt
        result["engine_variants_tok_s"] = {k: round(v, 2) for k, v in variants.items()}
        print(f"\nengine variants at N={n}:")
        for k, v in variants.items():
            print(f"  {k:<40} {v:8.1f} tok/s")
        same = label(dataclasses.replace(econf, weight_dtype="same"))
        if econf.fp16_weights and str(n) in result["hf_tok_s"]:  # type: ignore[operator]
            # like for like: the engine with the fp32 weights HF holds, same run (its
            # engine figure from the variants phase, not alternated with HF's)
            ratio = variants[same] / result["hf_tok_s"][str(n)]  # type: ignore[index]
            result["ratio_fp32_weights"] = {str(n): round(ratio, 3)}
            print(f"  ratio to HF at N={n} with fp32 weights on both sides: {ratio:.2f}")

    if args.agreement_prompts:
        checks = [("bf16_vs_fp32_greedy", "bfloat16", "same", "bf16")]
        if fp16_weights_supported():
            checks.append(
                ("fp16_weights_vs_fp32_greedy", "float32", "float16", "fp32 on fp16 weights")
            )
        for key, dt, wd, name in checks:
            agree = greedy_agreement(cfg, state, prompts[: args.agreement_prompts], 64, dt, wd)
            result[key] = {
                "prompts": args.agreement_prompts,
                "new_tokens": 64,
                **{k: round(v, 3) for k, v in agree.items()},
            }
            print(
                f"\n{name} vs fp32 greedy, {args.agreement_prompts} prompts x 64 tokens: "
                f"{agree['position_match']:.1%} of positions equal, {agree['prefix_match']:.1%} before "
                f"the first divergence, {agree['identical_answers']:.0%} of answers identical"
            )

    # A worker's KV capacity as configs/local.toml sizes it: 8192 tokens.
    bs = EngineConfig().scheduler.block_size
    rss = rss_probe(8192 // bs, args.dtype, econf.weight_dtype)
    result["worker_memory"] = {
        "num_kv_blocks": 8192 // bs,
        "block_size": bs,
        **{k: round(v, 1) for k, v in rss.items()},
    }
    print(
        f"\nworker peak RSS (SmolLM2, {label(econf)}, {8192 // bs} KV blocks = 8192 tokens): "
        f"{rss['peak_rss_mib']:.0f} MiB, of which KV cache {rss['kv_cache_mib']:.0f} MiB"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
