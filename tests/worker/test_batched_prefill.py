"""A prefill batch of several sequences runs one varlen call per layer op; it must give what the same
sequences give prefilled one by one (logits, KV, every state slot), and each capture must equal the
state of a prefill of exactly that prefix: at page boundaries, one token either side, and inside scan
chunks, including a sequence that continues a cached prefix.

On the CPU path here, twice: with the kernels the environment selects (the native varlen kernels where
they take the tensors) and with the PyTorch references (`kernels/segmented.py`'s loop); and, for two
families, on the CUDA path (the Triton varlen twins under TRITON_INTERPRET=1), in a subprocess that runs this
module's CPU test with the environment that selects it, so this process never imports triton.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from himamba.kernels import dispatch
from himamba.kernels.dispatch import CUDA_PATH_ENV, KERNELS_ENV
from himamba.services.worker.forward_batch import Capture
from himamba.services.worker.loader import load_model
from tests.worker.harness import Harness
from tests.worker.hf_reference import save_tiny

# Mamba2 + MoE + attention, gated DeltaNet, Mamba1, short conv.
ARCHS = ["NemotronH", "Qwen3Next", "Jamba", "Lfm2"]
PAGE = 16
PREFIX = 17  # sequence 1 continues a cached prefix of 17 tokens
LENS = [7, 23, 40]  # new tokens of this step
# (offset into the step's new tokens): sequence 1's 15 is its page boundary 32, 14 and 16 either side;
# sequence 2's 16 a page boundary, 15 and 17 either side, 37 inside its last chunk.
OFFSETS = [[3], [5, 14, 15, 16], [1, 15, 16, 17, 37]]
TOL = {"rtol": 2e-4, "atol": 2e-4}


@pytest.fixture(params=["default", "reference"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Each test with the kernels the environment selects, then with the PyTorch references."""
    if request.param == "reference":
        monkeypatch.setenv(KERNELS_ENV, "reference")
    dispatch.kernels_mode.cache_clear()
    yield request.param
    monkeypatch.undo()
    dispatch.kernels_mode.cache_clear()


def _prompts() -> list[list[int]]:
    return [[(11 * i + 7 * j) % 90 + 3 for j in range((PREFIX if i == 1 else 0) + n)] for i, n in enumerate(LENS)]


def _model(arch: str, tmp: Path):
    return load_model(save_tiny(arch, tmp / arch), dtype=torch.float32)


def _harness(model) -> tuple[Harness, list, list[list[Capture]]]:
    h = Harness(model, page_size=PAGE, num_pages=64, num_state_slots=24, seed=3)
    seqs = [h.new_sequence() for _ in LENS]
    captures = [[Capture(o, h.alloc_state_slot()) for o in offs] for offs in OFFSETS]
    h.prefill([seqs[1]], [_prompts()[1][:PREFIX]])  # the cached prefix
    return h, seqs, captures


def _new_tokens() -> list[list[int]]:
    return [p[-n:] for p, n in zip(_prompts(), LENS, strict=True)]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_equals_its_sequences_one_by_one(arch: str, tmp_path: Path) -> None:
    model = _model(arch, tmp_path)
    together, seqs, captures = _harness(model)
    batched = together.prefill(seqs, _new_tokens(), captures)

    alone, seqs1, captures1 = _harness(model)
    assert captures1 == captures  # the same slots and pages, taken in the same order
    rows = [alone.prefill([s], [t], [c])[0] for s, t, c in zip(seqs1, _new_tokens(), captures1, strict=True)]

    torch.testing.assert_close(batched, torch.stack(rows), **TOL)
    for got, want in zip(together.state.tensors, alone.state.tensors, strict=True):
        for name in got:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=f"state {name}")
    for got, want in zip(together.kv.k + together.kv.v, alone.kv.k + alone.kv.v, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("arch", ARCHS)
def test_each_capture_is_the_state_of_exactly_that_prefix(arch: str, tmp_path: Path) -> None:
    model = _model(arch, tmp_path)
    h, seqs, captures = _harness(model)
    h.prefill(seqs, _new_tokens(), captures)
    for i, caps in enumerate(captures):
        for cap in caps:
            fresh = Harness(model, page_size=PAGE, num_pages=64, num_state_slots=4, seed=5)
            seq = fresh.new_sequence()
            fresh.prefill([seq], [_prompts()[i][: (PREFIX if i == 1 else 0) + cap.offset]])
            for got, want in zip(h.read_state(cap.slot), fresh.read_state(seq.state_slot), strict=True):
                for name in got:
                    torch.testing.assert_close(got[name], want[name], **TOL, msg=f"seq {i} offset {cap.offset} {name}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_same_on_the_cuda_path_under_the_interpreter() -> None:
    """The tests above for two families with the Triton varlen twins (one launch per op)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_INTERPRET": "1", KERNELS_ENV: "triton", CUDA_PATH_ENV: "1"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    # Within the CI budget: both tests for NemotronH, the batch test for Qwen3Next.
    selection = "NemotronH or (Qwen3Next and batch_equals)"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            f"not cuda_path and default and ({selection})",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]
