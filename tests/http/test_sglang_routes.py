"""sglang's native routes (/generate, /server_info, /model_info, ...) against a TokenizerService
with a fake scheduler: sglang's shapes, refusals that name the field, the API key on every route
but /health and /metrics, and no secret in /server_info."""

from __future__ import annotations

import http.client
import itertools
import json
from typing import Any

from himamba.common.config import Config
from himamba.services.tokenizer.http.sglang_routes import public_config

Harness = Any  # tests/http/conftest.py's Harness (conftest modules are not importable)


def _sse(h: Harness, body: dict[str, Any]) -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Authorization": f"Bearer {h.api_key}"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        raw = resp.read().decode()
    finally:
        conn.close()
    events = []
    for part in raw.split("\n\n"):
        if part.strip():
            assert part.startswith("data: "), part
            payload = part[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_answers_in_sglangs_shape(harness: Harness):
    r = harness.post("/generate", {"text": "def f(x):", "sampling_params": {"max_new_tokens": 64, "temperature": 0}})
    assert r.status == 200, r.body
    out = r.json()
    assert out["text"] == harness.reply_text
    assert harness.tokenizer.decode(out["output_ids"]) == harness.reply_text
    meta = out["meta_info"]
    n_prompt = len(harness.tokenizer.encode("def f(x):").ids)
    assert meta["prompt_tokens"] == n_prompt and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": len(out["output_ids"])}
    assert meta["cached_tokens"] == harness.cached.total
    assert meta["cached_tokens_by_tier"] == {"device": 3, "host": 2, "storage": 1}
    assert isinstance(meta["id"], str) and meta["e2e_latency"] >= 0

    # Token ids in, a rid of the client's, the chosen tokens' logprobs, n > 1 as a list.
    ids = harness.tokenizer.encode("token ids").ids
    body = {"input_ids": ids, "rid": "mine", "return_logprob": True, "sampling_params": {"max_new_tokens": 2, "n": 2}}
    outs = harness.post("/generate", body).json()
    assert [o["index"] for o in outs] == [0, 1]
    for o in outs:
        assert o["meta_info"]["id"] == "mine" and o["meta_info"]["prompt_tokens"] == len(ids)
        assert [t for _, t, _ in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert len(o["output_ids"]) == 2


def test_generate_streams_cumulative_text_then_done(harness: Harness):
    events = _sse(harness, {"text": ["stream me"], "stream": True, "sampling_params": {"max_new_tokens": 64}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative, as sglang's
    assert texts[-1] == harness.reply_text
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["meta_info"]["cached_tokens"] == harness.cached.total


def test_generate_refuses_what_it_cannot_honour_naming_the_field(harness: Harness):
    cases = [
        ({"text": "x", "sampling_params": {"json_schema": "{nope"}}, "json_schema"),  # not valid JSON
        ({"text": "x", "lora_path": "a"}, "lora_path"),
        ({"text": "x", "sampling_params": {"min_new_tokens": 3}}, "min_new_tokens"),
        ({"text": "x", "sampling_params": {"skip_special_tokens": False}}, "skip_special_tokens"),
        ({"text": "x", "top_logprobs_num": 2}, "top_logprobs_num"),
        ({"text": ["a", "b"]}, "text"),
        ({"input_ids": [[1], [2]]}, "input_ids"),
        ({}, "text"),
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "x", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ({"text": "x", "return_hidden_states": True}, "return_hidden_states"),
    ]
    for body, param in cases:
        r = harness.post("/generate", body)
        assert r.status == 400, (body, r.body)
        assert r.json()["error"]["param"] == param, (body, r.json())
    assert harness.post("/generate", raw=b"{nope").status == 400
    assert harness.post("/generate", {"text": "x", "model": "other"}).status == 404
    # What sglang-router 0.3.2 forwards: sglang's fields at their defaults, accepted.
    routed = {
        "text": "hello world", "model": None, "sampling_params": {"max_new_tokens": 4},
        "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False,
    }  # fmt: skip
    assert harness.post("/generate", routed).status == 200
    assert harness.post("/generate", {"text": "still serving"}).status == 200


def test_server_and_model_info_for_the_gateway(harness: Harness):
    for path in ("/server_info", "/get_server_info"):
        info = harness.get(path).json()
        # What sglang-router reads to register a worker.
        assert info["served_model_name"] == harness.model_name
        assert info["model_path"] == str(harness.model_dir)
        assert info["tp_size"] == 1 and info["dp_size"] == 1
        assert info["config"]["http"]["api_key"] == "<redacted>"
        assert harness.api_key not in json.dumps(info)
    for path in ("/model_info", "/get_model_info"):
        m = harness.get(path).json()
        assert m["model_path"] == str(harness.model_dir) and m["is_generation"] is True


def test_server_info_shows_no_store_password():
    cfg = Config()
    cfg = type(cfg)(
        http=type(cfg.http)(api_key="k3y"),
        cache=type(cfg.cache)(hicache_storage_backend="redis", hicache_storage_url="redis://me:s3cret@10.0.0.5:6379/0"),
    )
    text = json.dumps(public_config(cfg))
    assert "s3cret" not in text and "k3y" not in text
    assert public_config(cfg)["cache"]["hicache_storage_url"] == "redis://me:<redacted>@10.0.0.5:6379/0"


def test_every_route_but_health_and_metrics_needs_the_key(harness: Harness):
    from himamba.services.tokenizer.http.server import _OPEN_ROUTES, _ROUTES

    assert set(_OPEN_ROUTES) == {"/health", "/metrics"}
    paths = [p for p in _ROUTES if p not in _OPEN_ROUTES] + ["/v1/models/x", "/nowhere"]
    for path in paths:
        for method in ("GET", "POST"):
            r = harness.request(method, path, {"text": "x"} if method == "POST" else None, key=None)
            assert r.status == 401, (method, path, r.status)
            r = harness.request(method, path, key="wrong")
            assert r.status == 401, (method, path, r.status)
    assert harness.get("/health", key=None).status in (200, 503)
    assert harness.get("/metrics", key=None).status == 200
    # /health_generate with the key: 503 naming what it waits for while the peers are not ready.
    r = harness.get("/health_generate")
    assert r.status in (200, 503)


def test_openai_bodies_as_sglang_router_forwards_them(harness: Harness):
    """sglang-router 0.3.2 rewrites OpenAI bodies with sglang's extension fields at their defaults
    (captured from a live router): a fleet breaks if these are refused."""
    chat = {
        "messages": [{"role": "user", "content": "Tell"}], "model": harness.model_name, "logprobs": False,
        "max_completion_tokens": 3, "stream": False, "no_stop_trim": False, "ignore_eos": False,
        "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
        "stream_reasoning": True, "return_hidden_states": False,
    }  # fmt: skip
    r = harness.post("/v1/chat/completions", chat)
    assert r.status == 200, r.body
    completion = {
        "model": harness.model_name, "prompt": "Tell", "max_tokens": 3, "stream": False, "echo": False,
        "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
    }  # fmt: skip
    r = harness.post("/v1/completions", completion)
    assert r.status == 200, r.body


def test_flush_cache_answers_what_the_cache_controller_says(harness: Harness):
    """/flush_cache asks the cache controller (here a fake bound on its inbox): a flush refused
    because copies are in flight is asked again, one refused because requests hold the cache is a
    409 naming why, a done one is a 200 with what was freed."""
    import threading

    import msgspec
    import zmq

    from himamba.common.messages import CacheFlushed, FlushCache, ToCache

    answers = [
        CacheFlushed(flush_id=0, ok=False, busy=True, error="2 device<->host copies in flight"),
        CacheFlushed(flush_id=0, ok=True, device_pages=7, device_states=2, host_pages=9, host_states=3),
        CacheFlushed(flush_id=0, ok=False, error="1 request(s) hold cache memory; flush when the server is idle"),
    ]
    asked: list[FlushCache] = []
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(harness.cfg.endpoints.cache_ipc)

    def fake_cache() -> None:
        for answer in answers:
            msg = msgspec.msgpack.decode(inbox.recv(), type=ToCache)
            assert isinstance(msg, FlushCache) and msg.reply_to == harness.cfg.endpoints.tokenizer_ipc
            asked.append(msg)
            harness.peers.send(msgspec.structs.replace(answer, flush_id=msg.flush_id))

    thread = threading.Thread(target=fake_cache, daemon=True)
    thread.start()
    try:
        r = harness.post("/flush_cache")
        assert r.status == 200, r.body
        freed = {"device_pages": 7, "device_states": 2, "host_pages": 9, "host_states": 3}
        assert r.json() == {"message": "Cache flushed.", "freed": freed}
        r = harness.post("/flush_cache")
        assert r.status == 409 and "1 request(s) hold cache memory" in r.json()["error"]["message"]
        thread.join(timeout=10)
        assert len(asked) == 3 and len({m.flush_id for m in asked}) == 3
    finally:
        ctx.destroy(linger=0)


def test_generate_sampling_left_out_takes_the_defaults(harness: Harness):
    """sampling_params a request leaves out take the checkpoint's generation_config.json values
    (this checkpoint has none: sglang's own), those it sets win; top_k -1 is no top-k."""
    from himamba.common.messages import AddRequest

    ids = harness.tokenizer.encode("defaults please").ids
    assert harness.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}).status == 200
    add = harness.scheduler.wait_for(lambda m: isinstance(m, AddRequest) and m.input_ids == ids)
    s = add.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    ids = harness.tokenizer.encode("mine please").ids
    given = {
        "max_new_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
    }
    assert harness.post("/generate", {"input_ids": ids, "sampling_params": given}).status == 200
    s = harness.scheduler.wait_for(lambda m: isinstance(m, AddRequest) and m.input_ids == ids).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.5, 0.9, 0, 0.1, 1.2)
