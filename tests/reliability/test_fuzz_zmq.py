"""Fuzzing the ZeroMQ front door with a raw DEALER: random bytes, msgpack of the wrong shape, wrong
field types, unknown fields, out-of-range values, prompts longer than the context, empty and
multi-frame messages. Each gets an ErrorReply whose message names the problem (the field, where
there is one), and a normal request right after still works."""

from __future__ import annotations

import os
import string
import uuid
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from himamba.common.messages import ClientReply, ErrorReply, GenerateChunk
from himamba.common.types import SamplingParams
from tests.reliability.prompts import MAX_CONTEXT_LEN, TINY_VOCAB

SOAK = os.environ.get("HIMAMBA_SOAK") == "1"
FUZZ = settings(
    max_examples=1000 if SOAK else 40,
    deadline=None,
    derandomize=not SOAK,  # CI runs the same examples every time; a soak explores
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
U64 = 2**64 - 1
I64_MIN = -(2**63)
TOP_FIELDS = {"type", "rid", "prompt", "input_ids", "sampling", "stream"}
SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)


class Door:
    """A raw DEALER on the server under test."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(ClientReply)

    def exchange(self, frames: list[bytes], timeout_s: float = 15.0) -> ClientReply:
        """Send one message; return the one reply it gets."""
        self.sock.send_multipart(frames)
        assert self.sock.poll(int(timeout_s * 1000)), f"no reply within {timeout_s}s to {frames[0][:80]!r}"
        return self.decoder.decode(self.sock.recv())

    def refused(self, obj: Any) -> ErrorReply:
        reply = self.exchange([msgspec.msgpack.encode(obj)])
        assert isinstance(reply, ErrorReply), f"accepted: {obj!r:.300} -> {reply!r:.300}"
        assert reply.message, "an ErrorReply must say what is wrong"
        assert 400 <= reply.code < 500, reply
        return reply

    def still_serves(self) -> None:
        """A normal request right after: exactly its two tokens, and nothing else in between."""
        rid = uuid.uuid4().hex
        reply = self.exchange([msgspec.msgpack.encode(_valid(rid))])
        assert isinstance(reply, GenerateChunk) and reply.rid == rid, reply
        assert reply.finished and len(reply.token_ids) == 2, reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _valid(rid: str) -> dict[str, Any]:
    return {
        "type": "GenerateRequest",
        "rid": rid,
        "input_ids": [11, 12, 13],
        "sampling": {"max_tokens": 2, "ignore_eos": True},
        "stream": False,
    }


@pytest.fixture(scope="module")
def door(served):
    d = Door(served.main.endpoint)
    yield d
    d.close()


# ---------------------------------------------------------------- strategies

# Every strategy draws only what msgpack can carry: its integers are int64 to uint64, so a larger
# one cannot even be sent (msgspec raises OverflowError in the harness, before the server).
ints = st.integers(min_value=I64_MIN, max_value=U64)
msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
not_a_bool = st.one_of(st.integers(-5, 5), st.text(max_size=5), st.floats(allow_nan=False), st.lists(st.booleans(), max_size=2))
not_an_int = st.one_of(
    st.text(max_size=5),
    st.floats(),  # even 2.0: an int field takes no float
    st.booleans(),
    st.lists(ints, max_size=2),
    st.dictionaries(st.text(max_size=3), ints, max_size=2),
)
not_a_float = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.floats(), max_size=2), st.binary(max_size=4))
not_a_str = st.one_of(ints, st.booleans(), st.lists(st.text(max_size=3), max_size=2), st.binary(max_size=4))
not_int_list = st.one_of(
    st.text(max_size=5), ints, st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3),
    st.lists(st.floats(), min_size=1, max_size=3),
    st.dictionaries(st.text(max_size=3), ints, min_size=1, max_size=2),
)  # fmt: skip
not_str_list = st.one_of(ints, st.text(min_size=1, max_size=5), st.lists(ints, min_size=1, max_size=3))

# field path -> values of a type the field never takes (None is left out where None is allowed)
WRONG_TYPES: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    ("rid",): st.one_of(not_a_str, st.none()),
    ("prompt",): not_a_str,
    ("input_ids",): not_int_list,
    ("stream",): st.one_of(not_a_bool, st.none()),
    ("sampling",): st.one_of(st.none(), ints, st.text(max_size=5), st.lists(ints, max_size=2)),
    ("sampling", "max_tokens"): not_an_int,
    ("sampling", "temperature"): st.one_of(not_a_float, st.none()),
    ("sampling", "top_p"): not_a_float,
    ("sampling", "top_k"): st.one_of(not_an_int, st.none()),
    ("sampling", "min_p"): not_a_float,
    ("sampling", "seed"): not_an_int,
    ("sampling", "stop"): not_str_list,
    ("sampling", "stop_token_ids"): not_int_list,
    ("sampling", "ignore_eos"): not_a_bool,
    ("sampling", "repetition_penalty"): not_a_float,
    ("sampling", "frequency_penalty"): not_a_float,
    ("sampling", "presence_penalty"): not_a_float,
    ("sampling", "n"): not_an_int,
    ("sampling", "logprobs"): not_a_bool,
}

# field path -> values in the right type but out of range, and the word the message must hold
OUT_OF_RANGE: dict[tuple[str, ...], tuple[st.SearchStrategy[Any], str]] = {
    ("sampling", "max_tokens"): (
        st.one_of(st.integers(I64_MIN, 0), st.integers(MAX_CONTEXT_LEN + 1, U64)), "max_tokens"),
    ("sampling", "temperature"): (
        st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=100.001), st.just(float("nan"))), "temperature"),
    ("sampling", "top_p"): (st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001)), "top_p"),
    ("sampling", "top_k"): (st.integers(I64_MIN, -1), "top_k"),
    ("sampling", "min_p"): (st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=1.0001)), "min_p"),
    ("sampling", "repetition_penalty"): (st.floats(max_value=0.0), "repetition_penalty"),
    ("sampling", "frequency_penalty"): (st.one_of(st.floats(max_value=-2.001), st.floats(min_value=2.001)), "frequency_penalty"),
    ("sampling", "presence_penalty"): (st.one_of(st.floats(max_value=-2.001), st.floats(min_value=2.001)), "presence_penalty"),
    # (n in [1, 16] is valid; 10**5..2**61 is left out: see test_fuzz_http's huge-n bug.)
    ("sampling", "n"): (st.one_of(st.integers(I64_MIN, 0), st.integers(17, 10**4), st.sampled_from([2**62, U64])), "n "),
    ("sampling", "stop"): (st.lists(st.just(""), min_size=1, max_size=2), "stop"),
    ("sampling", "stop_token_ids"): (
        st.lists(st.one_of(st.integers(I64_MIN, -1), st.integers(TINY_VOCAB, U64)), min_size=1, max_size=3), "stop_token_ids"),
    ("input_ids",): (
        st.lists(st.integers(1, TINY_VOCAB - 1), max_size=5).flatmap(
            lambda ok: st.lists(st.one_of(st.integers(I64_MIN, -1), st.integers(TINY_VOCAB, U64)), min_size=1, max_size=3).map(
                lambda bad: ok + bad)), "input_ids"),
}  # fmt: skip


def _with(rid: str, path: tuple[str, ...], value: Any) -> dict[str, Any]:
    req = _valid(rid)
    if len(path) == 1:
        req[path[0]] = value
    else:
        req["sampling"] = {**req["sampling"], path[1]: value}
    return req


# every strategy whose values the harness encodes with msgpack, by name
SENT: dict[str, st.SearchStrategy[Any]] = {
    "msgpack_values": msgpack_values,
    **{"wrong type " + ".".join(p): s for p, s in WRONG_TYPES.items()},
    **{"out of range " + ".".join(p): s for p, (s, _) in OUT_OF_RANGE.items()},
}


# ---------------------------------------------------------------- tests


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(data=st.data(), name=st.sampled_from(sorted(SENT)))
def test_every_strategy_draws_only_what_msgpack_can_send(data, name):
    """No server: the harness's own encoding never fails, so each fuzz test below can fail only
    for the server's sake (an integer past 64 bits once raised OverflowError in Door.refused)."""
    msgspec.msgpack.encode(data.draw(SENT[name], label=name))



@FUZZ
@given(payload=st.binary(max_size=512))
def test_random_bytes_are_refused(door, payload):
    reply = door.exchange([payload])
    assert isinstance(reply, ErrorReply) and reply.message and reply.code == 400, reply
    door.still_serves()


@FUZZ
@given(obj=msgpack_values.filter(lambda v: not (isinstance(v, dict) and "type" in v)))
def test_msgpack_of_the_wrong_shape_is_refused(door, obj):
    door.refused(obj)
    door.still_serves()


@FUZZ
@given(name=st.sampled_from(["Generate", "generate_request", "TokenOut", "AddRequest", "", "Shutdown"]), obj=msgpack_values)
def test_unknown_message_types_are_refused_naming_the_type(door, name, obj):
    reply = door.refused({"type": name, "rid": "t", "payload": obj})
    assert "type" in reply.message, reply.message
    door.still_serves()


@FUZZ
@given(data=st.data(), path=st.sampled_from(sorted(WRONG_TYPES)))
def test_wrong_field_types_are_refused_naming_the_field(door, data, path):
    value = data.draw(WRONG_TYPES[path], label=".".join(path))
    reply = door.refused(_with(uuid.uuid4().hex, path, value))
    assert path[-1] in reply.message, reply.message
    door.still_serves()


@FUZZ
@given(
    name=st.text(string.ascii_letters + string.digits + "_", min_size=1, max_size=24),
    where=st.sampled_from(["top", "sampling"]),
    value=msgpack_scalars,
)
def test_unknown_fields_are_refused_naming_them(door, name, where, value):
    known = TOP_FIELDS if where == "top" else SAMPLING_FIELDS
    if name in known:
        return
    req = _valid(uuid.uuid4().hex)
    if where == "top":
        req[name] = value
    else:
        req["sampling"][name] = value
    reply = door.refused(req)
    assert name in reply.message, reply.message
    door.still_serves()


@FUZZ
@given(data=st.data(), path=st.sampled_from(sorted(OUT_OF_RANGE)))
def test_out_of_range_values_are_refused_naming_the_field(door, data, path):
    values, word = OUT_OF_RANGE[path]
    rid = uuid.uuid4().hex
    reply = door.refused(_with(rid, path, data.draw(values, label=".".join(path))))
    assert word in reply.message, reply.message
    assert reply.rid == rid
    door.still_serves()


@FUZZ
@given(extra=st.integers(0, 600), as_text=st.booleans())
def test_prompts_longer_than_the_context_are_refused(door, extra, as_text):
    req = _valid(uuid.uuid4().hex)
    if as_text:
        del req["input_ids"]
        req["prompt"] = " ab" * (MAX_CONTEXT_LEN + extra)  # at least one token per repeat
    else:
        req["input_ids"] = [7] * (MAX_CONTEXT_LEN + extra)
    reply = door.refused(req)
    assert "prompt" in reply.message and str(MAX_CONTEXT_LEN) in reply.message, reply.message
    door.still_serves()


@pytest.mark.parametrize(
    "change",
    [
        {"input_ids": []},
        {"input_ids": None},
        {"prompt": "", "input_ids": None},
        {"prompt": "hello"},  # beside input_ids: exactly one is allowed
    ],
    ids=["empty-ids", "no-prompt", "empty-prompt", "both"],
)
def test_missing_or_empty_prompts_are_refused_naming_the_prompt(door, change):
    req = {**_valid(uuid.uuid4().hex), **change}
    reply = door.refused(req)
    assert "prompt" in reply.message or "input_ids" in reply.message, reply.message
    door.still_serves()


def test_an_empty_message_is_refused(door):
    reply = door.exchange([b""])
    assert isinstance(reply, ErrorReply) and reply.message and reply.code == 400
    door.still_serves()


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), min_size=2, max_size=6), lead_valid=st.booleans())
def test_multi_frame_messages_are_refused(door, frames, lead_valid):
    if lead_valid:
        frames = [msgspec.msgpack.encode(_valid(uuid.uuid4().hex)), *frames[1:]]
    reply = door.exchange(frames)
    assert isinstance(reply, ErrorReply) and "frame" in reply.message, reply
    door.still_serves()


def test_a_duplicate_rid_in_flight_and_an_unknown_abort_are_refused(door):
    rid = uuid.uuid4().hex
    long = {**_valid(rid), "sampling": {"max_tokens": 300, "ignore_eos": True}, "stream": True}
    door.sock.send(msgspec.msgpack.encode(long))
    door.sock.send(msgspec.msgpack.encode(long))  # the same rid while the first still runs
    door.sock.send(msgspec.msgpack.encode({"type": "AbortGenerate", "rid": rid}))
    errors: list[ErrorReply] = []
    final: GenerateChunk | None = None
    while final is None:
        assert door.sock.poll(15_000), "the first request never ended"
        r = door.decoder.decode(door.sock.recv())
        if isinstance(r, ErrorReply):
            errors.append(r)
        elif r.finished:
            final = r
    assert [(e.code, e.rid) for e in errors] == [(409, rid)] and rid in errors[0].message, errors
    assert final.finish_reason == "abort", final
    reply = door.refused({"type": "AbortGenerate", "rid": "never-sent"})
    assert reply.code == 404 and "never-sent" in reply.message
    door.still_serves()


# ---------------------------------------------------------------- invalid UTF-8


def _msgpack_map_with_raw_str(fields: dict[str, Any], key: str, raw: bytes) -> bytes:
    """A msgpack map of `fields` plus `key` whose value is a str of `raw` bytes (not UTF-8)."""
    head = bytes([0x80 | (len(fields) + 1)])
    body = b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in fields.items())
    return head + body + msgspec.msgpack.encode(key) + bytes([0xA0 | len(raw)]) + raw


def test_invalid_utf8_in_a_text_field_is_refused_and_the_server_keeps_serving(expendable):
    server = expendable["utf8"]
    door = Door(server.endpoint)
    try:
        base = {"type": "GenerateRequest", "rid": "u1", "sampling": {"max_tokens": 2}}
        payload = _msgpack_map_with_raw_str(base, "prompt", b"\xff\xfe\xfd")
        door.sock.send(payload)
        got = door.sock.poll(5_000)
        assert got, "no reply: the server did not answer an invalid UTF-8 prompt"
        reply = door.decoder.decode(door.sock.recv())
        assert isinstance(reply, ErrorReply) and reply.code == 400 and reply.message
        door.still_serves()
        assert server.proc.poll() is None
    finally:
        door.close()
