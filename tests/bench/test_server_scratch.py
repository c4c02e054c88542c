"""A server started for a benchmark keeps its storage tier as scratch data in the temp directory and
removes it when stopped: nothing is left beside the run's results (its log folder)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from himamba.bench.servers import start_server
from himamba.services.modelgen.checkpoint import make_checkpoint


def test_a_bench_server_leaves_no_storage_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    ckpt = make_checkpoint("nemotron_h", tmp_path / "ckpt", preset="tiny", seed=1)
    logs = tmp_path / "out" / "logs"
    server = start_server(ckpt, logs)
    try:
        stores = list(scratch_root.glob("himamba-storage-*"))
        assert len(stores) == 1 and stores[0].is_dir()
    finally:
        server.stop()
    assert not stores[0].exists(), "the storage scratch was left behind"
    assert [p.suffix for p in logs.iterdir()] == [".log"], list(logs.iterdir())
