"""Wire form of a message: [msgpack header, *raw tensor frames].

A tensor travels as its own frame (no copy on send for contiguous CPU tensors, none on
receive) and the header names it with a `TensorRef(dtype, shape, frame)`. Pickle is never used.
"""

from __future__ import annotations

import array
import warnings
from typing import Any, Generic, Sequence, TypeVar

import msgspec
import torch

from himamba.common.messages import TensorRef

T = TypeVar("T")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# memoryview formats of the integer dtypes `get_ints` reads (native byte order, as the frames carry).
_INT_FORMATS = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B"}


class WireError(ValueError):
    """A message that cannot be decoded; the text says what is wrong."""


_encoder = msgspec.msgpack.Encoder()


def tensor_ref(t: torch.Tensor, frame: int) -> TensorRef:
    if t.dtype not in _NAMES:
        raise ValueError(f"dtype {t.dtype} cannot cross the wire")
    return TensorRef(dtype=_NAMES[t.dtype], shape=tuple(t.shape), frame=frame)


def tensor_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a tensor (copied once to CPU/contiguous if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class IntsFrame:
    """A 1-D int64 tensor built from a Python list without torch: a step's token ids and page
    deltas are a few hundred integers, and `torch.tensor(list)` costs several times more than the
    list itself on the scheduler's per-step path."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[int]) -> None:
        self.values = array.array("q", values)

    def ref(self, frame: int) -> TensorRef:
        return TensorRef(dtype="int64", shape=(len(self.values),), frame=frame)


Frame = torch.Tensor | IntsFrame


def encode(msg: Any, tensors: Sequence[Frame] = ()) -> list[Any]:
    """Frames for `msg`; `tensors[i]` must be referenced in msg as TensorRef(frame=i)."""
    return [
        _encoder.encode(msg),
        *(memoryview(t.values).cast("B") if isinstance(t, IntsFrame) else tensor_frame(t) for t in tensors),
    ]


class Decoder(Generic[T]):
    """Typed decoder for one inbox: a message from the wrong direction is an error."""

    def __init__(self, type_: type[T]):
        self._dec = msgspec.msgpack.Decoder(type_)

    def decode(self, frames: Sequence[Any]) -> tuple[T, list[Any]]:
        if not frames:
            raise WireError("empty message")
        header = frames[0]
        buf = header.buffer if hasattr(header, "buffer") else header
        try:
            msg = self._dec.decode(buf)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            # msgspec raises UnicodeDecodeError for invalid UTF-8 in a string field
            raise WireError(f"undecodable message: {e}") from None
        except RecursionError:  # containers nested deeper than the interpreter's stack allows
            raise WireError("undecodable message: nested too deeply") from None
        return msg, list(frames[1:])


def get_tensor(frames: Sequence[Any], ref: TensorRef) -> torch.Tensor:
    """Materialise a TensorRef from the received frames (zero copy; read-only memory)."""
    if ref.dtype not in _DTYPES:
        raise WireError(f"unknown dtype {ref.dtype!r}")
    if not (0 <= ref.frame < len(frames)):
        raise WireError(f"tensor frame {ref.frame} missing ({len(frames)} frames)")
    frame = frames[ref.frame]
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    dtype = _DTYPES[ref.dtype]
    numel = 1
    for d in ref.shape:
        numel *= d
    if len(buf) != numel * dtype.itemsize:
        raise WireError(f"tensor frame {ref.frame} has {len(buf)} bytes, expected {numel * dtype.itemsize}")
    if numel == 0:
        return torch.empty(ref.shape, dtype=dtype)
    with warnings.catch_warnings():
        # zmq frames are read-only; we never write into received tensors
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(dtype).reshape(ref.shape)


def get_ints(frames: Sequence[Any], ref: TensorRef) -> Sequence[int]:
    """The integers of a TensorRef as a host sequence (a memoryview of the frame: zero copy), for
    values the host itself must read, such as the pages a worker checks before it uses them: no
    tensor op, so nothing a step on a GPU would count as waiting for the device."""
    if ref.dtype not in _INT_FORMATS:
        raise WireError(f"expected an integer tensor, got dtype {ref.dtype!r}")
    get_tensor(frames, ref)  # the frame and its size, checked as for a tensor
    frame = frames[ref.frame]
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return memoryview(buf).cast("B").cast(_INT_FORMATS[ref.dtype])
