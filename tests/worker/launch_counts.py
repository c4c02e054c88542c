"""What a piece of the forward would launch and where it would block the host on a GPU, counted
from a run on CPU tensors that takes the CUDA branches (HIMAMBA_KERNELS=triton with
TRITON_INTERPRET=1: `dispatch.cuda_path` is then true for CPU tensors).

Counted as a **launch**: every Triton kernel launch (the interpreter's `InterpretedFunction.run`,
wrapped, since launch hooks do not fire under the interpreter; the aten ops the interpreter itself
runs to stage its arguments are not counted) and every aten op that would launch a CUDA kernel,
that is every op except views (schema-aliasing ops), metadata and allocation-only ops (`_NO_LAUNCH`).

Counted as a **sync**: every op that on CUDA waits for the device to read a value back:
`_local_scalar_dense` (`item`, `int(t)`, `bool(t)`), `nonzero`, `masked_select`, `bincount`
(sizes its output from the largest value), `unique`, `repeat_interleave` without `output_size`,
indexing with a boolean mask, device-to-host copies, and the Python-level `Tensor.tolist` /
`Tensor.numpy` (which on a CPU tensor reach no aten op).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SYNC_OPS = frozenset(
    {
        aten._local_scalar_dense,
        aten.item,  # what inference mode shows in place of _local_scalar_dense
        aten.nonzero,
        aten.masked_select,
        aten.bincount,
        aten.unique_consecutive,
        aten.unique_dim,
        aten._unique,
        aten._unique2,
        aten.equal,
        aten.is_nonzero,
        aten.allclose,
    }
)

# Ops that launch no kernel: metadata, allocation without a fill, and views whose schema does not
# say so (`func.is_view` covers the rest).
_NO_LAUNCH = frozenset(
    {
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten.new_empty,
        aten.new_empty_strided,
        aten._unsafe_view,
        aten.lift_fresh,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        aten.is_contiguous,
        aten.set_,
    }
)


def _is_bool_index(func: Any, args: tuple) -> bool:
    if func.overloadpacket not in (aten.index, aten.index_put, aten.index_put_):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _is_host_copy(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy that would bring device memory to the host (judged on the devices the CUDA path has:
    a copy to "cpu" of a tensor the path would hold on the device)."""
    if func.overloadpacket is aten._to_copy:
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if func.overloadpacket is aten.copy_:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    packet = func.overloadpacket
    if packet in _SYNC_OPS or _is_bool_index(func, args) or _is_host_copy(func, args, kwargs):
        return True
    # repeat_interleave(Tensor repeats) must read the repeats to size its output, unless told.
    return packet is aten.repeat_interleave and kwargs.get("output_size") is None and len(args) < 3


class LaunchCounter(TorchDispatchMode):
    """Counts launches and syncs (module docstring) while active; `syncs` names each sync."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.triton_launches = 0
        self.syncs: list[str] = []
        self._staging = 0  # > 0 while the Triton interpreter runs a kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not self._staging:
            if _is_sync(func, args, kwargs):
                self.syncs.append(str(func))
            if not (func.is_view or func.overloadpacket in _NO_LAUNCH):
                self.launches += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def _kernel(self) -> Iterator[None]:
        self.launches += 1
        self.triton_launches += 1
        self._staging += 1
        try:
            yield
        finally:
            self._staging -= 1


@contextlib.contextmanager
def counting() -> Iterator[LaunchCounter]:
    """A LaunchCounter active over the block, with Triton's interpreter launches and the Python-level
    host reads (`tolist`, `numpy`) counted too."""
    from triton.runtime.interpreter import InterpretedFunction

    counter = LaunchCounter()
    run, tolist, numpy = InterpretedFunction.run, torch.Tensor.tolist, torch.Tensor.numpy

    def counted_run(self, *args, grid, warmup, **kwargs):
        with counter._kernel():
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def host_read(method):
        def read(tensor, *args, **kwargs):
            if not counter._staging:
                counter.syncs.append(f"Tensor.{method.__name__}")
            return method(tensor, *args, **kwargs)

        return read

    InterpretedFunction.run = counted_run
    torch.Tensor.tolist, torch.Tensor.numpy = host_read(tolist), host_read(numpy)
    try:
        with counter:
            yield counter
    finally:
        InterpretedFunction.run = run
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
