"""How the worker's ranks stay in step under tensor parallelism: rank 0 (the `worker` service, the one the
scheduler and the cache controller talk to) hands each message that changes device state to ranks
1..N-1 through the torch.distributed group, and the followers run it exactly as rank 0 does.

Why a broadcast through the group rather than a ZeroMQ fan-out (or every rank subscribing): a step's
collectives (all-reduces, the head's all-gather) must run in the same order on every rank, and a
broadcast in that same group orders the messages with them by construction; no second transport, no
socket per rank, the scheduler never knows N, and a dead rank surfaces as an error in the very next
collective. The objects go through a gloo group (the default group on the CPU, a second one beside NCCL
on CUDA), so the metadata never touches the GPU.

What travels: the message as encoded on the wire plus its tensor frames (a few KB a step); after a
step, what rank 0 sampled (a step that follows it reads those tokens); after a batch's copy orders,
each rank's outcome, merged so that an order is done when every rank did it and failed (once) when any
rank failed it.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import torch.distributed as dist

from himamba.common.messages import ToWorker
from himamba.common.wire import Decoder
from himamba.services.worker.host_transfer import TransferOutcome
from himamba.services.worker.tensor_parallel import control_group

_encoder = msgspec.msgpack.Encoder()


def _frame_bytes(frame: Any) -> bytes:
    return bytes(frame.buffer if hasattr(frame, "buffer") else frame)


class Fanout:
    """Rank 0's side and the followers' side of the group's message stream (one object, by rank)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._decoder = Decoder(ToWorker)

    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=control_group())
        return box[0]

    def send(self, msg: Any, frames: list[Any]) -> None:
        """Rank 0: hand a message (and its tensor frames) to the followers."""
        self._broadcast([_encoder.encode(msg), *(_frame_bytes(f) for f in frames)])

    def receive(self) -> tuple[Any, list[Any]]:
        """A follower: the next message rank 0 handed over (blocks until it does)."""
        return self._decoder.decode(self._broadcast(None))

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (what a step sampled)."""
        return self._broadcast(obj if self.rank == 0 else None)

    def merge_copies(self, mine: TransferOutcome) -> TransferOutcome:
        """Every rank's outcome of the same copy orders -> one: done where every rank did it, failed
        (once) where any failed it, with the first rank's error that says why."""
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, tuple(mine), group=control_group())
        failed = {op for o in outcomes for op in o[1]}
        errors = [f"rank {r}: {o[2]}" for r, o in enumerate(outcomes) if o[2]]
        done = [op for op in mine.done if op not in failed]
        ordered_failed = [op for op in (*mine.done, *mine.failed) if op in failed]
        return TransferOutcome(done, ordered_failed, errors[0] if errors else "")

    def agree_plan(self, mine: Any) -> Any:
        """The smallest of every rank's `mine` (a NamedTuple of numbers, such as a PoolPlan), field by
        field: each rank sizes its pools from its own free memory, yet a page or slot id must be valid
        on every rank (the controller only hears rank 0's sizes)."""
        plans: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(plans, tuple(mine), group=control_group())
        return type(mine)(*(min(values) for values in zip(*plans, strict=True)))


def ranks_env() -> tuple[int, str]:
    """This process's rank and the group's rendezvous address, as the launcher set them."""
    return int(os.environ.get("HIMAMBA_TP_RANK", "0") or 0), os.environ.get("HIMAMBA_TP_INIT", "")
