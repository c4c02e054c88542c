"""n > 1 in the front door: one scheduler request per sample, all sent together naming each other
(the scheduler holds the siblings for sample 0's prefill), seeds per sample, and aborts,
disconnects and errors that end every sample."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from himamba.common.client import Client, HimambaError
from himamba.common.messages import AbortRequest, AddRequest, ClientReply, ErrorReply, GenerateChunk
from himamba.common.types import SamplingParams
from himamba.services.tokenizer.samples import sample_requests, sample_sampling

_DECODER = msgspec.msgpack.Decoder(ClientReply)


def _sample_index(internal_rid: str) -> int:
    head = internal_rid.split(":", 1)[0]
    return int(head.split(".", 1)[1]) if "." in head else 0


def _of(scheduler: Any, cls: type, client_rid: str) -> list[Any]:
    return [m for m in scheduler.of_type(cls) if m.rid.endswith(":" + client_rid)]


@pytest.fixture
def client(server: Any) -> Any:
    with Client(server.endpoint, timeout_s=20) as c:
        yield c


def test_sample_sampling_offsets_the_seed_and_asks_for_one_sample() -> None:
    seeded = SamplingParams(n=3, seed=40, temperature=0.8)
    assert [sample_sampling(seeded, i).seed for i in range(3)] == [40, 41, 42]
    assert {sample_sampling(seeded, i).n for i in range(3)} == {1}
    assert sample_sampling(seeded, 2).temperature == 0.8
    unseeded = SamplingParams(n=2)
    assert [sample_sampling(unseeded, i).seed for i in range(2)] == [None, None]
    single = SamplingParams(seed=9)
    assert sample_sampling(single, 0) is single
    with pytest.raises(ValueError, match="rids"):
        sample_requests(["a"], [1], seeded, max_tokens=1, eos_token_ids=[], arrival_time=0.0)


def test_n_samples_are_n_scheduler_requests_with_their_own_seeds(server: Any, client: Client) -> None:
    outs = client.generate_n("def main():", rid="n3", n=3, seed=7, temperature=0.9, max_tokens=30)
    assert [o.index for o in outs] == [0, 1, 2]
    prompt_ids = server.tokenizer.encode("def main():").ids
    for o in outs:
        assert o.rid == "n3" and o.text == server.reply_text and o.finish_reason == "length"
        assert o.prompt_token_ids == prompt_ids
        assert o.usage is not None and o.usage.prompt_tokens == len(prompt_ids)
    adds = _of(server.scheduler, AddRequest, "n3")
    assert [_sample_index(a.rid) for a in adds] == [0, 1, 2]  # sample 0 went first
    assert len({a.rid for a in adds}) == 3
    assert adds[0].siblings == [adds[1].rid, adds[2].rid] and adds[0].first == ""
    assert [a.first for a in adds[1:]] == [adds[0].rid] * 2 and not adds[1].siblings
    assert [(a.sampling.seed, a.sampling.n) for a in adds] == [(7, 1), (8, 1), (9, 1)]
    assert all(a.input_ids == prompt_ids and a.max_tokens == 30 for a in adds)


def test_all_samples_reach_the_scheduler_at_once_and_an_abort_ends_each(server: Any, client: Client) -> None:
    # The fake scheduler never answers "silent" prompts: sample 0's prefill never ends. The
    # siblings are at the scheduler anyway (it holds them, with their slots reserved).
    chunks = client.stream("silent prompt", rid="sil", n=3)
    for i in range(3):
        server.scheduler.wait_for(
            lambda m, i=i: isinstance(m, AddRequest) and m.rid.endswith(":sil") and _sample_index(m.rid) == i
        )
    client.abort("sil")
    finals = sorted((c.index, c.finish_reason, c.finished) for c in chunks)
    assert finals == [(0, "abort", True), (1, "abort", True), (2, "abort", True)]
    for i in range(3):
        server.scheduler.wait_for(
            lambda m, i=i: isinstance(m, AbortRequest) and m.rid.endswith(":sil") and _sample_index(m.rid) == i
        )


def test_abort_ends_every_running_sample(server: Any, client: Client) -> None:
    chunks = client.stream("hold on", rid="ab3", n=3)
    seen = set()
    while seen != {0, 1, 2}:  # every sample produced output: all three are at the scheduler
        seen.add(next(chunks).index)
    client.abort("ab3")
    rest = list(chunks)
    assert sorted(c.index for c in rest if c.finished and c.finish_reason == "abort") == [0, 1, 2]
    for i in range(3):
        server.scheduler.wait_for(
            lambda m, i=i: isinstance(m, AbortRequest) and m.rid.endswith(":ab3") and _sample_index(m.rid) == i
        )


def test_a_client_rid_stays_in_flight_while_any_sample_runs(server: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        request = {"type": "GenerateRequest", "rid": "busy", "prompt": "hold me", "sampling": {"n": 2}}
        sock.send(msgspec.msgpack.encode(request))
        assert sock.poll(10_000)
        assert isinstance(_DECODER.decode(sock.recv()), GenerateChunk)
        sock.send(msgspec.msgpack.encode({**request, "prompt": "again", "sampling": {}}))
        while True:
            assert sock.poll(10_000)
            reply = _DECODER.decode(sock.recv())
            if isinstance(reply, ErrorReply):
                break
        assert reply.code == 409 and reply.rid == "busy"
    finally:
        ctx.destroy(linger=0)
    # The disconnect aborts both samples.
    for i in range(2):
        server.scheduler.wait_for(
            lambda m, i=i: isinstance(m, AbortRequest) and m.rid.endswith(":busy") and _sample_index(m.rid) == i
        )


def test_a_failing_sample_fails_the_request_once(server: Any, client: Client) -> None:
    with pytest.raises(HimambaError) as info:
        client.generate_n("error please", rid="err3", n=3)
    assert info.value.code == 500 and "boom" in info.value.message
    client.generate("after", rid="err3-after", max_tokens=1)
    # Sample 0 failed on its first output: the scheduler is told to end its siblings.
    aborted = {_sample_index(a.rid) for a in _of(server.scheduler, AbortRequest, "err3")}
    assert {1, 2} <= aborted
    # The rid is free again.
    assert client.generate("fine now", rid="err3", max_tokens=2).finish_reason == "length"


def test_n_out_of_range_is_refused(client: Client) -> None:
    with pytest.raises(HimambaError) as info:
        client.generate_n("x", n=17)
    assert info.value.code == 400 and "n must be in [1, 16]" in info.value.message
