"""reuse_heap: glibc's thresholds are set in the process that asks (here a child, to leave the test
process's allocator as it is), and a platform without glibc gets a reason instead."""

from __future__ import annotations

import subprocess
import sys

import pytest

from himamba.services.worker import heap_reuse


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_thresholds_are_set_on_glibc() -> None:
    code = "from himamba.services.worker.heap_reuse import reuse_heap; r = reuse_heap(); print(r.applied, r.reason)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True mmap threshold 32 MiB, trim threshold 256 MiB"


def test_other_platforms_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap_reuse.sys, "platform", "darwin")
    result = heap_reuse.reuse_heap()
    assert not result.applied and "darwin" in result.reason
