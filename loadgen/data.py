"""The data directory: public request traces and prompt sets read by the load generator,
the benchmarks and some tests.

They are not shipped with Baton (each dataset has its own license). `BATON_DATA_DIR`
names a directory that holds them, laid out as below; the default is `data/` in the
checkout. `python -m loadgen.data` (`./baton just data`) says which files are there;
`--from DIR` links them from a directory that holds them, each checked by its sha256.

    python -m loadgen.data                 # what is present, missing or altered
    python -m loadgen.data --from /mnt/ds  # link DIR's files into the data directory
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.config import Env

_CHECKOUT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class DataFile:
    path: str  # relative to the data directory
    sha256: str
    source: str
    license: str


DATA_FILES: tuple[DataFile, ...] = (
    DataFile(
        "traces/azure_llm_2023_conv.csv",
        "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
        "Azure/AzurePublicDataset data/AzureLLMInferenceTrace_conv.csv",
        "CC-BY 4.0",
    ),
    DataFile(
        "traces/mooncake_fast25_conversation_trace.jsonl",
        "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        "kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl",
        "Apache-2.0",
    ),
    DataFile(
        "traces/burstgpt1_first400.csv",
        "7865fda5dac50938a84dfccb06c405e2f5202969ecfbd671c8399de00f4335f0",
        "HPMLL/BurstGPT BurstGPT_1.csv, its first 400 rows",
        "CC-BY 4.0",
    ),
    DataFile(
        "prompts/alpaca_5000_random.json",
        "fc1add24c93c9fbbe585a64a6c9bf6165eb110225f4470efbff382a913558ec0",
        "tatsu-lab/stanford_alpaca, 5,000 random rows of 52k",
        "CC BY-NC 4.0",
    ),
    DataFile(
        "prompts/hotpotqa_dev_distractor_hard_500.jsonl",
        "d2d566c667d789508aa3511d89cfcc3480fc9d62e556a09331be9376be42c075",
        "HotpotQA dev, distractor setting, 500 hard questions",
        "CC BY-SA 4.0",
    ),
    DataFile(
        "prompts/leval_govreport_summ_14.jsonl",
        "72ff9fc383afef70208e12598536fedb3c86341c6e6218cb2061caa049f3e0db",
        "OpenLMLab/LEval gov_report_summ",
        "CC BY 4.0",
    ),
    DataFile(
        "prompts/writingprompts_train498_with_gpt4.csv",
        "0e6a79509b04db66617b15a3645a0ca548029bb6ddab84580640a41b04a8dab7",
        "WritingPrompts (Fan et al. 2018), 498 prompts with GPT-4 stories",
        "not stated",
    ),
    DataFile(
        "prompts/aime2024_30.jsonl",
        "a0f7eb9915f60f70fdaa9375414869d101eab639a67acf652cde98166efcd1cc",
        "AIME 2024 problems",
        "problems (c) MAA",
    ),
    DataFile(
        "lengths/vidur_arxiv_summarization_llama2_token_lengths.csv",
        "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc",
        "microsoft/vidur, arxiv summarization token lengths",
        "MIT",
    ),
)


def data_dir() -> Path:
    """$BATON_DATA_DIR, else `data/` in the checkout."""
    value = Env.DATA_DIR.get()
    return Path(value).expanduser() if value else _CHECKOUT / "data"


def how_to_get() -> str:
    return (
        f"the data directory is {data_dir()} (${Env.DATA_DIR.name}); "
        "`./baton just data --from DIR` links the files from a directory that holds them "
        "(docs/benchmarks.md, Data)"
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def link_from(source: Path, target: Path) -> list[str]:
    """Symlink each known file found under `source` into `target` when its sha256 matches;
    returns one line per file. A file already in `target` stays (a symlink is replaced)."""
    lines = []
    for item in DATA_FILES:
        src, dst = source / item.path, target / item.path
        if not src.is_file():
            lines.append(f"not in {source}: {item.path}")
            continue
        if dst.exists() and not dst.is_symlink():
            lines.append(f"already there, kept: {dst}")
            continue
        if sha256_of(src) != item.sha256:
            lines.append(f"sha256 differs, not linked: {src}")
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_symlink():
            dst.unlink()
        dst.symlink_to(src.resolve())
        lines.append(f"linked: {item.path}")
    return lines


def has_files(*paths: str) -> bool:
    """Whether every one of these (relative to the data directory) is there."""
    root = data_dir()
    return all((root / p).is_file() for p in paths)


def status(directory: Path) -> list[tuple[DataFile, str]]:
    """Each known file with 'ok', 'missing' or 'altered' (its sha256 differs)."""
    out = []
    for item in DATA_FILES:
        path = directory / item.path
        if not path.is_file():
            out.append((item, "missing"))
        else:
            out.append((item, "ok" if sha256_of(path) == item.sha256 else "altered"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="just data", description="Report or fill the data directory (traces, prompt sets)."
    )
    ap.add_argument(
        "--from", dest="source", type=Path, help="a directory holding the files (same layout)"
    )
    args = ap.parse_args(argv)
    target = data_dir()
    if args.source is not None:
        if not args.source.is_dir():
            ap.error(f"--from {args.source}: not a directory")
        if args.source.resolve() == target.resolve():
            ap.error(f"--from {args.source} is the data directory itself")
        for line in link_from(args.source, target):
            print(line)
    print(f"data directory: {target}")
    rows = status(target)
    for item, state in rows:
        print(f"  {state:8} {item.path}  ({item.source}; {item.license})")
    num_ok = sum(state == "ok" for _, state in rows)
    print(f"{num_ok} of {len(rows)} files present")
    return 0 if num_ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
