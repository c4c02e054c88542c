"""The worker's tensor-parallel group: which rank of how many this process is, its collectives, and how a
layer's parameters take their shard of a checkpoint tensor.

Layers read `group()` when they are built: with size 1 (every server without --tensor-parallel-size)
they build the whole model and every collective returns its input untouched. With size N each layer
builds its own share (heads, channels, intermediate rows) and marks each sharded parameter with a
`Shard` that `weight_loading` applies to the full checkpoint tensor; a row-parallel projection sums the
ranks' partial outputs with one all-reduce (`all_reduce`), a vocab-parallel head gathers its logits.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist


class Group(NamedTuple):
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1


class CollectiveTime:
    """Seconds spent in collectives since the last `reset` (the bench's all-reduce share)."""

    seconds = 0.0
    calls = 0

    @classmethod
    def reset(cls) -> None:
        cls.seconds, cls.calls = 0.0, 0


_group = Group()
_control: object | None = None  # the gloo group for objects beside NCCL; None: the default group


def group() -> Group:
    """The current group (rank 0 of 1 unless `init_group` or `use_group` set another)."""
    return _group


def use_group(g: Group) -> None:
    """Set the group layers see when built (the process group itself is `init_group`'s)."""
    global _group
    _group = g


def init_group(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 600.0) -> Group:
    """Join the process group (gloo on the CPU, NCCL on CUDA) and make it the current group."""
    global _control
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    _control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    use_group(Group(rank, size))
    return _group


def threads_per_rank(size: int) -> int:
    """Torch threads for each of `size` ranks sharing this machine's cores: torch's default (the cores
    this process may run on, or OMP_NUM_THREADS), split; not os.cpu_count(), the host's count even in a
    container pinned to a few."""
    return max(1, torch.get_num_threads() // size)


def control_group() -> object | None:
    """The group that carries Python objects (messages, outcomes): gloo, on the CPU, whatever the device."""
    return _control


def close_group() -> None:
    """Leave the process group, if this process joined one."""
    global _control
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _control = None
    use_group(Group())


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x` (in place); `x` itself on a group of one."""
    if _group.size == 1:
        return x
    t0 = time.perf_counter()
    dist.all_reduce(x)
    CollectiveTime.seconds += time.perf_counter() - t0
    CollectiveTime.calls += 1
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension, in rank order."""
    if _group.size == 1:
        return x
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous())
    CollectiveTime.seconds += time.perf_counter() - t0
    CollectiveTime.calls += 1
    return torch.cat(parts, dim=-1)


# A parameter's shard of its full checkpoint tensor: (full tensor, group) -> this rank's part.
Shard = Callable[[torch.Tensor, Group], torch.Tensor]


def split(dim: int, parts: tuple[int, ...] | None = None, whole: frozenset[int] = frozenset()) -> Shard:
    """Cut `dim` in N equal shares, each of the consecutive `parts` of the full size on its own (a fused
    projection such as Mamba2's [gate | x | B | C | dt]); None: the whole dimension is one part. Parts
    whose index is in `whole` are replicated: every rank keeps all of them (Mamba2's B and C of one group)."""

    def shard(full: torch.Tensor, g: Group) -> torch.Tensor:
        sizes = parts if parts is not None else (full.shape[dim],)
        pieces = []
        for i, part in enumerate(full.split(list(sizes), dim=dim)):
            share = part.shape[dim] if i in whole else part.shape[dim] // g.size
            pieces.append(part if i in whole else part.narrow(dim, g.rank * share, share))
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]

    return shard


def replicated_heads(dim: int, heads: int, head_size: int) -> Shard:
    """The one head (of `heads` < N) this rank uses: KV heads shared by the ranks whose query heads read them."""

    def shard(full: torch.Tensor, g: Group) -> torch.Tensor:
        return full.narrow(dim, (g.rank * heads // g.size) * head_size, head_size)

    return shard


def rank0_only(full: torch.Tensor, g: Group) -> torch.Tensor:
    """A row-parallel projection's bias: added once, by rank 0 (the all-reduce sums the ranks' outputs)."""
    return full if g.rank == 0 else torch.zeros_like(full)


def mark(param: torch.nn.Parameter | None, shard: Shard) -> None:
    """Tell the loader how `param` takes its share (a no-op on a group of one)."""
    if param is not None and _group.size > 1:
        param.tp_shard = shard  # type: ignore[attr-defined]


def divide(total: int, what: str) -> int:
    """total / N; a ValueError naming `what` when N does not divide it (the server refuses to start)."""
    n = _group.size
    if total % n:
        raise ValueError(f"tensor parallelism: {what} ({total}) is not divisible by --tensor-parallel-size {n}")
    return total // n
