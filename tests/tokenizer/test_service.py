"""TokenizerService end to end: a real service process, a fake scheduler, real clients."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from himamba.common.client import Client, HimambaError
from himamba.common.messages import (
    AbortRequest,
    AddRequest,
    ClientReply,
    ErrorReply,
    GenerateChunk,
    StopRequest,
)

_DECODER = msgspec.msgpack.Decoder(ClientReply)


class RawClient:
    """A bare DEALER, to send what the Client library never would."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def send_obj(self, obj: Any) -> None:
        self.send(msgspec.msgpack.encode(obj))

    def recv(self, timeout_s: float = 10.0) -> GenerateChunk | ErrorReply:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the service"
        return _DECODER.decode(self.sock.recv())

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def raw(server: Any) -> Any:
    client = RawClient(server.endpoint)
    yield client
    client.close()


@pytest.fixture
def client(server: Any) -> Any:
    with Client(server.endpoint, timeout_s=20) as c:
        yield c


def test_streamed_text_equals_decode_and_usage_is_reported(server: Any, client: Client) -> None:
    chunks = list(client.stream("def main():", rid="s1", max_tokens=30))
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == server.tokenizer.decode(server.reply_ids)
    assert [t for c in chunks for t in c.token_ids] == server.reply_ids
    assert all("\ufffd" not in c.text for c in chunks)
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    prompt_ids = server.tokenizer.encode("def main():").ids
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == len(server.reply_ids)
    assert last.usage.cached_tokens == server.cached
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    add = server.scheduler.wait_rid(AddRequest, "s1")
    assert add.input_ids == prompt_ids
    assert add.eos_token_ids == [0]
    assert add.max_tokens == 30


def test_max_tokens_defaults_and_is_capped_by_the_context(server: Any, client: Client) -> None:
    client.generate(input_ids=[5, 6, 7], rid="m1")
    assert server.scheduler.wait_rid(AddRequest, "m1").max_tokens == 32  # the server default
    long_prompt = list(range(10, 10 + server.max_context_len - 4))
    done = client.generate(input_ids=long_prompt, rid="m2", max_tokens=50)
    assert server.scheduler.wait_rid(AddRequest, "m2").max_tokens == 4
    assert done.prompt_token_ids is None  # ids in, no ids echoed


def test_non_stream_answers_with_one_chunk(server: Any, raw: RawClient) -> None:
    raw.send_obj({"type": "GenerateRequest", "rid": "n1", "prompt": "hello", "stream": False})
    reply = raw.recv()
    assert isinstance(reply, GenerateChunk)
    assert reply.finished and reply.finish_reason == "length"
    assert reply.text == server.tokenizer.decode(server.reply_ids)
    assert reply.token_ids == server.reply_ids
    assert reply.prompt_token_ids == server.tokenizer.encode("hello").ids
    assert not raw.sock.poll(200)  # nothing else follows


def _gen(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"type": "GenerateRequest", **fields})


@pytest.mark.parametrize(
    ("payload", "rid", "needle"),
    [
        (b"\xc1garbage", "", "undecodable"),
        (_gen(rid="u1", prompt="x", bogus=1), "u1", "bogus"),
        (msgspec.msgpack.encode({"type": "GenerateChunk", "rid": "u2", "text": "", "token_ids": []}), "u2", "type"),
        (_gen(rid=5), "", "rid"),
        (_gen(rid="v1"), "v1", "exactly one"),
        (_gen(rid="v2", prompt="a", input_ids=[1]), "v2", "exactly one"),
        (_gen(rid="v3", prompt=""), "v3", "prompt"),
        (_gen(rid="v4", input_ids=[]), "v4", "input_ids"),
        (_gen(rid="v5", input_ids=[1, 10**6]), "v5", "input_ids[1]"),
        (_gen(rid="v6", input_ids=[-1]), "v6", "input_ids[0]"),
        (_gen(rid="v7", prompt="a", sampling={"top_p": 0.0}), "v7", "top_p"),
        (_gen(rid="v8", prompt="a", sampling={"max_tokens": 0}), "v8", "max_tokens"),
        (_gen(rid="v9", input_ids=[1] * 64), "v9", "max_context_len"),
    ],
)
def test_bad_requests_get_an_error_reply_naming_the_problem(
    raw: RawClient, payload: bytes, rid: str, needle: str
) -> None:
    raw.send(payload)
    reply = raw.recv()
    assert isinstance(reply, ErrorReply)
    assert reply.code == 400
    assert reply.rid == rid
    assert needle in reply.message


def test_the_service_keeps_serving_after_bad_input(server: Any, raw: RawClient) -> None:
    raw.send(b"a", b"b")  # two payload frames
    assert isinstance(raw.recv(), ErrorReply)
    raw.send(b"")
    assert isinstance(raw.recv(), ErrorReply)
    raw.send_obj({"type": "GenerateRequest", "rid": "ok", "prompt": "fine", "stream": False})
    reply = raw.recv()
    assert isinstance(reply, GenerateChunk) and reply.text == server.reply_text


def test_abort_finishes_the_stream_and_reaches_the_scheduler(server: Any, client: Client) -> None:
    chunks = client.stream("hold on", rid="a1")
    first = next(chunks)
    assert not first.finished
    client.abort("a1")
    rest = list(chunks)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    server.scheduler.wait_rid(AbortRequest, "a1")


def test_abort_of_an_unknown_rid_is_an_error(raw: RawClient) -> None:
    raw.send_obj({"type": "AbortGenerate", "rid": "nope"})
    reply = raw.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 404 and reply.rid == "nope"


def test_stop_string_cuts_the_text_and_stops_the_scheduler(server: Any, client: Client) -> None:
    done = client.generate("say hello", rid="st1", stop=["wörld"])
    assert done.text == "héllo "
    assert done.finish_reason == "stop"
    server.scheduler.wait_rid(StopRequest, "st1")
    streamed = list(client.stream("say hello", rid="st2", stop=["日本"]))
    assert "".join(c.text for c in streamed) == "héllo wörld "
    assert streamed[-1].finish_reason == "stop"
    assert all("日" not in c.text for c in streamed)


def test_two_clients_may_use_the_same_rid(server: Any) -> None:
    with Client(server.endpoint, timeout_s=20) as a, Client(server.endpoint, timeout_s=20) as b:
        sa = a.stream("from a", rid="same")
        sb = b.stream("from b", rid="same")
        text_a = "".join(c.text for c in sa)
        text_b = "".join(c.text for c in sb)
    assert text_a == text_b == server.reply_text
    adds = [m for m in server.scheduler.of_type(AddRequest) if m.rid.endswith(":same")]
    assert len({m.rid for m in adds}) == 2
    assert sorted(server.tokenizer.decode(m.input_ids) for m in adds) == ["from a", "from b"]


def test_a_duplicate_in_flight_rid_is_refused(server: Any, client: Client, raw: RawClient) -> None:
    raw.send_obj({"type": "GenerateRequest", "rid": "d1", "prompt": "hold it"})
    assert isinstance(raw.recv(), GenerateChunk)
    raw.send_obj({"type": "GenerateRequest", "rid": "d1", "prompt": "again"})
    reply = raw.recv()
    while isinstance(reply, GenerateChunk):  # the held request's second token may come first
        reply = raw.recv()
    assert isinstance(reply, ErrorReply) and reply.code == 409 and reply.rid == "d1"


def test_client_disconnect_aborts_its_requests(server: Any) -> None:
    raw = RawClient(server.endpoint)
    raw.send_obj({"type": "GenerateRequest", "rid": "gone", "prompt": "hold the line"})
    assert isinstance(raw.recv(), GenerateChunk)
    raw.close()
    server.scheduler.wait_rid(AbortRequest, "gone")


def test_scheduler_error_becomes_an_error_reply(client: Client) -> None:
    with pytest.raises(HimambaError) as info:
        client.generate("error please", rid="e1")
    assert info.value.code == 500
    assert "boom" in info.value.message


def test_server_picks_a_rid_when_the_client_sends_none(server: Any, raw: RawClient) -> None:
    raw.send_obj({"type": "GenerateRequest", "prompt": "anon", "stream": False})
    reply = raw.recv()
    assert isinstance(reply, GenerateChunk) and reply.rid
    assert reply.text == server.reply_text
