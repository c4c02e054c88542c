"""Logprobs for evaluation against a real `himamba serve` (random-weight NemotronH, float32),
compared with transformers' log-softmax by token id: top-k alternatives of generated tokens,
echoed prompt logprobs (over several prefill chunks), vLLM's `prompt_logprobs`, the same answer
whether or not the prompt is in the prefix cache, and batched prompts."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from himamba.common.client import Client
from tests.e2e.prompts import random_tokens
from tests.live_server import LiveServer, start_live_server

TOL = 1e-4
CHUNK = 32  # --chunked-prefill-size: the long prompts below take several prefill chunks


@pytest.fixture(scope="module")
def live(model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    server = start_live_server(model_dir, tmp_path_factory.mktemp("logs"), "--chunked-prefill-size", str(CHUNK))
    try:
        yield server
    finally:
        server.stop()


def _ref_logprobs(ref: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids`: [len(ids), V] (row p predicts p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)


def _stream(live: LiveServer, path: str, body: dict[str, Any]) -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Authorization": f"Bearer {live.api_key}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    for raw in resp.read().decode().split("\n\n"):
        if raw.strip():
            payload = raw[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    conn.close()
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_top_logprobs_equal_transformers(live: LiveServer, ref: Any):
    prompt = random_tokens(20, seed=1)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    choice = live.post_json("/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    gen = lp["token_ids"]
    assert len(gen) == 4
    want = _ref_logprobs(ref, prompt + gen)
    for t, (tok, top) in enumerate(zip(gen, lp["top_logprobs_by_id"], strict=True)):
        row = want[len(prompt) - 1 + t]
        alternatives = {int(k): v for k, v in top.items()}
        assert len(alternatives) in (5, 6)  # the 5 most likely, and the chosen token (OpenAI's k + 1)
        assert tok in alternatives and lp["token_logprobs"][t] == alternatives[tok]
        for token_id, value in alternatives.items():
            assert value == pytest.approx(row[token_id].item(), abs=TOL), (t, token_id)
        ranked = sorted(alternatives, key=lambda i: -alternatives[i])[:5]
        fifth = row[ranked[-1]].item()
        # Every token left out is no more likely than the fifth (to the tolerance).
        left_out = row.clone()
        left_out[ranked] = float("-inf")
        assert left_out.max().item() <= fifth + TOL
        # The name-keyed dict has the same values where names are unique.
        assert max(lp["top_logprobs"][t].values()) == max(alternatives.values())

    # Chat: logprobs + top_logprobs=5, exactly 5 alternatives per token, by id.
    body = {
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    out = live.post_json("/v1/chat/completions", body)
    choice = out["choices"][0]
    chat_prompt = out["prompt_token_ids"]
    content = choice["logprobs"]["content"]
    gen = [c["token_id"] for c in content]
    assert gen == choice["token_ids"]
    want = _ref_logprobs(ref, chat_prompt + gen)
    for t, entry in enumerate(content):
        row = want[len(chat_prompt) - 1 + t]
        assert entry["logprob"] == pytest.approx(row[entry["token_id"]].item(), abs=TOL)
        assert len(entry["top_logprobs"]) == 5
        for alt in entry["top_logprobs"]:
            assert alt["logprob"] == pytest.approx(row[alt["token_id"]].item(), abs=TOL)
        # They are the 5 most likely, best first (compared by value: ids may tie).
        got = [a["logprob"] for a in entry["top_logprobs"]]
        assert got == pytest.approx(torch.topk(row, 5).values.tolist(), abs=TOL)


def _echo(live: LiveServer, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1, **extra}
    return live.post_json("/v1/completions", body)


def test_echo_prompt_logprobs_equal_transformers_and_ignore_the_cache(live: LiveServer, ref: Any, model_dir):
    prompt = random_tokens(3 * CHUNK + 7, seed=2)  # four prefill chunks
    first = _echo(live, prompt)
    choice = first["choices"][0]
    lp = choice["logprobs"]
    # The prompt's tokens, then the generated one; the first prompt token has no logprob.
    assert lp["token_ids"][: len(prompt)] == prompt and len(lp["token_ids"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _ref_logprobs(ref, prompt + lp["token_ids"][-1:])
    got = torch.tensor(lp["token_logprobs"][1:])
    expected = want[torch.arange(len(prompt)), torch.tensor(lp["token_ids"][1:])]
    assert torch.allclose(got, expected, atol=TOL, rtol=0), (got - expected).abs().max()
    # lm-eval's greedy check: the top-1 alternative (plus the token) vs the token's own logprob.
    for p in range(1, len(prompt)):
        assert max(lp["top_logprobs_by_id"][p].values()) == pytest.approx(want[p - 1].max().item(), abs=TOL)
    # The echoed text is the prompt's, then the answer.
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert choice["text"].startswith(tokenizer.decode(prompt, skip_special_tokens=False))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Put the prompt in the prefix cache with a plain request (a repeat of it hits the cache)...
    plain = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    live.post_json("/v1/completions", plain)
    assert live.post_json("/v1/completions", plain)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # ...the same echo request gives exactly the same logprobs: it recomputes the prompt.
    second = _echo(live, prompt)
    assert second["choices"][0]["logprobs"] == lp
    assert second["choices"][0]["text"] == choice["text"]

    # vLLM's prompt_logprobs: [null, {id: {logprob, rank, decoded_token}}, ...], the same values.
    vllm = live.post_json("/v1/completions", {**plain, "prompt_logprobs": 2})["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(prompt)
    for p in range(1, len(prompt)):
        entry = vllm[p]
        mine = entry[str(prompt[p])]
        assert mine["logprob"] == lp["token_logprobs"][p]
        assert mine["rank"] == int((want[p - 1] > want[p - 1][prompt[p]]).sum()) + 1
        best = sorted((v for v in entry.values() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in best] == [1, 2]
        assert [v["logprob"] for v in best] == pytest.approx(torch.topk(want[p - 1], 2).values.tolist(), abs=TOL)

    # The ZeroMQ client gets the same numbers (GenerateChunk.prompt_logprobs / top_logprobs).
    with Client(live.endpoint, timeout_s=120) as c:
        out = c.generate(input_ids=prompt, max_tokens=2, logprobs=True, top_logprobs=3, prompt_logprobs=1)
    assert out.prompt_logprobs is not None and out.top_logprobs is not None
    assert [e.logprob for e in out.prompt_logprobs] == lp["token_logprobs"][1 : len(prompt)]
    best_ids = [int(max(d, key=d.get)) for d in lp["top_logprobs_by_id"][1 : len(prompt)]]
    assert [e.top_ids[0] for e in out.prompt_logprobs] == best_ids
    assert [len(e.top_ids) for e in out.top_logprobs] == [3, 3] and out.logprobs == [e.logprob for e in out.top_logprobs]


def test_echo_streams_the_prompt_first_and_serves_every_sample(live: LiveServer):
    prompt = random_tokens(CHUNK + 5, seed=3)
    whole = _echo(live, prompt, n=2, seed=7, temperature=0.8)
    lps = [c["logprobs"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    # Both samples carry the same prompt logprobs (sample 0 computes them).
    assert lps[0]["token_logprobs"][: len(prompt)] == lps[1]["token_logprobs"][: len(prompt)]
    events = _stream(live, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1,
                                                 "temperature": 0, "ignore_eos": True})  # fmt: skip
    pieces = [e["choices"][0] for e in events if e["choices"]]
    token_logprobs = [x for p in pieces if p["logprobs"] for x in p["logprobs"]["token_logprobs"]]
    assert token_logprobs[: len(prompt)] == lps[0]["token_logprobs"][: len(prompt)]
    assert len(token_logprobs) == len(prompt) + 3


def test_batched_prompts(live: LiveServer):
    prompts = [random_tokens(8 + 5 * i, seed=10 + i) for i in range(3)]
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    singles = [live.post_json("/v1/completions", {**base, "prompt": p}) for p in prompts]
    batch = live.post_json("/v1/completions", {**base, "prompt": prompts, "n": 2})
    choices = batch["choices"]
    assert [c["index"] for c in choices] == list(range(6))  # prompt i, sample j: i * n + j
    for i, single in enumerate(singles):
        for j in range(2):
            assert choices[i * 2 + j]["text"] == single["choices"][0]["text"], (i, j)
            assert choices[i * 2 + j]["logprobs"]["token_ids"] == single["choices"][0]["logprobs"]["token_ids"]
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)  # each prompt once, n samples
    assert usage["completion_tokens"] == 6 * 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # Streamed: each choice's deltas join into the same text; the last chunk has the summed usage.
    events = _stream(live, "/v1/completions", {**base, "prompt": prompts, "n": 2, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    finished = set()
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            finished.add(c["index"])
    assert finished == set(range(6))
    assert [texts[k] for k in range(6)] == [c["text"] for c in choices]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 30
    assert events[-1]["usage"]["prompt_tokens"] == usage["prompt_tokens"]

    # Strings batch too; one refused prompt refuses the request, and the server goes on.
    texts_batch = live.post_json("/v1/completions", {**base, "prompt": ["hello", "world"]})
    assert [c["index"] for c in texts_batch["choices"]] == [0, 1]
    bad = {**base, "prompt": [prompts[0], [10**6]]}
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(bad), {"Authorization": f"Bearer {live.api_key}"})
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 400 and err["message"].startswith("prompt 1:") and err["param"] == "prompt"
    assert live.post_json("/v1/completions", {**base, "prompt": prompts[0]})["choices"][0]["text"] == singles[0][
        "choices"
    ][0]["text"]
