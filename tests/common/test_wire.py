from __future__ import annotations

import pytest
import torch

from himamba.common import messages as m
from himamba.common.wire import Decoder, WireError, encode, get_tensor, tensor_ref


def _roundtrip(msg, tensors, union):
    frames = [bytes(f) for f in encode(msg, tensors)]
    return Decoder(union).decode(frames)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_tensors_travel_as_raw_frames(dtype):
    t = (torch.arange(24) * 3).to(dtype).reshape(2, 3, 4)
    msg = m.BatchDone(batch_id=7, next_tokens=[1], logits=tensor_ref(t, 0))
    got, frames = _roundtrip(msg, [t], m.ToScheduler)
    assert got == msg
    assert len(frames) == 1 and len(frames[0]) == t.numel() * t.element_size()
    assert torch.equal(get_tensor(frames, got.logits), t)


def test_wrong_direction_and_garbage_are_errors():
    with pytest.raises(WireError, match="Invalid value 'BatchDone'"):
        _roundtrip(m.BatchDone(batch_id=1, next_tokens=[]), [], m.ToWorker)
    with pytest.raises(WireError):
        Decoder(m.ToWorker).decode([b"\x93garbage"])


def test_truncated_tensor_frame_is_an_error():
    t = torch.ones(4)
    ref = tensor_ref(t, 0)
    with pytest.raises(WireError, match="expected 16"):
        get_tensor([b"\x00" * 8], ref)
    with pytest.raises(WireError, match="missing"):
        get_tensor([], ref)
