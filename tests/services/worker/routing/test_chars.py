"""Character boundaries for hand-offs (services/worker/routing/chars.py), with SmolLM2's
real byte-level vocabulary."""

from __future__ import annotations

import pytest

from services.worker.routing.chars import CharBoundaries, ends_inside_char
from shared.model_store import byte_level_decoder, load_tokenizer


@pytest.mark.parametrize(
    ("data", "inside"),
    [
        (b"", False),
        (b"abc", False),
        ("é".encode(), False),
        ("é".encode()[:1], True),
        (b"x" + "क".encode()[:1], True),  # a 3-byte character's lead
        ("क".encode()[:2], True),
        ("🎉".encode()[:3], True),  # a 4-byte character, one byte short
        ("🎉".encode(), False),
        (b"\x89\x89\x89\x89", False),  # continuation bytes with no lead: nothing to complete
        (b"\xff", False),  # no UTF-8 byte
        (b"\xc3\xa9\xa9", False),  # one continuation too many: invalid, waits for nothing
        (b"\xe0\x80", False),  # no character begins so (overlong): waits for nothing
    ],
)
def test_ends_inside_char(data: bytes, inside: bool) -> None:
    assert ends_inside_char(data) is inside


def test_a_character_split_across_byte_tokens_is_seen_with_the_real_vocabulary() -> None:
    tok = load_tokenizer("smollm2-135m")
    by_byte = {b: c for c, b in byte_level_decoder().items()}  # byte -> its vocabulary char
    lead, cont = ("É".encode()[0], "É".encode()[1])
    lead_id, cont_id = (
        tok.backend.token_to_id(by_byte[lead]),
        tok.backend.token_to_id(by_byte[cont]),
    )
    word = tok.encode("cris")
    chars = CharBoundaries(tok.token_bytes)
    assert chars.ends_inside_char([*word, lead_id])
    assert not chars.ends_inside_char([*word, lead_id, cont_id])
    # a hand-after needs the sampled token to end a character; a rewrite, the text before it
    assert chars.splits_char(word, lead_id, rewrites=False)
    assert not chars.splits_char(word, lead_id, rewrites=True)
    assert chars.splits_char([*word, lead_id], cont_id, rewrites=True)
    assert not chars.splits_char([*word, lead_id], cont_id, rewrites=False)
    # only the last four tokens are read: a character is at most four bytes
    assert not chars.ends_inside_char([lead_id, *tok.encode(" and more words")])
