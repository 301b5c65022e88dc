"""The DTMC's predicted throughput vs a measured run of two real engines, for B_L = 1..N.

Two LLMEngines (random tiny Llama-shaped models: a fast entry model S and a slower
model L) run in one process, each in its own thread with one torch thread (torch
releases the GIL in its kernels, so the two step loops overlap as on two devices).
N requests are active (a finished one is replaced at once). After each S token a
Bernoulli(p) hook hands the request to L, which writes one token (or a geometric
run) and hands it back. Each loop obeys the hold rule (shared/hold.py):
step when >= B_m requests are ready, or all N are here, or the hold timeout fired.

1. calibrate: an eager run (B = 1, 1); its step samples give t_S(b), t_L(b) (affine fit)
2. for B_L = 1..N (B_S fixed): measure output tokens/s after a warm-up
3. predict each with the chain (the service's one-line fit from the eager run; and
   overlap-aware fits, t_m(b) alone and while the other model steps, since on a
   shared CPU the two loops slow each other) and with the deterministic Monte-Carlo
   sim; compare rankings with the measurement (Spearman)

    ./baton python scripts/check_dtmc.py --n 6 --p 0.1 --seconds 8 --out dtmc.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import threading
import time
from dataclasses import dataclass, field

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from tqdm import tqdm

from services.batcher.dtmc import AffineLatency, ModelPair, predicted_throughput
from services.batcher.estimates import DecayedAffineFit
from services.batcher.simulate import simulate
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.loader import build_model, random_config, random_state_dict
from services.worker.engine.outputs import StepOutputs
from shared.hold import may_step, wait_left_s
from shared.sampling import SamplingParams
from shared.scheduling.scheduler import SchedulerConfig

VOCAB = 4096
# Sizes chosen so that L's step is ~5-8x S's and mostly weight reads (flat in b), as a
# large model's decode step is on a GPU; S is small but not pure Python overhead.
SMALL_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=6, num_key_value_heads=2, head_dim=64,
)  # fmt: skip
LARGE_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
    num_attention_heads=12, num_key_value_heads=4, head_dim=64,
)  # fmt: skip
PROMPT_TOKENS = 8
MAX_MODEL_LEN = 1024


def tiny_engine(shape: dict, seed: int, max_seqs: int) -> LLMEngine:
    cfg = random_config(**shape)
    model = build_model(cfg, random_state_dict(cfg, seed=seed), torch.float32, torch.device("cpu"))
    config = EngineConfig(
        dtype="float32",
        scheduler=SchedulerConfig(
            num_kv_blocks=1024, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_seqs
        ),
    )
    return LLMEngine(config, model)


@dataclass
class Loop:
    """One model's side: who is ready here (since when), and what its steps did."""

    engine: LLMEngine
    hold: int
    ready: dict[str, float] = field(default_factory=dict)  # request id -> time it became ready
    samples: list[tuple[int, float, float]] = field(default_factory=list)  # (b, s, end time)
    num_timeouts: int = 0
    rows: int = 0  # requests that sampled in the current step (set by the hook)


class TwoModelRun:
    """N closed-loop requests between S (index 0) and L (index 1) under the hold rule."""

    def __init__(
        self,
        small: LLMEngine,
        large: LLMEngine,
        num_active: int,
        holds: tuple[int, int],
        p: float,
        tokens_per_visit: float,
        max_tokens: int,
        hold_timeout_s: float,
        seed: int,
    ) -> None:
        self.loops = (Loop(small, holds[0]), Loop(large, holds[1]))
        self.n, self.p, self.q = num_active, p, 1.0 / tokens_per_visit
        self.max_tokens, self.hold_timeout_s = max_tokens, hold_timeout_s
        self.rng = random.Random(seed)
        self.cond = threading.Condition()
        self.stop = False
        self.seen_by_large: dict[str, int] = {}  # tokens of the sequence L's KV holds
        self.live: set[str] = set()  # requests started and not finished
        self.num_started = 0
        self.prefix = f"s{seed}-"
        small.hook = self._route_small
        large.hook = self._route_large

    # hooks run on their engine's thread; the rng is only used under the GIL per call
    def _route_small(self, outputs: StepOutputs) -> list[int] | None:
        self.loops[0].rows = len(outputs.request_ids)  # one S token per row (hand-after keeps it)
        return [1 if self.rng.random() < self.p else 0 for _ in outputs.request_ids]

    def _route_large(self, outputs: StepOutputs) -> list[int] | None:
        self.loops[1].rows = len(outputs.request_ids)
        return [1 if self.rng.random() < self.q else 0 for _ in outputs.request_ids]

    def _start_request(self, now: float) -> None:  # under cond
        rid = f"{self.prefix}r{self.num_started}"
        self.live.add(rid)
        self.num_started += 1
        prompt = [self.rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        self.loops[0].engine.add_request(rid, prompt, params)
        self.loops[0].ready[rid] = now

    def _step_loop(self, m: int) -> None:
        me, peer = self.loops[m], self.loops[1 - m]
        while True:
            # 1. Hold: wait until the rule lets this model step.
            with self.cond:
                while not self.stop:
                    now = time.perf_counter()
                    oldest = now - min(me.ready.values()) if me.ready else 0.0
                    if may_step(len(me.ready), self.n, me.hold, oldest, self.hold_timeout_s):
                        me.num_timeouts += len(me.ready) < me.hold and len(me.ready) < self.n
                        break
                    self.cond.wait(wait_left_s(len(me.ready), oldest, self.hold_timeout_s))
                if self.stop:
                    return
                me.ready.clear()
            # 2. Step (the GIL is released inside torch's kernels).
            me.rows = 0
            t0 = time.perf_counter()
            outputs = me.engine.step()
            t1 = time.perf_counter()
            handoffs = me.engine.pop_handoffs()
            # 3. Relay hand-offs and replace finished requests.
            with self.cond:
                if me.rows:  # one output token per row: samples double as the token count
                    me.samples.append((me.rows, t1 - t0, t1))
                for h in handoffs:
                    peer.ready[h.request_id] = t1
                    if m == 0:
                        seen = self.seen_by_large.get(h.request_id)
                        if seen is None:
                            params = SamplingParams(
                                max_tokens=MAX_MODEL_LEN - len(h.token_ids),
                                temperature=0.0,
                                ignore_eos=True,
                            )
                            peer.engine.add_request(h.request_id, h.token_ids, params)
                        else:
                            peer.engine.resume_request(h.request_id, h.token_ids[seen:])
                    else:
                        seen = self.seen_by_large[h.request_id]
                        peer.engine.resume_request(h.request_id, h.token_ids[seen:])
                    self.seen_by_large[h.request_id] = len(h.token_ids)
                for out in outputs:
                    if m == 0 and out.finished:  # S owns the request; L drops its KV
                        me.ready.pop(out.request_id, None)
                        peer.ready.pop(out.request_id, None)
                        self.live.discard(out.request_id)
                        if out.request_id in self.seen_by_large:
                            peer.engine.abort_request(out.request_id)
                            del self.seen_by_large[out.request_id]
                        self._start_request(t1)
                    elif m == 0 and out.request_id not in peer.ready:
                        me.ready.setdefault(out.request_id, t1)
                if m == 1:  # requests L keeps writing (a run) are ready at L again
                    sent = {h.request_id for h in handoffs}
                    for out in outputs:
                        if out.request_id not in sent and out.request_id in self.seen_by_large:
                            me.ready[out.request_id] = t1
                self.cond.notify_all()

    def run(self, seconds: float, warmup_s: float) -> float:
        """Run; return output tokens/s over [warmup_s, seconds]."""
        with self.cond:
            for _ in range(self.n):
                self._start_request(time.perf_counter())
        threads = [threading.Thread(target=self._step_loop, args=(m,)) for m in (0, 1)]
        t_start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        for t in threads:
            t.join()
        lo, hi = t_start + warmup_s, t_start + seconds
        tokens = sum(b for loop in self.loops for (b, _, t) in loop.samples if lo <= t <= hi)
        return tokens / (hi - lo)

    def drain(self) -> None:
        """Abort everything so the engines can be reused by the next run."""
        for loop in self.loops:
            loop.engine.hook = None
            for rid in self.live:
                loop.engine.abort_request(rid)
            while loop.engine.has_unfinished():
                loop.engine.step()
            loop.engine.pop_handoffs()


Sample = tuple[int, float, float]  # (batch size, seconds, end time)


def overlapped_share(mine: list[Sample], other: list[Sample]) -> np.ndarray:
    """Per step of mine: the share of its duration the other model was mid-step."""
    if not mine:
        return np.zeros(0)
    m = np.array([(e - d, e) for _, d, e in mine])
    o = np.array([(e - d, e) for _, d, e in other]) if other else np.zeros((0, 2))
    out = np.zeros(len(m))
    for k in range(0, len(m), 512):  # chunks keep the broadcast small
        a = m[k : k + 512, None, :]
        inter = np.minimum(a[..., 1], o[None, :, 1]) - np.maximum(a[..., 0], o[None, :, 0])
        out[k : k + 512] = np.clip(inter, 0, None).sum(axis=1) / (a[:, 0, 1] - a[:, 0, 0])
    return np.clip(out, 0.0, 1.0)


@dataclass(frozen=True)
class StepFit:
    """Per model: t(b) alone and t(b) while the other model steps too (affine in b)."""

    solo: tuple[AffineLatency, AffineLatency]
    overlap: tuple[AffineLatency, AffineLatency]
    plain: tuple[AffineLatency, AffineLatency]  # one line through every sample (the service's)


def fit_steps(runs: list[TwoModelRun]) -> StepFit:
    """seconds = a + c b + f (a2 + c2 b), f = overlapped share: solo (a, c), overlapped
    (a + a2, c + c2), by least squares over every step of `runs`."""
    solo, overlap, plain = [], [], []
    for m in (0, 1):
        rows, f_all = [], []
        for run in runs:
            mine, other = run.loops[m].samples, run.loops[1 - m].samples
            rows += mine
            f_all.append(overlapped_share(mine, other))
        b = np.array([r[0] for r in rows], dtype=float)
        t = np.array([r[1] for r in rows])
        f = np.concatenate(f_all)
        x = np.stack([np.ones_like(b), b, f, f * b], axis=1)
        a, c, a2, c2 = np.linalg.lstsq(x, t, rcond=None)[0]
        alone = AffineLatency(max(a, 1e-6), max(c, 0.0))
        both = AffineLatency(max(a + a2, 1e-6), max(c + c2, 0.0))
        solo.append(alone)
        overlap.append(both)
        single = DecayedAffineFit()
        for bb, tt, _ in rows:
            single.add(bb, tt)
        plain.append(single.fit())
    return StepFit((solo[0], solo[1]), (overlap[0], overlap[1]), (plain[0], plain[1]))


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if np.std(ra) == 0 or np.std(rb) == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=6, help="active requests N (default 6)")
    ap.add_argument("--p", type=float, default=0.1, help="hand-off probability per S token")
    ap.add_argument("--tokens-per-visit", type=float, default=1.0, help="mean L run (>= 1)")
    ap.add_argument("--b-small", type=int, default=1, help="B_S held fixed (default 1)")
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per run (default 8)")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds not measured per run")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--hold-timeout-ms", type=float, default=2000.0, help="safety net (ms)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    n = args.n
    if not 1 <= args.b_small <= n or not 0 < args.p <= 1 or args.tokens_per_visit < 1:
        ap.error("need 1 <= --b-small <= --n, 0 < --p <= 1, --tokens-per-visit >= 1")
    if args.seconds <= args.warmup:
        ap.error("--seconds must exceed --warmup")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    small = tiny_engine(SMALL_SHAPE, 1, max_seqs=n)
    large = tiny_engine(LARGE_SHAPE, 2, max_seqs=n)
    b_large_values = [b for b in range(1, n + 1) if args.b_small + b <= n + 1]

    def measure(b_s: int, b_l: int, seed: int) -> tuple[float, TwoModelRun]:
        run = TwoModelRun(
            small, large, n, (b_s, b_l), args.p, args.tokens_per_visit, args.max_tokens,
            args.hold_timeout_ms / 1000, seed,
        )  # fmt: skip
        tok_s = run.run(args.seconds, args.warmup)
        run.drain()
        return tok_s, run

    # 1. Calibrate on an eager run (what the batcher sees before its first table).
    _, calib = measure(1, 1, args.seed)
    eager_fit = fit_steps([calib])
    # 2. Measure every B_L.
    measured, timeouts, batches, runs = [], [], [], [calib]
    for b_l in tqdm(b_large_values, desc="B_L", unit="run"):
        tok_s, run = measure(args.b_small, b_l, args.seed + b_l)
        measured.append(tok_s)
        timeouts.append(run.loops[0].num_timeouts + run.loops[1].num_timeouts)
        batches.append(float(np.mean([b for b, _, _ in run.loops[1].samples] or [0])))
        runs.append(run)
    all_fit = fit_steps(runs)

    # 3. Predict: the chain as the service runs it (one line per model), the chain
    #    with overlap-aware step times, and the deterministic sim with those.
    def chain(fit: StepFit, aware: bool) -> list[float]:
        lat = fit.solo if aware else fit.plain
        over = fit.overlap if aware else (None, None)
        return [
            predicted_throughput(
                ModelPair(args.p, lat[0], lat[1], args.tokens_per_visit,
                          overlap_latency_s_small=over[0], overlap_latency_s_large=over[1]),
                n, args.b_small, b,
            )
            for b in b_large_values
        ]  # fmt: skip

    preds = {
        "chain, plain fit, eager run": chain(eager_fit, False),
        "chain, overlap-aware, eager run": chain(eager_fit, True),
        "chain, overlap-aware, all runs": chain(all_fit, True),
        "sim (deterministic), overlap-aware, all runs": [
            simulate(
                ModelPair(args.p, all_fit.solo[0], all_fit.solo[1], args.tokens_per_visit,
                          overlap_latency_s_small=all_fit.overlap[0],
                          overlap_latency_s_large=all_fit.overlap[1]),
                n, args.b_small, b, num_steps=60_000, seed=args.seed,
            ).throughput_tok_s
            for b in b_large_values
        ],
    }  # fmt: skip
    rhos = {name: spearman(measured, pred) for name, pred in preds.items()}
    load = os.getloadavg()
    print(
        f"N={n} p={args.p} tokens/visit={args.tokens_per_visit} B_S={args.b_small} "
        f"{args.seconds:.0f} s/run; load avg {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )

    def line(f: AffineLatency) -> str:
        return f"{f.intercept_s * 1e3:.1f} + {f.per_request_s * 1e3:.2f} b ms"

    for name, fit in (("eager run", eager_fit), ("all runs", all_fit)):
        print(
            f"  {name}: t_S plain {line(fit.plain[0])}, solo {line(fit.solo[0])}, overlapped "
            f"{line(fit.overlap[0])}; t_L plain {line(fit.plain[1])}, solo {line(fit.solo[1])}, "
            f"overlapped {line(fit.overlap[1])}"
        )
    print(
        " B_L  measured  " + "  ".join(f"[{k}]" for k in range(len(preds))) + "  L batch  timeouts"
    )
    for i, b in enumerate(b_large_values):
        cols = "  ".join(f"{pred[i]:{len(str(k)) + 2}.1f}" for k, pred in enumerate(preds.values()))
        print(f" {b:3d}  {measured[i]:8.1f}  {cols}  {batches[i]:7.2f}  {timeouts[i]:8d}")
    for k, (name, pred) in enumerate(preds.items()):
        best = b_large_values[int(np.argmax(pred))]
        print(f" [{k}] {name}: Spearman {rhos[name]:.3f}, best B_L {best}")
    print(f" measured best B_L {b_large_values[int(np.argmax(measured))]}")
    if args.out:
        fits = {
            name: {
                kind: [[x.intercept_s, x.per_request_s] for x in getattr(fit, kind)]
                for kind in ("plain", "solo", "overlap")
            }
            for name, fit in (("eager_run", eager_fit), ("all_runs", all_fit))
        }
        result = {
            "args": vars(args),
            "b_large": b_large_values,
            "measured_tok_s": measured,
            "predicted_tok_s": preds,
            "spearman": rhos,
            "fits_s": fits,
            "mean_large_batch": batches,
            "timeouts": timeouts,
            "load_avg": load,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.platform(),
        }
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
