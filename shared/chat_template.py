"""A model's chat template: messages -> the prompt's text, or straight to its token ids.

The template is the model's Jinja source (HF's `chat_template`), rendered in Jinja's
immutable sandbox. The token ids of a chat are those of the rendered text. For the
ChatML form (SmolLM2's template, Qwen's, and others that frame each message as
`<|im_start|>{role}\\n{content}<|im_end|>\\n`), `ChatTemplate.ids` assembles them instead:
the framing's special tokens and fixed pieces are encoded once at load, and only each
message's `{role}\\n{content}` is encoded per request.

Why: rendering and encoding the whole text is on every request's TTFT in the gateway,
on caches the client and the other processes have just walked over: the sandboxed
render took ~190-240 us and encoding SmolLM2's rendered chat (with its default system
prompt, ~20 tokens of the ~35) ~350 us there, against ~230 us for the assembled ids
(a probe sweeping 16 MB between calls; warm 152 -> 40 us).
llama.cpp likewise renders the template families it knows natively
(`llm_chat_detect_template`).

Why the ids are the same: a tokenizer splits its input at its added tokens first and
encodes the pieces between them one by one (HF tokenizers' AddedVocabulary), so a chat
whose framing tokens are added tokens that strip nothing around them (no lstrip, rstrip
or single_word) encodes piece by piece. The form is taken only where the template's
source is a known spelling of ChatML (`chatml_sources`: the common one, and SmolLM2's,
which adds a default system message; its text is read off a sentinel chat's rendering),
and where the form's ids then equal the Jinja path's on a set of probe chats
(every OpenAI role, a system message first or not, several turns, empty and
whitespace-edged content, Jinja syntax inside content). Probes
alone would not do: a template that differs only for chats they lack (a window over the
last turns, a role treated as a system message, content cut to a length) renders them
as ChatML does. Any other template keeps the Jinja path.

A message's content is text, never framing: a special token's text inside it (a user
writing `<|im_end|>\n<|im_start|>assistant\n...`) must not end the turn and forge
another. The ChatML form encodes each message's piece with the special tokens read as
plain text (`content_tokenizer`), as OpenAI's API treats them; the Jinja path, which
encodes the whole rendered text, refuses such content (`SpecialTextInContent`) rather
than let it through as framing. (Let through, a user message holding a forged
assistant turn and a new user turn makes SmolLM2 answer the forged one.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# A content no default system prompt holds (a private-use character).
_SENTINEL = "\ue000"
_DEFAULT_SYSTEM = re.compile(
    re.escape(IM_START) + r"system\n(.*)" + re.escape(IM_END) + r"\n", re.DOTALL
)
_ROLES = ("system", "user", "assistant", "developer", "tool", "function")
# The known spellings' message loop and generation prompt (the Jinja source's own text)
_CHATML_LOOP = (
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_sources(default_system: str | None) -> list[str]:
    """The template sources taken as ChatML, for a form with this default system
    message (None: none): the common spelling, or SmolLM2's, which puts the default
    system message first when a chat does not begin with one; each with its newlines
    as they are or escaped (`\\n` in a Jinja string literal renders the same)."""
    source = "{% for message in messages %}"
    if default_system is not None:
        source += (
            "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
            + default_system
            + "<|im_end|>\n' }}{% endif %}"
        )
    source += _CHATML_LOOP
    return [source, source.replace("\n", "\\n")]


Messages = list[dict[str, str]]


def probe_chats() -> list[Messages]:
    """Chats on which a fast form must give the ids the template's text encodes to."""

    def chat(*turns: tuple[str, str]) -> Messages:
        return [{"role": role, "content": content} for role, content in turns]

    return [
        chat(("user", "Hello.")),
        chat(("system", "Be brief."), ("user", "Hi")),
        chat(("system", ""), ("user", "x")),
        chat(("user", "a"), ("assistant", "b"), ("user", "c")),
        chat(("system", "s"), ("user", "a"), ("assistant", "b"), ("user", "c")),
        chat(("assistant", "first")),
        chat(("user", "a"), ("user", "b")),
        chat(("user", "")),
        chat(("user", "  spaces around  ")),
        chat(("user", "\nline one\n\nline two\n")),
        chat(("user", "héllo ✓ 中文 🙂 \t tab")),
        chat(("user", "{{ messages }} {% raw %}{% endraw %} inside {{ 'x' }}")),
        chat(*((role, f"as {role}") for role in _ROLES)),
        chat(("user", "a"), ("system", "late system")),
    ]


class JinjaChat:
    """The template's Jinja source, compiled once in the immutable sandbox."""

    def __init__(self, source: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(source)

    def render(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        return str(
            self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        )


@dataclass(frozen=True, slots=True)
class ChatMLForm:
    """The ChatML framing with its pieces pre-encoded. `default_system`: the system
    message the template puts first when a chat does not begin with one (None: none)."""

    default_system: str | None
    im_start_id: int
    im_end_id: int
    system_ids: tuple[int, ...]  # the default system message, framed, with its "\n"
    newline_ids: tuple[int, ...]  # the "\n" after each message's <|im_end|>
    prompt_ids: tuple[int, ...]  # the generation prompt: <|im_start|>assistant\n

    def ids(self, messages: Messages, tokenizer: Any) -> list[int]:
        """`tokenizer`: a `tokenizers.Tokenizer` that reads special tokens as plain text
        (`content_tokenizer`): each message's piece goes through its `encode`."""
        out: list[int] = []
        if self.default_system is not None and messages and messages[0]["role"] != "system":
            out.extend(self.system_ids)
        start, end, newline = self.im_start_id, self.im_end_id, self.newline_ids
        for m in messages:
            out.append(start)
            out.extend(encode_ids(tokenizer, m["role"] + "\n" + m["content"]))
            out.append(end)
            out.extend(newline)
        out.extend(self.prompt_ids)
        return out


class SpecialTextInContent(ValueError):
    """A message's content holds a special token's text, and the template has no form
    that encodes it as plain text."""

    def __init__(self, index: int, token: str) -> None:
        super().__init__(
            f"messages[{index}].content holds the special token text {token!r}, which this "
            "model's chat template would read as framing; remove it"
        )
        self.index = index


# Texts longer than this are encoded with `encode_batch`, which releases the GIL while
# it runs (`encode` holds it: a 3.9 MB prompt held the gateway's event loop ~3 s).
LONG_TEXT_CHARS = 16384


def encode_ids(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text)`'s ids, without special tokens added around them."""
    if len(text) > LONG_TEXT_CHARS:
        return list(tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def content_tokenizer(tokenizer: Any) -> Any:
    """A copy of `tokenizer` that encodes special tokens' text as plain text."""
    from tokenizers import Tokenizer as FastTokenizer

    copy = FastTokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


def _framing_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of an added token that the tokenizer splits on cleanly, else None."""
    token_id = tokenizer.token_to_id(text)
    added = tokenizer.get_added_tokens_decoder().get(token_id) if token_id is not None else None
    if added is None or added.content != text:
        return None
    if added.lstrip or added.rstrip or added.single_word:
        return None  # it would take whitespace from the pieces beside it
    return int(token_id)


def detect_chatml(
    source: str, jinja: JinjaChat, tokenizer: Any, content_tok: Any
) -> ChatMLForm | None:
    """The ChatML form of this template (`source`, compiled as `jinja`), or None where
    it is not one (or not exactly). `content_tok`: content_tokenizer(tokenizer)."""
    start_id = _framing_token_id(tokenizer, IM_START)
    end_id = _framing_token_id(tokenizer, IM_END)
    if start_id is None or end_id is None:
        return None
    try:
        text = jinja.render([{"role": "user", "content": _SENTINEL}])
    except Exception:  # a template that needs more than messages: not this form
        return None
    tail = f"{IM_START}user\n{_SENTINEL}{IM_END}\n{IM_START}assistant\n"
    if not text.endswith(tail):
        return None
    head = text[: -len(tail)]
    default_system: str | None = None
    if head:
        match = _DEFAULT_SYSTEM.fullmatch(head)
        if match is None:
            return None
        default_system = match.group(1)
    if source.strip() not in chatml_sources(default_system):
        return None  # ChatML-like, but not a spelling known to be exactly ChatML

    def encode(piece: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(piece, add_special_tokens=False).ids)

    system_ids: tuple[int, ...] = ()
    if default_system is not None:
        system_ids = (start_id, *encode("system\n" + default_system), end_id, *encode("\n"))
    form = ChatMLForm(
        default_system=default_system,
        im_start_id=start_id,
        im_end_id=end_id,
        system_ids=system_ids,
        newline_ids=encode("\n"),
        prompt_ids=(start_id, *encode("assistant\n")),
    )
    for chat in probe_chats():
        try:
            expected = jinja.render(chat)
        except Exception:  # the template refuses a chat the form would take
            return None
        # (no probe holds special-token text: there the form reads it as text, by design)
        if form.ids(chat, content_tok) != tokenizer.encode(expected, add_special_tokens=False).ids:
            return None
    return form


class ChatTemplate:
    """Messages -> prompt text (`render`) or prompt token ids (`ids`, the hot path)."""

    def __init__(self, source: str, tokenizer: Any) -> None:
        """`tokenizer`: the model's `tokenizers.Tokenizer`."""
        self._tok = tokenizer
        self.content_tokenizer = content_tokenizer(tokenizer)
        self._jinja = JinjaChat(source)
        self.form = detect_chatml(source, self._jinja, tokenizer, self.content_tokenizer)
        added = tokenizer.get_added_tokens_decoder().values()
        self._specials = tuple(sorted({a.content for a in added if a.special and a.content}))

    def render(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        return self._jinja.render(messages, add_generation_prompt)

    def ids(self, messages: Messages) -> list[int]:
        """The chat's token ids, ending with the assistant's generation prompt."""
        if self.form is not None:
            return self.form.ids(messages, self.content_tokenizer)
        for i, m in enumerate(messages):  # (the form needs no check: it reads them as text)
            for token in self._specials:
                if token in m["content"]:
                    raise SpecialTextInContent(i, token)
        return encode_ids(self._tok, self._jinja.render(messages))
