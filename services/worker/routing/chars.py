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
inside a character is read off its last 4 tokens (`CharBoundaries.ends_inside_char`),
by Python's own incremental UTF-8 decoder: what it keeps back, waiting for more bytes,
is a character begun and not complete (bytes that are no UTF-8 it replaces instead:
they wait for nothing).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable, Sequence

MAX_CHAR_BYTES = 4
_UTF8 = codecs.getincrementaldecoder("utf-8")


def ends_inside_char(data: bytes) -> bool:
    """Whether `data` ends in a character begun and not complete."""
    decoder = _UTF8("replace")
    decoder.decode(data, final=False)
    pending, _ = decoder.getstate()
    return bool(pending)


class CharBoundaries:
    """Whether a token sequence ends inside a character, by the vocabulary's bytes."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        # a token's bytes never change: each is looked up once
        self._bytes = functools.lru_cache(maxsize=None)(token_bytes)

    def ends_inside_char(self, tokens: Sequence[int]) -> bool:
        return ends_inside_char(b"".join(self._bytes(t) for t in tokens[-MAX_CHAR_BYTES:]))

    def splits_char(self, seq: Sequence[int], sampled: int, rewrites: bool) -> bool:
        """Whether a hand-off now would split a character. `seq`: the text so far,
        without the token just `sampled`; `rewrites`: the next writer rewrites that
        token (so it writes after `seq`), else it writes after the token."""
        if rewrites:
            return self.ends_inside_char(seq)
        return self.ends_inside_char([*seq[-(MAX_CHAR_BYTES - 1) :], sampled])
