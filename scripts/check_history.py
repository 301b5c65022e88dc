"""Fail when docs, code or comments carry development history or point outside the repository.

The repository describes Baton as it is; how it came to be lives in git. This check
reads every tracked text file (and untracked ones git does not ignore) and reports
each line that names a session, a dated run, a commit hash, an issue number, a file
outside the checkout, or speaks of what the code "used to" do.

    python scripts/check_history.py            # exit 1 and one line per hit
    python scripts/check_history.py FILE...    # only these files

Dates are allowed on a benchmark's "Machine ... date ..." line, the one place a figure's
provenance belongs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Files read as text; data and generated files (JSON, CSV, images, model files) are not.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg", ".txt", ""}
SKIP = {"scripts/check_history.py", "tests/test_check_history.py"}

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|\w+-\w+th|"
    r"\w+ieth|\d+(?:st|nd|rd|th)|last|this|previous|next|earlier|later"
)


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    pattern: re.Pattern[str]


RULES = (
    Rule("session", re.compile(rf"\b(?:{_ORDINALS}) sessions?\b|\bsession's\b", re.I)),
    Rule("dated run", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")),
    Rule("issue number", re.compile(r"\bissues? #?\d+\b|\bstop \d+\b", re.I)),
    Rule(
        "file outside the repository",
        re.compile(r"\.\./shared\b|\b(?:DESIGN|STYLE|anchors|peers)\.md\b|\bpapers/\d", re.I),
    ),
    Rule(
        "history",
        re.compile(
            r"\bused to\b|\bno longer\b|\(was [^)]*\)|\btried, not landed\b|\bbefore the fix\b",
            re.I,
        ),
    ),
    # 7-12 hex digits with both a letter and a digit, alone or in a range: a commit hash.
    Rule(
        "commit hash",
        re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w/-])"),
    ),
)

# A benchmark's provenance line may carry its date.
_PROVENANCE = re.compile(r"\bmachine\b", re.I)


@dataclass(frozen=True, slots=True)
class Hit:
    path: str
    line_no: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line_no}: {self.rule}: {self.text.strip()[:160]}"


def scan_text(path: str, text: str) -> Iterator[Hit]:
    """Every rule's hit in `text`, one per line and rule."""
    for line_no, line in enumerate(text.splitlines(), start=1):
        for rule in RULES:
            if not rule.pattern.search(line):
                continue
            if rule.name == "dated run" and _PROVENANCE.search(line):
                continue
            yield Hit(path, line_no, rule.name, line)


def repository_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, relative to the checkout."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [p for p in out.splitlines() if p and (REPO / p).is_file()]


def scan_files(paths: Iterable[str]) -> list[Hit]:
    hits: list[Hit] = []
    for rel in paths:
        path = Path(rel)
        if rel in SKIP or path.suffix not in TEXT_SUFFIXES:
            continue
        try:
            text = (REPO / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        hits.extend(scan_text(rel, text))
    return hits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="files to check (default: the whole checkout)")
    args = ap.parse_args(argv)
    hits = scan_files(args.files or repository_files())
    for hit in hits:
        print(hit)
    if hits:
        print(f"{len(hits)} lines carry history or point outside the repository", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
