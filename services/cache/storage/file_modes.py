"""Who may read the file backend's values: its user alone (files 0600, directories 0700), or also
one group the operator names (0640 / 0750, the files chowned to that group).

Stored values are a model's KV pages and states: what users' prompts computed. They are never
world-readable, whatever the process's umask (each mode is set with fchmod/chmod, not left to it).
"""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import NamedTuple

__all__ = ["StorageModes", "resolve_group", "storage_modes"]


class StorageModes(NamedTuple):
    """The modes and group (-1: leave it) the file backend gives what it creates."""

    file: int
    directory: int
    gid: int

    def apply_fd(self, fd: int) -> None:
        """Give a file this backend just created its group and mode."""
        if self.gid >= 0:
            os.fchown(fd, -1, self.gid)
        os.fchmod(fd, self.file)

    def make_dirs(self, path: Path) -> None:
        """mkdir -p, each directory created here with the directory mode and group; existing ones
        (the operator's) keep theirs."""
        missing = []
        d = path
        while not d.exists() and d.parent != d:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=self.directory)
            except FileExistsError:  # another server made it first
                continue
            if self.gid >= 0:
                os.chown(d, -1, self.gid)
            os.chmod(d, self.directory)


def resolve_group(group: str) -> int:
    """The gid of a group name or number this process may give its files; ValueError naming why not."""
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r}") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ValueError(f"this user is not in group {group!r}, so it cannot give its files to it")
    return gid


def storage_modes(group: str = "") -> StorageModes:
    """0600/0700 with no group; 0640/0750 for `group`'s members."""
    if not group:
        return StorageModes(0o600, 0o700, -1)
    return StorageModes(0o640, 0o750, resolve_group(group))
