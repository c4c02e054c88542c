"""The GPU check's install step, as on a GPU image: a fresh venv that already holds a torch (this
machine's local CPU wheel; 2.11's cu130 build there) and the packages a GPU image ships, and no
registry: `check.sh --only install,env` installs the carried wheels and the project with `--no-index`,
leaves torch as it was, and imports every module of the product.

Setting the venv up needs the registry (the packages the image would already have); the install under
test uses only the wheels folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCAL_WHEELS = Path("/opt/wheels")  # where this project's machines keep the CPU torch wheel
# What the GPU images ship that himamba needs (docs/serving/gpu.md: "The GPU check"), and setuptools for the
# editable build without isolation.
IMAGE_PACKAGES = ["uvloop", "aiohttp", "tokenizers", "safetensors", "prometheus-client", "numpy", "jinja2",
                  "setuptools>=77"]  # fmt: skip

pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert r.returncode == 0, f"{cmd[:4]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_offline_install_beside_an_existing_torch(tmp_path):
    torch_wheels = sorted(LOCAL_WHEELS.glob("torch-*.whl")) if LOCAL_WHEELS.is_dir() else []
    if not torch_wheels:
        pytest.skip(f"no local torch wheel in {LOCAL_WHEELS} (this project's machines keep one there)")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    # The "image": torch from the local wheel, then what the image ships (from the registry).
    _run([py, "-m", "pip", "install", "-q", str(torch_wheels[-1]), *IMAGE_PACKAGES], timeout=600)
    torch_before = _run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    # The carried wheels, for this interpreter rather than the GPU image's 3.12.
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu/fetch-wheels.sh"), str(wheels)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON_VERSION": version},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    results = tmp_path / "results"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu/check.sh"), "--only", "install,env", "--python", py,
         "--wheels", str(wheels), str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr + (results / "install.log").read_text()
    assert "CHECK install INFO installed: pip install --no-index" in r.stdout, r.stdout
    assert "CHECK env INFO imported" in r.stdout, r.stdout
    assert _run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip() == torch_before
