"""OpenAI's logprobs objects, chat and legacy completions, from the logprobs a request's
text stream released."""

from __future__ import annotations

from typing import Any

from services.gateway.text import LogprobSlice, TextStream


def logprobs_object(
    is_chat: bool, k: int | None, lps: LogprobSlice | None, text_stream: TextStream
) -> Any:
    """OpenAI's logprobs object for these tokens (None when not asked for; empty, not
    null, for an answer with no token to show, cut at its first token).

    Chat: `content` entries with `top_logprobs: [{token, logprob, bytes}]`.
    Completions (legacy): `top_logprobs: [{token: logprob}]` per position, None for k = 0,
    and `text_offset`: where each token's text starts in the answer's text (a token
    that is a piece of a character: where that character starts). A token whose own
    text is not whole characters reads `bytes:\\xNN...`, as OpenAI's legacy
    completions write it (its lone decode is U+FFFD, which names no bytes).
    """
    if k is None or lps is None:
        return None
    text, raw = text_stream.token_text, text_stream.token_bytes
    ids, tops = lps.ids, (lps.top if k > 0 else [])
    if is_chat:
        tokens = [text(t) for t in ids]
        content = []
        for i, (tid, t, lp) in enumerate(zip(ids, tokens, lps.logprobs, strict=False)):
            top = tops[i] if i < len(tops) else []
            content.append(
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(raw(tid)),
                    "top_logprobs": [
                        {"token": text(other), "logprob": v, "bytes": list(raw(other))}
                        for other, v in top
                    ],
                }
            )
        return {"content": content}

    def legacy(token_id: int) -> str:
        s = text(token_id)
        if "\ufffd" not in s:
            return s
        data = raw(token_id)
        try:
            return data.decode()  # (a real U+FFFD in the text)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    top_dicts: list[dict[str, float]] | None = None
    if k > 0:
        top_dicts = []
        for top in tops:
            entry: dict[str, float] = {}
            for tid, v in top:  # most likely first: keep it when two ids decode alike
                entry.setdefault(legacy(tid), v)
            top_dicts.append(entry)
    return {
        "tokens": [legacy(t) for t in ids],
        "token_logprobs": lps.logprobs,
        "top_logprobs": top_dicts,
        "text_offset": lps.starts,
    }
