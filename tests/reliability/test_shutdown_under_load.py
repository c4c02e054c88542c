"""SIGTERM while 16 streams run: the front door stops taking requests, lets those in flight
finish within --shutdown-timeout (each client gets all its tokens, or a clean 503 "server
shutting down"), then the back end stops; no service is killed, one final line says how the stop
went, and no socket, lock file, temporary config or shared-memory segment stays behind."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from himamba.bench.servers import start_server
from himamba.common.client import AsyncClient, HimambaError
from himamba.common.types import GrammarSpec
from himamba.services.modelgen.checkpoint import make_checkpoint

STREAMS = 16
TOKENS = 120


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    """Not exited (a zombie has exited: its reparented remains wait for init to reap them)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _config_path(pid: int) -> Path:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(os.fsdecode(args[args.index(b"--config") + 1]))


def test_sigterm_under_16_streams_drains_and_leaves_nothing(tmp_path: Path) -> None:
    model = make_checkpoint("nemotron_h", tmp_path / "model", preset="tiny", seed=0)
    server = start_server(
        model, tmp_path / "logs", "--instance", f"shutdown-load-{os.getpid()}", "--shutdown-timeout", "60",
        "--hicache-storage-backend", "none",
    )  # fmt: skip
    try:
        launcher = server.proc.pid
        children = _children(launcher)
        assert len(children) == 4
        for child in children:  # the config (secrets inside) came through a pipe, never a file
            assert str(_config_path(child)).startswith("/dev/fd/"), _config_path(child)
        instance_dir = Path(server.endpoint.removeprefix("ipc://")).parent
        helpers: list[int] = []  # the services' own children

        async def scenario() -> list[tuple[int, str]]:
            async with AsyncClient(server.endpoint, timeout_s=300) as c:
                started: set[int] = set()

                async def one(i: int) -> tuple[int, str]:
                    got = 0
                    try:
                        async for chunk in c.stream(input_ids=[40 + i, 41, 42], max_tokens=TOKENS, ignore_eos=True):
                            got += len(chunk.token_ids)
                            started.add(i)
                    except HimambaError as e:
                        return got, f"{e.code} {e.message}"
                    return got, "done"

                # A constrained request first: the front door's grammar-check process is up too.
                await c.generate(input_ids=[5, 6], max_tokens=2, grammar=GrammarSpec(kind="regex", spec="[ab]+"))
                helpers.extend(p for child in children for p in _children(child))
                streams = [asyncio.create_task(one(i)) for i in range(STREAMS)]
                while len(started) < STREAMS:
                    await asyncio.sleep(0.05)
                os.kill(launcher, signal.SIGTERM)
                return list(await asyncio.gather(*streams))

        outcomes = asyncio.run(scenario())
        code = server.proc.wait(timeout=60 + 2 * 15 + 30)  # --shutdown-timeout + the stages' grace, a bound
        leftovers = sorted(p.name for p in instance_dir.iterdir())  # before stop() removes the directory
    finally:
        server.stop()
    assert code == 0
    for got, how in outcomes:  # all tokens, or a clean error naming the shutdown
        assert (got, how) == (TOKENS, "done") or how == "503 server shutting down", (got, how)
    assert sum(how == "done" for _, how in outcomes) == STREAMS  # 60 s is plenty: none was cut off
    log = server.log()
    assert "did not stop in time" not in log, log[-3000:]
    assert "killed: none" in log
    assert f"shutdown: {STREAMS} request(s) in flight at SIGTERM, {STREAMS} finished, 0 aborted" in log
    final = next(line for line in log.splitlines() if "launcher" in line and "stopped in" in line)
    assert f"tokenizer: {STREAMS} request(s) in flight at SIGTERM, {STREAMS} finished" in final, final
    assert helpers  # the grammar-check process, at least
    alive = [p for p in children + helpers if _running(p)]
    assert not alive, alive
    assert not [n for n in leftovers if n.endswith((".sock", ".lock"))], leftovers
    shm = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"himamba-{c}-") for c in children)]
    assert not shm, shm
