"""A constrained request is queued only once the worker reports its grammar built
(`GrammarReady`), and a worker that restarts meanwhile is asked again: a real TokenizerService,
a fake scheduler and a fake worker that answers when the test says so."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import msgspec
import zmq
from tokenizers import Tokenizer

from himamba.common.client import Client, HimambaError
from himamba.common.grammar import grammar_text, spec_key
from himamba.common.messages import AddRequest, GrammarReady, PrepareGrammar, ToWorker, WorkerInfo
from himamba.common.types import GrammarSpec
from tests.tokenizer.conftest import CACHED, MAX_CONTEXT_LEN, REPLY_TEXT
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config


def _info(tokenizer: Tokenizer, pid: int) -> WorkerInfo:
    return WorkerInfo(
        vocab_size=tokenizer.get_vocab_size(), eos_token_ids=[0], num_attention_layers=1, num_recurrent_layers=1,
        kv_bytes_per_token=1, state_bytes_per_slot=1, num_pages=64, num_state_slots=4, num_host_pages=0,
        num_host_state_slots=0, model_name="fake", pid=pid,
    )  # fmt: skip


def _add_requests(scheduler: FakeScheduler) -> int:
    return len([m for m in scheduler.received if isinstance(m, AddRequest)])


def _wait_until_the_door_knows_the_worker(c: Client, timeout_s: float = 30) -> None:
    """The WorkerInfo travels on another connection than the client's request: until the door has
    it, a grammar is only hinted to the worker and the request queued at once. Its 4 state slots
    make n=16 a 400 once it has."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            c.generate_n(input_ids=[5, 6, 7], n=16, max_tokens=1)
        except HimambaError as e:
            if "n may be at most" in str(e):
                return
            raise
        time.sleep(0.05)
    raise AssertionError("the door never took the WorkerInfo")


def test_a_grammar_request_waits_for_the_worker_and_a_restarted_worker_is_asked_again(
    model_dir: Path, demo_tokenizer: Tokenizer
) -> None:
    cfg = service_config(model_dir, MAX_CONTEXT_LEN)
    scheduler = FakeScheduler(cfg, demo_tokenizer, REPLY_TEXT, CACHED)
    ctx = zmq.Context()
    worker_in = ctx.socket(zmq.PULL)
    worker_in.bind(cfg.endpoints.worker_ipc)
    to_door = ctx.socket(zmq.PUSH)
    to_door.connect(cfg.endpoints.tokenizer_ipc)
    decode = msgspec.msgpack.Decoder(ToWorker).decode
    grammar = GrammarSpec(kind="regex", spec="[a-z ]+")

    def next_prepare(timeout_s: float = 30) -> PrepareGrammar:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if worker_in.poll(200):
                msg = decode(worker_in.recv())
                if isinstance(msg, PrepareGrammar):
                    return msg
        raise AssertionError("no PrepareGrammar reached the worker")

    try:
        with running_service(cfg), Client(cfg.endpoints.zmq_endpoint, timeout_s=60) as c:
            to_door.send(msgspec.msgpack.encode(_info(demo_tokenizer, pid=101)))
            _wait_until_the_door_knows_the_worker(c)
            queued = _add_requests(scheduler)
            got: list[object] = []
            asking = threading.Thread(
                target=lambda: got.append(c.generate(input_ids=[5, 6, 7], max_tokens=3, grammar=grammar))
            )
            asking.start()
            first = next_prepare()
            # The check's conversion travels with it: the worker only compiles (no GIL-holding work).
            assert first.grammar == grammar and first.lowered == grammar_text(grammar)
            time.sleep(1.0)  # the door holds the request: nothing reached the scheduler
            assert _add_requests(scheduler) == queued
            to_door.send(msgspec.msgpack.encode(_info(demo_tokenizer, pid=202)))  # the worker restarted
            assert next_prepare() == first  # and is asked again
            to_door.send(msgspec.msgpack.encode(GrammarReady(key=spec_key(grammar))))
            asking.join(60)
            assert len(got) == 1, got
            out = got[0]
            assert out.finish_reason == "length" and len(out.token_ids) == 3  # type: ignore[attr-defined]
    finally:
        scheduler.close()
        ctx.destroy(linger=0)


def test_a_request_waiting_for_its_grammar_holds_no_other_client(model_dir: Path, demo_tokenizer: Tokenizer) -> None:
    """While one ZeroMQ client's constrained request waits for the worker's build (seconds on a
    large schema, up to GRAMMAR_READY_TIMEOUT_S), another client's plain request is served: the
    door's client loop does not wait on one client's build. Client B's own timeout (far under the
    door's 60 s wait) is what fails when it does."""
    cfg = service_config(model_dir, MAX_CONTEXT_LEN)
    scheduler = FakeScheduler(cfg, demo_tokenizer, REPLY_TEXT, CACHED)
    ctx = zmq.Context()
    worker_in = ctx.socket(zmq.PULL)
    worker_in.bind(cfg.endpoints.worker_ipc)
    to_door = ctx.socket(zmq.PUSH)
    to_door.connect(cfg.endpoints.tokenizer_ipc)
    decode = msgspec.msgpack.Decoder(ToWorker).decode
    grammar = GrammarSpec(kind="regex", spec="[a-z]+")
    try:
        with (
            running_service(cfg),
            Client(cfg.endpoints.zmq_endpoint, timeout_s=60) as a,
            Client(cfg.endpoints.zmq_endpoint, timeout_s=20) as b,
        ):
            to_door.send(msgspec.msgpack.encode(_info(demo_tokenizer, pid=101)))
            _wait_until_the_door_knows_the_worker(a)
            got: list[object] = []
            asking = threading.Thread(
                target=lambda: got.append(a.generate(input_ids=[5, 6, 7], max_tokens=3, grammar=grammar))
            )
            asking.start()
            while not (worker_in.poll(200) and isinstance(decode(worker_in.recv()), PrepareGrammar)):
                pass  # A's request now waits for the build
            plain = b.generate(input_ids=[8, 9], max_tokens=2)  # served while A waits
            assert plain.finish_reason == "length" and len(plain.token_ids) == 2
            assert got == []  # A is still held: nothing of it reached the scheduler yet
            to_door.send(msgspec.msgpack.encode(GrammarReady(key=spec_key(grammar))))
            asking.join(60)
            assert len(got) == 1 and len(got[0].token_ids) == 3  # type: ignore[attr-defined]
    finally:
        scheduler.close()
        ctx.destroy(linger=0)


def test_sigterm_while_a_request_waits_for_its_grammar_answers_it_503(
    model_dir: Path, demo_tokenizer: Tokenizer
) -> None:
    """A constrained request accepted before SIGTERM but still waiting for the worker's build is
    in flight: the drain counts it and the stop answers it 503, as any request still running (it is
    not yet in the request table, so it used to be dropped silently: its client waited forever)."""
    cfg = service_config(model_dir, MAX_CONTEXT_LEN, http={"shutdown_timeout_s": 0.5})
    scheduler = FakeScheduler(cfg, demo_tokenizer, REPLY_TEXT, CACHED)
    ctx = zmq.Context()
    worker_in = ctx.socket(zmq.PULL)
    worker_in.bind(cfg.endpoints.worker_ipc)
    to_door = ctx.socket(zmq.PUSH)
    to_door.connect(cfg.endpoints.tokenizer_ipc)
    decode = msgspec.msgpack.Decoder(ToWorker).decode
    grammar = GrammarSpec(kind="regex", spec="[a-z]+")
    try:
        with running_service(cfg) as proc, Client(cfg.endpoints.zmq_endpoint, timeout_s=30) as c:
            to_door.send(msgspec.msgpack.encode(_info(demo_tokenizer, pid=101)))
            _wait_until_the_door_knows_the_worker(c)
            got: list[object] = []

            def ask() -> None:
                try:
                    got.append(c.generate(input_ids=[5, 6, 7], max_tokens=3, grammar=grammar))
                except (HimambaError, TimeoutError) as e:
                    got.append(e)

            asking = threading.Thread(target=ask)
            asking.start()
            while not (worker_in.poll(200) and isinstance(decode(worker_in.recv()), PrepareGrammar)):
                pass  # the request waits for the build, which never comes
            proc.send_signal(signal.SIGTERM)
            asking.join(60)
            assert len(got) == 1 and isinstance(got[0], HimambaError), got
            assert "shutting down" in str(got[0])
            assert proc.wait(30) == 0
    finally:
        scheduler.close()
        ctx.destroy(linger=0)
