"""The `logprobs` objects of OpenAI responses (and vLLM's `prompt_logprobs`), from TokenLogprobs.

Completions (`logprobs: k`): `tokens`, `token_logprobs`, `top_logprobs` (per token a dict
name -> logprob of the k most likely tokens plus the chosen one, as OpenAI: up to k + 1
entries; null for k = 0) and `text_offset`. Token names can collide (see token_text.py), so
beside them, as extensions, `token_ids` and `top_logprobs_by_id` (the same dicts keyed by token
id). With `echo`, the prompt's tokens come first; the first has no logprob (null), as OpenAI's.
Chat (`logprobs: true, top_logprobs: k`): `content`, one entry per token with `token`,
`logprob`, `bytes`, `top_logprobs` (k entries), plus `token_id` (extension).
vLLM's `prompt_logprobs: k`: [null, {id: {logprob, rank, decoded_token}}, ...] per prompt token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from himamba.common.messages import TokenLogprobs
from himamba.services.tokenizer.http.token_text import TokenText


class LogprobsAsk(NamedTuple):
    """What a request asked for."""

    logprobs: bool  # the chosen tokens' logprobs
    top: int = 0  # alternatives per token (completions' `logprobs: k`, chat's `top_logprobs`)
    echo: bool = False  # completions: the prompt before the answer (with its logprobs when `logprobs`)
    prompt: int | None = None  # vLLM's `prompt_logprobs: k`

    @property
    def prompt_logprobs(self) -> int | None:
        """How many alternatives the worker computes per prompt token (None: none wanted)."""
        echo = self.top if self.echo and self.logprobs else None
        if echo is None:
            return self.prompt
        return echo if self.prompt is None else max(echo, self.prompt)


def _top_dict(names: TokenText, token_id: int, lp: TokenLogprobs, k: int, by_id: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for t, v in zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True):
        out.setdefault(str(t) if by_id else names.completion_name(t), v)
    out.setdefault(str(token_id) if by_id else names.completion_name(token_id), lp.logprob)
    return out


class CompletionLogprobs:
    """The completions `logprobs` object of one choice, built piece by piece (stream deltas)."""

    def __init__(self, names: TokenText, k: int):
        self._names = names
        self._k = k
        self._offset = 0  # where the next token's text starts in the choice's text

    def build(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float | None],
        entries: Sequence[TokenLogprobs | None] | None,
    ) -> dict[str, Any]:
        """One piece: `logprobs[i]` None for a token without one (the prompt's first)."""
        names = self._names
        offsets = []
        for t in ids:
            offsets.append(self._offset)
            self._offset += len(names.text(t))
        out: dict[str, Any] = {
            "tokens": [names.completion_name(t) for t in ids],
            "token_logprobs": list(logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
            "token_ids": list(ids),
        }
        if self._k > 0:
            entries = entries if entries is not None else []
            if len(entries) != len(ids):
                raise ValueError(f"top logprobs: {len(entries)} entries for {len(ids)} tokens")
            out["top_logprobs"] = [
                None if e is None else _top_dict(names, t, e, self._k, False) for t, e in zip(ids, entries, strict=True)
            ]
            out["top_logprobs_by_id"] = [
                None if e is None else _top_dict(names, t, e, self._k, True) for t, e in zip(ids, entries, strict=True)
            ]
        return out

    def prompt(self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The echoed prompt's piece (entries: tokens 1..)."""
        if len(entries) != len(prompt_ids) - 1:
            raise ValueError(f"prompt logprobs: {len(entries)} entries for a prompt of {len(prompt_ids)} tokens")
        all_entries: list[TokenLogprobs | None] = [None, *entries]
        return self.build(prompt_ids, [None if e is None else e.logprob for e in all_entries], all_entries)


def join(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs pieces of one choice, one after the other."""
    out = dict(first)
    for key, value in second.items():
        if isinstance(value, list) and isinstance(first.get(key), list):
            out[key] = first[key] + value
        else:
            out[key] = value
    return out


def chat_logprobs(
    names: TokenText, ids: Sequence[int], logprobs: Sequence[float], entries: Sequence[TokenLogprobs] | None, k: int
) -> dict[str, Any]:
    """The chat `logprobs` object of some tokens of one choice."""

    def item(t: int, lp: float) -> dict[str, Any]:
        return {"token": names.chat_name(t), "logprob": lp, "bytes": list(names.raw_bytes(t)), "token_id": t}

    content = []
    for j, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
        entry = item(t, lp)
        top: list[dict[str, Any]] = []
        if k > 0:
            if entries is None or len(entries) != len(ids):
                raise ValueError("top logprobs: not one entry per token")
            e = entries[j]
            top = [item(a, v) for a, v in zip(e.top_ids[:k], e.top_logprobs[:k], strict=True)]
        entry["top_logprobs"] = top
        content.append(entry)
    return {"content": content}


def vllm_prompt_logprobs(
    names: TokenText, prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs], k: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token its own entry
    and the k most likely, keyed by token id."""
    out: list[dict[str, Any] | None] = [None]
    for t, e in zip(prompt_ids[1:], entries, strict=True):
        d: dict[str, Any] = {}
        for rank, (a, v) in enumerate(zip(e.top_ids[:k], e.top_logprobs[:k], strict=True), start=1):
            d[str(a)] = {"logprob": v, "rank": rank, "decoded_token": names.completion_name(a)}
        d.setdefault(str(t), {"logprob": e.logprob, "rank": e.rank, "decoded_token": names.completion_name(t)})
        out.append(d)
    return out
