"""Decode steps sent ahead, end to end: the real scheduler and cache controller (as processes)
against a stand-in worker that decides every sampled token. Requests that stop with a token,
reach their length or are aborted while a step is in flight end exactly once, are never in a
step after the one that ended them (give or take the step already sent when an abort lands),
and leave no memory held; steady decode steps go ahead."""

from __future__ import annotations

import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from himamba.bench.scheduler_scale import StandInWorker, _wait_ready, stop_processes
from himamba.bench.servers import himamba_command, unique_endpoints
from himamba.common.config import Config, encode
from himamba.common.messages import (
    AbortRequest,
    AddRequest,
    BatchDone,
    CacheStats,
    GetCacheStats,
    MetricsReport,
    RunBatch,
    TokenBatch,
    ToTokenizer,
    WorkerInfo,
)
from himamba.common.types import SamplingParams
from himamba.common.wire import Decoder
from himamba.common.wire import encode as encode_msg

EOS = 2
PROMPT = 40
# rid -> (tokens it samples before its own end, how it ends)
STOP_AT = {f"r{i}": 3 + i for i in range(3)}  # sample EOS as their (3 + i)-th token
STOP_TOKEN_AT = 5  # r3 samples its stop token (9) as its 5th token
MAX_TOKENS = 6  # r4 reaches max_tokens
ABORT_AT = 4  # r5 is aborted during the step that samples its 4th token
LONG = 24  # r6, r7 run on (they keep the batch at steady decode)


class ScriptedWorker(StandInWorker):
    """Samples EOS / the stop token on cue, records every step, aborts r5 mid-step."""

    def __init__(self, endpoints: dict[str, str], info: WorkerInfo) -> None:
        super().__init__(endpoints, info, forward_s=0.002, running=8)
        self.steps: list[tuple[str, list[str], dict[str, int]]] = []
        self.abort_after_step: int | None = None
        # Connected once the scheduler is up (`connect_aborts`): connecting before it binds leaves
        # ZeroMQ retrying every 100 ms, and steady decode may outrun that.
        self.abort_out = self.ctx.socket(zmq.PUSH)
        self.abort_out.setsockopt(zmq.LINGER, 0)
        self.scheduler_ipc = endpoints["scheduler_ipc"]

    def connect_aborts(self) -> None:
        self.abort_out.connect(self.scheduler_ipc)

    def _token(self, rid: str, step: int) -> int:
        nth = step + 1  # this step's token is the request's nth
        if STOP_AT.get(rid) == nth:
            return EOS
        if rid == "r3" and nth == STOP_TOKEN_AT:
            return 9
        return 7

    def _on_batch(self, msg: RunBatch, frames: list[Any], arrived: float) -> None:
        left_out: list[str] = []
        if msg.follows >= 0:  # sent while the step it follows ran: resolved as the worker does
            resolved = self.follow_on(msg, frames[1:])  # the header is frames[0]
            if resolved is None:
                return
            msg, frames, left_out = resolved
        tokens = {s.rid: self._token(s.rid, s.step) for s in msg.seqs}
        self.steps.append((msg.mode, [s.rid for s in msg.seqs], tokens))
        if msg.mode != "none" and msg.seqs:
            time.sleep(self.forward_s)
        aborting = any(s.rid == "r5" and s.step + 1 == ABORT_AT for s in msg.seqs) and msg.mode == "decode"
        if aborting and self.abort_after_step is None:
            self.abort_after_step = len(self.steps) - 1
            self.abort_out.send_multipart(encode_msg(AbortRequest(rid="r5")))
            time.sleep(0.01)  # the abort lands while this step is still "running"
        self.done(msg, [tokens[s.rid] for s in msg.seqs], left_out)


def _config(endpoints: dict[str, str], model_dir: Path) -> Config:
    raw = msgspec.to_builtins(Config())
    raw["endpoints"].update(endpoints)
    raw["model"]["model"] = str(model_dir)
    raw["model"]["max_context_len"] = 512
    raw["scheduler"]["max_running_requests"] = 8
    raw["cache"]["page_size"] = 16
    # r6 and r7 cross a track boundary (context 48) while decoding: the default (lazy) strategy
    # asks for its boundary slot, and a step is not built ahead before the slot is there.
    raw["scheduler"]["mamba_track_interval"] = 48
    raw["cache"]["hicache_storage_backend"] = "none"
    raw["metrics"]["report_interval_s"] = 0.2
    return msgspec.convert(raw, Config)


class FailingWorker(ScriptedWorker):
    """Fails the first full decode step that samples the requests' FAIL_AT-th tokens; the step
    that follows it (already sent) must then be refused."""

    def __init__(self, endpoints: dict[str, str], info: WorkerInfo) -> None:
        super().__init__(endpoints, info)
        self.failed: int | None = None  # the batch that failed
        self.refused: int | None = None  # the one that followed it

    def _on_batch(self, msg: RunBatch, frames: list[Any], arrived: float) -> None:
        if self.failed is None and msg.follows >= 0 and len(msg.seqs) == 8 and msg.seqs[0].step + 1 >= FAIL_AT:
            self.failed = msg.batch_id
            self.last = None
            self._send("scheduler", BatchDone(batch_id=msg.batch_id, next_tokens=[], error="the forward failed"))
            return
        if self.failed is not None and msg.follows == self.failed:
            self.refused = msg.batch_id
        super()._on_batch(msg, frames, arrived)


FAIL_AT = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _scenario(tmp_path_factory.mktemp("ahead"), ScriptedWorker)


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _scenario(tmp_path_factory.mktemp("ahead-failed"), FailingWorker)


def _scenario(work: Path, worker_cls: type[ScriptedWorker]) -> dict[str, Any]:
    endpoints = unique_endpoints("himamba-ahead")
    model_dir = work / "stand-in-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer.json").write_text("{}")
    cfg = work / "config.json"
    cfg.write_bytes(encode(_config(endpoints, model_dir)))
    info = WorkerInfo(
        vocab_size=64, eos_token_ids=[EOS], num_attention_layers=1, num_recurrent_layers=1,
        kv_bytes_per_token=1024, state_bytes_per_slot=1 << 16, num_pages=512, num_state_slots=64,
        num_host_pages=0, num_host_state_slots=0, model_name="stand-in", pid=os.getpid(),
    )  # fmt: skip
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(endpoints["control_ipc"])
    front = ctx.socket(zmq.PULL)
    front.bind(endpoints["tokenizer_ipc"])
    stats_ep = endpoints["tokenizer_ipc"] + "-stats"
    stats_in = ctx.socket(zmq.PULL)
    stats_in.bind(stats_ep)
    worker = worker_cls(endpoints, info)
    worker.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("cache", "scheduler"):
        with open(work / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(
                [*himamba_command(), "service", name, "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT
            )
    try:
        _wait_ready(control, {"cache", "scheduler"}, procs)
        worker.connect_aborts()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(endpoints["scheduler_ipc"])
        for i in range(8):
            sampling = SamplingParams(stop_token_ids=[9] if i == 3 else [])
            max_tokens = {4: MAX_TOKENS, 6: LONG, 7: LONG}.get(i, 100)
            prompt = [10 + (i * 7 + j) % 40 for j in range(PROMPT)]
            push.send_multipart(
                # EOS named here too (as the front door does): the scheduler may not have the
                # stand-in's WorkerInfo (its eos ids) yet when the first requests arrive.
                encode_msg(
                    AddRequest(
                        rid=f"r{i}", input_ids=prompt, sampling=sampling, max_tokens=max_tokens, eos_token_ids=[EOS]
                    )
                )
            )
        decoder: Decoder[Any] = Decoder(ToTokenizer)  # type: ignore[arg-type]
        tokens: dict[str, list[int]] = defaultdict(list)
        finishes: dict[str, list[str]] = defaultdict(list)
        ahead = 0.0
        deadline = time.monotonic() + 120
        while sum(len(f) for f in finishes.values()) < 8 or ahead == 0:
            assert time.monotonic() < deadline, f"timed out: finishes {dict(finishes)}, steps ahead {ahead}"
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited with {p.returncode}"
            if not front.poll(200):
                continue
            msg, _ = decoder.decode(front.recv_multipart(copy=False))
            if isinstance(msg, TokenBatch):
                for out in msg.outs:
                    tokens[out.rid] += out.token_ids
                    if out.finish_reason is not None:
                        finishes[out.rid].append(out.finish_reason)
            elif isinstance(msg, MetricsReport) and msg.service == "scheduler":
                for line in msg.text.splitlines():
                    if line.startswith("himamba_scheduler_ahead_decode_steps_total"):
                        ahead = float(line.split()[-1])
        time.sleep(0.3)  # releases reach the controller with the next cache round trip
        to_cache = ctx.socket(zmq.PUSH)
        to_cache.setsockopt(zmq.LINGER, 0)
        to_cache.connect(endpoints["cache_ipc"])
        to_cache.send_multipart(encode_msg(GetCacheStats(reply_to=stats_ep, check_invariants=True)))
        assert stats_in.poll(10_000)
        stats = msgspec.msgpack.decode(stats_in.recv_multipart()[0], type=CacheStats)
        return {"tokens": tokens, "finishes": finishes, "steps": worker.steps, "ahead": ahead,
                "abort_step": worker.abort_after_step, "stats": stats, "worker": worker}  # fmt: skip
    finally:
        stop_processes(procs)
        worker.close()
        ctx.destroy(linger=0)


def test_every_request_ends_once_with_the_right_reason_and_tokens(run: dict[str, Any]) -> None:
    finishes, tokens = run["finishes"], run["tokens"]
    assert dict(finishes) == {
        **{rid: ["stop"] for rid in STOP_AT},
        "r3": ["stop"],
        "r4": ["length"],
        "r5": ["abort"],
        "r6": ["length"],
        "r7": ["length"],
    }
    for rid, n in STOP_AT.items():
        assert finishes[rid] == ["stop"] and tokens[rid] == [7] * (n - 1) + [EOS]
    assert finishes["r3"] == ["stop"] and tokens["r3"] == [7] * (STOP_TOKEN_AT - 1) + [9]
    assert finishes["r4"] == ["length"] and len(tokens["r4"]) == MAX_TOKENS
    # No token after the abort is handled: the token of the step it lands in is not sent, or (if
    # that step's results were in first) it is the last one.
    assert finishes["r5"] == ["abort"] and len(tokens["r5"]) in (ABORT_AT - 1, ABORT_AT)
    assert len(tokens["r6"]) == len(tokens["r7"]) == LONG


def test_no_step_after_the_one_that_ended_a_request_runs_it(run: dict[str, Any]) -> None:
    steps = run["steps"]
    for rid in [*STOP_AT, "r3", "r4", "r6"]:
        last = max(i for i, (_, rids, _) in enumerate(steps) if rid in rids)
        assert steps[last][2][rid] in (EOS, 9) or rid in ("r4", "r6")  # its last step sampled its end
        n_runs = sum(rid in rids for mode, rids, _ in steps if mode == "decode")
        assert n_runs == len(run["tokens"][rid]) - 1  # the prefill sampled the first token
    # The abort lands during step k: k + 1 may already have been sent ahead, k + 2 may not.
    k = run["abort_step"]
    assert k is not None
    assert sum("r5" in rids for _, rids, _ in steps[k + 1 :]) <= 1


def test_steady_decode_goes_ahead_and_no_memory_is_left_held(run: dict[str, Any]) -> None:
    assert run["ahead"] > 0
    stats: CacheStats = run["stats"]
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0
    assert stats.free_pages + stats.cached_pages == stats.total_pages
    assert stats.free_slots + stats.cached_slots == stats.total_slots


def test_a_failed_step_fails_the_one_that_follows_it_and_every_request_ends_once(failed_run: dict[str, Any]) -> None:
    worker: FailingWorker = failed_run["worker"]
    assert worker.failed is not None and worker.refused is not None  # sent before the failure was known
    # All eight were running when it failed: each ends exactly once, with the error, and none
    # ran again (the refused step never reached the "forward").
    assert dict(failed_run["finishes"]) == {f"r{i}": ["error"] for i in range(8)}
    assert all(len(failed_run["tokens"][f"r{i}"]) == FAIL_AT - 1 for i in range(8))
    stats: CacheStats = failed_run["stats"]
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0
    assert stats.free_pages + stats.cached_pages == stats.total_pages
    assert stats.free_slots + stats.cached_slots == stats.total_slots
