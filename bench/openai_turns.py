"""One multi-turn round sent to any OpenAI-compatible server (ours, vLLM's `vllm serve`, sglang's),
streamed over HTTP and timed as a user's client would see it.

A round is `POST /v1/completions` with the history as token ids, greedy, `ignore_eos`, streamed,
with `return_token_ids` (vLLM's extension, which we accept too) so the answer's ids continue the
conversation exactly, and `stream_options.include_usage` for the prompt's cached tokens
(`usage.prompt_tokens_details.cached_tokens`; ours adds them per tier). A server that streams no
token ids cannot continue the conversation: that round is an error naming why, not a guess.
"""

from __future__ import annotations

import json
import time
from types import TracebackType
from typing import Any, Self

import aiohttp

from himamba.bench.latency_summary import TIERS, RequestRecord
from himamba.bench.workload import Turn


def _cached(usage: dict[str, Any]) -> dict[str, int]:
    """Cached prompt tokens per tier; a peer that reports only a total counts it as `device`."""
    details = usage.get("prompt_tokens_details") or {}
    by_tier = details.get("cached_tokens_by_tier")
    if isinstance(by_tier, dict):
        return {t: int(by_tier.get(t) or 0) for t in TIERS}
    return {**dict.fromkeys(TIERS, 0), "device": int(details.get("cached_tokens") or 0)}


class OpenAITurns:
    """The multi-turn driver's client for an OpenAI-compatible server at `base_url`."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # No connection cap: `max_parallel` is the driver's to enforce, as with the ZeroMQ client.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def timed_request(self, turn: Turn, output_length: int) -> tuple[RequestRecord, list[int]]:
        """Send one round; its record (times from the moment it was sent) and the answer's ids."""
        assert self._session is not None, "use OpenAITurns as an async context manager"
        rec = RequestRecord(turn.client, turn.round, len(turn.input_ids), turn.repeated_len)
        body = {
            "model": self.model,
            "prompt": turn.input_ids,
            "max_tokens": output_length,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        token_ids: list[int] = []
        finish: str | None = None
        usage: dict[str, Any] | None = None
        t0 = time.perf_counter()
        last = t0
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=body) as response:
                if response.status != 200:
                    text = (await response.text())[:300]
                    raise RuntimeError(f"{self.base_url} answered {response.status}: {text}")
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    now = time.perf_counter()
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        ids = choice.get("token_ids")
                        if ids is None and choice.get("text"):
                            raise RuntimeError(
                                f"{self.base_url} streams no token ids (it needs vLLM's return_token_ids), "
                                "so the conversation cannot go on"
                            )
                        if ids:
                            if rec.ttft_s is None:
                                rec.ttft_s = now - t0
                            else:
                                # A chunk of several tokens spreads its gap over them: ITL stays per token.
                                rec.itl_s.extend([(now - last) / len(ids)] * len(ids))
                            last = now
                            token_ids.extend(ids)
                        finish = choice.get("finish_reason") or finish
            rec.e2e_s = time.perf_counter() - t0
            if usage is not None:
                rec.cached = _cached(usage)
            if finish not in ("length", "stop"):
                rec.error = f"finished with {finish!r}"
            elif len(token_ids) != output_length:
                rec.error = f"{len(token_ids)} tokens came back, {output_length} were asked for"
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as e:
            rec.error = str(e) or repr(e)
        except Exception as e:  # noqa: BLE001 - a malformed answer is this round's result, never a hung run
            rec.error = repr(e)
        rec.completion_tokens = len(token_ids)
        return rec, token_ids
