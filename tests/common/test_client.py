"""Client and AsyncClient against a scripted ROUTER server in a thread (no himamba services)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from himamba.common.client import AsyncClient, Client, Completion, CompletionBuilder, HimambaError, make_request
from himamba.common.config import Config, load
from himamba.common.messages import AbortGenerate, ClientRequest, ErrorReply, GenerateChunk, GenerateRequest
from himamba.common.runtime_dir import resolve_endpoints
from himamba.common.types import CachedTokens, Usage, combined_usage

USAGE = Usage(prompt_tokens=2, completion_tokens=3, cached_tokens=CachedTokens(device=1, host=1, storage=0))


class FakeServer:
    """A ROUTER that answers each GenerateRequest by its prompt:

    "echo <words>": one chunk per word, then a final chunk ("length").
    "fail": an ErrorReply (code 418).  "silent": nothing.  "hold": one chunk, then nothing.
    An AbortGenerate for a held request gets the final "abort" chunk. Everything received is kept.
    With sampling.n > 1 every sample i answers the same, its words suffixed with i, the samples'
    chunks interleaved (finished ones last sample first).
    """

    def __init__(self) -> None:
        self.endpoint = f"ipc://@himamba-test-client-{uuid.uuid4().hex[:12]}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.endpoint)
        self.received: list[ClientRequest] = []
        self._samples: dict[str, int] = {}  # n of each request, for its abort
        self._lock = threading.Lock()
        self._dec = msgspec.msgpack.Decoder(ClientRequest)
        self._enc = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _send(self, ident: bytes, reply: GenerateChunk | ErrorReply) -> None:
        self.sock.send_multipart([ident, self._enc.encode(reply)])

    def _answer(self, ident: bytes, req: GenerateRequest) -> None:
        if req.sampling.n > 1:
            self._answer_samples(ident, req)
            return
        prompt = req.prompt or ""
        rid = req.rid
        if prompt == "fail":
            self._send(ident, ErrorReply(message="no teapot", rid=rid, code=418))
        elif prompt == "hold":
            self._send(ident, GenerateChunk(rid=rid, text="held", token_ids=[1]))
        elif prompt.startswith("echo "):
            words = prompt.split()[1:]
            final = GenerateChunk(rid=rid, text="", token_ids=[], finished=True, finish_reason="length", usage=USAGE)
            if not req.stream:
                ids = list(range(len(words)))
                whole = msgspec.structs.replace(final, text="".join(words), token_ids=ids, prompt_token_ids=[9, 9])
                self._send(ident, whole)
                return
            for i, w in enumerate(words):
                prompt_ids = [9, 9] if i == 0 else None
                self._send(ident, GenerateChunk(rid=rid, text=w, token_ids=[i], prompt_token_ids=prompt_ids))
            self._send(ident, final)

    def _answer_samples(self, ident: bytes, req: GenerateRequest) -> None:
        n, rid = req.sampling.n, req.rid
        self._samples[rid] = n
        if req.prompt == "hold":
            for i in range(n):
                self._send(ident, GenerateChunk(rid=rid, text=f"held{i}", token_ids=[i], index=i))
            return
        words = (req.prompt or "").split()[1:]
        for j, w in enumerate(words if req.stream else []):
            for i in range(n):
                self._send(ident, GenerateChunk(rid=rid, text=f"{w}{i}", token_ids=[10 * i + j], index=i))
        for i in reversed(range(n)):
            text = "".join(f"{w}{i}" for w in words) if not req.stream else ""
            ids = [10 * i + j for j in range(len(words))] if not req.stream else []
            usage = Usage(prompt_tokens=2, completion_tokens=len(words), cached_tokens=CachedTokens(device=i))
            final = GenerateChunk(
                rid=rid, text=text, token_ids=ids, finished=True, finish_reason="length", usage=usage, index=i
            )
            self._send(ident, final)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, payload = self.sock.recv_multipart()
            msg = self._dec.decode(payload)
            with self._lock:
                self.received.append(msg)
            if isinstance(msg, GenerateRequest):
                self._answer(ident, msg)
            elif isinstance(msg, AbortGenerate):
                for i in range(self._samples.get(msg.rid, 1)):
                    aborted = GenerateChunk(
                        rid=msg.rid, text="", token_ids=[], finished=True, finish_reason="abort", index=i
                    )
                    self._send(ident, aborted)

    def wait_received(self, cls: type, rid: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if any(isinstance(m, cls) and m.rid == rid for m in self.received):
                    return
            time.sleep(0.01)
        raise AssertionError(f"server never received {cls.__name__} {rid!r}: {self.received}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.close()


def test_default_endpoint_is_where_a_default_server_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Client() finds `himamba serve` (default port), Client(port=/instance=) any other instance."""
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    served = resolve_endpoints(Config()).endpoints.zmq_endpoint
    with Client() as c:
        assert c.endpoint == served
    c2 = AsyncClient()
    assert c2.endpoint == served
    c2.close()
    other = resolve_endpoints(load(overrides={"http": {"port": 30001}})).endpoints.zmq_endpoint
    assert other != served
    with Client(port=30001) as c:
        assert c.endpoint == other
    named = resolve_endpoints(load(overrides={"http": {"port": 0}, "endpoints": {"instance": "blue"}}))
    with Client(instance="blue") as c:
        assert c.endpoint == named.endpoints.zmq_endpoint


def test_make_request_checks_prompt_xor_ids_and_fills_sampling() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        make_request()
    with pytest.raises(ValueError, match="exactly one"):
        make_request("a", input_ids=[1])
    req = make_request("a", max_tokens=5, stop=["x"], temperature=0.5, seed=3)
    assert req.rid and req.prompt == "a" and req.stream
    sp = req.sampling
    assert (sp.max_tokens, sp.stop, sp.temperature, sp.seed) == (5, ["x"], 0.5, 3)
    assert make_request("a").rid != make_request("a").rid
    assert make_request(input_ids=[1, 2], rid="mine", stream=False).rid == "mine"
    assert make_request("a", logit_bias={3: 100.0}).sampling.logit_bias == {3: 100.0}


def test_a_completion_says_what_stopped_it() -> None:
    builder = CompletionBuilder("r")
    builder.add(
        GenerateChunk(
            rid="r", text="hi", token_ids=[5, 7], finished=True, finish_reason="stop", stop_reason=7, matched_stop=7
        )
    )
    done = builder.build()
    assert (done.finish_reason, done.stop_reason, done.matched_stop) == ("stop", 7, 7)


def test_wait_connected_tells_whether_a_server_is_there(server: FakeServer) -> None:
    with Client(server.endpoint) as c:
        assert c.wait_connected(5.0)
    with Client(f"ipc://@himamba-test-nobody-{uuid.uuid4().hex}") as c:
        assert not c.wait_connected(0.3)


def test_generate_returns_a_completion(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        done = c.generate("echo a b c", rid="g1")
    assert done == Completion("g1", "abc", [0, 1, 2], "length", USAGE, [9, 9], None)


def test_stream_yields_deltas(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        chunks = list(c.stream("echo x y"))
    assert [ch.text for ch in chunks] == ["x", "y", ""]
    assert chunks[-1].finished and chunks[-1].usage == USAGE


def test_interleaved_streams_on_one_sync_client(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        s1 = c.stream("echo 1 2 3", rid="s1")
        s2 = c.stream("echo a b", rid="s2")
        assert next(s1).text == "1"
        assert "".join(ch.text for ch in s2) == "ab"  # s1's replies are kept aside meanwhile
        assert "".join(ch.text for ch in s1) == "23"


def test_error_reply_raises_himamba_error(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        with pytest.raises(HimambaError) as info:
            c.generate("fail", rid="f1")
        assert info.value.code == 418 and info.value.message == "no teapot" and info.value.rid == "f1"
        assert c.generate("echo ok").text == "ok"  # the connection is still good


def test_closing_a_stream_early_aborts_the_request(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        it = c.stream("hold", rid="h1")
        assert next(it).text == "held"
        it.close()
        server.wait_received(AbortGenerate, "h1")


def test_abort_ends_the_stream_with_reason_abort(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        it = c.stream("hold", rid="h2")
        next(it)
        c.abort("h2")
        assert [ch.finish_reason for ch in it] == ["abort"]


def test_timeout_raises_and_aborts(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=0.2) as c:
        with pytest.raises(TimeoutError):
            c.generate("silent", rid="t1")
        server.wait_received(AbortGenerate, "t1")


def test_async_client_runs_many_requests_over_one_connection(server: FakeServer) -> None:
    async def main() -> list[Completion]:
        async with AsyncClient(server.endpoint, timeout_s=5) as c:
            assert await c.wait_connected(5.0)
            return await asyncio.gather(*(c.generate(f"echo r{i} x{i}", rid=f"a{i}") for i in range(20)))

    results = asyncio.run(main())
    assert [r.text for r in results] == [f"r{i}x{i}" for i in range(20)]
    assert [r.rid for r in results] == [f"a{i}" for i in range(20)]


def test_async_stream_error_and_early_exit(server: FakeServer) -> None:
    async def main() -> list[str]:
        async with AsyncClient(server.endpoint, timeout_s=5) as c:
            texts = [ch.text async for ch in c.stream("echo p q")]
            with pytest.raises(HimambaError):
                await c.generate("fail")
            stream = c.stream("hold", rid="ah")
            async for ch in stream:
                assert ch.text == "held"
                break
            await stream.aclose()
            return texts

    assert asyncio.run(main()) == ["p", "q", ""]
    server.wait_received(AbortGenerate, "ah")


def test_async_timeout(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncClient(server.endpoint, timeout_s=0.2) as c:
            await c.generate("silent", rid="at")

    with pytest.raises(TimeoutError):
        asyncio.run(main())
    server.wait_received(AbortGenerate, "at")


def test_generate_n_returns_one_completion_per_sample_by_index(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        outs = c.generate_n("echo a b", rid="n1", n=3, seed=5, temperature=0.7)
        with pytest.raises(ValueError, match="generate_n"):
            c.generate("echo a", n=2)  # type: ignore[call-arg]
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.text for o in outs] == ["a0b0", "a1b1", "a2b2"]
    assert [o.token_ids for o in outs] == [[0, 1], [10, 11], [20, 21]]
    assert all(o.rid == "n1" and o.finish_reason == "length" for o in outs)
    assert [o.usage.cached_tokens.device for o in outs if o.usage is not None] == [0, 1, 2]
    (req,) = [m for m in server.received if isinstance(m, GenerateRequest) and m.rid == "n1"]
    assert (req.sampling.n, req.sampling.seed, req.stream) == (3, 5, False)
    assert combined_usage([o.usage for o in outs if o.usage is not None]) == Usage(
        prompt_tokens=2, completion_tokens=6, cached_tokens=CachedTokens(device=0)
    )


def test_a_stream_of_n_samples_ends_after_every_sample_finished(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        chunks = list(c.stream("echo x y", n=2))
    assert [(ch.index, ch.text) for ch in chunks if not ch.finished] == [(0, "x0"), (1, "x1"), (0, "y0"), (1, "y1")]
    assert sorted(ch.index for ch in chunks if ch.finished) == [0, 1]
    assert chunks[-1].finished


def test_abort_of_n_samples_ends_every_sample(server: FakeServer) -> None:
    with Client(server.endpoint, timeout_s=5) as c:
        it = c.stream("hold", rid="hn", n=3)
        assert [next(it).text for _ in range(3)] == ["held0", "held1", "held2"]
        c.abort("hn")
        assert sorted((ch.index, ch.finish_reason) for ch in it) == [(0, "abort"), (1, "abort"), (2, "abort")]


def test_async_generate_n(server: FakeServer) -> None:
    async def main() -> list[Completion]:
        async with AsyncClient(server.endpoint, timeout_s=5) as c:
            with pytest.raises(ValueError, match="generate_n"):
                await c.generate("echo a", n=2)  # type: ignore[call-arg]
            return await c.generate_n("echo q", n=2)

    assert [(o.index, o.text) for o in asyncio.run(main())] == [(0, "q0"), (1, "q1")]
