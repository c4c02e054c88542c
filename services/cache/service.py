"""CacheService: the cache-controller process. Owns the CacheController and answers by message."""

from __future__ import annotations

from typing import Any

from himamba.common.config import Config
from himamba.common.messages import (
    CacheReset,
    CacheStep,
    CacheStepDone,
    GetCacheStats,
    Shutdown,
    ToCache,
    TransfersDone,
    WorkerInfo,
)
from himamba.common.transport import Outbox
from himamba.services.actor import Actor
from himamba.services.cache.controller import CacheController


class CacheService(Actor[ToCache]):
    name = "cache"

    def __init__(self, cfg: Config):
        super().__init__(cfg, cfg.endpoints.cache_ipc, ToCache)  # type: ignore[arg-type]
        self.scheduler = Outbox(self.ctx, cfg.endpoints.scheduler_ipc)
        self.ctrl: CacheController | None = None
        self._early: list[tuple[Any, list[Any]]] = []

    async def start(self) -> str:
        # The pools' sizes come from the worker, which knows the model; wait for it.
        assert self.inbox is not None
        self.log.info("waiting for the worker's pool sizes")
        while self.ctrl is None:
            msg, frames = await self.inbox.recv()
            if isinstance(msg, WorkerInfo):
                self.on_worker_info(msg)
            elif isinstance(msg, Shutdown):
                raise RuntimeError("shut down before the worker was ready")
            else:
                self._early.append((msg, frames))
        c = self.ctrl
        return (
            f"{c.device_kv.capacity} device pages, {c.device_state.capacity} device state slots, "
            f"radix cache {'off' if c.tree is None else 'on'}"
        )

    async def background(self) -> None:
        early, self._early = self._early, []
        for msg, frames in early:
            await self.handle(msg, frames)

    def on_worker_info(self, info: WorkerInfo) -> None:
        self.ctrl = CacheController(
            self.cfg.cache,
            num_pages=info.num_pages,
            num_slots=info.num_state_slots,
            num_host_pages=info.num_host_pages,
            num_host_slots=info.num_host_state_slots,
        )

    async def handle(self, msg: ToCache, frames: list[Any]) -> None:
        assert self.ctrl is not None
        match msg:
            case CacheStep(step_id=step_id, ops=ops):
                results = [self.ctrl.apply(op) for op in ops]
                transfers = self.ctrl.take_transfers()
                await self.scheduler.send(CacheStepDone(step_id=step_id, results=results, transfers=transfers))
            case TransfersDone(op_ids=op_ids):
                self.ctrl.transfers_done(op_ids)
            case GetCacheStats(reply_to=reply_to, check_invariants=check):
                stats = self.ctrl.stats()
                if check:
                    try:
                        self.ctrl.check_invariants()
                    except AssertionError as e:
                        stats = type(stats)(**{**_fields(stats), "invariants_ok": False, "invariants_error": str(e)})
                out = Outbox(self.ctx, reply_to)
                await out.send(stats)
                out.close()
            case WorkerInfo():
                # A restarted worker has empty pools: every page and state the tree knew is gone.
                self.log.warning("worker restarted: forgetting the cache and every request's memory")
                self.on_worker_info(msg)
                await self.scheduler.send(CacheReset(num_pages=msg.num_pages, num_state_slots=msg.num_state_slots))
            case Shutdown():
                pass


def _fields(s: Any) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}
