"""Token-level routing benchmark: every policy against the baselines, closed loop.

One run builds a cluster file (one worker each for smollm2-small, smollm2-medium and
the full smollm2-135m; for every policy a preset per runtime mode: ``<policy>`` in
``baton`` mode, ``<policy>-eager`` in ``eager_async``, ``<policy>-std`` in
``std_serving``, ``<policy>-barrier`` in ``barrier``), starts it once with the launcher on free ports, and drives closed
loops over HTTP: at concurrency c, c clients each send ``--requests-per-slot``
chat completions back to back (temperature 0, ``ignore_eos``, ``--new-tokens``
tokens, streamed so TTFT is measured), alpaca prompts from the held-out range
[4500, 5000) in order. The baselines ``large_only`` / ``small_only`` are plain
requests to smollm2-135m / smollm2-small. ``barrier`` is step barriers: the entry
model waits while any of its requests is at a peer (lockstep serving).

Per (policy, mode, concurrency):

* ``output_tok_s``: completion tokens of the cell / wall time of the cell;
* ``mean_ttft_ms``, ``mean_e2el_ms``: per request, first content chunk and last byte;
* ``token_share``: tokens each model wrote (``usage.tokens_by_model``) / all;
* ``agreement_with_large``: position-wise fraction of the large-only greedy answer's
  tokens that the answer has at the same position (mean over requests). Token ids
  are recovered by re-tokenizing the returned text with the smollm2-135m
  tokenizer (the API returns text); a decode/encode round trip can merge or split
  a few tokens, the same way for every mode;
* ``mean_logprob_large``: mean log-probability of the answer's (re-tokenized)
  tokens under smollm2-135m, teacher forced after the serving runs with the
  engine's model code (dtype auto, one thread), over all tokens of the cell's scored
  requests (``--score-limit`` per cell).

Both quality figures score the answer proper: the text up to the model's first
``<|im_end|>`` (requests ask for ``skip_special_tokens: false``); what
``ignore_eos`` makes a model write past its own end is timed but not scored.

Prints a table (figure, anchor, ratio) and the issue's targets, met or not; writes
``--out`` JSON ``{"results": [...], "targets": [...], "run": {...}}``.

A small example (the subsets measured and their exact commands are in
docs/token-routing.md, "Benchmark")::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_token.py --policies r2r \\
        --concurrency 1 4 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadgen.data import data_dir  # noqa: E402
from services.launcher.servers import free_port  # noqa: E402
from shared.config import ClusterConfig, PresetConfig, load_cluster  # noqa: E402
from shared.runtime import exit_on_sigterm  # noqa: E402

DEFAULT_PROMPTS = data_dir() / "prompts" / "alpaca_5000_random.json"
HELDOUT = (4500, 5000)
SMALL, MEDIUM, LARGE = "smollm2-small", "smollm2-medium", "smollm2-135m"
POLICIES = ("r2r", "citer", "co-llm", "r-stitch", "me")
TOKEN_MODES = ("baton", "eager_async", "barrier", "std_serving")  # run by the runtime
MODES = ("baton", "eager_async", "barrier", "std_serving", "large_only", "small_only")
BASELINE_MODEL = {"large_only": LARGE, "small_only": SMALL}
PRESET_SUFFIX = {
    "baton": "",
    "eager_async": "-eager",
    "barrier": "-barrier",
    "std_serving": "-std",
}
PAPER_SCALING = 8.61  # TokenRouter: Baton throughput at concurrency 16 over 1


# ---------------------------------------------------------------- pure parts (tested)


def preset_name(policy: str, mode: str) -> str:
    """The bench cluster's preset for a policy run in one runtime mode."""
    return policy + PRESET_SUFFIX[mode]


END_OF_TURN = "<|im_end|>"  # SmolLM2's end of turn (the chat template's EOS)


def answer_proper(text: str) -> str:
    """The answer up to the model's first end of turn (the rest is what ignore_eos made
    it write past its own end: not part of the answer whose quality is scored)."""
    return text.split(END_OF_TURN, 1)[0]


def agreement(answer: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of the reference's positions where the answer has the same token."""
    if not reference:
        raise ValueError("empty reference answer")
    same = sum(1 for a, r in zip(answer, reference, strict=False) if a == r)
    return same / len(reference)


def token_share(by_model: Iterable[dict[str, int]]) -> dict[str, float]:
    """Tokens each model wrote over all tokens, summed over requests."""
    totals: dict[str, int] = {}
    for counts in by_model:
        for model, n in counts.items():
            totals[model] = totals.get(model, 0) + n
    total = sum(totals.values())
    return {m: n / total for m, n in sorted(totals.items())} if total else {}


@dataclass
class Reply:
    """One request's answer and timings."""

    prompt_index: int  # index into the held-out prompts
    text: str
    completion_tokens: int
    tokens_by_model: dict[str, int]
    ttft_s: float | None
    e2e_s: float


@dataclass
class Cell:
    """One (policy, mode, concurrency) closed loop."""

    policy: str | None  # None for the baselines (large_only / small_only)
    mode: str
    concurrency: int
    wall_s: float = 0.0  # summed over rounds
    replies: list[Reply] = field(default_factory=list)
    round_tok_s: list[float] = field(default_factory=list)  # output tok/s of each round
    agreements: list[float] = field(default_factory=list)
    logprob_sum: float = 0.0
    logprob_tokens: int = 0

    def row(self) -> dict[str, Any]:
        """The JSON row (the issue's shape; nulls where nothing was measured)."""
        row: dict[str, Any] = {
            "policy": self.policy,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "output_tok_s": None,
            "mean_ttft_ms": None,
            "mean_e2el_ms": None,
            "token_share": None,
            "agreement_with_large": None,
            "mean_logprob_large": None,
        }
        if not self.replies:
            return row
        n = len(self.replies)
        ttfts = [r.ttft_s for r in self.replies if r.ttft_s is not None]
        row["output_tok_s"] = sum(r.completion_tokens for r in self.replies) / self.wall_s
        row["mean_ttft_ms"] = 1e3 * sum(ttfts) / len(ttfts) if ttfts else None
        row["mean_e2el_ms"] = 1e3 * sum(r.e2e_s for r in self.replies) / n
        row["token_share"] = token_share(r.tokens_by_model for r in self.replies)
        if self.agreements:
            row["agreement_with_large"] = sum(self.agreements) / len(self.agreements)
        if self.logprob_tokens:
            row["mean_logprob_large"] = self.logprob_sum / self.logprob_tokens
        row["requests"] = n
        row["output_tok_s_rounds"] = self.round_tok_s
        return row


def find_row(rows: list[dict[str, Any]], mode: str, conc: int, policy: str | None) -> Any:
    """The row of (policy, mode, conc); the baselines' rows have no policy."""
    want = None if mode in BASELINE_MODEL else policy
    for r in rows:
        if r["mode"] == mode and r["concurrency"] == conc and r["policy"] == want:
            return r
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(rows: list[dict[str, Any]], policy: str = "r2r", conc: int = 8) -> list[dict[str, Any]]:
    """The issue's targets for one policy: figure, anchor, ratio, need, met (None: not run)."""
    out: list[dict[str, Any]] = []

    def tput(mode: str, c: int = conc) -> float | None:
        r = find_row(rows, mode, c, policy)
        return None if r is None else r["output_tok_s"]

    def add(name: str, fig: float | None, anchor: float | None, need: float) -> None:
        rat = ratio(fig, anchor)
        met = None if rat is None else rat >= need
        out.append(
            {
                "target": name,
                "figure": fig,
                "anchor": anchor,
                "ratio": rat,
                "need": need,
                "met": met,
            }
        )

    add(
        f"{policy} c={conc}: baton tok/s >= 2x std_serving", tput("baton"), tput("std_serving"), 2.0
    )
    add(
        f"{policy} c={conc}: delayed batching (baton) >= 1.1x eager_async",
        tput("baton"),
        tput("eager_async"),
        1.1,
    )
    for metric in ("agreement_with_large", "mean_logprob_large"):
        mine, small, large = (
            find_row(rows, m, conc, policy) for m in ("baton", "small_only", "large_only")
        )
        vals = [None if r is None else r[metric] for r in (mine, small, large)]
        met = None if None in vals else vals[1] < vals[0] < vals[2]  # type: ignore[operator]
        out.append(
            {
                "target": f"{policy} c={conc}: {metric} strictly between small_only and large_only",
                "figure": vals[0],
                "anchor": {"small_only": vals[1], "large_only": vals[2]},
                "ratio": None,
                "need": None,
                "met": met,
            }
        )
    concs = sorted(
        r["concurrency"]
        for r in rows
        if r["policy"] == policy and r["mode"] == "baton" and r["output_tok_s"]
    )
    if len(concs) >= 2:
        lo, hi = concs[0], concs[-1]
        fig = ratio(tput("baton", hi), tput("baton", lo))
        out.append(
            {
                "target": f"{policy} baton scaling c={lo} -> c={hi} (paper 1 -> 16: {PAPER_SCALING}x)",
                "figure": fig,
                "anchor": PAPER_SCALING,
                "ratio": ratio(fig, PAPER_SCALING),
                "need": None,
                "met": None,  # reported, not a pass/fail target
            }
        )
    return out


def fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "met" if x else "NOT met"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each row's throughput next to its anchor (std_serving for the token modes,
    large_only for the baselines) and the ratio."""
    head = (
        "| policy | mode | conc | out tok/s | anchor | anchor tok/s | ratio | TTFT ms | E2E ms "
        "| large-model share | agreement | logprob (large) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        anchor_mode = "large_only" if r["mode"] in BASELINE_MODEL else "std_serving"
        anchor = find_row(rows, anchor_mode, r["concurrency"], r["policy"])
        a_tput = None if anchor is None else anchor["output_tok_s"]
        share = r["token_share"]
        large = None if share is None else share.get(LARGE, 0.0)
        lines.append(
            f"| {r['policy'] or '-'} | {r['mode']} | {r['concurrency']} | {fmt(r['output_tok_s'])} "
            f"| {anchor_mode} | {fmt(a_tput)} | {fmt(ratio(r['output_tok_s'], a_tput), '.2f')} "
            f"| {fmt(r['mean_ttft_ms'], '.0f')} | {fmt(r['mean_e2el_ms'], '.0f')} "
            f"| {fmt(large, '.3f')} | {fmt(r['agreement_with_large'], '.3f')} "
            f"| {fmt(r['mean_logprob_large'], '.3f')} |"
        )
    return "\n".join(lines)


def target_table(tgts: list[dict[str, Any]]) -> str:
    lines = ["| target | figure | anchor | ratio | need | result |", "|---|---|---|---|---|---|"]
    for t in tgts:
        anchor = t["anchor"]
        if isinstance(anchor, dict):
            anchor = ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in anchor.items())
        result = "reported" if t["met"] is None and t["figure"] is not None else fmt(t["met"])
        if t["figure"] is None:
            result = "not run"
        lines.append(
            f"| {t['target']} | {fmt(t['figure'], '.3f')} | {fmt(anchor, '.3f') if not isinstance(anchor, str) else anchor} "
            f"| {fmt(t['ratio'], '.2f')} | {fmt(t['need'])} | {result} |"
        )
    return "\n".join(lines)


def cluster_text(
    base: ClusterConfig,
    policies: Sequence[str],
    modes: Sequence[str],
    ports: dict[str, int],
    fixed_b: Sequence[int] = (),
) -> str:
    """The bench's cluster file: three workers, one preset per (policy, token mode).
    Policy models and arguments come from the base cluster file's presets; `fixed_b`
    pins the batcher's (B_entry, B_large) instead of the chain's B*."""
    out = [
        "# Written by scripts/bench_token.py: token-level presets per (policy, mode).",
        'namespace = "bench-token"',
        f'nats_url = "nats://127.0.0.1:{ports["nats"]}"',
        f'redis_url = "redis://127.0.0.1:{ports["redis"]}/0"',
        "",
        "[gateway]",
        'host = "127.0.0.1"',
        f"port = {ports['gateway']}",
        "",
        "[batcher]",
        "# Short runs: trust the estimates sooner, publish the tables more often.",
        "publish_interval_s = 2.0",
        "min_tokens = 500",
        "min_handoffs = 10",
        "min_step_samples = 30",
        *([f"fixed_b = [{fixed_b[0]}, {fixed_b[1]}]"] if fixed_b else []),
        "",
    ]
    for model in (LARGE, MEDIUM, SMALL):
        out += [f"[models.{model}]", 'dtype = "auto"', ""]  # as configs/local.toml
        out += [
            "[[instances]]",
            f'model = "{model}"',
            "replicas = 1",
            "[instances.scheduler]",
            "max_num_seqs = 16",
            "max_num_batched_tokens = 512",
            "num_kv_blocks = 512",
            "max_model_len = 2048",
            "",
        ]
    for policy in policies:
        src = base.presets.get(policy)
        if src is None or src.token_policy != policy:
            raise SystemExit(f"bench_token: the base cluster file has no token preset {policy!r}")
        for mode in modes:
            if mode not in TOKEN_MODES:
                continue
            out += [f"[presets.{preset_name(policy, mode)}]", *preset_lines(src, mode), ""]
    return "\n".join(out)


def preset_lines(src: PresetConfig, mode: str) -> list[str]:
    args = ", ".join(f"{k} = {json.dumps(v)}" for k, v in src.args.items())
    return [
        f"models = {json.dumps(src.models)}",
        f'token_policy = "{src.token_policy}"',
        f'mode = "{mode}"',
        f"args = {{ {args} }}",
    ]


# ---------------------------------------------------------------- the cluster


class Deployment:
    """The launcher as a subprocess in its own session; stopped with SIGINT (Ctrl-C)."""

    def __init__(self, cluster_path: Path, log_dir: Path, base_url: str) -> None:
        self.cluster_path, self.log_dir, self.base_url = cluster_path, log_dir, base_url
        cluster = load_cluster(cluster_path, environ={})
        # the launcher's worker ids (ClusterConfig.replica_ids), waited for in /health
        self.instances = {i for inst in cluster.instances for i in cluster.replica_ids(inst)}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
        env["OMP_NUM_THREADS"] = "1"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / "launcher.out", "ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.launcher",
                    str(self.cluster_path),
                    "--log-dir",
                    str(self.log_dir),
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"bench_token: the launcher exited ({self.proc.returncode}); see {self.log_dir}"
                )
            try:
                # /health is ready with one live worker; a bench needs all of them.
                resp = httpx.get(self.base_url + "/health", timeout=1)
                if resp.status_code == 200 and self.instances <= set(resp.json()["workers"]):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise SystemExit(f"bench_token: not ready after {timeout_s:.0f} s; see {self.log_dir}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # the launcher drains and stops its children
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# ---------------------------------------------------------------- the closed loops


def load_prompts(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lo, hi = HELDOUT
    return [
        ex["instruction"] + ("\n\n" + ex["input"] if ex.get("input") else "") for ex in data[lo:hi]
    ]


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, index: int, new_tokens: int
) -> Reply:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        # Keep "<|im_end|>" in the text: quality is scored on the answer proper, the
        # tokens before the model's first end of turn (ignore_eos writes on past it).
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{model}: in-band error {chunk['error']}")
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    pieces.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
    e2e = time.perf_counter() - t0
    n = int(usage.get("completion_tokens", 0))
    by_model = usage.get("tokens_by_model") or {model: n}
    return Reply(index, "".join(pieces), n, dict(by_model), ttft, e2e)


async def closed_loop(
    base_url: str,
    model: str,
    cell: Cell,
    prompts: list[str],
    total: int,
    new_tokens: int,
    desc: str,
) -> None:
    """cell.concurrency clients sending total requests, each client back to back; prompt i
    for request i (the same prompts for every mode at one concurrency)."""
    if total > len(prompts):
        raise SystemExit(f"bench_token: {total} requests need more than {len(prompts)} prompts")
    queue = list(range(total))
    bar = tqdm(total=total, desc=desc, unit="req", leave=False)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            cell.replies.append(await one_request(client, model, prompts[i], i, new_tokens))
            bar.update(1)

    limits = httpx.Limits(max_connections=cell.concurrency + 4)
    first = len(cell.replies)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(cell.concurrency)))
        wall = time.perf_counter() - t0
    cell.wall_s += wall
    cell.round_tok_s.append(sum(r.completion_tokens for r in cell.replies[first:]) / wall)
    bar.close()


def plan_cells(policies: Sequence[str], modes: Sequence[str], concs: Sequence[int]) -> list[Cell]:
    cells = []
    for c in concs:
        for mode in modes:
            if mode in BASELINE_MODEL:
                cells.append(Cell(None, mode, c))
            else:
                cells.extend(Cell(p, mode, c) for p in policies)
    return cells


# ---------------------------------------------------------------- quality (after serving)


def score(cells: list[Cell], references: dict[int, str], prompts: list[str], limit: int) -> None:
    """Agreement with the large-only answers and mean log-prob under the large model."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "scripts"))
    from train_routers import Sequence as TFSeq  # the engine's teacher-forced forward
    from train_routers import create_engine, prefill_hidden, token_batches

    from shared.model_store import load_tokenizer

    tok = load_tokenizer(LARGE)
    ref_ids = {i: tok.encode(answer_proper(t)) for i, t in references.items()}
    jobs: list[tuple[Cell, TFSeq]] = []
    for cell in cells:
        for reply in cell.replies:
            ids = tok.encode(answer_proper(reply.text))
            if ref_ids.get(reply.prompt_index):
                cell.agreements.append(agreement(ids, ref_ids[reply.prompt_index]))
        for reply in sorted(cell.replies, key=lambda r: r.prompt_index)[:limit]:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": prompts[reply.prompt_index]}]
            )
            ids = tok.encode(answer_proper(reply.text))
            if ids:
                jobs.append((cell, TFSeq(prompt + ids, len(prompt))))
    if not jobs:
        return
    engine = create_engine(LARGE, "auto")
    seqs = [s for _, s in jobs]
    owner = {id(s): c for c, s in jobs}
    with torch.inference_mode():
        for batch in tqdm(
            token_batches(seqs, 1024), desc="scoring under smollm2-135m", unit="batch"
        ):
            for s, h in zip(batch, prefill_hidden(engine, batch), strict=True):
                logits = engine.model.compute_logits(h[s.start - 1 : len(s.ids) - 1])
                ref = torch.tensor(s.ids[s.start :])
                lp = torch.log_softmax(logits, dim=-1).gather(1, ref.view(-1, 1))
                cell = owner[id(s)]
                cell.logprob_sum += float(lp.sum())
                cell.logprob_tokens += len(ref)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Token-level routing: every policy in every runtime mode against the "
        "large-only / small-only baselines, closed loop over HTTP (JSON to --out).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests per client per cell")
    p.add_argument("--new-tokens", type=int, default=256, help="max_tokens (ignore_eos)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every cell this many times, alternating the order (a ratio of two cells "
        "near 1 needs >= 2 on a shared machine)",
    )
    p.add_argument(
        "--only",
        nargs="*",
        default=[],
        metavar="POLICY:MODE:CONC",
        help="run only these cells of the matrix (e.g. me:baton:8); baselines as :large_only:8",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="unmeasured requests per baton preset first (delayed batching's estimates)",
    )
    p.add_argument(
        "--score-limit",
        type=int,
        default=1000,
        help="requests per cell scored under the large model",
    )
    p.add_argument(
        "--base-cluster",
        type=Path,
        default=REPO / "configs" / "local.toml",
        help="policy presets (models, args) come from here",
    )
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench_token.json")
    p.add_argument(
        "--cluster-out", type=Path, default=None, help="also keep the generated cluster file here"
    )
    p.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temp dir)")
    p.add_argument(
        "--quality",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score the answers against large-only references (--no-quality: throughput "
        "and latency only)",
    )
    p.add_argument(
        "--fixed-b",
        nargs=2,
        type=int,
        default=[],
        metavar=("B_ENTRY", "B_LARGE"),
        help="pin the batcher's tables of the baton presets to this pair (a B sweep by hand)",
    )
    args = p.parse_args(argv)
    if args.fixed_b and min(args.fixed_b) < 1:
        p.error("--fixed-b values must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if any(c < 1 for c in args.concurrency) or args.requests_per_slot < 1 or args.new_tokens < 1:
        p.error("--concurrency, --requests-per-slot and --new-tokens must be >= 1")
    return args


def round_schedule(cells: list[Cell], rounds: int) -> list[Cell]:
    """The order cells run in: every cell once per round, rounds alternating forward
    and reversed (each cell's rounds add into the same Cell)."""
    return [cell for r in range(rounds) for cell in (cells if r % 2 == 0 else cells[::-1])]


def selected(cells: list[Cell], only: list[str]) -> list[Cell]:
    if not only:
        return cells
    keep = set()
    for spec in only:
        parts = spec.split(":")
        if len(parts) != 3:
            raise SystemExit(f"bench_token: --only takes POLICY:MODE:CONC, got {spec!r}")
        keep.add((parts[0] or None, parts[1], int(parts[2])))
    return [c for c in cells if (c.policy, c.mode, c.concurrency) in keep]


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()  # (the launcher runs in its own session)
    args = parse_args(argv)
    base = load_cluster(args.base_cluster)
    prompts = load_prompts(args.prompts)
    cells = selected(plan_cells(args.policies, args.modes, args.concurrency), args.only)
    ports = {"gateway": free_port(), "nats": free_port(), "redis": free_port()}
    text = cluster_text(base, args.policies, args.modes, ports, args.fixed_b)
    work = Path(tempfile.mkdtemp(prefix="bench-token-"))
    cluster_path = args.cluster_out or work / "cluster.toml"
    cluster_path.parent.mkdir(parents=True, exist_ok=True)
    cluster_path.write_text(text)
    base_url = f"http://127.0.0.1:{ports['gateway']}"
    dep = Deployment(cluster_path, args.log_dir or work / "logs", base_url)
    print(f"bench_token: cluster {cluster_path}, logs {dep.log_dir}", flush=True)
    t_start = time.time()
    references: dict[int, str] = {}
    try:
        dep.start()  # (in the try: a SIGTERM while it waits for the workers stops them too)
        warm = sorted({c.policy for c in cells if c.mode == "baton" and c.policy})
        for policy in warm:
            if args.warmup:
                w = Cell(policy, "baton", min(args.warmup, 8))
                asyncio.run(
                    closed_loop(
                        base_url,
                        policy,
                        w,
                        prompts[-args.warmup :],
                        args.warmup,
                        args.new_tokens,
                        f"warm-up {policy}",
                    )
                )
        # Cells run one after another; with --rounds > 1 the order alternates (forward,
        # reversed, ...), so a drift of the machine's speed hits every cell alike and
        # a ratio of two cells is not the order they ran in.
        for cell in tqdm(round_schedule(cells, args.rounds), desc="cells", unit="cell"):
            model = BASELINE_MODEL.get(cell.mode) or preset_name(cell.policy or "", cell.mode)
            desc = f"{cell.policy or '-'} {cell.mode} c={cell.concurrency}"
            total = cell.concurrency * args.requests_per_slot
            asyncio.run(closed_loop(base_url, model, cell, prompts, total, args.new_tokens, desc))
            if cell.mode == "large_only":
                for r in cell.replies:
                    references.setdefault(r.prompt_index, r.text)
        # 2. Large-only greedy answers for any prompt no large_only cell covered.
        needed = sorted({r.prompt_index for c in cells for r in c.replies} - references.keys())
        if needed and args.quality:
            ref = Cell(None, "large_only", min(8, len(needed)))
            sub = [prompts[i] for i in needed]
            asyncio.run(
                closed_loop(
                    base_url, LARGE, ref, sub, len(sub), args.new_tokens, "large-only references"
                )
            )
            for r in ref.replies:
                references[needed[r.prompt_index]] = r.text
    finally:
        dep.stop()
    if args.quality:
        score(cells, references, prompts, args.score_limit)
    rows = [c.row() for c in cells]
    tgts = targets(rows) if any(c.policy == "r2r" for c in cells) else []
    print(table(rows))
    if tgts:
        print()
        print(target_table(tgts))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
        "wall_s": time.time() - t_start,
        "argv": sys.argv[1:],
        "new_tokens": args.new_tokens,
        "requests_per_slot": args.requests_per_slot,
        "rounds": args.rounds,
        "fixed_b": args.fixed_b,
        "load_avg": os.getloadavg(),
        "presets": {
            p: {"models": base.presets[p].models, "args": base.presets[p].args}
            for p in args.policies
        },
    }
    args.out.write_text(json.dumps({"results": rows, "targets": tgts, "run": run}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
