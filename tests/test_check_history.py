"""The history-word check (scripts/check_history.py): what it flags, and a clean checkout."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

check_history = load_script("check_history")


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("measured in the thirty-fifth session", "session"),
        ("as the 12th session found", "session"),
        ("(a probe, 2026-12-06)", "dated run"),
        ("see issue 3 for the targets", "issue number"),
        ("fixed in 1a4c84d", "commit hash"),
        ("between d3782e3..a26f5a2", "commit hash"),
        ("the data in ../shared/data", "file outside the repository"),
        ("(papers/003, eq. 11)", "file outside the repository"),
        ("the gateway used to count it twice", "history"),
        ("a request is no longer dropped", "history"),
        ("the TTL is 2 s (was 1 s)", "history"),
        ("previously the gateway retried", "history"),
        ("as session 34 measured", "session"),
        ("see HEAD..abc1234 for the change", "commit hash"),
        ("github.com/o/r/commit/0123456789abcdef0123456789abcdef01234567", "commit hash"),
    ],
)
def test_history_is_flagged(line: str, rule: str) -> None:
    hits = list(check_history.scan_text("x.md", f"intro\n{line}\n"))
    assert [(h.line_no, h.rule) for h in hits] == [(2, rule)]


@pytest.mark.parametrize(
    "line",
    [
        "Machine: 2-core Intel Xeon VM; date: 2026-12-07; command: just bench-gateway",
        "a NATS session and aiohttp's ClientSession",
        "SEED = 20261202",
        "hash = 2654435761",
        "sha256 9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc",
        "color #1f77b4 and 0x7fffffff",
        "the request waits for its turn",
        "a lock is used to serialize the writes",
        "prompts no longer than max_model_len",
        "each step issues 2 Redis writes",
        "the last session of the aiohttp client, and a full-length session",
        "the model gpt-4o-2024-08-06",
        "see docs/architecture.md and README.md",
    ],
)
def test_reference_text_passes(line: str) -> None:
    md_files = {"architecture.md", "README.md"}
    assert list(check_history.scan_text("x.md", line, md_files)) == []


def test_a_markdown_file_the_checkout_lacks_is_named() -> None:
    hits = list(check_history.scan_text("x.py", "as DESIGN.md says", {"README.md"}))
    assert [h.rule for h in hits] == ["no such file here (DESIGN.md)"]


def test_the_checkout_carries_no_history() -> None:
    hits = check_history.scan_files(check_history.repository_files())
    assert hits == [], "\n".join(str(h) for h in hits[:40])
