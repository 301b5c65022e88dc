"""The history-word check (scripts/check_history.py): what it flags, and a clean checkout.

Each sample carries a "·" inside the words the check looks for, removed before the
check runs (`sample`), so that this file passes the very check it tests.
"""

from __future__ import annotations

import pytest

from tests.scripts import load_script

check_history = load_script("check_history")


def sample(text: str) -> str:
    return text.replace("·", "")


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("measured in the thirty-fifth ses·sion", "session"),
        ("as the 12th ses·sion found", "session"),
        ("(a probe, 2026-12·-06)", "dated run"),
        ("see iss·ue 3 for the targets", "issue number"),
        ("fixed in 1a4c·84d", "commit hash"),
        ("between d378·2e3..a26f·5a2", "commit hash"),
        ("the data in ../sha·red/data", "file outside the repository"),
        ("(pap·ers/003, eq. 11)", "file outside the repository"),
        ("the gateway us·ed to count it twice", "history"),
        ("a request is no lon·ger dropped", "history"),
        ("the TTL is 2 s (w·as 1 s)", "history"),
        ("previ·ously the gateway retried", "history"),
        ("as ses·sion 34 measured", "session"),
        ("see HEAD..abc·1234 for the change", "commit hash"),
        ("github.com/o/r/com·mit/0123456789abcdef0123·456789abcdef01234567", "commit hash"),
    ],
)
def test_history_is_flagged(line: str, rule: str) -> None:
    hits = list(check_history.scan_text("x.txt", f"intro\n{sample(line)}\n"))
    assert [(h.line_no, h.rule) for h in hits] == [(2, rule)]


@pytest.mark.parametrize(
    "line",
    [
        "Machine: 2-core Intel Xeon VM; date: 2026-12·-07; command: just bench-gateway",
        "a NATS ses·sion and aiohttp's ClientSession",
        "SEED = 20261202",
        "hash = 2654435761",
        "sha256 9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc",
        "color #1f77b4 and 0x7fffffff",
        "the request waits for its turn",
        "a lock is us·ed to serialize the writes",
        "prompts no lon·ger than max_model_len",
        "each step issues 2 Redis writes",
        "the last ses·sion of the aiohttp client, and a full-length ses·sion",
        "the model gpt-4o-2024-08·-06",
        "see docs/architecture.md and README.md",
    ],
)
def test_reference_text_passes(line: str) -> None:
    md_files = {"architecture.md", "README.md"}
    assert list(check_history.scan_text("x.txt", sample(line), md_files)) == []


def test_a_markdown_file_the_checkout_lacks_is_named() -> None:
    hits = list(check_history.scan_text("x.py", sample("as DESIGN.m·d says"), {"README.md"}))
    assert [h.rule for h in hits] == [sample("no such file here (DESIGN.m·d)")]


def test_the_checkout_carries_no_history() -> None:
    hits = check_history.scan_files(check_history.repository_files())
    assert hits == [], "\n".join(str(h) for h in hits[:40])
