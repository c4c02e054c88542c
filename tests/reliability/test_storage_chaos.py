"""Storage-tier chaos with the file backend: corrupted or truncated objects, a storage directory
that vanishes mid-load, and a read-only directory (a read-only bind mount when the tests run as
root) must leave answers equal to the no-cache reference, the server up, and nothing leaked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.chaos_wave import keep
from tests.reliability.pools import assert_nothing_leaked, wait_drained
from tests.reliability.prompts import Prompt, mixed_prompts, random_ids

# Device and host pools far smaller than the conversations, so turns come back from storage.
SMALL_TIERS = ("--max-total-tokens", "1024", "--max-mamba-cache-size", "12", "--hicache-tokens", "1024",
               "--hicache-mamba-slots", "12", "--max-running-requests", "4")  # fmt: skip


def _conversation_turns(seed: int, turns: int = 3) -> list[Prompt]:
    rng = random.Random(seed)
    history: list[int] = []
    out = []
    for _ in range(turns):
        history = history + random_ids(48, rng)
        out.append(Prompt(list(history), 8))
    return out


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_corrupted_and_truncated_objects_are_misses(storage_server_factory, reference_tokens, tmp_path):
    turns = _conversation_turns(1)
    first = storage_server_factory(tmp_path, *SMALL_TIERS)
    asyncio.run(keep(first.endpoint, turns[:2]))
    first.stop()
    objects = _files(tmp_path)
    assert objects, "the first server stored nothing"
    for i, path in enumerate(objects):
        data = bytearray(path.read_bytes())
        if i % 2 and data:
            data[len(data) // 2] ^= 0xFF  # one flipped byte
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    second = storage_server_factory(tmp_path, *SMALL_TIERS)
    got = asyncio.run(keep(second.endpoint, turns))
    assert got == reference_tokens([(p.input_ids, p.max_tokens) for p in turns])
    assert second.proc.poll() is None
    assert_nothing_leaked(wait_drained(second))


def test_storage_directory_removed_mid_load(served, reference_tokens):
    """On the shared server under test (it runs last there): its store vanishes under load."""
    assert served.main_storage_dir is not None, "the server under test has no storage tier"
    prompts = mixed_prompts(48, seed=77, max_tokens=(4, 8))

    async def run() -> list[list[int]]:
        task = asyncio.get_running_loop().create_task(keep(served.main.endpoint, prompts))
        await asyncio.sleep(0.5)
        shutil.rmtree(served.main_storage_dir, ignore_errors=True)
        return await task

    got = asyncio.run(run())
    assert got == reference_tokens([(p.input_ids, p.max_tokens) for p in prompts])
    again = asyncio.run(keep(served.main.endpoint, prompts[:8]))  # and after, with no store at all
    assert again == reference_tokens([(p.input_ids, p.max_tokens) for p in prompts[:8]])
    assert served.main.proc.poll() is None
    assert_nothing_leaked(wait_drained(served.main))


@contextlib.contextmanager
def _read_only_dir(root: Path) -> Iterator[Path]:
    """A directory this process cannot write: mode 555, or for root (who writes through modes) a
    read-only bind mount; skips where neither is possible."""
    path = root / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    source = root / "ro-source"
    source.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(path)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"root cannot be kept from writing here (no bind mount: {mounted.stderr.decode().strip()})")
    try:
        remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True, check=False)
        if remount.returncode != 0:
            pytest.skip(f"no read-only remount: {remount.stderr.decode().strip()}")
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_read_only_storage_directory(storage_server_factory, reference_tokens, tmp_path):
    with _read_only_dir(tmp_path) as store:
        with pytest.raises(OSError):
            (store / "probe").write_bytes(b"x")  # the directory really is read-only to us
        server = storage_server_factory(store, *SMALL_TIERS)
        turns = _conversation_turns(2)
        got = asyncio.run(keep(server.endpoint, turns))
        assert got == reference_tokens([(p.input_ids, p.max_tokens) for p in turns])
        assert server.proc.poll() is None
        assert_nothing_leaked(wait_drained(server))
        server.stop()
