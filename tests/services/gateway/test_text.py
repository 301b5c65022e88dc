"""Detokenization and merging in the gateway, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest

from services.gateway.text import (
    IncrementalDetokenizer,
    LogprobSlice,
    OutputAssembler,
    StopStringCutter,
    TextStream,
)
from shared.model_store import load_tokenizer

TEXT = "naïve café — 日本語のテキスト 🎉🚀 done"


def test_incremental_detokenizer_never_splits_a_character() -> None:
    tok = load_tokenizer("random-tiny")
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, skip_ids=set())
    pieces = [detok.add([t]) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_detokenizer_skips_eos() -> None:
    tok = load_tokenizer("random-tiny")
    detok = IncrementalDetokenizer(tok, skip_ids={tok.eos_token_id})
    out = detok.add([*tok.encode("hi there"), tok.eos_token_id]) + detok.flush()
    assert out == "hi there"


def test_special_tokens_are_dropped_unless_kept() -> None:
    tok = load_tokenizer("smollm2-135m")
    ids = [*tok.encode("Paris."), tok.eos_token_id, *tok.encode("more")]
    plain = TextStream(tok, [], skip_ids=set())
    kept = TextStream(tok, [], skip_ids=set(), keep_special=True)
    assert plain.add(0, ids, None)[0] + plain.finish() == "Paris.more"
    assert kept.add(0, ids, None)[0] + kept.finish() == "Paris.<|im_end|>more"
    assert plain.token_text(tok.eos_token_id) == ""
    assert kept.token_text(tok.eos_token_id) == "<|im_end|>"


def test_assembler_merges_by_position() -> None:
    asm = OutputAssembler()
    assert asm.add(0, [1, 2], None) == ([1, 2], [])
    assert asm.add(4, [5], None) == ([], [])  # a gap: held back
    assert asm.has_gap
    assert asm.add(1, [2, 3, 4], None) == ([3, 4, 5], [])  # overlap dropped, gap filled
    assert asm.add(2, [3], None) == ([], [])  # a duplicate
    assert asm.token_ids == [1, 2, 3, 4, 5] and not asm.has_gap


def test_stop_string_cut_across_deltas() -> None:
    cutter = StopStringCutter(["STOP"])
    out = cutter.push("hello ST") + cutter.push("OP and more")
    assert out == "hello " and cutter.is_stopped
    assert cutter.push("ignored") == "" and cutter.flush() == ""
    free = StopStringCutter(["STOP"])
    assert free.push("a ST") + free.push("ep") + free.flush() == "a STep"


def test_only_text_that_may_begin_a_stop_string_waits() -> None:
    cutter = StopStringCutter(["STOP", "the end"])
    assert cutter.push("hello") == "hello"  # begins neither: out at once
    assert cutter.push(" S") == " "  # "S" may begin STOP
    assert cutter.push("x the") == "Sx "  # "the" may begin "the end"
    assert cutter.push(" dog") == "the dog"
    assert cutter.push(" the en") == " "
    assert cutter.push("d") == "" and cutter.is_stopped
    long = StopStringCutter(["#" * 250])
    assert long.push("words, no hashes") == "words, no hashes"
    assert long.push(" ##") == " " and long.push("#" * 248) == "" and long.is_stopped


@pytest.mark.parametrize("seed", range(200))
def test_the_cutter_releases_what_a_whole_text_search_would(seed: int) -> None:
    """Text pushed in random pieces comes out as the text before the first stop string
    anywhere in it (all of it when none), and nothing past that."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(2)]
    text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
    cutter, out, at = StopStringCutter(stops), "", 0
    while at < len(text):
        n = rng.randint(1, 4)
        out += cutter.push(text[at : at + n])
        at += n
    out += cutter.flush()
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    assert out == (text[: min(hits)] if hits else text)
    assert cutter.is_stopped == bool(hits)


def test_text_stream_stops_before_the_stop_string() -> None:
    tok = load_tokenizer("random-tiny")
    ids = tok.encode("one two three four")
    stream = TextStream(tok, ["three"], {tok.eos_token_id})
    texts = [stream.add(i, [t], None)[0] for i, t in enumerate(ids)]
    assert "".join(texts) + stream.finish() == "one two "
    assert stream.is_stopped


def test_an_answer_cut_inside_a_character_ends_as_a_plain_decode_does() -> None:
    """max_tokens can end an answer between the bytes of one character: held back while
    streaming, it comes out at the end as the replacement character a plain decode of
    the whole answer gives, after the text before it."""
    tok = load_tokenizer("smollm2-135m")
    ids = tok.encode("ok 🎉")
    cut = ids[:-1]  # the emoji spans several byte tokens: drop its last one
    assert tok.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, skip_ids=set())
    streamed = "".join(detok.add([t]) for t in cut)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(cut)
    assert detok.flush() == ""  # nothing twice


def test_chunked_deltas_decode_as_single_tokens_do() -> None:
    tok = load_tokenizer("smollm2-135m")
    ids = tok.encode(TEXT * 3)
    one, chunked = IncrementalDetokenizer(tok, set()), IncrementalDetokenizer(tok, set())
    by_one = "".join(one.add([t]) for t in ids) + one.flush()
    by_chunk = "".join(chunked.add(ids[i : i + 3]) for i in range(0, len(ids), 3))
    assert by_one == by_chunk + chunked.flush() == TEXT * 3


def test_warming_a_tokenizer_compiles_its_chat_template_once() -> None:
    """The gateway warms each model's tokenizer at start: the template compiled there is
    the one the first request renders with."""
    from shared.model_store import Tokenizer, load_tokenizer

    loaded = load_tokenizer("random-tiny")  # (a test may have warmed this one already)
    tok = Tokenizer(loaded.name, loaded.backend, loaded.chat_template, loaded.eos_token_id)
    assert not tok.is_chat_built
    tok.warm()
    assert tok.is_chat_built
    chat = tok.chat
    messages = [{"role": "user", "content": "Say hello."}]
    assert tok.apply_chat_template(messages) == load_tokenizer("random-tiny").apply_chat_template(
        messages
    )
    assert tok.chat is chat


def test_a_tokens_bytes_are_its_raw_bytes_even_inside_a_character() -> None:
    """OpenAI's logprobs `bytes`: the pieces of a split character join into it."""
    from tokenizers.pre_tokenizers import ByteLevel

    from shared.model_store import byte_level_decoder

    assert set(byte_level_decoder()) == set(ByteLevel.alphabet())
    assert sorted(byte_level_decoder().values()) == list(range(256))
    tok = load_tokenizer("random-tiny")
    ids = tok.encode(TEXT)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == TEXT.encode()
    assert any(tok.decode([t]) == "\ufffd" for t in ids)  # (the case it is for)
    assert tok.token_bytes(tok.eos_token_id) == b"<|im_end|>"
    stream = TextStream(tok, [], skip_ids={tok.eos_token_id})
    assert stream.token_bytes(tok.eos_token_id) == b""  # skipped, as its text
    assert stream.token_bytes(ids[0]) == pieces[0]


def test_a_window_of_tokens_decodes_without_the_pieces_of_cut_characters() -> None:
    """The worker's stop-string check decodes the answer's last tokens: a character cut
    at either end of the window is left out, not turned into U+FFFD (a stop string
    "\\ufffd" stopped an answer at its first half character)."""
    tok = load_tokenizer("random-tiny")
    text = "Le chat 没有 猫 🙂 été"
    ids = tok.encode(text)
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    for k in range(len(ids) + 1):
        head, tail = tok.decode_window(ids[:k]), tok.decode_window(ids[k:])
        assert "\ufffd" not in head + tail, k
        assert text.startswith(head) and text.endswith(tail)
        # together they lose at most the one character cut between them
        assert len(text) - 1 <= len(head) + len(tail) <= len(text)
    assert tok.decode_window([*ids[:2], tok.eos_token_id]) == tok.decode(ids[:2])
    lone = tok.backend.token_to_id("Ŀ")  # the byte 0x9D: a continuation byte alone
    bad = [*tok.encode("a"), lone, *tok.encode("b")]
    assert tok.decode_window(bad) == "a\ufffdb"  # an invalid byte inside stays visible


def feed(stream: TextStream, ids: list[int]) -> tuple[str, LogprobSlice]:
    """Token by token, each with logprob -position, as a worker's deltas bring them."""
    text, lps = "", LogprobSlice()
    for i, t in enumerate(ids):
        piece, _ = stream.add(i, [t], [-float(i)])
        text += piece
        lps.extend(stream.take_logprobs())
    text += stream.finish()
    lps.extend(stream.take_logprobs(final=True))
    return text, lps


def test_logprobs_cover_the_returned_text_only() -> None:
    """Cut at a stop string, the answer's logprobs end with the token its text ends in:
    the stop string's tokens (the text the client never sees) have none (a probe saw
    the stopped-out " Paris" in them)."""
    tok = load_tokenizer("random-tiny")
    ids = tok.encode("one two three four")
    text, lps = feed(TextStream(tok, ["three"], {tok.eos_token_id}), ids)
    assert text == "one two "
    kept = [tok.decode([t]) for t in lps.ids]
    assert "".join(kept).startswith(text) and len("".join(kept[:-1])) < len(text)
    assert lps.logprobs == [-float(i) for i in range(len(lps.ids))]
    assert lps.starts == [0, 3, 7][: len(lps.ids)]
    first = tok.encode("The capital")  # a stop at the very first token: no text, no logprobs
    assert feed(TextStream(tok, ["The"], set()), first) == ("", LogprobSlice())
    whole, all_lps = feed(TextStream(tok, [], set()), ids)  # no stop: every token
    assert whole == "one two three four" and all_lps.ids == ids


def test_logprob_offsets_index_the_answers_text_inside_characters_too() -> None:
    """`text_offset`: the pieces of a character start where the character does."""
    tok = load_tokenizer("random-tiny")
    ids = tok.encode("a 猫 b")
    text, lps = feed(TextStream(tok, [], set()), ids)
    assert text == "a 猫 b" and lps.ids == ids
    assert lps.starts == sorted(lps.starts) and max(lps.starts) < len(text)
    pieces = [i for i, t in enumerate(ids) if tok.decode([t]) == "\ufffd"]
    assert pieces and {lps.starts[i] for i in pieces} == {text.index("猫") - 1}
