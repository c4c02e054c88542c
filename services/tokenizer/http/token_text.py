"""How one token is named in logprobs: its text, or its raw bytes where it is not whole UTF-8.

A byte-level BPE token can hold part of a character; decoded alone it is "\\ufffd", and several
such tokens decode to the same string (so they would collide as `top_logprobs` keys). OpenAI
names them by their bytes: `bytes:\\xe6\\x97` in the completions API, `\\xe6\\x97` with the
`bytes` list in chat. With vLLM's `return_tokens_as_token_ids` every token is `token_id:<id>`.
The raw bytes come from the vocabulary: byte-level pieces (GPT-2's byte-to-unicode alphabet) and
byte-fallback pieces (`<0xE6>`); any other token's bytes are its decoded text's UTF-8.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _escaped(raw: bytes) -> str:
    return "".join(f"\\x{b:02x}" for b in raw)


class TokenText:
    """Names of token ids as the logprobs objects show them (cached per id)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        self._tok = tokenizer
        self._as_ids = as_ids
        self._cache: dict[int, tuple[str, bytes, bool]] = {}

    def _entry(self, token_id: int) -> tuple[str, bytes, bool]:
        """(decoded text, raw bytes, whether the bytes are whole UTF-8)."""
        got = self._cache.get(token_id)
        if got is not None:
            return got
        text = self._tok.decode([token_id], skip_special_tokens=False)
        raw = text.encode("utf-8")
        whole = "\ufffd" not in text
        if not whole:
            piece = self._tok.id_to_token(token_id) or ""
            table = _unicode_to_byte()
            fallback = _BYTE_FALLBACK.match(piece)
            if fallback:
                raw = bytes([int(fallback.group(1), 16)])
            elif piece and all(c in table for c in piece):
                raw = bytes(table[c] for c in piece)
            try:
                raw.decode("utf-8")
                whole = True  # a real U+FFFD in the vocabulary
            except UnicodeDecodeError:
                pass
        got = (text, raw, whole)
        self._cache[token_id] = got
        return got

    def text(self, token_id: int) -> str:
        """The token's decoded text (what it adds to the choice's text)."""
        return self._entry(token_id)[0]

    def raw_bytes(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]

    def completion_name(self, token_id: int) -> str:
        """Its name in /v1/completions logprobs (`tokens` and the `top_logprobs` keys)."""
        if self._as_ids:
            return f"token_id:{token_id}"
        text, raw, whole = self._entry(token_id)
        return text if whole else "bytes:" + _escaped(raw)

    def chat_name(self, token_id: int) -> str:
        """Its `token` in /v1/chat/completions logprobs (the `bytes` list beside it is exact)."""
        if self._as_ids:
            return f"token_id:{token_id}"
        text, raw, whole = self._entry(token_id)
        return text if whole else _escaped(raw)
