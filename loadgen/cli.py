"""Command-line parsers: the benchmark (default) and `compare`."""

from __future__ import annotations

import argparse
import json

from loadgen.config import DEFAULT_NUM_PROMPTS
from loadgen.data import data_dir
from loadgen.tokens import TOKENS_PER_WORD
from loadgen.traces import TRACE_FORMATS
from loadgen.workloads import PROMPT_SET_FILES

DESCRIPTION = """\
Drive an OpenAI-compatible endpoint with an arrival process or a replayed trace
and report TTFT, TPOT, ITL, E2EL, throughput, goodput, SLO attainment and
OnTimeUtility (JSON fields named as `vllm bench serve` names them).

  python -m loadgen --model auto --dataset mixed --request-rate 4 --num-prompts 200
  python -m loadgen --trace data/traces/azure_llm_2023_conv.csv \\
      --time-scale 0.5 --duration 120 --save-result run.json --plot plots/
  python -m loadgen compare A.json B.json

Every request streams (stream_options.include_usage). Definitions:
  TTFT  send -> first chunk that carries content (text or reasoning_content);
        a role-only or empty first chunk does not count
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request (vLLM's definition)
  ITL   every gap between content chunks, pooled over requests
  E2EL  send -> [DONE]
Output tokens come from the final usage chunk (else: content chunks).

Read from Baton's gateway when present (optional; other servers work without):
response headers X-Request-Id and X-Instance-Id, and the `baton` object {model,
instance, policy, router_overhead_ms, predicted_ttft_ms, cost} of the final
chunk. Sent on every request: x-request-id, x-slo-ttft-ms (see --slo-ttft-ms),
x-baton-task (the request's task) and, with --budget, x-baton-budget; the x-baton-*
headers are Baton-specific, other servers ignore them.
"""


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's parser."""
    p = argparse.ArgumentParser(
        prog="loadgen",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("endpoint")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root; /v1/... is appended (a trailing /v1 is accepted too)",
    )
    g.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions (chat prompts) or /v1/completions (default: chat)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="the request's `model`: a model or a routing preset (e.g. auto, r2r); "
        "default: the first id of GET /v1/models",
    )
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    g.add_argument(
        "--header",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="extra headers on every request (--header a=1 b=2, or repeated)",
    )
    g.add_argument(
        "--extra-body",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="JSON object merged into every request body",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one request may take in all (default 600)",
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0)"
    )
    eos = g.add_mutually_exclusive_group()
    eos.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        default=None,
        help="send ignore_eos=true so outputs run to max_tokens "
        "(default: on for --trace and --dataset random, off otherwise)",
    )
    eos.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json (or a directory with one) to build prompts to exact "
        "token lengths; without it lengths are approximated as "
        f"{TOKENS_PER_WORD} tokens per whitespace-separated word. Reported "
        "token counts come from the server's usage either way",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seeds arrivals and prompt choice (default 0)"
    )
    g.add_argument("--label", default=None, help="run label (result file name, plots, compare)")

    g = p.add_argument_group("arrivals (absolute schedule, seeded)")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean requests/s; inf = all at once, or closed loop with "
        "--max-concurrency (default inf). With --trace and no --time-scale: "
        "scale the trace to this mean rate",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape B of inter-arrival gaps: 1 = Poisson, < 1 burstier, "
        "> 1 smoother; gap CV = 1/sqrt(B) (default 1)",
    )
    g.add_argument(
        "--arrival",
        choices=("gamma", "mmpp", "square"),
        default="gamma",
        help="gamma: renewal at --request-rate; mmpp: two-state Markov-modulated; "
        "square: alternating high/low rates. All keep --request-rate as the mean",
    )
    g.add_argument(
        "--rate-ratio",
        type=float,
        default=4.0,
        help="mmpp/square: high rate / low rate (default 4)",
    )
    g.add_argument(
        "--high-share",
        type=float,
        default=None,
        help="mmpp/square: share of time at the high rate (default 0.2 mmpp, 0.5 square)",
    )
    g.add_argument(
        "--mmpp-sojourn-s",
        type=float,
        default=2.0,
        help="mmpp: time constant tau; the mean stay is tau/(1-f) high and tau/f low "
        "(f = --high-share) (default 2)",
    )
    g.add_argument(
        "--square-period-s",
        type=float,
        default=60.0,
        help="square: seconds of one high+low cycle, high first (default 60)",
    )
    g.add_argument(
        "--ramp-up-strategy",
        choices=("linear", "exponential"),
        default=None,
        help="ramp the rate from --ramp-up-start-rps to --ramp-up-end-rps (then hold)",
    )
    g.add_argument("--ramp-up-start-rps", type=float, default=None)
    g.add_argument("--ramp-up-end-rps", type=float, default=None)
    g.add_argument(
        "--ramp-up-duration-s",
        type=float,
        default=None,
        help="ramp length (default: --duration, else the time that --num-prompts take)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most N requests in flight; with rate inf this is a closed loop",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"number of requests (default {DEFAULT_NUM_PROMPTS} unless --duration or "
        "--trace bound the run; with --trace: the first N rows)",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds during which requests are sent (the run then drains)",
    )

    g = p.add_argument_group("trace replay")
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="replay a trace's arrival offsets and input/output lengths",
    )
    g.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default=None,
        help="default: guessed from the file name",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="multiply the trace's offsets by X: X < 1 compresses time (X = 0.5 "
        "replays at twice the trace's rate), X > 1 stretches it (default 1)",
    )
    g.add_argument(
        "--trace-start-s",
        type=float,
        default=0.0,
        help="start this many trace seconds in (default 0)",
    )
    g.add_argument(
        "--trace-duration-s",
        type=float,
        default=None,
        help="replay only the trace's first S seconds (from --trace-start-s, in trace "
        "time, before --time-scale); --duration instead counts replayed seconds",
    )
    g.add_argument(
        "--max-input-tokens",
        type=int,
        default=None,
        help="cap every prompt at this many tokens (trace lengths and prompt sets)",
    )
    g.add_argument(
        "--max-output-tokens", type=int, default=None, help="cap every request's max_tokens"
    )

    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default="alpaca",
        choices=(*PROMPT_SET_FILES, "mixed", "random", "jsonl"),
        help="prompt set, `mixed` task mix, random lengths, or a JSONL file; with "
        "--trace the prompt set whose text builds the prompts (default alpaca)",
    )
    g.add_argument("--dataset-path", default=None, metavar="FILE", help="the JSONL file")
    g.add_argument(
        "--mix",
        default=None,
        metavar="TASK:SHARE,...",
        help="shares for --dataset mixed (default alpaca, hotpotqa, govreport, "
        "writingprompts at 0.25 each)",
    )
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random lengths are uniform in len*(1-r) .. len*(1+r)",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens of every request (default: the prompt's reference answer "
        "length, the trace's output length, or 128 for JSONL)",
    )
    g.add_argument(
        "--data-dir",
        default=str(data_dir()),
        help="data directory with prompts/ (default: $BATON_DATA_DIR, else data/; "
        "see `just data`; now %(default)s)",
    )

    g = p.add_argument_group("routing inputs per request")
    g.add_argument(
        "--slo-ttft-ms",
        default="paper",
        metavar="MS|paper|none",
        help="TTFT target sent as header x-slo-ttft-ms (llm-d's convention; Baton "
        "reads it): a fixed number of ms, "
        "`paper` = 158 ms + 3.5e-3 ms per prompt token clipped to "
        "[150, 1120] ms, or `none` (default paper)",
    )
    g.add_argument(
        "--budget",
        type=float,
        default=None,
        help="cost budget per request, sent as header x-baton-budget and recorded per "
        "request (Baton caps each answer's cost at it; other servers ignore it)",
    )

    g = p.add_argument_group("metrics")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (all must hold)",
    )
    g.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="metrics that get percentiles (default %(default)s)",
    )
    g.add_argument(
        "--metric-percentiles",
        default="90,95,99",
        help="percentiles to report (default %(default)s)",
    )
    g.add_argument(
        "--utility-table",
        default=None,
        metavar="FILE",
        help="JSON {task: {model: utility}} or CSV task,model,utility for "
        "OnTimeUtility (default: every answer is worth 1)",
    )

    g = p.add_argument_group("output")
    g.add_argument(
        "--save-result",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="write the result JSON (to PATH, or a vLLM-style name in --result-dir)",
    )
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument(
        "--save-detailed",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="write one JSONL line per request (default: next to the result JSON)",
    )
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts to DIR")
    g.add_argument(
        "--metadata",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra fields stored in the result JSON",
    )
    g.add_argument(
        "--keep-text", action="store_true", help="keep generated text in the detailed JSONL"
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def build_compare_parser() -> argparse.ArgumentParser:
    """`loadgen compare A.json B.json`."""
    p = argparse.ArgumentParser(
        prog="loadgen compare", description="Two result JSONs side by side with B/A ratios."
    )
    p.add_argument("a", help="result JSON of run A (the baseline)")
    p.add_argument("b", help="result JSON of run B")
    p.add_argument(
        "--fields", default=None, help="comma-separated fields (default: headline + shared)"
    )
    return p
