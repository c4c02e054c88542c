"""OpenAI response objects built from the front door's `GenerateChunk`s.

One `ResponseBuilder` per HTTP request. Completions and chat completions differ only in the
object names and where the text goes (`choices[i].text` vs `message` / `delta`). With n > 1 each
sample is `choices[index]`; stream chunks carry one choice each, under its index (as OpenAI's).
`usage.prompt_tokens_details` carries `cached_tokens` (OpenAI) and, as our extension,
`cached_tokens_by_tier` = {"device", "host", "storage"}; with n > 1 the prompt counts once
(`combined_usage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tokenizers import Tokenizer

from himamba.common.messages import GenerateChunk
from himamba.common.types import Usage, combined_usage

Kind = Literal["completion", "chat"]


def usage_json(usage: Usage) -> dict[str, Any]:
    cached = usage.cached_tokens
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached.total,
            "cached_tokens_by_tier": {"device": cached.device, "host": cached.host, "storage": cached.storage},
        },
    }


class ResponseBuilder:
    """Turns the chunks of one request into OpenAI JSON (whole response or stream chunks)."""

    def __init__(
        self,
        kind: Kind,
        *,
        response_id: str,
        created: int,
        model: str,
        tokenizer: Tokenizer,
        return_token_ids: bool,
        logprobs: bool,
        prompt_token_ids: list[int] | None = None,
        n: int = 1,
    ):
        self.kind = kind
        self._id = response_id
        self._created = created
        self._model = model
        self._tok = tokenizer
        self._return_token_ids = return_token_ids
        self._logprobs = logprobs
        self.prompt_token_ids = prompt_token_ids
        self.n = n
        # Per choice: where its next token's text starts (completions logprobs), whether its
        # first stream chunk (role, prompt ids) went out.
        self._text_offset = [0] * n
        self._started = [False] * n
        self._sent_prompt_ids = False

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def _logprobs_json(self, index: int, ids: list[int], logprobs: list[float] | None) -> dict[str, Any] | None:
        if not self._logprobs or logprobs is None:
            return None
        texts = [self._tok.decode([t], skip_special_tokens=False) for t in ids]
        if self.kind == "chat":
            content = [
                {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                for s, lp in zip(texts, logprobs, strict=True)
            ]
            return {"content": content}
        offsets = []
        for s in texts:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(s)
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def _note_prompt(self, chunk: GenerateChunk) -> None:
        if chunk.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(chunk.prompt_token_ids)

    def _choice(self, chunk: GenerateChunk, stream: bool) -> dict[str, Any]:
        index = self._index(chunk)
        first = not self._started[index]
        self._started[index] = True
        choice: dict[str, Any] = {"index": index}
        if self.kind == "completion":
            choice["text"] = chunk.text
        elif stream:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if chunk.text or first:
                delta["content"] = chunk.text
            choice["delta"] = delta
        else:
            choice["message"] = {"role": "assistant", "content": chunk.text}
        choice["logprobs"] = self._logprobs_json(index, chunk.token_ids, chunk.logprobs)
        choice["finish_reason"] = chunk.finish_reason if chunk.finished else None
        if self._return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
            if self.kind == "completion" and first:
                choice["prompt_token_ids"] = self.prompt_token_ids  # where vLLM puts it for completions
        return choice

    def _index(self, chunk: GenerateChunk) -> int:
        if not (0 <= chunk.index < self.n):
            raise ValueError(f"index: chunk of choice {chunk.index}, but the request has {self.n} choice(s)")
        return chunk.index

    def whole(self, chunks: Sequence[GenerateChunk]) -> dict[str, Any]:
        """The non-streamed response from the finished chunks of a stream=False request (one
        per choice)."""
        ordered = sorted(chunks, key=lambda c: c.index)
        if [c.index for c in ordered] != list(range(self.n)):
            raise ValueError(f"chunks: expected one per choice 0..{self.n - 1}, got {[c.index for c in ordered]}")
        for chunk in ordered:
            self._note_prompt(chunk)
        out = self._head(stream=False)
        out["choices"] = [self._choice(chunk, stream=False) for chunk in ordered]
        if self._return_token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        usages = [c.usage for c in ordered if c.usage is not None]
        if len(usages) == len(ordered):
            out["usage"] = usage_json(combined_usage(usages))
        return out

    def delta(self, chunk: GenerateChunk, include_usage: bool = False) -> dict[str, Any] | None:
        """One stream chunk (None when it would say nothing: no text, no ids, not the end)."""
        self._note_prompt(chunk)
        first = not self._started[self._index(chunk)] and self.kind == "chat"
        if not (chunk.text or chunk.token_ids or chunk.finished or first):
            return None
        out = self._head(stream=True)
        out["choices"] = [self._choice(chunk, stream=True)]
        if self._return_token_ids and not self._sent_prompt_ids:
            out["prompt_token_ids"] = self.prompt_token_ids  # once, on the first chunk
            self._sent_prompt_ids = True
        if include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last one, which has no choices
        return out

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last stream chunk when stream_options.include_usage: no choices, just usage (of
        all choices: `combined_usage`)."""
        out = self._head(stream=True)
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out
