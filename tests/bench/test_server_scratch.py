"""A server started for a benchmark with the file storage tier keeps it as scratch data in the temp
directory and removes it when stopped: nothing is left beside the run's results (its log folder).
Without the tier (the default: the disk tier is opt-in) no scratch directory is made at all."""

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
    server = start_server(ckpt, logs, "--hicache-storage-backend", "file")
    try:
        stores = list(scratch_root.glob("himamba-storage-*"))
        assert len(stores) == 1 and stores[0].is_dir()
    finally:
        server.stop()
    assert not stores[0].exists(), "the storage scratch was left behind"
    assert [p.suffix for p in logs.iterdir()] == [".log"], list(logs.iterdir())
    plain = start_server(ckpt, tmp_path / "plain-logs")
    try:
        assert plain.own_scratch_dir is None and not list(scratch_root.glob("himamba-storage-*"))
    finally:
        plain.stop()
