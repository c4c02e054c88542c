"""Nested, huge, truncated and type-confused input on the ZeroMQ and HTTP front doors: each
gets the right 4xx (or, past the size limit, a disconnect of that client alone) and the server
keeps serving. The exact cases of the hostile-clients issue are here by name."""

from __future__ import annotations

import json
import math
import socket
import uuid

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from himamba.common.messages import ErrorReply
from himamba.common.types import MAX_STOP_STRINGS
from tests.hostile.conftest import API_KEY, MAX_CONTEXT_LEN, Door, Hostile

FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def _nested_array(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray of 1, `depth` times, around a nil


def _nested_map(depth: int) -> bytes:
    return (b"\x81\xa1k" * depth) + b"\xc0"  # {"k": {"k": ... nil}}


def _map(fields: list[tuple[str, bytes]]) -> bytes:
    """A msgpack map whose values are given as raw msgpack bytes."""
    assert len(fields) < 16
    return bytes([0x80 | len(fields)]) + b"".join(msgspec.msgpack.encode(k) + v for k, v in fields)


def _request_with(field: str, raw_value: bytes, rid: str = "nest") -> bytes:
    enc = msgspec.msgpack.encode
    return _map([("type", enc("GenerateRequest")), ("rid", enc(rid)), ("api_key", enc(API_KEY)), (field, raw_value)])


@pytest.mark.parametrize(
    "payload",
    [
        _nested_array(1_000),  # the 1 KB message that killed the front door
        _nested_array(100_000),
        _nested_map(1_000),
        _request_with("prompt", _nested_array(1_000)),
        _request_with("sampling", _nested_map(1_000)),
        _request_with("junk", _nested_array(5_000)),  # an unknown field: the rid fallback decodes it
    ],
    ids=["array-1k", "array-100k", "map-1k", "in-prompt", "in-sampling", "unknown-field"],
)
def test_deeply_nested_msgpack_is_an_error_reply(hostile: Hostile, door: Door, payload: bytes) -> None:
    reply = door.refused([payload])
    assert reply.rid in ("", "nest")
    assert hostile.alive()
    door.still_serves()


@FUZZ
@given(cut=st.integers(1, 200))
def test_truncated_requests_are_refused(hostile: Hostile, cut: int) -> None:
    d = Door(hostile.endpoint)
    try:
        whole = msgspec.msgpack.encode(d.request("trunc", prompt="hello there", input_ids=None))
        d.refused([whole[: min(cut, len(whole) - 1)]])
        d.still_serves()
    finally:
        d.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e-40),
        ("repetition_penalty", 1e-40),
        ("temperature", math.nan),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("top_p", math.nan),
        ("min_p", math.inf),
        ("frequency_penalty", -math.inf),
        ("presence_penalty", math.nan),
        ("top_k", 2**64 - 1),
    ],
)
def test_values_that_cannot_sample_are_refused_over_zeromq(door: Door, field: str, value: float) -> None:
    req = door.request(sampling={"max_tokens": 2, field: value})
    reply = door.refused([msgspec.msgpack.encode(req)])
    assert field in reply.message, reply.message
    door.still_serves()


def test_a_long_rid_is_refused_naming_it(door: Door) -> None:
    reply = door.refused([msgspec.msgpack.encode(door.request("r" * 300))])
    assert "rid" in reply.message
    door.still_serves()


def test_a_huge_prompt_is_refused_before_it_is_tokenized(door: Door) -> None:
    reply = door.refused([msgspec.msgpack.encode(door.request(prompt="ab " * 300_000, input_ids=None))])
    assert "characters" in reply.message and str(MAX_CONTEXT_LEN) in reply.message
    door.still_serves()


def test_a_message_over_the_size_limit_disconnects_only_its_sender(hostile: Hostile, door: Door) -> None:
    big = Door(hostile.endpoint)
    try:
        big.send([msgspec.msgpack.encode(big.request(prompt="x" * (20 << 20), input_ids=None))])  # the 20 MB
        assert not big.sock.poll(1500), "a message over the limit must not be read, let alone answered"
    finally:
        big.close()
    assert hostile.alive()
    door.still_serves()


# ---------------------------------------------------------------- HTTP


def _completion(**fields: object) -> dict[str, object]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"[" * 100_000 + b"]" * 100_000, 400),  # aiohttp's plain-text 500 before
        (b'{"prompt": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}", 400),
        (b'{"prompt": "hello", "max_tokens": 2', 400),  # truncated
        (b'{"prompt": "hello", "max_tokens": "two"}', 400),  # type-confused
        (b'{"prompt": {"nested": [1, {"a": null}]}}', 400),
        (b"\xff\xfe{}", 400),
        (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413),  # over the body limit
    ],
    ids=["nested-array", "nested-prompt", "truncated", "wrong-type", "object-prompt", "bad-utf8", "huge"],
)
def test_malformed_http_bodies_get_a_json_4xx(hostile: Hostile, raw: bytes, status: int) -> None:
    r = hostile.post("/v1/completions", None, raw=raw)
    assert r.status == status, r.body[:300]
    assert "error" in r.json() and r.json()["error"]["message"]
    assert hostile.alive()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 2**70}, "top_k"),  # "internal error: OverflowError" before
        ({"temperature": 1e-40}, "temperature"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"stop": ["s"] * 85_000}, "stop"),  # froze the event loop for 12 s before
        ({"stop": ["x" * 5000]}, "stop"),
    ],
    ids=["top_k-2^70", "temperature-1e-40", "repetition-1e-40", "85k-stops", "long-stop"],
)
def test_http_values_that_cannot_sample_are_a_400_naming_the_field(hostile: Hostile, fields: dict, param: str) -> None:
    r = hostile.post("/v1/completions", _completion(**fields))
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert param in err["message"] and err["param"] == param, err


def test_a_huge_chat_is_refused_before_it_is_tokenized(hostile: Hostile) -> None:
    body = {"messages": [{"role": "user", "content": "ab " * 200_000}], "max_tokens": 2}
    r = hostile.post("/v1/chat/completions", body)
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert err["param"] == "messages" and "characters" in err["message"], err


def test_a_malformed_http_request_line_is_a_400_without_a_traceback(hostile: Hostile) -> None:
    tracebacks = hostile.server.log().count("Traceback")
    for raw in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", b"\x00\x01\x02\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", hostile.port), timeout=10) as s:
            s.sendall(raw)
            status_line = s.recv(4096).split(b"\r\n", 1)[0]
            assert status_line.startswith(b"HTTP/1.") and status_line.split()[1] == b"400", (raw, status_line)
    assert hostile.server.log().count("Traceback") == tracebacks
    assert hostile.alive()


def test_an_unauthorised_http_request_is_a_401(hostile: Hostile) -> None:
    r = hostile.post("/v1/completions", _completion(), key=None)
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------- budgets keep others served


def test_the_most_stop_strings_leave_a_concurrent_stream_served(hostile: Hostile) -> None:
    """A request at the stop-string limits runs beside a stream: the stream gets chunks while
    the stop-string request is still running (counted, not timed)."""
    stream, heavy = Door(hostile.endpoint), Door(hostile.endpoint)
    try:
        stops = [f"{i:03d}" + "\u00e9" * (4096 // MAX_STOP_STRINGS - 3) for i in range(MAX_STOP_STRINGS)]
        assert sum(len(s) for s in stops) <= 4096
        stream.send([msgspec.msgpack.encode(stream.request("s", sampling={"max_tokens": 400, "ignore_eos": True}, stream=True))])
        first = stream.recv()
        assert not isinstance(first, ErrorReply), first
        heavy.send([msgspec.msgpack.encode(heavy.request("h", prompt="hello", input_ids=None,
                    sampling={"max_tokens": 200, "ignore_eos": True, "stop": stops}, stream=True))])  # fmt: skip
        chunks_while_heavy = 0
        heavy_done = stream_done = False
        while not (heavy_done and stream_done):
            if not heavy_done and heavy.sock.poll(0):
                r = heavy.recv()
                assert not isinstance(r, ErrorReply), r
                heavy_done = r.finished
            elif not stream_done and stream.sock.poll(10):
                r = stream.recv()
                assert not isinstance(r, ErrorReply), r
                if not heavy_done:
                    chunks_while_heavy += 1
                stream_done = r.finished
            elif stream_done:
                heavy.sock.poll(1000)
        assert chunks_while_heavy > 10, chunks_while_heavy
    finally:
        stream.close()
        heavy.close()


def test_a_client_that_never_reads_loses_its_requests_not_the_server(hostile: Hostile) -> None:
    """Its replies fill a bounded queue; then its requests are aborted (their memory freed)
    while other clients are served."""
    aborts_before = _finished(hostile, "abort")
    lazy = Door(hostile.endpoint)
    lazy.sock.close(0)  # again, with the smallest receive queue: the server's side fills
    lazy.sock = lazy.ctx.socket(zmq.DEALER)
    lazy.sock.setsockopt(zmq.RCVHWM, 1)
    lazy.sock.setsockopt(zmq.RCVBUF, 4096)
    lazy.sock.setsockopt(zmq.LINGER, 0)
    lazy.sock.connect(hostile.endpoint)
    try:
        n = 8
        for i in range(n):
            req = lazy.request(f"lazy-{i}", sampling={"max_tokens": MAX_CONTEXT_LEN - 8, "ignore_eos": True}, stream=True)
            lazy.send([msgspec.msgpack.encode(req)])
        d = Door(hostile.endpoint)
        try:
            # Served meanwhile, and the lazy client's requests end as aborts, not by running out.
            for _ in range(200):
                d.still_serves()
                if _finished(hostile, "abort") >= aborts_before + n:
                    break
            assert _finished(hostile, "abort") >= aborts_before + n
            for _ in range(100):  # the scheduler frees them right after the front door aborts them
                if hostile.server.cache_stats().running_requests == 0:
                    break
                d.still_serves()
            assert hostile.server.cache_stats().running_requests == 0
        finally:
            d.close()
    finally:
        lazy.close()


def _finished(hostile: Hostile, reason: str) -> float:
    total = 0.0
    for line in hostile.metrics().splitlines():
        if line.startswith("himamba_request_finished_total{") and f'reason="{reason}"' in line:
            total += float(line.split()[-1])
    return total


def test_unknown_ids_in_json_do_not_matter(hostile: Hostile) -> None:
    """A control: a well-formed request still works after all of the above."""
    r = hostile.post("/v1/completions", _completion(user=str(uuid.uuid4())))
    assert r.status == 200, r.body[:300]
    assert json.loads(r.body)["choices"][0]["text"] is not None
