"""Builds the native CPU kernels (the C files beside this module) once per machine and source, and loads them.

The library is compiled by the system's C compiler (`$CC`, else `cc`, else `gcc`) for this CPU
(`-march=native`) into a cache directory (`$HIMAMBA_NATIVE_CACHE`, else `$XDG_CACHE_HOME/himamba/native`,
else `~/.cache/himamba/native`), under a name derived from the sources, the flags, the compiler and
the CPU; the first process compiles (a few seconds), every later one loads the file. Processes
racing to build write separate temporaries and rename them into place, so a reader never sees a
half-written library. Without a compiler, or when it fails, `native_build()` says why and the
callers keep the PyTorch reference. The entry points' ctypes signatures are read from their C
definitions when the library is loaded (signatures.py), so there is no second copy to keep in step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

# Loaded before the library, so that the library's libgomp.so.1 resolves to torch's OpenMP runtime
# (the same threads and thread count) instead of loading the system's beside it.
import torch  # noqa: F401

from .signatures import read_signatures

log = logging.getLogger(__name__)

CACHE_ENV = "HIMAMBA_NATIVE_CACHE"
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# -ffp-contract=fast: a * b + c becomes one fused multiply-add (ISO C modes leave them apart, half the
# rate); -fno-math-errno: expf / log1pf may inline; no -ffast-math, so sums keep their order and NaNs stay NaNs.
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c11",
    "-ffp-contract=fast",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fno-semantic-interposition",
)
# With OpenMP the kernels' parallel loops join the process's OpenMP runtime (torch's libgomp is
# already loaded, and the library's libgomp.so.1 resolves to it), so they honour torch's thread count.
OPENMP = "-fopenmp"


class NativeBuild(NamedTuple):
    """The loaded library (None when there is none) and, in words, what was built or why not."""

    library: ctypes.CDLL | None
    detail: str


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "himamba" / "native"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0]) and cc
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for), or the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep)) or platform.machine()


def _compile(cc: str, out: Path, flags: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [*cc.split(), *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode == 0:
            os.replace(tmp, out)
        return done
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    for name, (args, result) in read_signatures(SOURCES).items():
        fn = getattr(library, name)
        fn.argtypes = list(args)
        fn.restype = result
    return library


@functools.cache
def native_build() -> NativeBuild:
    """Build (first time on this machine) and load the native kernels; once per process."""
    if platform.system() != "Linux":
        return NativeBuild(None, f"not built: native kernels are built on Linux only (this is {platform.system()})")
    cc = _compiler()
    if cc is None:
        return NativeBuild(None, "not built: no C compiler (set CC, or install Debian package gcc libc6-dev)")
    try:
        version = subprocess.run(
            [*cc.split(), "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return NativeBuild(None, f"not built: {cc} --version failed: {e}")
    compiler = version.splitlines()[0] if version else cc
    digest = hashlib.sha256()
    for part in (
        *[s.read_bytes() for s in SOURCES + HEADERS],
        " ".join(FLAGS).encode(),
        version.encode(),
        _cpu_signature().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    out_dir = cache_dir()
    path = out_dir / f"himamba_native-{digest.hexdigest()[:20]}.so"
    try:
        if not path.exists():
            out_dir.mkdir(parents=True, exist_ok=True)
            log.info("compiling the native CPU kernels with %s into %s", compiler, path)
            done = _compile(cc, path, (*FLAGS, OPENMP))
            if done.returncode != 0:  # a compiler without OpenMP: the same kernels, serial
                log.warning("compiling with %s failed, trying without OpenMP: %s", OPENMP, done.stderr.strip()[-500:])
                done = _compile(cc, path, FLAGS)
            if done.returncode != 0:
                return NativeBuild(None, f"not built: {compiler} failed: {done.stderr.strip()[-500:]}")
        return NativeBuild(_load(path), f"{compiler}, -march=native ({path.name})")
    except (OSError, subprocess.SubprocessError, AttributeError, ValueError) as e:
        return NativeBuild(None, f"not built: {type(e).__name__}: {e}")
