"""Test-only fault injection for a served model: on PYTHONPATH (tests/hostile/conftest.py puts it
there for the hostile server's processes), it wraps the worker's `sampler.sample` so that rows
whose seed is NAN_SEED get NaN logits, as a faulty kernel would give them. The production sampler
has no hook: this module exists only in the test tree."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

NAN_SEED = 424242
_TARGET = "himamba.services.worker.sampler"


def _poisoning(sample: Any) -> Any:
    def sample_with_nan_rows(logits: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if any(p.seed == NAN_SEED for p in params):
            logits = logits.float().clone()
            for i, p in enumerate(params):
                if p.seed == NAN_SEED:
                    logits[i] = float("nan")
        return sample(logits, params, *args, **kwargs)

    return sample_with_nan_rows


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps `sample` as the sampler module is first imported, before anyone binds the name."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            module.sample = _poisoning(module.sample)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _WrapOnImport())
