"""SIGTERM and the storage tier: backups still pending when the front door has drained are
flushed with what is left of --shutdown-timeout; what does not fit is cancelled, so it is simply
not stored (never a torn value), and the launcher's final line says what was flushed and what not.

The storage backend is slowed (--debug-storage-slow-s) so that backups are still queued at SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

from himamba.bench.servers import start_server
from himamba.common.client import AsyncClient
from himamba.services.cache.storage.base import ValueKind
from himamba.services.cache.storage.file import FileBackend
from himamba.services.modelgen.checkpoint import make_checkpoint

PROMPTS = 12
PROMPT_TOKENS = 64  # four whole pages each (page size 16): four page backups a prompt
_FINAL = re.compile(r"cache: flushed (\d+) backup\(s\) \((\d+) pages\) in [\d.]+s, (\d+) not flushed \(not stored\)")


def _serve_then_stop(tmp_path: Path, name: str, slow_s: float, shutdown_timeout_s: float) -> tuple[str, Path]:
    """A server with a slowed file tier: PROMPTS distinct prompts, then SIGTERM at once. Returns
    the server's log and its storage directory."""
    store = tmp_path / f"store-{name}"
    server = start_server(
        make_checkpoint("nemotron_h", tmp_path / "model", preset="tiny", seed=0), tmp_path / f"logs-{name}",
        "--hicache-storage-backend", "file", "--hicache-storage-dir", str(store),
        "--debug-storage-slow-s", str(slow_s), "--shutdown-timeout", str(shutdown_timeout_s),
        "--hicache-storage-prefetch-policy", "best_effort",
    )  # fmt: skip
    try:

        async def requests() -> None:
            async with AsyncClient(server.endpoint, timeout_s=120) as c:
                prompts = [[100 + i, *range(200, 200 + PROMPT_TOKENS - 1)] for i in range(PROMPTS)]
                await asyncio.gather(*(c.generate(input_ids=p, max_tokens=2) for p in prompts))

        asyncio.run(requests())
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(timeout=shutdown_timeout_s + 2 * 15 + 30) == 0
    finally:
        server.stop()
    return server.log(), store


def _stored(store: Path) -> FileBackend:
    """A fresh backend over what the stopped server left (it re-scans every segment)."""
    (fp_dir,) = [d for d in store.iterdir() if d.is_dir()]
    return FileBackend(bytes.fromhex(fp_dir.name), store)


def _every_value_whole(b: FileBackend) -> int:
    """Every segment scanned to its end (no torn tail) and every value reads back verified; the
    number of KV pages stored."""
    for seg in b._segments.values():  # the backend's own scan is what is checked
        assert seg.scanned == os.path.getsize(seg.path), f"{seg.name}: a torn tail"
    keys = [key for kind, key in b._index if kind is ValueKind.KV]
    dest = [bytearray(b._index[(ValueKind.KV, k)][2]) for k in keys]
    for key, buf in zip(keys, dest, strict=True):
        assert b.get_pages([key], [memoryview(buf)]) == 1, key.hex()
    assert b.stats().num_corrupt == 0
    return len(keys)


def test_with_time_left_every_pending_backup_is_flushed(tmp_path: Path) -> None:
    log, store = _serve_then_stop(tmp_path, "time", slow_s=0.5, shutdown_timeout_s=60)
    assert "did not stop in time" not in log and "killed: none" in log, log[-3000:]
    final = _FINAL.search(log)
    assert final, log[-3000:]
    flushed, _pages, not_flushed = map(int, final.groups())
    assert flushed > 0, "no backup was pending at SIGTERM: the test proves nothing"
    assert not_flushed == 0
    b = _stored(store)
    assert _every_value_whole(b) >= PROMPTS * (PROMPT_TOKENS // 16 - 1)  # every prompt's pages (but its last)
    b.close()


def test_without_time_what_is_not_flushed_is_not_stored_and_nothing_is_torn(tmp_path: Path) -> None:
    log, store = _serve_then_stop(tmp_path, "none", slow_s=3.0, shutdown_timeout_s=0.5)
    assert "did not stop in time" not in log and "killed: none" in log, log[-3000:]
    final = _FINAL.search(log)
    assert final, log[-3000:]
    assert int(final.group(3)) > 0, log[-3000:]  # cancelled: never written
    b = _stored(store)
    _every_value_whole(b)
    b.close()
