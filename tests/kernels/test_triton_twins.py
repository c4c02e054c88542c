"""Every Triton twin against its reference under Triton's interpreter on CPU, and every twin's
kernels compiled ahead of time for a CUDA sm_90 target (no GPU needed).

Both run in subprocesses (`triton_run.py`) so that this process, the other tests and the services
they start never import triton. Skipped only when triton is not installed (the `test` extra
installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kernels import triton_cases

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "triton_run.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


# Wall and CPU seconds (the subprocess and its children) of each phase, for the summary line.
PHASES: dict[str, tuple[float, float]] = {}


def _run(mode: str, out: Path, *extra: str, interpret: bool) -> dict | list:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    # Triton 3.9 warns on every process that it will change this default; keep today's.
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    start, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run(
        [sys.executable, str(RUNNER), mode, str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    PHASES[mode] = (time.perf_counter() - start, _children_cpu() - cpu)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _run("interpret", tmp_path_factory.mktemp("twins") / "interpret.json", interpret=True)


@pytest.fixture(scope="module")
def compiled(interpreted: dict, tmp_path_factory: pytest.TempPathFactory) -> list:
    folder = tmp_path_factory.mktemp("aot")
    specs = folder / "specs.json"
    specs.write_text(json.dumps({"specs": interpreted["specs"]}))
    return _run("compile", folder / "compiled.json", str(specs), interpret=False)


@pytest.mark.parametrize("case_id", [c.id for c in triton_cases.CASES])
def test_twin_matches_reference_under_interpreter(interpreted: dict, case_id: str) -> None:
    result = interpreted["cases"][case_id]
    assert result["error"] is None, result["error"]
    assert result["comparisons"] >= 1


def test_every_twin_module_has_cases(interpreted: dict) -> None:
    """Each twin module launched at least one kernel under the interpreter."""
    launched = {spec["module"].rsplit(".", 1)[-1] for spec in interpreted["specs"]}
    modules = {p.stem for p in (HERE.parent.parent / "kernels" / "triton").glob("*.py")} - {"__init__", "jit_math"}
    assert modules <= launched, sorted(modules - launched)


def test_kernels_compile_for_sm90(compiled: list) -> None:
    """Every specialization the interpreter ran also compiles to a cubin for sm_90."""
    failures = [f"{r['kernel']} {r['constexprs']}:\n{r['error']}" for r in compiled if r["error"]]
    assert not failures, "\n\n".join(failures)
    assert compiled and all(r["cubin_bytes"] > 0 for r in compiled)


def test_summary(interpreted: dict, compiled: list) -> None:
    """Prints what ran and what it cost (shown with pytest -s)."""
    comparisons = sum(r["comparisons"] for r in interpreted["cases"].values())
    (i_wall, i_cpu), (c_wall, c_cpu) = PHASES["interpret"], PHASES["compile"]
    print(
        f"\ntriton twins: {len(interpreted['cases'])} cases, {comparisons} tensor comparisons under TRITON_INTERPRET=1 "
        f"({i_wall:.0f} s wall, {i_cpu:.0f} s CPU); {len(compiled)} kernel specializations compiled for sm_90 "
        f"({c_wall:.0f} s wall, {c_cpu:.0f} s CPU)"
    )
    assert comparisons >= len(interpreted["cases"])
