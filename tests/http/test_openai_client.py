"""The official `openai` client against a real `himamba serve` (random-weight NemotronH)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def live(live_server: Any) -> Any:
    return live_server


@pytest.fixture(scope="module")
def client(live: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI, demo_checkpoint: Path) -> str:
    (card,) = client.models.list().data
    assert card.id == demo_checkpoint.name
    return card.id


@pytest.fixture(scope="module")
def tokenizer(demo_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_file(str(demo_checkpoint / "tokenizer.json"))


def test_completion(client: openai.OpenAI, model: str):
    out = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    (choice,) = out.choices
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0


def test_streamed_completion_text_matches_its_tokens(client: openai.OpenAI, model: str, tokenizer: Tokenizer):
    stream = client.completions.create(
        model=model,
        prompt="import numpy as np\n",
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    text, ids, reasons = "", [], []
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        ids += (choice.model_extra or {}).get("token_ids", [])
        reasons.append(choice.finish_reason)
    assert len(ids) == 10
    assert text == tokenizer.decode(ids)
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_chat_completion(client: openai.OpenAI, model: str):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=6, temperature=0
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens >= 1


def test_streamed_chat_completion(client: openai.OpenAI, model: str):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to three"}],
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(content, str)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_repeated_prefix_is_served_from_cache(client: openai.OpenAI, model: str):
    prefix = "".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(12))
    first = client.completions.create(model=model, prompt=prefix + "# first", max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prefix + "# second", max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens > 64
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None and details.cached_tokens > 0
    by_tier = (details.model_extra or {})["cached_tokens_by_tier"]
    assert set(by_tier) == {"device", "host", "storage"}
    assert sum(by_tier.values()) == details.cached_tokens


def test_errors_surface_as_openai_exceptions(client: openai.OpenAI, model: str, live: Any):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", n=17)
    assert e.value.status_code == 400 and "n must be in [1, 16]" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="word " * 5000)  # longer than the context
    bad = openai.OpenAI(base_url=live.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # ... and the server still serves.
    assert client.completions.create(model=model, prompt="ok", max_tokens=1).choices[0].finish_reason == "length"


def test_health_is_ok_once_every_service_is_ready(live: Any):
    deadline = time.monotonic() + 3
    while (status := live.get("/health").status) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 200
