"""Fail when docs, code or comments carry development history or point outside the repository.

The repository describes Baton as it is; how it came to be lives in git. This check
reads every tracked text file (and untracked ones git does not ignore) and reports
each line that names a session, a dated run, a commit hash, an issue number, a file
outside the checkout (a Markdown file the checkout does not have), or speaks of what
the code "used to" do.

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
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Files read as text; data and generated files (JSON, CSV, images, model files) are not.
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".cfg", ".txt", ""}
SKIP = {"scripts/check_history.py"}  # its rules name what they look for

_UNITS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
_ORDINALS = (
    rf"{_UNITS}|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|"
    r"seventeenth|eighteenth|nineteenth|"
    rf"(?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)(?:-(?:{_UNITS}))?|"
    r"twentieth|thirtieth|fortieth|fiftieth|sixtieth|seventieth|eightieth|ninetieth|"
    r"\d+(?:st|nd|rd|th)|previous|earlier"
)
_PASSIVE = re.compile(r"\b(?:is|are|was|were|be|been|being)\s+$", re.I)


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    pattern: re.Pattern[str]
    # a match this says is not history (given the line and the match's start)
    exempt: Callable[[str, re.Match[str]], bool] | None = None


def _is_passive_or_comparison(line: str, m: re.Match[str]) -> bool:
    """'is used to ...' (a purpose) and 'no longer than' (a length) are not history."""
    word = m.group(0).lower()
    if word == "used to":
        return bool(_PASSIVE.search(line[: m.start()]))
    if word == "no longer":
        return line[m.end() :].lstrip().lower().startswith("than")
    return False


RULES = (
    Rule("session", re.compile(rf"\b(?:{_ORDINALS})[ -]sessions?\b|\bsessions? \d+\b", re.I)),
    # a date, unless part of a name (a model version such as gpt-4o-2024-08-06)
    Rule("dated run", re.compile(r"(?<![\w-])20\d\d-[01]\d-[0-3]\d\b")),
    Rule("issue number", re.compile(r"\bissue #?\d+\b", re.I)),
    Rule("file outside the repository", re.compile(r"\.\./shared\b|\bpapers/\d")),
    Rule(
        "history",
        re.compile(
            r"\bused to\b|\bno longer\b|\(was [^)]*\)|\btried, not landed\b|\bbefore the fix\b"
            r"|\bpreviously\b|\bformerly\b",
            re.I,
        ),
        _is_passive_or_comparison,
    ),
    # 7-12 hex digits with both a letter and a digit, alone, in a range or after
    # "commit/"; or a whole 40-digit one: a commit hash
    Rule(
        "commit hash",
        re.compile(
            r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w/-])"
            r"|\.\.(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
            r"|\bcommit/[0-9a-f]{7,40}\b|\b[0-9a-f]{40}\b"
        ),
    ),
)

# A benchmark's provenance line ("Machine / date / command: ...") may carry its date.
_PROVENANCE = re.compile(r"^\W*machine\b", re.I)
# A Markdown file named in the text: it must be one of the checkout's.
_MD_FILE = re.compile(r"[\w./-]*?([\w-]+\.md)\b")


@dataclass(frozen=True, slots=True)
class Hit:
    path: str
    line_no: int
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line_no}: {self.rule}: {self.text.strip()[:160]}"


def scan_text(path: str, text: str, md_files: Collection[str] | None = None) -> Iterator[Hit]:
    """Every rule's hit in `text`, one per line and rule. `md_files`: the basenames of
    the checkout's Markdown files (None: not checked)."""
    for line_no, line in enumerate(text.splitlines(), start=1):
        for rule in RULES:
            hit = next(
                (
                    m
                    for m in rule.pattern.finditer(line)
                    if rule.exempt is None or not rule.exempt(line, m)
                ),
                None,
            )
            if hit is None:
                continue
            if rule.name == "dated run" and _PROVENANCE.search(line):
                continue
            yield Hit(path, line_no, rule.name, line)
        if md_files is not None:
            missing = [m.group(1) for m in _MD_FILE.finditer(line) if m.group(1) not in md_files]
            if missing:
                yield Hit(path, line_no, f"no such file here ({', '.join(missing)})", line)


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
    paths = list(paths)
    md_files = {Path(p).name for p in repository_files() if p.endswith(".md")}
    hits: list[Hit] = []
    for rel in paths:
        path = Path(rel)
        if rel in SKIP or path.suffix not in TEXT_SUFFIXES:
            continue
        try:
            text = (REPO / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        hits.extend(scan_text(rel, text, md_files))
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
