"""A worker rank other than 0 under tensor parallelism: the whole process. It builds the same
WorkerService as rank 0 (its shard of the model, of the pools and of the host pools) but answers no one:
it runs, in order, each message rank 0 hands it through the group (tp_ranks.Fanout), until rank 0 says
stop or the group breaks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from himamba.common.config import Config
from himamba.common.log import setup_logging
from himamba.common.messages import Shutdown
from himamba.services.actor import die_with_parent
from himamba.services.worker.service import WorkerService
from himamba.services.worker.tensor_parallel import close_group


class _Silent:
    """A follower's peers: only rank 0 answers the scheduler, the cache and the front door."""

    async def send(self, msg: Any, tensors: Any = ()) -> None:
        return None

    def send_nowait(self, msg: Any, tensors: Any = ()) -> None:
        return None


def run_follower(cfg: Config, rank: int) -> int:
    """Run worker rank `rank` (>= 1) until rank 0 says stop or the group breaks; the exit code."""
    return asyncio.run(_follow(cfg, rank))


async def _follow(cfg: Config, rank: int) -> int:
    # Rank 0 stops the followers (a signal would cut a collective in half and leave the group hanging);
    # the launcher kills a follower by PID only past its grace.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)  # an orphan is killed (its shared memory goes with its resource tracker)
    log = setup_logging(f"worker-rank{rank}", cfg.log.level)
    worker = WorkerService(cfg, rank=rank)
    worker.scheduler = worker.cache = worker.tokenizer = _Silent()  # type: ignore[assignment]
    worker.control = _Silent()  # type: ignore[assignment]
    code = 0
    try:
        detail = await worker.start()
        worker.tables.samples = False
        log.info("rank %d of %d ready (%s)", rank, cfg.model.tensor_parallel_size, detail)
        fanout = worker.fanout
        assert fanout is not None
        while True:
            msg, frames = fanout.receive()
            if isinstance(msg, Shutdown):
                log.info("rank %d: rank 0 stops the group", rank)
                break
            await worker.handle(msg, frames)
    except Exception as e:  # noqa: BLE001 - a broken group or a failed start: this rank is done
        log.error("rank %d stops: %s: %s", rank, type(e).__name__, e)
        code = 1
    finally:
        try:
            await worker.stop()
        except Exception as e:  # noqa: BLE001
            log.warning("rank %d: error while stopping: %r", rank, e)
        close_group()
        worker.ctx.destroy(linger=0)
        logging.shutdown()
    return code
