"""logit_bias against a real `himamba serve` (random-weight NemotronH, the session's shared
server): +100 on one token makes greedy decoding emit it, -100 on the greedy token moves it off,
on /v1/completions, /v1/chat/completions and /v1/responses alike."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.http_request import http_request


def _post(live_server: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {live_server.api_key}"}
    port = int(live_server.base_url.rsplit(":", 1)[1])
    r = http_request(port, "POST", path, json.dumps(body).encode(), headers)
    assert r.status == 200, r.body
    return r.json()


@pytest.fixture(scope="module")
def greedy(live_server: Any) -> list[int]:
    body = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    return _post(live_server, "/v1/completions", body)["choices"][0]["token_ids"]


def test_plus_100_makes_greedy_emit_the_token(live_server: Any, greedy: list[int]):
    target = (greedy[0] + 101) % 1000 + 10  # some token greedy decoding did not pick first
    assert target != greedy[0]
    bias = {str(target): 100}
    base = {"max_tokens": 4, "temperature": 0, "return_token_ids": True, "logit_bias": bias}
    done = _post(live_server, "/v1/completions", {**base, "prompt": "def add(a, b):"})
    assert done["choices"][0]["token_ids"] == [target] * 4
    chat = _post(live_server, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}]})
    assert chat["choices"][0]["token_ids"] == [target] * 4
    response = _post(
        live_server, "/v1/responses", {"input": "hi", "max_output_tokens": 4, "temperature": 0, "logit_bias": bias}
    )
    assert response["output"][0]["content"][0]["text"] == done["choices"][0]["text"]


def test_minus_100_on_the_greedy_token_changes_it(live_server: Any, greedy: list[int]):
    body = {"prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    moved = _post(live_server, "/v1/completions", {**body, "logit_bias": {str(greedy[0]): -100}})
    assert moved["choices"][0]["token_ids"] != greedy[:1]
