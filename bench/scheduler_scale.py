"""`himamba bench scheduler --scale`: the scheduler's serial work per decode step at scale.

The real scheduler and cache controller run as processes (as under `himamba serve`) against a
stand-in worker in this process that answers every RunBatch after a fixed "forward" time, with no
model. A decode step's serial scheduler time is what a GPU would sit idle for between two steps:
from the moment the stand-in sends BatchDone to the moment it has the next RunBatch (the
stand-in's own time is outside that window). At steady decode the scheduler sends each step
while the one before runs (scheduler/decode_ahead.py), so the window holds only what of its
per-step work outlasts the forward; its whole per-step work is the "sched CPU" column. For
running requests x context in {32, 256} x {2k, 32k} (and 256 x 2k with a repetition penalty) it prints that time per step (ms
and us per running request), the scheduler's and the cache controller's CPU per step (from
/proc), and RunBatch bytes per step. JSON: `serial_ms_per_step` keyed like "256x32768".
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import zmq

from himamba.bench.machine_info import describe_machine
from himamba.bench.report_files import write_json
from himamba.bench.servers import himamba_command, unique_endpoints
from himamba.common.config import Config, encode
from himamba.common.messages import (
    AbortRequest,
    AddRequest,
    BatchDone,
    Hello,
    Ready,
    RunBatch,
    ToWorker,
    TransfersDone,
    WorkerInfo,
)
from himamba.common.types import SamplingParams
from himamba.common.wire import Decoder
from himamba.common.wire import encode as encode_msg
from himamba.services.worker.follow_on import FollowError, LastSampled, Resolved, resolve, sampled

PAGE = 16
# Token ids below 256 are Python's cached small ints: 256 x 32k-token prompts then cost the
# scheduler and the controller no per-token objects, so memory stays small on a 2-core box.
_VOCAB = 250
# Tokens a request may decode (while the others prefill, then measured): its max_tokens.
_DECODE_ROOM = 4096


class ScaleCase(NamedTuple):
    running: int
    context: int
    penalised: bool = False

    @property
    def key(self) -> str:
        return f"{self.running}x{self.context}" + ("-penalty" if self.penalised else "")


CASES = (
    ScaleCase(32, 2048),
    ScaleCase(32, 32768),
    ScaleCase(256, 2048),
    ScaleCase(256, 32768),
    ScaleCase(256, 2048, True),
)


def parse_cases(text: str) -> tuple[ScaleCase, ...]:
    """Cases named as their keys, comma-separated: RUNNINGxCONTEXT, with -penalty for a repetition penalty."""
    cases = []
    for key in (t.strip() for t in text.split(",")):
        running, sep, context = key.removesuffix("-penalty").partition("x")
        if not (sep and running.isdigit() and context.isdigit() and int(running) > 0 and int(context) > 0):
            raise ValueError(f"a scale case is RUNNINGxCONTEXT[-penalty], e.g. 32x2048, got {key!r}")
        cases.append(ScaleCase(int(running), int(context), key.endswith("-penalty")))
    return tuple(cases)


class ScaleResult(NamedTuple):
    case: str
    running: int
    context: int
    decode_steps: int
    serial_ms_per_step: float
    serial_us_per_request: float
    scheduler_cpu_ms_per_step: float
    cache_cpu_ms_per_step: float
    run_batch_bytes_per_step: int
    # Every round's serial ms per step for this case (the row is the round with the median).
    serial_ms_rounds: tuple[float, ...] = ()


def _log(msg: str) -> None:
    print(f"[bench scheduler --scale] {msg}", file=sys.stderr, flush=True)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StandInWorker(threading.Thread):
    """Answers RunBatch after `forward_s`, acknowledges copies at once; measures decode steps."""

    def __init__(self, endpoints: dict[str, str], info: WorkerInfo, forward_s: float, running: int) -> None:
        super().__init__(daemon=True)
        self.info, self.forward_s, self.running = info, forward_s, running
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(endpoints["worker_ipc"])
        self.out = {}
        for peer in ("scheduler", "cache", "tokenizer"):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoints[f"{peer}_ipc"])
            self.out[peer] = s
        self.decoder = Decoder(ToWorker)  # type: ignore[arg-type]
        self.stop_flag = threading.Event()
        self.measuring = threading.Event()
        self.gaps: list[float] = []
        self.bytes: list[int] = []
        self.decode_steps = 0  # full decode steps seen (all `running` requests in the batch)
        self.last_done_at: float | None = None
        self.last: LastSampled | None = None  # the inputs of a step that follows the last one

    def follow_on(self, msg: RunBatch, frames: list[Any]) -> Resolved | None:
        """A step that `follows` the last one, as the worker runs it (services/worker/follow_on.py);
        None after answering it failed (it follows a failed or another step)."""
        try:
            return resolve(msg, frames, self.last)
        except FollowError as e:
            self._answer(msg, BatchDone(batch_id=msg.batch_id, next_tokens=[], error=str(e)))
            return None

    def done(self, msg: RunBatch, tokens: list[int], left_out: list[str]) -> None:
        """Answer `msg` (as resolved) with `tokens`."""
        self._answer(msg, BatchDone(batch_id=msg.batch_id, next_tokens=tokens, left_out=left_out))

    def _answer(self, msg: RunBatch, done: BatchDone) -> None:
        """Send `done`, remember what it sampled, acknowledge `msg`'s copies (whatever the forward did)."""
        self.last = sampled(msg, done)
        self._send("scheduler", done)
        if msg.transfers:
            self._send("cache", TransfersDone(op_ids=[t.op_id for t in msg.transfers]))

    def _send(self, peer: str, msg: Any) -> None:
        self.out[peer].send_multipart(encode_msg(msg))

    def run(self) -> None:
        for peer in self.out:
            self._send(peer, self.info)
        while not self.stop_flag.is_set():
            if not self.inbox.poll(100):
                continue
            frames = self.inbox.recv_multipart(copy=False)
            arrived = time.perf_counter()
            msg, _ = self.decoder.decode(frames)
            match msg:
                case Hello(service=service) if service in self.out:
                    self._send(service, self.info)
                case RunBatch():
                    self._on_batch(msg, frames, arrived)

    def _on_batch(self, msg: RunBatch, frames: list[Any], arrived: float) -> None:
        left_out: list[str] = []
        if msg.follows >= 0:
            resolved = self.follow_on(msg, frames[1:])  # the header is frames[0]
            if resolved is None:
                return
            msg, _, left_out = resolved
        full_decode = msg.mode == "decode" and len(msg.seqs) == self.running
        if full_decode:
            self.decode_steps += 1
            if self.measuring.is_set() and self.last_done_at is not None:
                self.gaps.append(arrived - self.last_done_at)
                self.bytes.append(sum(len(f.buffer) for f in frames))
        if msg.mode != "none" and msg.seqs:
            deadline = arrived + self.forward_s
            while time.perf_counter() < deadline:  # the "forward" (a sleep would oversleep)
                pass
        # Stamped before the send: a stand-in thread preempted after sending would shorten the gap.
        self.last_done_at = time.perf_counter() if full_decode else None
        self.done(msg, [1] * len(msg.seqs), left_out)

    def close(self) -> None:
        self.stop_flag.set()
        self.join(timeout=5)
        self.ctx.destroy(linger=0)


def _config(endpoints: dict[str, str], case: ScaleCase, model_dir: str) -> Config:
    cfg = Config()
    raw = msgspec.to_builtins(cfg)
    raw["endpoints"].update(endpoints)
    raw["model"]["model"] = model_dir
    raw["model"]["max_context_len"] = case.context + _DECODE_ROOM
    raw["scheduler"]["max_running_requests"] = case.running
    raw["scheduler"]["chunked_prefill_size"] = 65536
    raw["scheduler"]["mamba_track_interval"] = 64
    raw["cache"]["page_size"] = PAGE
    raw["cache"]["hicache_storage_backend"] = "none"
    raw["metrics"]["report_interval_s"] = 60
    return msgspec.convert(raw, Config)


def _run_case(case: ScaleCase, work: Path, forward_s: float, steps: int) -> ScaleResult:
    endpoints = unique_endpoints("himamba-scale")
    pages = case.running * ((case.context + _DECODE_ROOM) // PAGE + 8) + 64
    info = WorkerInfo(
        vocab_size=_VOCAB + 6, eos_token_ids=[], num_attention_layers=1, num_recurrent_layers=1,
        kv_bytes_per_token=1024, state_bytes_per_slot=1 << 20, num_pages=pages,
        num_state_slots=case.running * 6 + 64, num_host_pages=0, num_host_state_slots=0,
        model_name="stand-in", pid=os.getpid(),
    )  # fmt: skip
    model_dir = work / "stand-in-model"  # the services only check that a checkpoint is named
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "tokenizer.json").write_text("{}")
    cfg_path = work / f"{case.key}.json"
    cfg_path.write_bytes(encode(_config(endpoints, case, str(model_dir))))
    ctx = zmq.Context()
    control = ctx.socket(zmq.PULL)
    control.bind(endpoints["control_ipc"])
    tokenizer = ctx.socket(zmq.PULL)  # the stand-in front door: tokens, readiness, metrics
    # Nobody reads it: without an unbounded queue the scheduler would block on its token sends
    # after ~2,000 steps (the two sides' high-water marks), as behind a front door that stopped.
    tokenizer.setsockopt(zmq.RCVHWM, 0)
    tokenizer.bind(endpoints["tokenizer_ipc"])
    worker = StandInWorker(endpoints, info, forward_s, case.running)
    worker.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in ("cache", "scheduler"):
        with open(work / f"{case.key}-{name}.log", "wb") as log:  # the child keeps its own descriptor
            procs[name] = subprocess.Popen(
                [*himamba_command(), "service", name, "--config", str(cfg_path)], stdout=log, stderr=subprocess.STDOUT
            )
    try:
        _wait_ready(control, {"cache", "scheduler"}, procs)
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoints["scheduler_ipc"])
        rng = random.Random(case.running * 7 + case.context)
        sampling = SamplingParams(repetition_penalty=1.1 if case.penalised else 1.0)
        _log(f"{case.key}: {case.running} requests of {case.context} tokens")
        for i in range(case.running):
            prompt = [rng.randrange(1, _VOCAB) for _ in range(case.context)]
            push.send_multipart(
                encode_msg(AddRequest(rid=f"r{i}", input_ids=prompt, sampling=sampling, max_tokens=_DECODE_ROOM - 1))
            )
        # Warm up until every request decodes, then measure `steps` decode steps.
        _wait(lambda: worker.decode_steps >= 8, procs, f"{case.key}: prefill")
        sched_cpu0, cache_cpu0 = _cpu_s(procs["scheduler"].pid), _cpu_s(procs["cache"].pid)
        first = worker.decode_steps
        worker.measuring.set()
        _wait(lambda: worker.decode_steps >= first + steps, procs, f"{case.key}: decode")
        worker.measuring.clear()
        n = worker.decode_steps - first
        sched_cpu = (_cpu_s(procs["scheduler"].pid) - sched_cpu0) / n
        cache_cpu = (_cpu_s(procs["cache"].pid) - cache_cpu0) / n
        for i in range(case.running):  # done: end them (they would decode up to max_tokens)
            push.send_multipart(encode_msg(AbortRequest(rid=f"r{i}")))
        serial = statistics.median(worker.gaps)
        return ScaleResult(
            case=case.key,
            running=case.running,
            context=case.context,
            decode_steps=len(worker.gaps),
            serial_ms_per_step=round(serial * 1e3, 3),
            serial_us_per_request=round(serial * 1e6 / case.running, 2),
            # The stand-in's forward time is idle time for the scheduler, not CPU it spent.
            scheduler_cpu_ms_per_step=round(sched_cpu * 1e3, 3),
            cache_cpu_ms_per_step=round(cache_cpu * 1e3, 3),
            run_batch_bytes_per_step=int(statistics.median(worker.bytes)),
        )
    finally:
        stop_processes(procs)
        worker.close()
        ctx.destroy(linger=0)


def stop_processes(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every service started for a case, then wait for each (SIGKILL after 10 s)."""
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_ECHO = """
import sys, zmq
ctx = zmq.Context()
inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
inbox.bind(sys.argv[1]); out.connect(sys.argv[2])
while True:
    frames = inbox.recv_multipart(copy=False)
    if frames[0].bytes == b"stop":
        break
    out.send_multipart(frames, copy=False)
"""


def transport_floor_ms(rounds: int = 400) -> float:
    """Median wall time of a bare ZeroMQ ipc round trip to another process that answers at once:
    the part of a step's serial time that is the four-process design's messaging, not scheduling."""
    tag = unique_endpoints("himamba-echo")
    there, back = tag["worker_ipc"], tag["scheduler_ipc"]
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, there, back])
    ctx = zmq.Context()
    inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(back)
    out.connect(there)
    try:
        payload = b"x" * 1024
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            out.send(payload)
            if not inbox.poll(5000):
                raise TimeoutError("the echo process did not answer")
            inbox.recv()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times[rounds // 4 :]) * 1e3, 3)
    finally:
        out.send(b"stop")
        echo.wait(timeout=10)
        ctx.destroy(linger=0)


def _wait_ready(control: zmq.Socket, names: set[str], procs: dict[str, subprocess.Popen[bytes]]) -> None:
    decoder = msgspec.msgpack.Decoder(Ready)
    left = set(names)
    deadline = time.monotonic() + 120
    while left:
        if time.monotonic() > deadline:
            raise TimeoutError(f"services not ready: {sorted(left)}")
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}")
        if control.poll(200):
            try:
                left.discard(decoder.decode(control.recv()).service)
            except msgspec.ValidationError:
                pass  # a Fatal: the process exits and is reported above


def _wait(cond: Any, procs: dict[str, subprocess.Popen[bytes]], what: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{what}: {name} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: timed out")
        time.sleep(0.05)


def _spread(values: tuple[float, ...]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else ""


def format_table(rows: list[ScaleResult]) -> list[str]:
    head = (
        f"{'running x context':<22}{'serial ms/step':>15}{'us/request':>12}{'sched CPU ms':>14}"
        f"{'cache CPU ms':>14}{'RunBatch B':>12}{'rounds min-max':>18}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.case:<22}{r.serial_ms_per_step:>15.3f}{r.serial_us_per_request:>12.2f}"
            f"{r.scheduler_cpu_ms_per_step:>14.3f}{r.cache_cpu_ms_per_step:>14.3f}{r.run_batch_bytes_per_step:>12}"
            f"{_spread(r.serial_ms_rounds):>18}"
        )
    by = {r.case: r for r in rows}
    for running in (32, 256):
        short, long = by.get(f"{running}x2048"), by.get(f"{running}x32768")
        if short and long and short.serial_ms_per_step > 0:
            lines.append(
                f"{running} running: 32k / 2k serial time per step {long.serial_ms_per_step / short.serial_ms_per_step:.2f}x"
            )
    return lines


def run_scale(
    out_dir: Path, forward_ms: float, steps: int, cases: tuple[ScaleCase, ...] = CASES, rounds: int = 1
) -> int:
    """Each case `rounds` times, the cases in alternating order round by round (forward, then
    backward), so a drift of the machine's speed does not land on one case; a case's row is its
    median round."""
    machine = describe_machine(1, "cpu")
    print(machine.line(), flush=True)
    print(
        f"stand-in worker: no model, {forward_ms} ms per forward; {steps} measured decode steps per case "
        f"in each of {rounds} round(s); "
        f"page {PAGE}, radix cache on, default strategy",
        flush=True,
    )
    floor = transport_floor_ms()
    print(
        f"transport floor: a bare ZeroMQ ipc round trip to a process that answers at once takes {floor} ms", flush=True
    )
    runs: dict[str, list[ScaleResult]] = {case.key: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="himamba-scale-") as tmp:
        for r in range(rounds):
            for case in cases if r % 2 == 0 else tuple(reversed(cases)):
                res = _run_case(case, Path(tmp), forward_ms / 1e3, steps)
                runs[case.key].append(res)
                _log(f"round {r + 1}/{rounds}, {case.key}: {res.serial_ms_per_step} ms serial per decode step")
    rows: list[ScaleResult] = []
    for case in cases:
        ordered = sorted(runs[case.key], key=lambda x: x.serial_ms_per_step)
        median = ordered[(len(ordered) - 1) // 2]
        rows.append(median._replace(serial_ms_rounds=tuple(x.serial_ms_per_step for x in runs[case.key])))
    table = format_table(rows)
    for line in table:
        print(line)
    payload = {
        "benchmark": "scheduler_scale",
        "machine": machine._asdict(),
        "workload": {"forward_ms": forward_ms, "steps": steps, "rounds": rounds, "page_size": PAGE},
        "transport_floor_ms": floor,
        "rows": [r._asdict() for r in rows],
        "serial_ms_per_step": {r.case: r.serial_ms_per_step for r in rows},
        "printed": table,
    }
    write_json(out_dir / "scheduler_scale.json", payload)
    print(f"wrote {out_dir / 'scheduler_scale.json'}")
    print(json.dumps({"serial_ms_per_step": payload["serial_ms_per_step"]}))
    return 0
