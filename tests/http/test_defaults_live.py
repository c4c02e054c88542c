"""An omitted max_tokens against a real `himamba serve` (random-weight NemotronH, the shared
live server): generation goes on past the old fixed default of 128 tokens, up to the context."""

from __future__ import annotations

from typing import Any

from tests.http_request import http_request

ROOM = 200  # tokens the prompt leaves in the context: more than 128


def test_omitted_max_tokens_runs_to_the_context_length(live_server: Any):
    models = http_request(
        live_server.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {live_server.api_key}"}
    )
    context = models.json()["data"][0]["max_model_len"]
    prompt = [10 + (i * 7) % 1500 for i in range(context - ROOM)]  # token ids no other test sends
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
    out = live_server.post_json("/v1/completions", body)
    assert out["usage"]["prompt_tokens"] == context - ROOM
    assert out["usage"]["completion_tokens"] == ROOM
    assert out["choices"][0]["finish_reason"] == "length"
