"""Character boundaries: the pen changes hands only between characters.

A byte-level BPE vocabulary (SmolLM2's) writes a rare character as several tokens, one
or more bytes of its UTF-8 each. A model that wrote the first bytes knows the rest; a
model handed the pen in between sees a lone lead byte it never saw alone in training
and writes on as if it were not there: the text gets U+FFFD and loses the character
(a black-box probe saw r2r answer "\ufffdcris une phrase" for "Écris une phrase", and
the same in Hindi). So the runtime defers a hand-off that would split a character
until the character is complete: a hand-after while the text, the sampled token
included, ends inside one; a rewrite while the text before the rewritten token does.

A character is at most 4 bytes and every token at least one, so whether a text ends
inside a character is read off its last 4 tokens (`ends_inside_char`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

MAX_CHAR_BYTES = 4


def char_width(lead: int) -> int:
    """Bytes of the UTF-8 character that byte begins (0: a continuation byte, or none
    that UTF-8 uses)."""
    if lead < 0x80:
        return 1
    if lead < 0xC0 or lead >= 0xF8:
        return 0
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def continuation_bytes_owed(data: bytes) -> int:
    """How many continuation bytes the last character of `data` still needs (0: it
    ends between characters, or in bytes that are no valid UTF-8 and wait for none)."""
    # Find the last byte that is not a continuation byte (10xxxxxx), at most 4 back.
    for back in range(1, min(MAX_CHAR_BYTES, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: its lead is further back
        return max(0, char_width(byte) - back)
    return 0  # only continuation bytes: nothing valid to complete


class CharBoundaries:
    """Whether a token sequence ends inside a character, by the vocabulary's bytes."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        # a token's bytes never change: each is looked up once
        self._bytes = functools.lru_cache(maxsize=None)(token_bytes)

    def ends_inside_char(self, tokens: Sequence[int]) -> bool:
        tail = b"".join(self._bytes(t) for t in tokens[-MAX_CHAR_BYTES:])
        return continuation_bytes_owed(tail) > 0

    def splits_char(self, seq: Sequence[int], sampled: int, rewrites: bool) -> bool:
        """Whether a hand-off now would split a character. `seq`: the text so far,
        without the token just `sampled`; `rewrites`: the next writer rewrites that
        token (so it writes after `seq`), else it writes after the token."""
        if rewrites:
            return self.ends_inside_char(seq)
        return self.ends_inside_char([*seq[-(MAX_CHAR_BYTES - 1) :], sampled])
