"""The OpenAI-compatible endpoints against a TokenizerService with a fake scheduler."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from himamba.common.messages import AbortRequest, AddRequest, StopRequest

Harness = Any  # tests/http/conftest.py's Harness (conftest modules are not importable)
_CONTEXT_LEN = 64  # the harness's max_context_len


def _sse_events(resp: http.client.HTTPResponse) -> list[Any]:
    """Read a whole SSE body: the decoded `data:` payloads, "[DONE]" kept as a string."""
    events: list[Any] = []
    for raw in resp.read().decode().split("\n\n"):
        if not raw.strip():
            continue
        assert raw.startswith("data: "), raw
        payload = raw[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _stream(h: Harness, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPResponse, list[Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {h.api_key}"})
    resp = conn.getresponse()
    events = _sse_events(resp)
    conn.close()
    return resp, events


def _add_for(h: Harness, prompt_ids: list[int]) -> AddRequest:
    return h.scheduler.wait_for(lambda m: isinstance(m, AddRequest) and m.input_ids == prompt_ids)


def test_models_lists_the_served_model(harness: Harness):
    r = harness.get("/v1/models")
    assert r.status == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [harness.model_name]
    assert body["data"][0]["max_model_len"] == harness.max_context_len
    assert harness.get(f"/v1/models/{harness.model_name}").json()["id"] == harness.model_name
    assert harness.get("/v1/models/other").status == 404


def test_completion_whole_answer_with_usage_by_tier(harness: Harness):
    r = harness.post("/v1/completions", {"model": harness.model_name, "prompt": "def f(x):"})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == harness.model_name
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == harness.reply_text
    assert choice["finish_reason"] == "length"
    prompt_ids = harness.tokenizer.encode("def f(x):").ids
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(harness.scheduler.reply_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == harness.cached.total
    assert details["cached_tokens_by_tier"] == {
        "device": harness.cached.device,
        "host": harness.cached.host,
        "storage": harness.cached.storage,
    }
    add = _add_for(harness, prompt_ids)
    assert add.sampling.temperature == 1.0  # OpenAI's default when the body has none


def test_token_id_prompt_and_vllm_extensions_reach_the_scheduler(harness: Harness):
    ids = harness.tokenizer.encode("import os").ids
    body = {
        "prompt": ids,
        "max_tokens": 3,
        "temperature": 0,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "ignore_eos": True,
        "stop_token_ids": [7],
        "seed": 11,
        "return_token_ids": True,
    }
    r = harness.post("/v1/completions", body)
    assert r.status == 200, r.body
    out = r.json()
    assert out["prompt_token_ids"] == ids
    assert out["choices"][0]["token_ids"] == harness.scheduler.reply_ids[:3]
    assert out["choices"][0]["finish_reason"] == "length"
    s = _add_for(harness, ids).sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.min_p, s.repetition_penalty) == (3, 0.0, 5, 0.1, 1.2)
    assert (s.ignore_eos, s.stop_token_ids, s.seed) == (True, [7], 11)


def test_batch_of_one_prompt_is_accepted(harness: Harness):
    r = harness.post("/v1/completions", {"prompt": ["class A:"], "max_tokens": 2, "temperature": 0})
    assert r.status == 200, r.body
    assert r.json()["usage"]["completion_tokens"] == 2


def test_stop_string_cuts_the_text_and_stops_the_request(harness: Harness):
    r = harness.post("/v1/completions", {"prompt": "print(1)", "stop": "wörld", "temperature": 0})
    assert r.status == 200, r.body
    choice = r.json()["choices"][0]
    assert choice["text"] == harness.reply_text[: harness.reply_text.index("wörld")]
    assert choice["finish_reason"] == "stop"
    add = _add_for(harness, harness.tokenizer.encode("print(1)").ids)
    harness.scheduler.wait_for(lambda m: isinstance(m, StopRequest) and m.rid == add.rid)


def test_streamed_completion_is_sse_with_done_and_usage(harness: Harness):
    body = {"prompt": "x = 1", "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    resp, events = _stream(harness, "/v1/completions", body)
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    *deltas, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in deltas) == harness.reply_text
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == harness.cached.total


def test_chat_completion_renders_the_template_like_hf(harness: Harness):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    r = harness.post("/v1/chat/completions", {"model": harness.model_name, "messages": messages, "temperature": 0})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": harness.reply_text}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["host"] == harness.cached.host
    # bos_token / eos_token come from tokenizer_config.json; the template's tokens are not doubled.
    text = "<|system|><|system|>\nbe brief<|endoftext|>\n<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    _add_for(harness, harness.tokenizer.encode(text, add_special_tokens=False).ids)


def test_streamed_chat_starts_with_the_role_and_ends_with_done(harness: Harness):
    body = {"messages": [{"role": "user", "content": "stream please"}], "stream": True, "max_completion_tokens": 4}
    resp, events = _stream(harness, "/v1/chat/completions", body)
    assert resp.status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == harness.tokenizer.decode(harness.scheduler.reply_ids[:4])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_of_the_chosen_tokens(harness: Harness):
    r = harness.post("/v1/completions", {"prompt": "lp", "max_tokens": 3, "logprobs": 0, "temperature": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -1.5, -2.5]
    ids = harness.scheduler.reply_ids[:3]
    # "héllo": "é" is two byte tokens, each "\ufffd" alone: named by their bytes, as OpenAI does,
    # with the ids beside them.
    assert [harness.tokenizer.decode([t]) for t in ids] == ["h", "\ufffd", "\ufffd"]
    assert lp["tokens"] == ["h", "bytes:\\xc3", "bytes:\\xa9"]
    assert lp["token_ids"] == ids
    assert lp["text_offset"][0] == 0
    r = harness.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "lp"}], "max_tokens": 3, "logprobs": True}
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -1.5, -2.5]
    assert [c["token"] for c in content] == ["h", "\\xc3", "\\xa9"]
    assert [c["bytes"] for c in content] == [[ord("h")], [0xC3], [0xA9]]  # together: "é" in UTF-8
    assert [c["token_id"] for c in content] == ids
    body = {"prompt": "lp", "max_tokens": 3, "logprobs": 0, "return_tokens_as_token_ids": True}
    lp = harness.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]  # vLLM's names


def _assert_error(r: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status == status, (r.status, r.body)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": 12}, 400, "prompt"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "n": 17}, 400, "n"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
        ({"prompt": "x", "logprobs": -1}, 400, "logprobs"),
        ({"prompt": "x", "logprobs": 21}, 400, "top_logprobs"),  # past --max-logprobs (20)
        ({"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ({"prompt": ["a", [1, "b"]]}, 400, "prompt"),
        ({"prompt": ["a", "b", "too long" * 100]}, 400, "prompt"),  # one prompt refused: all are
        ({"prompt": [1, "a"]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": list(range(1, _CONTEXT_LEN + 1))}, 400, None),  # too long for the context
        ({"prompt": [10**9]}, 400, None),  # a token id out of the vocabulary
    ],
)
def test_bad_completion_bodies_get_openai_errors(
    harness: Harness, body: dict[str, Any], status: int, param: str | None
):
    assert harness.max_context_len == _CONTEXT_LEN
    _assert_error(harness.post("/v1/completions", body), status, param)


def test_malformed_and_oversized_bodies(harness: Harness):
    err = _assert_error(harness.post("/v1/completions", raw=b'{"prompt": "x",'), 400)
    assert err["code"] == "invalid_json"
    _assert_error(harness.post("/v1/completions", raw=b'["prompt"]'), 400)
    _assert_error(harness.post("/v1/chat/completions", {"messages": []}), 400, "messages")
    _assert_error(harness.post("/v1/chat/completions", {"messages": [{"content": "no role"}]}), 400, "messages")
    _assert_error(harness.post("/v1/completions", raw=b'{"prompt": "' + b"a" * (2 << 20) + b'"}'), 413)


def test_api_key_is_required_on_v1_only(harness: Harness):
    assert _assert_error(harness.get("/v1/models", key=None), 401)["code"] == "invalid_api_key"
    _assert_error(harness.post("/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    assert harness.get("/metrics", key=None).status == 200
    assert harness.get("/health", key=None).status in (200, 503)


@pytest.mark.parametrize("first", ["right", "wrong"])
def test_two_authorization_headers_are_a_400_whichever_comes_first(harness: Harness, first: str):
    """A proxy that judged the other header would disagree with us: refused, never judged by one."""
    keys = [harness.api_key, "wrong"] if first == "right" else ["wrong", harness.api_key]
    conn = http.client.HTTPConnection("127.0.0.1", harness.port, timeout=30)
    conn.putrequest("GET", "/v1/models")
    for key in keys:
        conn.putheader("Authorization", f"Bearer {key}")
    conn.endheaders()
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    conn.close()
    assert resp.status == 400 and "Authorization" in err["message"], (resp.status, err)


def test_the_same_authorization_header_twice_is_one_key(harness: Harness):
    """sglang's router sends its own Authorization header beside the client's: the same key twice agrees."""
    conn = http.client.HTTPConnection("127.0.0.1", harness.port, timeout=30)
    conn.putrequest("GET", "/v1/models")
    for _ in range(2):
        conn.putheader("Authorization", f"Bearer {harness.api_key}")
    conn.endheaders()
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 200


def test_unknown_routes_and_methods(harness: Harness):
    _assert_error(harness.get("/v1/nothing"), 404)
    _assert_error(harness.get("/v1/completions"), 405)


def test_server_keeps_serving_after_errors(harness: Harness):
    for _ in range(3):
        harness.post("/v1/completions", raw=b"{nope")
    r = harness.post("/v1/completions", {"prompt": "still alive", "max_tokens": 2})
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_mid_stream_aborts_the_request(harness: Harness):
    conn = http.client.HTTPConnection("127.0.0.1", harness.port, timeout=30)
    body = {"prompt": "hold the line", "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {harness.api_key}"})
    resp = conn.getresponse()
    assert resp.status == 200
    line = resp.readline()  # the first event: the request is running
    first = json.loads(line.decode()[len("data: ") :])
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    harness.scheduler.wait_for(lambda m: isinstance(m, AbortRequest) and m.rid.endswith(":" + first["id"]))


def test_client_disconnect_while_waiting_for_a_whole_answer_aborts(harness: Harness):
    conn = http.client.HTTPConnection("127.0.0.1", harness.port, timeout=30)
    conn.request(
        "POST", "/v1/completions", json.dumps({"prompt": "hold still"}), {"Authorization": f"Bearer {harness.api_key}"}
    )
    add = _add_for(harness, harness.tokenizer.encode("hold still").ids)
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    harness.scheduler.wait_for(lambda m: isinstance(m, AbortRequest) and m.rid == add.rid)


def test_n_choices_whole_answer_counts_the_prompt_once(harness: Harness):
    ids = harness.tokenizer.encode("def sample():").ids
    body = {"prompt": ids, "n": 3, "seed": 5, "temperature": 0.8, "logprobs": 0, "return_token_ids": True}
    r = harness.post("/v1/completions", body)
    assert r.status == 200, r.body
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    for c in out["choices"]:
        assert c["text"] == harness.reply_text and c["finish_reason"] == "length"
        assert c["token_ids"] == harness.scheduler.reply_ids
        assert c["logprobs"]["text_offset"][0] == 0  # each choice's offsets start at its own text
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(ids)  # once, not three times
    assert usage["completion_tokens"] == 3 * len(harness.scheduler.reply_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == harness.cached.total
    adds = [m for m in harness.scheduler.adds() if m.input_ids == ids]
    assert sorted(a.sampling.seed for a in adds) == [5, 6, 7]


def test_n_choices_stream_carries_each_choice_index(harness: Harness):
    body = {
        "messages": [{"role": "user", "content": "two please"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp, events = _stream(harness, "/v1/chat/completions", body)
    assert resp.status == 200 and events[-1] == "[DONE]"
    *deltas, usage_chunk = events[:-1]
    for index in (0, 1):
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == index]
        assert [("role" in c["delta"]) for c in mine] == [True] + [False] * (len(mine) - 1)
        assert "".join(c["delta"].get("content", "") for c in mine) == harness.reply_text
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert all(len(c["choices"]) == 1 for c in deltas)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 2 * len(harness.scheduler.reply_ids)


def test_client_disconnect_aborts_every_choice(harness: Harness):
    conn = http.client.HTTPConnection("127.0.0.1", harness.port, timeout=30)
    body = {"prompt": "hold them all", "stream": True, "n": 3}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {harness.api_key}"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = json.loads(resp.readline().decode()[len("data: ") :])
    ids = harness.tokenizer.encode("hold them all").ids
    harness.scheduler.wait_for(lambda m: len([a for a in harness.scheduler.adds() if a.input_ids == ids]) == 3)
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    # Each sample is aborted; a token of a sample already aborted draws another abort (late
    # outputs are stopped again), so count the samples, not the messages.
    harness.scheduler.wait_for(lambda m: len({a.rid for a in harness.scheduler.aborts_of(":" + first["id"])}) == 3)


def test_stop_reason_and_matched_stop_say_what_stopped_the_answer(harness: Harness):
    """vLLM's stop_reason (the stop string or stop token id; null for EOS and length) and sglang's
    matched_stop (the same, or the EOS id) on completions and chat choices, streamed or whole."""
    harness.scheduler.replies["say-bye-eos"] = "Bye now<|endoftext|>"
    harness.scheduler.replies["say-bye-token"] = "Bye now"
    last = harness.tokenizer.encode("Bye now").ids[-1]

    r = harness.post("/v1/completions", {"prompt": "print(1)", "stop": ["zzz", "wörld"], "temperature": 0})
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == ("stop", "wörld", "wörld")

    r = harness.post("/v1/completions", {"prompt": "say-bye-token", "stop_token_ids": [last], "temperature": 0})
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == ("stop", last, last)

    r = harness.post("/v1/completions", {"prompt": "x = 2", "max_tokens": 2, "temperature": 0})
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == ("length", None, None)

    chat = {"messages": [{"role": "user", "content": "say-bye-eos"}], "temperature": 0}
    choice = harness.post("/v1/chat/completions", chat).json()["choices"][0]
    assert choice["message"]["content"] == "Bye now"
    assert (choice["finish_reason"], choice["stop_reason"], choice["matched_stop"]) == ("stop", None, 0)

    _, events = _stream(harness, "/v1/chat/completions", {**chat, "stream": True})
    *chunks, done = events
    assert done == "[DONE]"
    ends = [
        (c["choices"][0]["finish_reason"], c["choices"][0].get("stop_reason"), c["choices"][0].get("matched_stop"))
        for c in chunks
    ]
    assert ends[-1] == ("stop", None, 0) and all(e == (None, None, None) for e in ends[:-1])

    body = {"prompt": "print(1)", "stop": "wörld", "temperature": 0, "stream": True}
    _, events = _stream(harness, "/v1/completions", body)
    final = events[-2]["choices"][0]
    assert (final["finish_reason"], final["stop_reason"], final["matched_stop"]) == ("stop", "wörld", "wörld")

    r = harness.post("/generate", {"text": "say-bye-token", "sampling_params": {"stop_token_ids": [last]}})
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": last}


@pytest.mark.parametrize(
    ("bias", "words"),
    [
        ({"abc": 1}, "logit_bias: keys are token ids, got 'abc'"),
        ({"-3": 1}, "logit_bias: keys are token ids, got '-3'"),
        ({"5": 100.5}, "logit_bias[5]: 100.5 is out of range [-100, 100]"),
        ({"5": -250}, "logit_bias[5]: -250.0 is out of range [-100, 100]"),
        ({str(i): 1 for i in range(301)}, "logit_bias: at most 300 tokens, got 301"),
        ({"99999999": 1}, "logit_bias: token id 99999999 is out of range [0, "),
        ({"1" * 5000: 1}, "logit_bias: token id 1111"),  # past int()'s digit limit: a 400, not a 500
        ({"9" * 30: 1}, "logit_bias: token id 9999"),  # past 64 bits
        ({"5": 100, "05": -100}, "logit_bias: keys '5' and '05' are the same token id 5"),  # which bias?
        ({"5": "high"}, "Expected `float`, got `str` - at `$.logit_bias"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400_naming_the_problem(harness: Harness, path: str, bias: dict[str, Any], words: str):
    body = {"logit_bias": bias, "max_tokens": 1}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = harness.post(path, body)
    assert r.status == 400, r.body
    assert words in r.json()["error"]["message"], r.json()


def test_logit_bias_reaches_the_engine_as_token_ids(harness: Harness):
    """chat, completions and sglang's /generate pass the bias on as {token id: value}."""
    r = harness.post("/v1/completions", {"prompt": "bias-c", "max_tokens": 1, "logit_bias": {"17": 100, "3": -100}})
    assert r.status == 200, r.body
    add = _add_for(harness, harness.tokenizer.encode("bias-c").ids)
    assert add.sampling.logit_bias == {17: 100.0, 3: -100.0}
    chat = {"messages": [{"role": "user", "content": "bias-chat"}], "max_tokens": 1, "logit_bias": {"9": 2.5}}
    assert harness.post("/v1/chat/completions", chat).status == 200
    add = harness.scheduler.wait_for(
        lambda m: isinstance(m, AddRequest) and "bias-chat" in harness.tokenizer.decode(m.input_ids)
    )
    assert add.sampling.logit_bias == {9: 2.5}
    body = {"text": "bias-sgl", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"4": -1}}}
    assert harness.post("/generate", body).status == 200
    assert _add_for(harness, harness.tokenizer.encode("bias-sgl").ids).sampling.logit_bias == {4: -1.0}


def test_a_batch_whose_replies_add_up_past_the_logprob_bound_is_refused_before_any_prompt_runs(harness: Harness):
    """Each prompt alone is far under the bound; the batch's one reply is not (an lm-eval batch of
    64 x 1,000 tokens with echo and logprobs 5 was a 22.8 MB reply). Nothing of it is queued."""
    from himamba.services.tokenizer.prepare import MAX_LOGPROB_ENTRIES

    def batch(marker: int, count: int) -> list[list[int]]:
        return [[marker, i + 10, *([5] * 58)] for i in range(count)]  # 60 tokens each: 59 x 21 entries

    big = batch(901, 200)  # 200 x 59 x 21 = 247,800 entries in all; one prompt: 1,239
    assert 200 * 59 * 21 > MAX_LOGPROB_ENTRIES > 59 * 21
    body = {"prompt": big, "max_tokens": 1, "echo": True, "logprobs": 20, "temperature": 0}
    r = harness.post("/v1/completions", body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == "prompt"
    assert "these 200 prompts would carry 252000 logprob entries in all" in err["message"]  # + 200 x 1 x 21 sampled
    assert "prompt_logprobs: 59 tokens x 21" in err["message"] and str(MAX_LOGPROB_ENTRIES) in err["message"]
    # Text prompts count by their tokens.
    text = "alpha beta gamma delta " * 3
    n_text = len(harness.tokenizer.encode(text).ids)
    count = MAX_LOGPROB_ENTRIES // ((n_text - 1) * 21 + 21) + 1
    text_body = {**body, "prompt": [f"{i} {text}" for i in range(count)]}
    assert harness.post("/v1/completions", text_body).status == 400
    # A batch sent after them is served (the fake model has no prompt logprobs: none asked): the
    # refused prompts never reached the scheduler.
    small = batch(902, 2)
    ok = harness.post("/v1/completions", {"prompt": small, "max_tokens": 1, "temperature": 0})
    assert ok.status == 200, ok.body
    for ids in small:
        _add_for(harness, ids)
    assert not [a for a in harness.scheduler.adds() if a.input_ids[0] == 901]
