"""Incremental detokenization: turn a growing list of token ids into stable text deltas.

Byte-level BPE can split one UTF-8 character over several tokens, so decoding the newest token
alone may give a replacement character ("\\ufffd") that a later token would complete. We keep two
offsets into the ids (the prefix-offset / read-offset technique):

    ids:  [ ... emitted ... | prefix_offset ... read_offset | new tokens ... ]
                            `-------- window decoded twice --------'

`prefix_text = decode(ids[prefix_offset:read_offset])` is text already emitted; decoding the window
`ids[prefix_offset:]` and cutting `prefix_text` off its front gives the new text. It is emitted only
when it does not end in "\\ufffd" (an incomplete character); then both offsets move forward.
Decoding from `prefix_offset` rather than `read_offset` keeps decoders that treat the first token
of a string specially (leading-space rules) consistent between the two decodes.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"
# Markup the output parsers read (tool calls, thinking): some tokenizers mark these tokens special
# (skipped when decoding), which would hide a tool call from the parser. They stay in the text.
PARSER_MARKUP = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<TOOLCALL>", "</TOOLCALL>",
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<|tool_call|>",
)  # fmt: skip


def markup_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of special tokens that are parser markup (kept in the text; see PARSER_MARKUP)."""
    return frozenset(
        tid
        for tid, token in tokenizer.get_added_tokens_decoder().items()
        if token.special and token.content in PARSER_MARKUP
    )


class IncrementalDetokenizer:
    """Text deltas of one request's output; the concatenation of every `add` and the final `flush`
    equals `tokenizer.decode(all_ids, skip_special_tokens=...)` for byte-level tokenizers."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._keep = keep  # special tokens decoded even when skipping special tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def token_ids(self) -> list[int]:
        """Every id added so far (a copy)."""
        return list(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not (self._skip and self._keep) or self._keep.isdisjoint(ids):
            return self._tok.decode(ids, skip_special_tokens=self._skip)
        # Decode the runs between kept tokens as usual, and the kept tokens as their text.
        parts: list[str] = []
        start = 0
        for i, t in enumerate(ids):
            if t in self._keep:
                parts.append(self._tok.decode(ids[start:i], skip_special_tokens=True))
                parts.append(self._tok.decode([t], skip_special_tokens=False))
                start = i + 1
        parts.append(self._tok.decode(ids[start:], skip_special_tokens=True))
        return "".join(parts)

    def add(self, token_ids: list[int]) -> str:
        """Append `token_ids`; return the text that became stable (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character decodes as "\\ufffd" here)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
