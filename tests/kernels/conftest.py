"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from himamba.kernels import dispatch
from himamba.kernels.native.build import native_build

_MODES = ["reference", pytest.param("native", marks=pytest.mark.skipif(
    native_build().library is None, reason=f"native kernels {native_build().detail}"
))]  # fmt: skip


@pytest.fixture(params=_MODES)
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Run the test once on the PyTorch references and once on the native CPU kernels (through
    the public ops, which dispatch reads HIMAMBA_KERNELS for)."""
    monkeypatch.setenv(dispatch.KERNELS_ENV, request.param)
    dispatch.kernels_mode.cache_clear()
    yield request.param
    monkeypatch.delenv(dispatch.KERNELS_ENV)
    dispatch.kernels_mode.cache_clear()
