"""Request traces: parse Azure, BurstGPT and Mooncake files into arrival rows.

Each row keeps the trace's arrival offset (seconds from its first row) and its
input/output token counts (the trace's own tokenizer; a replay maps them onto
ours by length). `select_rows` applies the replay window, time scale and caps.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TRACE_FORMATS = ("azure", "burstgpt", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_id block in the Mooncake traces


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace."""

    offset_s: float  # arrival, seconds after the trace's first row
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: ids of 512-token prompt prefix blocks
    label: str = ""  # BurstGPT: the model the request went to


def read_trace(path: str | Path, fmt: str) -> list[TraceRow]:
    """Parse a trace file, rows sorted by arrival, offsets relative to the first."""
    readers = {"azure": _read_azure, "burstgpt": _read_burstgpt, "mooncake": _read_mooncake}
    if fmt not in readers:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {TRACE_FORMATS}")
    rows = readers[fmt](Path(path))
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    rows.sort(key=lambda r: r.offset_s)
    first = rows[0].offset_s
    return [replace(r, offset_s=r.offset_s - first) for r in rows]


def _read_azure(path: Path) -> list[TraceRow]:
    """`TIMESTAMP,ContextTokens,GeneratedTokens` with wall-clock timestamps (ns digits)."""
    with path.open(newline="") as f:
        records = list(csv.DictReader(f))
    stamps = np.array(
        [np.datetime64(r["TIMESTAMP"].strip().replace(" ", "T"), "ns") for r in records]
    )
    seconds = (stamps - stamps.min()).astype(np.int64) / 1e9
    return [
        TraceRow(float(t), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
        for t, r in zip(seconds, records, strict=True)
    ]


def _read_burstgpt(path: Path) -> list[TraceRow]:
    """`Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type` (seconds)."""
    with path.open(newline="") as f:
        return [
            TraceRow(
                float(r["Timestamp"]),
                int(r["Request tokens"]),
                int(r["Response tokens"]),
                label=r["Model"],
            )
            for r in csv.DictReader(f)
        ]


def _read_mooncake(path: Path) -> list[TraceRow]:
    """JSONL `{timestamp (ms), input_length, output_length, hash_ids}`."""
    rows = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            rows.append(
                TraceRow(
                    r["timestamp"] / 1000.0,
                    int(r["input_length"]),
                    int(r["output_length"]),
                    hash_ids=tuple(r.get("hash_ids", ())),
                )
            )
    return rows


def native_rate(rows: list[TraceRow]) -> float:
    """Mean arrival rate (req/s) of rows: count over their span from offset 0."""
    span = rows[-1].offset_s - rows[0].offset_s
    return math.inf if span <= 0 else len(rows) / span


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """Which part of a trace to replay and how."""

    start_s: float = 0.0  # skip rows before this offset (trace time)
    trace_duration_s: float | None = None  # keep rows within this long after start_s (trace time)
    num_prompts: int | None = None  # first N rows of the window
    time_scale: float | None = None  # offsets are multiplied by this: < 1 compresses time
    target_rate: float | None = None  # if time_scale is None: scale to this mean rate
    duration_s: float | None = None  # keep rows whose scaled offset is below this
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None


def select_rows(rows: list[TraceRow], window: TraceWindow) -> tuple[list[TraceRow], float]:
    """Apply the window; return the rows (first at offset 0) and the time scale used."""
    chosen = [r for r in rows if r.offset_s >= window.start_s]
    if window.trace_duration_s is not None:
        end = window.start_s + window.trace_duration_s
        chosen = [r for r in chosen if r.offset_s < end]
    if window.num_prompts is not None:
        chosen = chosen[: window.num_prompts]
    if not chosen:
        raise ValueError("the trace window selects no rows")
    scale = 1.0
    if window.time_scale is not None:
        scale = window.time_scale
    elif window.target_rate is not None and math.isfinite(window.target_rate):
        rate = native_rate(chosen)
        scale = rate / window.target_rate if math.isfinite(rate) else 1.0
    assert scale > 0, "time scale must be positive"
    first = chosen[0].offset_s
    out = []
    for r in chosen:
        offset = (r.offset_s - first) * scale
        if window.duration_s is not None and offset >= window.duration_s:
            break
        inp = r.input_tokens
        outp = r.output_tokens
        if window.max_input_tokens is not None:
            inp = min(inp, window.max_input_tokens)
        if window.max_output_tokens is not None:
            outp = min(outp, window.max_output_tokens)
        out.append(
            replace(r, offset_s=offset, input_tokens=max(1, inp), output_tokens=max(1, outp))
        )
    return out, scale
