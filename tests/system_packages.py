"""The Debian packages the tests use, under the names scripts/test.sh installs them by: a test
that needs a missing one skips, naming the package, instead of failing for the machine's sake."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import shutil
from typing import NamedTuple

import pytest


class DebianPackage(NamedTuple):
    """`names` (what apt-get installs) and `probe`, what shows they are there: `cmd:COMMAND` on
    PATH or `lib:SONAME` loadable, exactly as in scripts/test.sh's NEEDS."""

    names: str
    probe: str

    def present(self) -> bool:
        kind, _, what = self.probe.partition(":")
        if kind == "cmd":
            return shutil.which(what) is not None
        try:
            ctypes.CDLL(what)
        except OSError:
            return False
        return True


C_COMPILER = DebianPackage("gcc libc6-dev", "cmd:cc")
PROMETHEUS = DebianPackage("prometheus", "cmd:promtool")
REDIS = DebianPackage("redis-server", "cmd:redis-server")
SYSTEMD = DebianPackage("systemd", "cmd:systemd-analyze")
UTIL_LINUX = DebianPackage("util-linux", "cmd:prlimit")
# The Mooncake wheel's store.so and mooncake_master link these even over TCP.
MOONCAKE_LIBRARIES = (
    DebianPackage("libibverbs1", "lib:libibverbs.so.1"),
    DebianPackage("libnl-3-200", "lib:libnl-3.so.200"),
    DebianPackage("libnl-route-3-200", "lib:libnl-route-3.so.200"),
)
ALL = (C_COMPILER, PROMETHEUS, REDIS, SYSTEMD, UTIL_LINUX, *MOONCAKE_LIBRARIES)


def missing_reason(*needs: DebianPackage) -> str | None:
    """Why a test needing `needs` cannot run here, naming each missing package; None when all are there."""
    gone = [n for n in needs if not n.present()]
    if not gone:
        return None
    names = " ".join(n.names for n in gone)
    probes = ", ".join(n.probe.partition(":")[2] for n in gone)
    return f"needs Debian package {names} (no {probes} here; scripts/test.sh installs it when it may)"


def requires(*needs: DebianPackage) -> pytest.MarkDecorator:
    """A skipif mark naming whichever of `needs` is missing."""
    reason = missing_reason(*needs)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_without(*needs: DebianPackage) -> None:
    """Skip the calling test (or fixture) when any of `needs` is missing, naming it."""
    __tracebackhide__ = True  # pytest -rs then reports the caller's line, not this one
    reason = missing_reason(*needs)
    if reason is not None:
        pytest.skip(reason)


def skip_without_mooncake() -> None:
    """Skip unless a Mooncake Store can start here: the wheel (a Python requirement of the tests,
    so its absence is an install to fix, named as such) and its Debian libraries."""
    __tracebackhide__ = True
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("needs the Mooncake wheel (pip: mooncake-transfer-engine-non-cuda, in the test extra)")
    skip_without(*MOONCAKE_LIBRARIES)
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:  # a library outside the three above: say which
        pytest.skip(f"the Mooncake wheel does not load: {e}")
