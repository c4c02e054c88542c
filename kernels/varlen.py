"""Where each sequence of a packed prefill batch lies, as the varlen kernels read it.

A varlen prefill runs the new tokens of every sequence of a step, concatenated along one token axis,
through one call per layer (vLLM's `query_start_loc` / `cu_seqlens`): sequence b's tokens are
[cu_seqlens[b], cu_seqlens[b + 1]). A recurrent op starts sequence b from its pool slot
`state_slots[b]` when `has_initial[b]` (a cached prefix) or from zeros, writes its state after each
capture offset into that capture's slot, and its final state back into `state_slots[b]`.

Everything here is built on the host from host lists and copied to the device in one transfer per
step, so a kernel never makes the host wait to learn a length.
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


def make_varlen(
    new_lens: Sequence[int],
    prefix_lens: Sequence[int],
    captures: Sequence[Sequence[tuple[int, int]]],
    device: torch.device,
) -> Varlen:
    """The layout of a packed batch; `captures[b]` lists (offset, slot) pairs of sequence b (any order;
    offsets outside 1..new_len are refused)."""
    if len(prefix_lens) != len(new_lens) or (captures and len(captures) != len(new_lens)):
        raise ValueError(f"{len(new_lens)} sequences, {len(prefix_lens)} prefix lengths, {len(captures)} capture lists")
    caps: list[tuple[tuple[int, int], ...]] = []
    for b, n in enumerate(new_lens):
        got = tuple(sorted((int(o), int(s)) for o, s in (captures[b] if captures else ())))
        if any(not (1 <= o <= n) for o, _ in got):
            raise ValueError(f"sequence {b}: capture offsets must lie in 1..{n}, got {[o for o, _ in got]}")
        caps.append(got)
    num = len(new_lens)
    cu_seqlens = [0]
    for n in new_lens:
        cu_seqlens.append(cu_seqlens[-1] + int(n))
    cu_captures = [0]
    for c in caps:
        cu_captures.append(cu_captures[-1] + len(c))
    flat_caps = [o for c in caps for o, _ in c] + [-1] + [s for c in caps for _, s in c] + [0]
    host = torch.tensor(cu_seqlens + [int(p) for p in prefix_lens] + cu_captures + flat_caps, dtype=torch.int64)
    dev = host.to(device, non_blocking=True)  # one copy for the whole step
    a, b_, c_ = num + 1, 2 * num + 1, 3 * num + 2
    total_caps = cu_captures[-1]
    return Varlen(
        new_lens=tuple(int(n) for n in new_lens),
        prefix_lens=tuple(int(p) for p in prefix_lens),
        captures=tuple(caps),
        cu_seqlens=dev[:a],
        prefix=dev[a:b_],
        cu_captures=dev[b_:c_],
        capture_offsets=dev[c_ : c_ + total_caps + 1],
        capture_slots=dev[c_ + total_caps + 1 : c_ + 2 * total_caps + 2],
    )
