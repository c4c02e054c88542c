"""One request's output as the client sees it: token ids in, text chunks out.

Chains the incremental detokenizer and the stop-string matcher, keeps the usage counters, and
builds the `GenerateChunk`s: a delta per scheduler output when streaming, one whole answer at
the end otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tokenizers import Tokenizer

from himamba.common.messages import GenerateChunk, TokenLogprobs, TokenOut
from himamba.common.types import CachedTokens, FinishReason, Usage
from himamba.services.tokenizer.detokenize import IncrementalDetokenizer
from himamba.services.tokenizer.stop import StopMatcher


class OutputStep(NamedTuple):
    """The result of one scheduler output for this request."""

    chunk: GenerateChunk | None  # what to send the client now, if anything
    finished: bool  # the request is over for the client
    stop_string_hit: bool  # a stop string completed: the scheduler must be told to stop


class RequestOutput:
    """Turns the scheduler's TokenOuts of one request into client chunks."""

    def __init__(
        self,
        client_rid: str,
        tokenizer: Tokenizer,
        *,
        stream: bool,
        stops: list[str],
        prompt_len: int,
        prompt_token_ids: list[int] | None = None,
        index: int = 0,
        keep_special: frozenset[int] = frozenset(),
        eos_ids: frozenset[int] = frozenset(),
        stop_token_ids: frozenset[int] = frozenset(),
    ):
        self.client_rid = client_rid
        self.index = index  # the sample of an n > 1 request: every chunk carries it
        self._stream = stream
        self._detok = IncrementalDetokenizer(tokenizer, keep=keep_special)  # keep: parser markup
        self._stop = StopMatcher(stops)
        self._eos_ids = eos_ids  # empty under ignore_eos: then EOS stops nothing
        self._stop_token_ids = stop_token_ids
        self._prompt_len = prompt_len
        self._prompt_token_ids = prompt_token_ids  # sent once, on the first chunk
        self._completion_tokens = 0
        self._cached = CachedTokens()
        self._text: list[str] = []  # whole answer, for stream=False
        self._ids: list[int] = []
        self._logprobs: list[float] | None = None
        self._top_logprobs: list[TokenLogprobs] | None = None  # whole answer, for stream=False
        self._prompt_logprobs: list[TokenLogprobs] | None = None  # sent once, on the next chunk

    def on_token_out(self, out: TokenOut) -> OutputStep:
        """Absorb one scheduler output (its error field is the caller's business)."""
        if out.cached is not None:
            self._cached = out.cached
        if out.prompt_tokens:
            self._prompt_len = out.prompt_tokens
        self._ids.extend(out.token_ids)
        self._completion_tokens = max(out.completion_tokens, len(self._ids))
        if out.logprobs is not None:
            self._logprobs = (self._logprobs or []) + list(out.logprobs)
        if out.top_logprobs is not None:
            self._top_logprobs = (self._top_logprobs or []) + list(out.top_logprobs)
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = list(out.prompt_logprobs)

        result = self._stop.feed(self._detok.add(out.token_ids))
        text = result.emit
        if result.stopped:
            # Only a still-running request needs a StopRequest; one the scheduler finished has stopped.
            step_chunk = self._final(text, out, "stop")
            return OutputStep(step_chunk, True, out.finish_reason is None)
        if out.finish_reason is not None:
            tail = self._stop.feed(self._detok.flush())
            text += tail.emit
            reason: FinishReason = "stop" if tail.stopped else out.finish_reason
            if not tail.stopped:
                text += self._stop.flush()
            return OutputStep(self._final(text, out, reason), True, False)
        if not self._stream:
            self._text.append(text)
            return OutputStep(None, False, False)
        if not text and not out.token_ids:
            return OutputStep(None, False, False)
        return OutputStep(self._chunk(text, out.token_ids, out.logprobs, out.top_logprobs), False, False)

    def finish(self, reason: FinishReason) -> GenerateChunk:
        """End the request now (client abort): release held text, build the final chunk."""
        tail = self._stop.feed(self._detok.flush())
        text = tail.emit + self._stop.flush()
        return self._final_chunk(text, [], None, None, reason)

    def _final(self, text: str, out: TokenOut, reason: FinishReason) -> GenerateChunk:
        return self._final_chunk(text, out.token_ids, out.logprobs, out.top_logprobs, reason)

    def _final_chunk(
        self,
        text: str,
        new_ids: list[int],
        new_logprobs: list[float] | None,
        new_top: list[TokenLogprobs] | None,
        reason: FinishReason,
    ) -> GenerateChunk:
        usage = Usage(
            prompt_tokens=self._prompt_len,
            completion_tokens=self._completion_tokens,
            cached_tokens=self._cached,
        )
        stopped = self._what_stopped() if reason == "stop" else (None, None)
        end: dict[str, Any] = {"finished": True, "reason": reason, "usage": usage, "stopped": stopped}
        if self._stream:
            return self._chunk(text, new_ids, new_logprobs, new_top, **end)
        self._text.append(text)
        return self._chunk("".join(self._text), self._ids, self._logprobs, self._top_logprobs, **end)

    def _what_stopped(self) -> tuple[int | str | None, int | str | None]:
        """(vLLM's stop_reason, sglang's matched_stop) of an answer that finished with "stop": the
        stop string, else its last token when that is EOS (stop_reason None, as vLLM) or a stop
        token (the scheduler tests EOS first, so do we)."""
        if self._stop.matched is not None:
            return self._stop.matched, self._stop.matched
        last = self._ids[-1] if self._ids else None
        if last in self._eos_ids:
            return None, last
        if last in self._stop_token_ids:
            return last, last
        return None, None

    def _chunk(
        self,
        text: str,
        ids: list[int],
        logprobs: list[float] | None,
        top_logprobs: list[TokenLogprobs] | None = None,
        *,
        finished: bool = False,
        reason: FinishReason | None = None,
        usage: Usage | None = None,
        stopped: tuple[int | str | None, int | str | None] = (None, None),
    ) -> GenerateChunk:
        prompt_ids, self._prompt_token_ids = self._prompt_token_ids, None
        prompt_lps, self._prompt_logprobs = self._prompt_logprobs, None
        return GenerateChunk(
            rid=self.client_rid,
            text=text,
            token_ids=list(ids),
            finished=finished,
            finish_reason=reason,
            usage=usage,
            logprobs=None if logprobs is None else list(logprobs),
            prompt_token_ids=prompt_ids,
            index=self.index,
            top_logprobs=None if top_logprobs is None else list(top_logprobs),
            prompt_logprobs=prompt_lps,
            stop_reason=stopped[0],
            matched_stop=stopped[1],
        )
