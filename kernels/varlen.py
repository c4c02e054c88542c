"""Where each sequence of a packed prefill batch lies, as the varlen kernels read it.

A varlen prefill runs the new tokens of every sequence of a step, concatenated along one token axis,
through one call per layer (vLLM's `query_start_loc` / `cu_seqlens`): sequence b's tokens are
[cu_seqlens[b], cu_seqlens[b + 1]). A recurrent op starts sequence b from its pool slot
`state_slots[b]` when `has_initial[b]` (a cached prefix) or from zeros, writes its state after each
capture offset into that capture's slot, and its final state back into `state_slots[b]`.

Everything here is built on the host from host lists and copied to the device in one transfer per
step, so a kernel never makes the host wait to learn a length.

The ops assume what the cache controller guarantees: the slots of one step (every sequence's state slot
and every capture slot) are distinct. A slot one sequence writes and another starts from would be read
before or after the write depending on the kernel and its threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class Varlen(NamedTuple):
    """A packed prefill batch's layout: host values (for grids and the CPU segment loop) and their
    device copies (for the kernels)."""

    new_lens: tuple[int, ...]  # [B] new tokens per sequence
    prefix_lens: tuple[int, ...]  # [B] tokens before them (cached KV / state in the slot)
    # Per sequence, (offset, slot) sorted by offset, 1 <= offset <= new_len: copy the state after
    # `offset` new tokens into `slot` (at new_len: a copy of the final state).
    captures: tuple[tuple[tuple[int, int], ...], ...]
    cu_seqlens: Tensor  # [B + 1] int64
    prefix: Tensor  # [B] int64, prefix_lens on the device
    cu_captures: Tensor  # [B + 1] int64: sequence b's captures are [cu_captures[b], cu_captures[b + 1])
    # [C + 1] int64 each: the captures of every sequence in order, then one unused entry, so a kernel
    # may read the entry after a sequence's last capture without a masked scalar load.
    capture_offsets: Tensor
    capture_slots: Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    @property
    def max_len(self) -> int:
        return max(self.new_lens, default=0)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)


class HostIndex(NamedTuple):
    """A layout's index arrays as int64 CPU tensors (views of one), built from its host tuples: what a
    native CPU kernel reads, so that it reads exactly what the arguments were checked against."""

    cu_seqlens: Tensor  # [B + 1]
    prefix: Tensor  # [B]
    cu_captures: Tensor  # [B + 1]
    capture_offsets: Tensor  # [C + 1], the last unused
    capture_slots: Tensor  # [C + 1], the last unused


def _checked_captures(
    new_lens: Sequence[int], prefix_lens: Sequence[int], captures: Sequence[Sequence[tuple[int, int]]]
) -> list[tuple[tuple[int, int], ...]]:
    if len(prefix_lens) != len(new_lens) or (captures and len(captures) != len(new_lens)):
        raise ValueError(f"{len(new_lens)} sequences, {len(prefix_lens)} prefix lengths, {len(captures)} capture lists")
    if any(int(n) < 0 for n in new_lens) or any(int(p) < 0 for p in prefix_lens):
        raise ValueError(f"lengths must be >= 0, got new {list(new_lens)} after prefixes {list(prefix_lens)}")
    caps: list[tuple[tuple[int, int], ...]] = []
    for b, n in enumerate(new_lens):
        got = tuple(sorted((int(o), int(s)) for o, s in (captures[b] if captures else ())))
        if any(not (1 <= o <= n) for o, _ in got):
            raise ValueError(f"sequence {b}: capture offsets must lie in 1..{n}, got {[o for o, _ in got]}")
        caps.append(got)
    return caps


def _packed(new_lens: Sequence[int], prefix_lens: Sequence[int], caps: Sequence[tuple[tuple[int, int], ...]]) -> Tensor:
    """cu_seqlens, prefix lengths, cu_captures, capture offsets (+ -1), capture slots (+ 0): one int64 CPU tensor."""
    cu_seqlens = [0]
    for n in new_lens:
        cu_seqlens.append(cu_seqlens[-1] + int(n))
    cu_captures = [0]
    for c in caps:
        cu_captures.append(cu_captures[-1] + len(c))
    flat_caps = [o for c in caps for o, _ in c] + [-1] + [s for c in caps for _, s in c] + [0]
    return torch.tensor(cu_seqlens + [int(p) for p in prefix_lens] + cu_captures + flat_caps, dtype=torch.int64)


def _views(packed: Tensor, num: int, total_caps: int) -> HostIndex:
    a, b, c = num + 1, 2 * num + 1, 3 * num + 2
    return HostIndex(packed[:a], packed[a:b], packed[b:c], packed[c : c + total_caps + 1], packed[c + total_caps + 1 :])


def host_index(v: Varlen) -> HostIndex:
    """`v`'s index arrays rebuilt on the host from its host tuples, checked as `make_varlen` checks them."""
    caps = _checked_captures(v.new_lens, v.prefix_lens, v.captures)
    return _views(_packed(v.new_lens, v.prefix_lens, caps), len(v.new_lens), sum(len(c) for c in caps))


def make_varlen(
    new_lens: Sequence[int],
    prefix_lens: Sequence[int],
    captures: Sequence[Sequence[tuple[int, int]]],
    device: torch.device,
) -> Varlen:
    """The layout of a packed batch; `captures[b]` lists (offset, slot) pairs of sequence b (any order;
    negative lengths, and offsets outside 1..new_len, are refused)."""
    caps = _checked_captures(new_lens, prefix_lens, captures)
    dev = _views(
        _packed(new_lens, prefix_lens, caps).to(device, non_blocking=True),  # one copy for the whole step
        len(new_lens),
        sum(len(c) for c in caps),
    )
    return Varlen(
        new_lens=tuple(int(n) for n in new_lens),
        prefix_lens=tuple(int(p) for p in prefix_lens),
        captures=tuple(caps),
        cu_seqlens=dev.cu_seqlens,
        prefix=dev.prefix,
        cu_captures=dev.cu_captures,
        capture_offsets=dev.capture_offsets,
        capture_slots=dev.capture_slots,
    )


def host_slots(state_slots: Tensor, v: Varlen) -> Tensor:
    """The sequences' state slots as a native CPU kernel reads them: a contiguous [B] int64 CPU tensor;
    ValueError otherwise (as the segment loop refuses them)."""
    if (
        state_slots.dtype != torch.int64
        or state_slots.device.type != "cpu"
        or tuple(state_slots.shape) != (v.num_seqs,)
    ):
        raise ValueError(
            f"state_slots must be a [{v.num_seqs}] int64 CPU tensor, got {state_slots.dtype} "
            f"{tuple(state_slots.shape)} on {state_slots.device}"
        )
    return state_slots.contiguous()
