"""Counting a step's GPU kernel launches and host syncs, on any device.

Run on CPU tensors with HIMAMBA_KERNELS=triton, TRITON_INTERPRET=1 and HIMAMBA_CUDA_PATH=1
(`dispatch.cuda_path`), a step takes the code path a GPU would, so what `LaunchCount` sees is what
a GPU would run:

- launches: every Triton kernel launch (the interpreter's `InterpretedFunction.run`, whose own
  hooks do not fire under TRITON_INTERPRET; its internals are not counted), plus every aten op
  that would launch a CUDA kernel: all ops the dispatcher sees but views (`OpOverload.is_view`) and
  allocations (`ALLOCATIONS`).
- syncs: ops that make the host wait for the device (`SYNC_OPS`: a scalar read, `nonzero`,
  `equal`, `bincount`, ...; an `index`/`index_put_` with a boolean mask, which runs `nonzero`),
  and the host reads the dispatcher does not see (`Tensor.tolist`, `.numpy`, `.cpu`). Each is
  recorded with the line of ours that asked for it.

What this cannot see on CPU tensors: a `.to("cpu")` (a no-op there) and host-to-device copies
that would wait (`torch.tensor(values, device=cuda)`; `host_values` in penalties.py avoids them).
"""

from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NamedTuple, Self

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense.default,
        aten.item.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten.equal.default,
        aten.is_nonzero.default,
        aten.bincount.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
        aten.unique_dim.default,
        aten.repeat_interleave.Tensor,
        aten.repeat_interleave.self_Tensor,
    }
)
ALLOCATIONS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
_MASKED_INDEXING = frozenset({aten.index.Tensor, aten.index_put_.default, aten.index_put.default})
_HOST_READS = ("tolist", "numpy", "cpu")


class Sync(NamedTuple):
    """One place where the host would wait for the device."""

    op: str
    where: str  # file:line of the first frame of ours (not torch's, not this file's)


class StepCount(NamedTuple):
    launches: int  # aten ops that launch a kernel + Triton launches
    triton_launches: int
    syncs: list[Sync]
    ops: dict[str, int]  # launches by op name (Triton kernels as "triton:<name>")


def _ours() -> str:
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if "/torch/" in name or "/triton/runtime" in name or name == __file__ or name.endswith("launch_count.py"):
            continue
        return f"{name.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _has_mask(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class LaunchCount(TorchDispatchMode):
    """`with LaunchCount() as count: ...`, then `count.result()`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.triton = 0
        self.syncs: list[Sync] = []
        self._restore: list[Callable[[], None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in SYNC_OPS or (func in _MASKED_INDEXING and _has_mask(args)):
            self.syncs.append(Sync(str(func.overloadpacket.__name__), _ours()))
        elif not func.is_view and func not in ALLOCATIONS:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> Self:
        self._patch_host_reads()
        self._patch_triton()
        return super().__enter__()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        super().__exit__(kind, value, tb)
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()

    def result(self) -> StepCount:
        return StepCount(sum(self.ops.values()), self.triton, list(self.syncs), dict(self.ops))

    def _patch(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        had = name in vars(owner)
        original = vars(owner).get(name)
        setattr(owner, name, wrapper)

        def restore() -> None:
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._restore.append(restore)

    def _patch_host_reads(self) -> None:
        for name in _HOST_READS:
            method = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
                self.syncs.append(Sync(_name, _ours()))
                with _disable_current_modes():
                    return _method(t, *args, **kwargs)

            self._patch(torch.Tensor, name, read)

    def _patch_triton(self) -> None:
        if os.environ.get("TRITON_INTERPRET") != "1":  # no Triton launches on CPU tensors
            return
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run

        def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
            self.triton += 1
            self.ops[f"triton:{fn.fn.__name__}"] += 1
            # The interpreter moves arguments through numpy with torch ops of its own: not launches.
            with _disable_current_modes():
                return original(fn, *args, **kwargs)

        self._patch(InterpretedFunction, "run", run)
