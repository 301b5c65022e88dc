"""Token counting for building prompts to a target length.

Without `--tokenizer`, lengths are approximated from whitespace-separated words:
tokens ~= TOKENS_PER_WORD * words (English BPE tokenizers average 1.3-1.5). With a
tokenizer (a `tokenizer.json` file, or a directory holding one), prompts are cut
from the corpus's token ids, so their length is exact up to merges at the cut
when the server re-tokenizes. Reported token counts come from the server's
`usage`, not from here.

A counter cuts prompts in "units": words for the approximation, token ids with
a tokenizer. The corpus is split into units once, so building a prompt is a
slice and one `render`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

TOKENS_PER_WORD = 1.4  # SmolLM2 on the shared prompt sets: alpaca 1.37, hotpotqa 1.55


class TokenCounter(Protocol):
    """Counts tokens, cuts text to a token count, and splits a corpus into units."""

    name: str

    def count(self, text: str) -> int: ...

    def cut(self, text: str, num_tokens: int) -> str:
        """Text cut to at most num_tokens tokens."""
        ...

    def units(self, texts: Sequence[str]) -> list[Any]:
        """The texts as one list of units (words or token ids)."""
        ...

    def units_for(self, num_tokens: int) -> int:
        """How many units make num_tokens tokens."""
        ...

    def render(self, units: Sequence[Any]) -> str:
        """Units back to text."""
        ...


class WordCounter:
    """Approximate counter: TOKENS_PER_WORD tokens per whitespace word."""

    name = f"approx:{TOKENS_PER_WORD}-tokens-per-word"

    def count(self, text: str) -> int:
        return round(len(text.split()) * TOKENS_PER_WORD)

    def cut(self, text: str, num_tokens: int) -> str:
        return " ".join(text.split()[: self.units_for(num_tokens)])

    def units(self, texts: Sequence[str]) -> list[Any]:
        return [w for text in texts for w in text.split()]

    def units_for(self, num_tokens: int) -> int:
        return max(1, round(num_tokens / TOKENS_PER_WORD))

    def render(self, units: Sequence[Any]) -> str:
        return " ".join(units)


class TokenizerCounter:
    """Exact counter over a Hugging Face `tokenizers` file (no hub access)."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.name = name

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def cut(self, text: str, num_tokens: int) -> str:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return text if len(ids) <= num_tokens else self._tokenizer.decode(ids[:num_tokens])

    def units(self, texts: Sequence[str]) -> list[Any]:
        # encode_batch runs in parallel outside the GIL: one pass over the corpus at start-up
        encoded = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [i for e in encoded for i in e.ids]

    def units_for(self, num_tokens: int) -> int:
        return max(1, math.ceil(num_tokens))

    def render(self, units: Sequence[Any]) -> str:
        return self._tokenizer.decode(list(units))


def create_token_counter(tokenizer: str | None) -> TokenCounter:
    """The exact counter for a local tokenizer file or directory, or the word approximation."""
    if tokenizer is None:
        return WordCounter()
    from tokenizers import Tokenizer  # imported on use: only this mode needs it

    file = Path(tokenizer)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer {tokenizer}: no tokenizer.json there (no hub downloads)")
    return TokenizerCounter(Tokenizer.from_file(str(file)), tokenizer)
