"""n > 1 against a real `himamba serve` (random-weight NemotronH), over ZeroMQ and HTTP: the
samples share their prompt's cache, are reproducible with a seed, and an abort frees them all."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from himamba.common.client import Client, Completion
from himamba.common.messages import CacheStats
from tests.scrape import samples as scrape_samples

PROMPT_LEN = 40  # longer than a page (16 tokens by default): the siblings can hit it
CACHED_METRIC = 'himamba_request_cached_tokens_total{tier="device"}'


def _cached_device_tokens(live: Any) -> float:
    """The front door's counter of prompt tokens the device cache served (all samples)."""
    return scrape_samples(live.get("/metrics").body.decode()).get(CACHED_METRIC, 0.0)


def _wait_idle(live: Any, timeout_s: float = 30.0) -> CacheStats:
    """The cache controller's stats once no request holds anything (or the last ones seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = live.cache_stats()
        if stats.running_requests == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@pytest.fixture(scope="module")
def live(live_server: Any) -> Any:
    return live_server


@pytest.fixture(scope="module")
def client(live: Any) -> Iterator[Client]:
    with Client(live.endpoint, timeout_s=120, api_key=live.api_key) as c:
        yield c


@pytest.fixture(scope="module")
def oai(live: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=120) as c:
        yield c


def _prompt(first: int) -> list[int]:
    """A prompt no other test sends (token ids `first` .. `first + PROMPT_LEN - 1`)."""
    return list(range(first, first + PROMPT_LEN))


def _ids(outs: list[Completion]) -> list[list[int]]:
    return [o.token_ids for o in outs]


def _assert_all_free(stats: CacheStats) -> None:
    assert stats.running_requests == 0, stats
    assert stats.invariants_ok, stats.invariants_error
    # Whatever is not free belongs to the tree (unlocked, evictable), not to a request.
    assert stats.free_pages + stats.cached_pages == stats.total_pages, stats
    assert stats.free_slots + stats.cached_slots == stats.total_slots, stats


def test_zmq_samples_share_the_prompt_and_repeat_with_a_seed(client: Client):
    ids = _prompt(200)
    options = {"input_ids": ids, "max_tokens": 8, "temperature": 1.0, "seed": 123, "ignore_eos": True}
    outs = client.generate_n(n=3, **options)  # type: ignore[arg-type]
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in outs)
    usages = [o.usage for o in outs]
    assert all(u is not None and u.prompt_tokens == PROMPT_LEN for u in usages)
    assert usages[0] is not None and usages[0].cached_tokens.total == 0  # a fresh prompt
    for u in usages[1:]:  # the siblings ran after sample 0's prefill: the prompt was cached
        assert u is not None and 0 < u.cached_tokens.total < PROMPT_LEN
    assert len({tuple(t) for t in _ids(outs)}) > 1  # seed + i: the samples differ
    again = client.generate_n(n=3, **options)  # type: ignore[arg-type]
    assert _ids(again) == _ids(outs)
    assert [o.text for o in again] == [o.text for o in outs]


def test_greedy_samples_are_identical(client: Client):
    outs = client.generate_n(input_ids=_prompt(300), n=2, max_tokens=8, temperature=0, ignore_eos=True)
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 8
    assert outs[0].text == outs[1].text


def test_openai_n_choices_match_zmq_and_count_the_prompt_once(oai: openai.OpenAI, client: Client, live: Any):
    ids = _prompt(400)
    cached_before = _cached_device_tokens(live)
    kwargs = {"model": oai.models.list().data[0].id, "prompt": ids, "n": 3, "max_tokens": 8, "temperature": 1.0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    first = oai.completions.create(seed=9, extra_body=extra, **kwargs)  # type: ignore[call-overload]
    # Sample 0 found nothing (a fresh prompt) and each sample computes at least one prompt token:
    # more than PROMPT_LEN - 1 cached tokens in all means both siblings hit the cache.
    assert _cached_device_tokens(live) - cached_before > PROMPT_LEN - 1
    assert [c.index for c in first.choices] == [0, 1, 2]
    token_ids = [(c.model_extra or {})["token_ids"] for c in first.choices]
    assert first.usage is not None
    assert first.usage.prompt_tokens == PROMPT_LEN
    assert first.usage.completion_tokens == sum(len(t) for t in token_ids) == 24
    second = oai.completions.create(seed=9, extra_body=extra, **kwargs)  # type: ignore[call-overload]
    assert [c.text for c in second.choices] == [c.text for c in first.choices]
    zmq = client.generate_n(input_ids=ids, n=3, max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)
    assert _ids(zmq) == token_ids
    # Streamed: each chunk carries its choice's index; every choice's text is the same again.
    texts = ["", "", ""]
    for chunk in oai.completions.create(seed=9, stream=True, extra_body=extra, **kwargs):  # type: ignore[call-overload]
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]


def test_abort_mid_way_frees_every_sample(client: Client, live: Any):
    stream = client.stream(input_ids=_prompt(500), n=3, max_tokens=400, temperature=1.0, ignore_eos=True)
    seen: set[int] = set()
    for chunk in stream:
        assert not chunk.finished
        seen.add(chunk.index)
        if seen == {0, 1, 2}:  # every sample is running
            break
    stream.close()  # aborts the request: all three samples
    _assert_all_free(_wait_idle(live))


def test_http_disconnect_mid_way_frees_every_choice(live: Any):
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    body = {"prompt": _prompt(600), "n": 3, "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {live.api_key}"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    seen: set[int] = set()
    while seen != {0, 1, 2}:
        line = resp.readline().decode()
        if line.startswith("data: {"):
            (choice,) = json.loads(line[len("data: ") :])["choices"]
            assert choice["finish_reason"] is None
            seen.add(choice["index"])
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    _assert_all_free(_wait_idle(live))
