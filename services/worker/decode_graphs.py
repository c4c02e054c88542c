"""CUDA graphs of the decode forward: captured once per padded batch size at start-up, replayed each step.

Eager decode on a GPU is launch-bound: the host takes as long to enqueue a step's few hundred kernels as
the GPU takes to run them (an 8B-shaped Nemotron-H on an H200: 54 tok/s eager, 194 from a graph, at batch
1; docs/results/2026-11-28-h200). A graph replays a captured step with one launch, but reads its inputs
from the addresses it was captured with, so every decode input lives here in static buffers sized for the
largest captured batch:

    input_ids, positions, write_slots, seq_lens, state_slots  [max_batch]
    slot_table                                                [max_batch, max_len]

A step of B sequences copies its inputs into rows [0, B) and replays the graph of the smallest captured
size >= B. Rows [B, size) are padding: token 0 at position 0, one token of context in a scratch KV slot,
and a scratch state slot, both past the controller's pools (the worker allocates them and never hands
them out), so padding never touches a real sequence. Larger batches, and batches that want other rows'
logits (prompt logprobs), run eagerly.

Without CUDA (`capture=False`) the same buffers run eagerly, which is how the CPU tests check the
buffer and padding logic that the graphs replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.models.base import HybridModel
from himamba.services.worker.pools import KVPool, StatePool

_log = logging.getLogger("himamba.worker")


def capture_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes to capture (sglang's spacing): 1, 2, 4, 8, then every 8 up to 64, every
    16 up to 256, every 32 beyond; the last is max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)
    return [*sizes, max_batch]


class Scratch(NamedTuple):
    """Pool rows the worker keeps for padding: never a page or slot id the controller hands out."""

    token_slot: int  # a KV-pool token slot
    state_slot: int  # a state-pool slot


class CaptureReport(NamedTuple):
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool holds after capture


class DecodeGraphs:
    """Static decode buffers and, on CUDA, one captured graph of `model.forward` per padded size."""

    def __init__(
        self,
        model: HybridModel,
        kv: KVPool,
        state: StatePool,
        scratch: Scratch,
        max_batch: int,
        max_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv, self.state, self.scratch = model, kv, state, scratch
        self.max_len = max_len
        self.sizes = capture_sizes(max_batch)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.write_slots = torch.full((max_batch,), scratch.token_slot, **i64)
        self.seq_lens = torch.ones(max_batch, **i64)
        self.state_slots = torch.full((max_batch,), scratch.state_slot, **i64)
        self.slot_table = torch.full((max_batch, max_len), scratch.token_slot, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _batch(self, size: int) -> ForwardBatch:
        """The model's view of the first `size` rows of the buffers."""
        return ForwardBatch(
            mode="decode",
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            new_lens=[1] * size,
            prefix_lens=[1] * size,  # host-side checks only: the decode kernels read seq_lens
            write_slots=self.write_slots[:size],
            slot_table=self.slot_table[:size],
            seq_lens=self.seq_lens[:size],
            state_slots=self.state_slots[:size],
        )

    def capture(self, progress: Callable[[str], None] | None = None) -> CaptureReport:
        """Capture every size, largest first (the smaller graphs reuse its memory pool)."""
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                batch = self._batch(size)
                for _ in range(2):  # compiles the Triton kernels and settles the allocator before capture
                    self.model.forward(batch, self.kv, self.state)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self.model.forward(batch, self.kv, self.state)
                self.graphs[size] = graph
                if progress is not None:
                    progress(f"captured decode batch {size} ({len(self.graphs)}/{len(self.sizes)})")
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # The warm-ups and captures ran padding through the scratch slot: leave it as it was made.
        self.state.zero(torch.tensor([self.scratch.state_slot], device=self.input_ids.device))
        return CaptureReport(sorted(self.sizes), time.perf_counter() - t0, torch.cuda.memory_reserved() - before)

    def padded_size(self, batch: ForwardBatch) -> int | None:
        """The size this batch runs at, or None when it runs eagerly."""
        b = len(batch.new_lens)
        if batch.mode != "decode" or batch.logit_rows is not None or b > self.sizes[-1]:
            return None
        if batch.slot_table is None or batch.slot_table.shape[1] > self.max_len:
            return None
        return next(s for s in self.sizes if s >= b)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode batch from its graph (or, without graphs, from the buffers);
        None when the batch runs eagerly instead (see `padded_size`)."""
        size = self.padded_size(batch)
        if size is None:
            return None
        b, width = len(batch.new_lens), batch.slot_table.shape[1]
        assert batch.seq_lens is not None and batch.state_slots is not None
        self._fill(b, size, width, batch)
        if size in self.graphs:
            self.graphs[size].replay()
            # The graph's output buffer is overwritten by the next replay: the caller gets its own copy.
            return self.outputs[size][:b].clone()
        return self.model.forward(self._batch(size), self.kv, self.state)[:b]

    def _fill(self, b: int, size: int, width: int, batch: ForwardBatch) -> None:
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.write_slots[:b].copy_(batch.write_slots)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.state_slots[:b].copy_(batch.state_slots)
        self.slot_table[:b, :width].copy_(batch.slot_table)
        if b < size:  # padding rows: whatever an earlier, larger step left there goes
            for t, value in (
                (self.input_ids, 0),
                (self.positions, 0),
                (self.write_slots, self.scratch.token_slot),
                (self.seq_lens, 1),
                (self.state_slots, self.scratch.state_slot),
            ):
                t[b:size].fill_(value)
            self.slot_table[b:size, 0].fill_(self.scratch.token_slot)


def scratch_rows(num_pages: int, page_size: int, num_slots: int) -> Scratch:
    """The scratch rows of pools allocated one page and one slot larger than the controller's."""
    return Scratch(token_slot=num_pages * page_size, state_slot=num_slots)


def describe_capture(report: CaptureReport) -> str:
    sizes: Sequence[int] = report.sizes
    return (
        f"CUDA graphs: decode captured for {len(sizes)} batch sizes ({sizes[0]}..{sizes[-1]}) in "
        f"{report.seconds:.1f}s, {report.memory_bytes / 2**20:.0f} MiB"
    )
