"""A batch of OpenAI `/v1/completions` requests sent at once over HTTP, one client thread per prompt:
the served end-to-end time of an OpenAI-compatible server (ours or a peer's) as its users see it.

Every request is greedy (temperature 0), never stops at eos (`ignore_eos`, which both vLLM and we
accept) and must come back with exactly the tokens asked for; anything else is an error that names
the server's answer, never a shorter run timed as if it were whole.
"""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request

from himamba.bench.at_once import wall_seconds_at_once


class CompletionError(RuntimeError):
    """A request failed or came back with fewer tokens than asked for."""


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at /v1/models."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as r:
        models = json.loads(r.read())["data"]
    if not models:
        raise CompletionError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def _complete(base_url: str, model: str, prompt: list[int], new_tokens: int, timeout_s: float) -> None:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise CompletionError(f"{base_url} answered {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    got = answer.get("usage", {}).get("completion_tokens")
    if got != new_tokens:
        raise CompletionError(f"{base_url} returned {got} completion tokens, {new_tokens} were asked for")


def complete_batch(
    base_url: str, model: str, prompts: list[list[int]], new_tokens: int, timeout_s: float = 600.0
) -> float:
    """Send every prompt at once; wall seconds until the last completion is back."""
    return wall_seconds_at_once(
        [functools.partial(_complete, base_url, model, p, new_tokens, timeout_s) for p in prompts]
    )
