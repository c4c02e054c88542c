"""OpenAI response objects built from the front door's `GenerateChunk`s.

One `ResponseBuilder` per HTTP request. Completions and chat completions differ only in the
object names and where the text goes (`choices[0].text` vs `message` / `delta`).
`usage.prompt_tokens_details` carries `cached_tokens` (OpenAI) and, as our extension,
`cached_tokens_by_tier` = {"device", "host", "storage"}.
"""

from __future__ import annotations

from typing import Any, Literal

from tokenizers import Tokenizer

from himamba.common.messages import GenerateChunk
from himamba.common.types import Usage

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
    ):
        self.kind = kind
        self._id = response_id
        self._created = created
        self._model = model
        self._tok = tokenizer
        self._return_token_ids = return_token_ids
        self._logprobs = logprobs
        self.prompt_token_ids = prompt_token_ids
        self._text_offset = 0  # completions logprobs: where the next token's text starts
        self._sent_role = False
        self._sent_prompt_ids = False

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def _logprobs_json(self, ids: list[int], logprobs: list[float] | None) -> dict[str, Any] | None:
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
            offsets.append(self._text_offset)
            self._text_offset += len(s)
        return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    def _note_prompt(self, chunk: GenerateChunk) -> None:
        if chunk.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(chunk.prompt_token_ids)

    def _choice(self, chunk: GenerateChunk, stream: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "completion":
            choice["text"] = chunk.text
        elif stream:
            delta: dict[str, Any] = {}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            if chunk.text or "role" in delta:
                delta["content"] = chunk.text
            choice["delta"] = delta
        else:
            choice["message"] = {"role": "assistant", "content": chunk.text}
        choice["logprobs"] = self._logprobs_json(chunk.token_ids, chunk.logprobs)
        choice["finish_reason"] = chunk.finish_reason if chunk.finished else None
        if self._return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
            if self.kind == "completion" and not self._sent_prompt_ids:
                choice["prompt_token_ids"] = self.prompt_token_ids  # where vLLM puts it for completions
        return choice

    def whole(self, chunk: GenerateChunk) -> dict[str, Any]:
        """The non-streamed response from the one finished chunk of a stream=False request."""
        self._note_prompt(chunk)
        out = self._head(stream=False)
        out["choices"] = [self._choice(chunk, stream=False)]
        if self._return_token_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
        if chunk.usage is not None:
            out["usage"] = usage_json(chunk.usage)
        return out

    def delta(self, chunk: GenerateChunk, include_usage: bool = False) -> dict[str, Any] | None:
        """One stream chunk (None when it would say nothing: no text, no ids, not the end)."""
        self._note_prompt(chunk)
        first = not self._sent_role and self.kind == "chat"
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
        """The last stream chunk when stream_options.include_usage: no choices, just usage."""
        out = self._head(stream=True)
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out
