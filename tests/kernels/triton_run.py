"""Runs the Triton twins' cases in a process of their own: `python triton_run.py interpret|compile OUT`.

`interpret` (with TRITON_INTERPRET=1 set by the caller before anything imports triton) runs every
case of `triton_cases` against the references on CPU, writes one JSON result per case, and records
each kernel launch's specialization (argument types and constexprs). `compile` (no interpreter)
compiles each recorded specialization ahead of time for a CUDA sm_90 target, which needs no GPU:
the interpreter accepts shapes the GPU compiler rejects (tl.dot dimensions under 16, ...).

The test module `test_triton_twins.py` starts this file so that the pytest process itself never
imports triton.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.worker`

import torch

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
}


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no triton type for a kernel argument of type {type(value).__name__}")


def _recorder(specs: dict[str, dict]):
    """Wrap InterpretedFunction.run so that every launch records its specialization in `specs`."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        names = list(params)
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in params}
        signature, constexprs = {}, {}
        for name in names:
            if "constexpr" in str(params[name].annotation):
                signature[name] = "constexpr"
                constexprs[name] = bound[name]
            else:
                signature[name] = _arg_type(bound[name])
        spec = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": signature,
                "constexprs": constexprs}  # fmt: skip
        specs[json.dumps(spec, sort_keys=True)] = spec
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def interpret(out: Path) -> None:
    import triton_cases

    specs: dict[str, dict] = {}
    _recorder(specs)
    results = {}
    for case in triton_cases.CASES:
        start = time.perf_counter()
        try:
            comparisons = case.run()
            results[case.id] = {"comparisons": comparisons, "error": None}
        except Exception:  # noqa: BLE001  (any failure is that case's result, reported by the test module)
            results[case.id] = {"comparisons": 0, "error": traceback.format_exc()}
        results[case.id]["seconds"] = round(time.perf_counter() - start, 3)
    out.write_text(json.dumps({"cases": results, "specs": list(specs.values())}))


def _compile_one(spec: dict) -> dict:
    """Compile one recorded specialization for sm_90; the result (or the error) as a JSON-able dict."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    result = {"kernel": f"{spec['module'].rsplit('.', 1)[-1]}.{spec['kernel']}", "constexprs": spec["constexprs"]}
    try:
        source = triton.compiler.ASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"])
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        return result | {"cubin_bytes": len(compiled.asm["cubin"]), "error": None}
    except Exception:  # noqa: BLE001  (a kernel that does not compile is reported, the others still run)
        return result | {"cubin_bytes": 0, "error": traceback.format_exc()}


def compile_specs(spec_file: Path, out: Path) -> None:
    """Compile every recorded specialization, on all cores (CI has 2): each compile is independent."""
    from concurrent.futures import ProcessPoolExecutor

    specs = json.loads(spec_file.read_text())["specs"]
    with ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(_compile_one, specs))
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    mode, target_file = sys.argv[1], Path(sys.argv[2])
    if mode == "interpret":
        interpret(target_file)
    elif mode == "compile":
        compile_specs(Path(sys.argv[3]), target_file)
    else:
        raise SystemExit(f"mode must be interpret or compile, got {mode!r}")
