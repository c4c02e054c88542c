"""OpenAI response objects built from the front door's `GenerateChunk`s.

One `ResponseBuilder` per HTTP request. Completions and chat completions differ only in the
object names and where the text goes (`choices[i].text` vs `message` / `delta`). With n > 1 each
sample is `choices[index]`; stream chunks carry one choice each, under its index (as OpenAI's).
`usage.prompt_tokens_details` carries `cached_tokens` (OpenAI) and, as our extension,
`cached_tokens_by_tier` = {"device", "host", "storage"}; with n > 1 the prompt counts once
(`combined_usage`). A chat answer read by parsers (tool calls, reasoning) goes through one
`AnswerShaper` per choice: its message has `tool_calls` / `reasoning_content`, and one stream
chunk may become several events (a tool call's head, then its arguments).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from tokenizers import Tokenizer

from himamba.common.messages import GenerateChunk, TokenLogprobs
from himamba.common.types import Usage, combined_usage
from himamba.services.tokenizer.http.logprobs_json import (
    CompletionLogprobs,
    LogprobsAsk,
    chat_logprobs,
    join,
    vllm_prompt_logprobs,
)
from himamba.services.tokenizer.http.token_text import TokenText
from himamba.services.tokenizer.tool_parsers.streaming import AnswerShaper

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


def _stop_fields(chunk: GenerateChunk) -> dict[str, int | str | None]:
    """What stopped a choice, in vLLM's key (`stop_reason`: the stop string or stop token id, null
    for EOS and length) and sglang's (`matched_stop`: the same, or the EOS id); null until it ends."""
    return {"stop_reason": chunk.stop_reason, "matched_stop": chunk.matched_stop}


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
        ask: LogprobsAsk | None = None,
        tokens_as_ids: bool = False,
        index_base: int = 0,
        echo_text: str | None = None,
        shaping: Callable[[], AnswerShaper] | None = None,
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
        # Logprobs beyond the chosen tokens' (logprobs_json.py); a batched completions request
        # has a builder per prompt, whose choices start at `index_base` (prompt i: i * n).
        self.ask = ask if ask is not None else LogprobsAsk(logprobs)
        self._names = TokenText(tokenizer, tokens_as_ids)
        self.index_base = index_base
        self._echo_text = echo_text  # completions `echo`: the prompt, before each choice's text
        self._prompt_logprobs: list[TokenLogprobs] | None = None  # sample 0 brings them
        self._completion_lps = [CompletionLogprobs(self._names, self.ask.top) for _ in range(n)]
        # Per choice: whether its first stream chunk (role, prompt ids, echo) went out.
        self._started = [False] * n
        self._sent_prompt_ids = False
        # chat answers read by parsers: one shaper per choice
        self._shapers = [shaping() for _ in range(n)] if shaping is not None and kind == "chat" else None

    def _head(self, stream: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def _logprobs_json(self, index: int, chunk: GenerateChunk, first: bool) -> dict[str, Any] | None:
        if not self._logprobs or chunk.logprobs is None:
            if not (first and self._echoes_logprobs()):
                return None
        ids, logprobs = chunk.token_ids, chunk.logprobs or []
        if self.kind == "chat":
            return chat_logprobs(self._names, ids, logprobs, chunk.top_logprobs, self.ask.top)
        pieces = self._completion_lps[index]
        head = pieces.prompt(self._prompt_ids(), self._prompt_entries()) if first and self._echoes_logprobs() else None
        body = pieces.build(ids, logprobs, chunk.top_logprobs)
        return body if head is None else join(head, body)

    def _echoes_logprobs(self) -> bool:
        return self.kind == "completion" and self.ask.echo and self.ask.logprobs

    def _prompt_ids(self) -> list[int]:
        if self.prompt_token_ids is None:
            raise ValueError("echo: the prompt's token ids never came")
        return self.prompt_token_ids

    def _prompt_entries(self) -> list[TokenLogprobs]:
        # Sample 0 computes them; its first chunk comes before any sibling's (the siblings wait
        # for its prefill), so every choice finds them here.
        if self._prompt_logprobs is None:
            raise ValueError("prompt logprobs: sample 0's first chunk has not come")
        return self._prompt_logprobs

    def _note_prompt(self, chunk: GenerateChunk) -> None:
        if chunk.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(chunk.prompt_token_ids)
        if chunk.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = list(chunk.prompt_logprobs)

    def _choice(self, chunk: GenerateChunk, stream: bool) -> dict[str, Any]:
        index = self._index(chunk)
        first = not self._started[index]
        self._started[index] = True
        choice: dict[str, Any] = {"index": self.index_base + index}
        if self.kind == "completion":
            choice["text"] = (self._echo_text or "") + chunk.text if first else chunk.text
        elif stream:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if chunk.text or first:
                delta["content"] = chunk.text
            choice["delta"] = delta
        elif self._shapers is not None:
            shaper = self._shapers[index]
            shaper.feed(chunk.text)
            shaper.finish()
            choice["message"] = shaper.message()
        else:
            choice["message"] = {"role": "assistant", "content": chunk.text}
        choice["logprobs"] = self._logprobs_json(index, chunk, first)
        if self.kind == "completion" and first and self.ask.prompt is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self._names, self._prompt_ids(), self._prompt_entries(), self.ask.prompt
            )
        choice["finish_reason"] = self._finish_reason(index, chunk)
        choice.update(_stop_fields(chunk))
        if self._return_token_ids:
            choice["token_ids"] = list(chunk.token_ids)
            if self.kind == "completion" and first:
                choice["prompt_token_ids"] = self.prompt_token_ids  # where vLLM puts it for completions
        return choice

    def _finish_reason(self, index: int, chunk: GenerateChunk) -> str | None:
        if not chunk.finished:
            return None
        if self._shapers is not None and chunk.finish_reason is not None:
            return self._shapers[index].finish_reason(chunk.finish_reason)
        return chunk.finish_reason

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
        if self.kind == "chat" and self.ask.prompt is not None:  # where vLLM puts it for chat
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                self._names, self._prompt_ids(), self._prompt_entries(), self.ask.prompt
            )
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

    def deltas(self, chunk: GenerateChunk, include_usage: bool = False) -> list[dict[str, Any]]:
        """The stream events of one chunk: `delta`'s one (or none), or, for a chat answer read by
        parsers, one per delta the parsers settled (the finish reason on the last)."""
        if self._shapers is None:
            event = self.delta(chunk, include_usage)
            return [] if event is None else [event]
        self._note_prompt(chunk)
        index = self._index(chunk)
        shaper = self._shapers[index]
        parts = shaper.feed(chunk.text)
        if chunk.finished:
            parts += shaper.finish()
        first = not self._started[index]
        self._started[index] = True
        carries_ids = bool(chunk.token_ids) and (self._logprobs or self._return_token_ids)
        if not parts and not (chunk.finished or first or carries_ids):
            return []
        if first:
            parts = [{"role": "assistant", **(parts[0] if parts else {"content": ""})}] + parts[1:]
        parts = parts or [{}]
        events = []
        for i, delta in enumerate(parts):
            out = self._head(stream=True)
            choice: dict[str, Any] = {
                "index": self.index_base + index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "matched_stop": None,
            }
            if i == 0:
                choice["logprobs"] = self._logprobs_json(index, chunk, first)
                if self._return_token_ids:
                    choice["token_ids"] = list(chunk.token_ids)
                    if not self._sent_prompt_ids:
                        out["prompt_token_ids"] = self.prompt_token_ids
                        self._sent_prompt_ids = True
            if i == len(parts) - 1:
                choice["finish_reason"] = self._finish_reason(index, chunk)
                choice.update(_stop_fields(chunk))
            out["choices"] = [choice]
            if include_usage:
                out["usage"] = None
            events.append(out)
        return events

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last stream chunk when stream_options.include_usage: no choices, just usage (of
        all choices: `combined_usage`)."""
        out = self._head(stream=True)
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out
