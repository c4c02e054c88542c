"""The file backend's values are its user's alone (0600 files, 0700 directories) whatever the umask,
or also one named group's (0640 / 0750, chowned to it); a group the server cannot use stops start-up
with the flag's name."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from himamba.common.config import ConfigError, load
from himamba.services.cache.storage.factory import open_configured_backend
from himamba.services.cache.storage.file import FileBackend
from himamba.services.cache.storage.file_modes import resolve_group

FP = bytes(range(32))


def _fill(b: FileBackend) -> None:
    pages = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    assert b.set_pages([bytes([i]) * 32 for i in range(4)], [memoryview(r) for r in pages]) == [True] * 4
    assert b.set_state(b"s" * 32, memoryview(np.ones(16, dtype=np.uint8)))


def _modes(root: Path) -> dict[str, tuple[int, int]]:
    """Everything under `root` (root itself excluded): relative path -> (permission bits, gid)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (stat.S_IMODE(st.st_mode), st.st_gid)
    return out


@pytest.fixture
def open_umask():
    """The loosest umask: the modes must not come from it."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_values_are_the_users_alone_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    b = FileBackend(FP, tmp_path / "store", max_bytes=1 << 20)  # a cap: the shared `usage` file too
    _fill(b)
    b.close()
    modes = _modes(tmp_path / "store")
    segments = [p for p in modes if p.endswith(".seg")]
    assert segments and any(p.endswith("usage") for p in modes)
    for path, (mode, _gid) in modes.items():
        want = 0o700 if (tmp_path / "store" / path).is_dir() else 0o600
        assert mode == want, f"{path}: {oct(mode)}"


def test_a_named_group_may_read_and_owns_the_files(tmp_path: Path, open_umask: None) -> None:
    group = grp.getgrgid(1 if os.geteuid() == 0 else os.getegid())  # root may give files to any group
    b = FileBackend(FP, tmp_path / "store", max_bytes=1 << 20, group=group.gr_name)
    _fill(b)
    b.close()
    for path, (mode, gid) in _modes(tmp_path / "store").items():
        want = 0o750 if (tmp_path / "store" / path).is_dir() else 0o640
        assert (mode, gid) == (want, group.gr_gid), path


def test_the_config_field_reaches_the_backend(tmp_path: Path, open_umask: None) -> None:
    group = grp.getgrgid(1 if os.geteuid() == 0 else os.getegid())
    cfg = load(overrides={"cache": {"hicache_storage_dir": str(tmp_path), "hicache_storage_group": group.gr_name}})
    b = open_configured_backend(cfg.cache, FP)
    assert isinstance(b, FileBackend)
    _fill(b)
    b.close()
    assert {gid for _, gid in _modes(tmp_path).values()} == {group.gr_gid}


def test_an_unknown_or_foreign_group_is_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from himamba.services.cli import resolve_model

    with pytest.raises(ValueError, match="no group named"):
        resolve_group("no-such-group-himamba")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a user in no group but its own
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    monkeypatch.setattr(os, "getgroups", lambda: [1000])
    with pytest.raises(ValueError, match="not in group"):
        resolve_group("0")
    monkeypatch.undo()
    cfg = load(
        overrides={"cache": {"hicache_storage_backend": "file", "hicache_storage_group": "no-such-group-himamba"}}
    )
    with pytest.raises(ConfigError, match=r"--hicache-storage-group \(cache.hicache_storage_group\): no group named"):
        resolve_model(cfg)
