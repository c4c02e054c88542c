"""Startup checks of the configuration against the model the worker loaded."""

from __future__ import annotations

from himamba.common.config import Config
from himamba.common.messages import WorkerInfo
from himamba.services.scheduler import mamba_track


def validate_against_worker(cfg: Config, info: WorkerInfo, strategy: mamba_track.Strategy) -> str:
    """An explanation of what cannot work, or "" when the pools can serve this config."""
    if (
        info.num_recurrent_layers == 0
        and strategy != "no_buffer"
        and cfg.scheduler.mamba_scheduler_strategy != "no_buffer"
    ):
        return (
            f"mamba_scheduler_strategy {strategy} needs recurrent layers, and this model has none; "
            "use --mamba-scheduler-strategy no_buffer"
        )
    ps = cfg.cache.page_size
    max_len = cfg.model.max_context_len
    if info.num_pages * ps < max_len:
        return (
            f"the device KV pool ({info.num_pages} pages x {ps} = {info.num_pages * ps} tokens) cannot hold one "
            f"request of max_context_len {max_len}; raise --max-total-tokens or lower --max-context-len"
        )
    need = 1 + mamba_track.track_slots_at_admission(strategy)
    if info.num_recurrent_layers and info.num_state_slots < need:
        return (
            f"the device state pool has {info.num_state_slots} slots but one request under {strategy} needs {need}; "
            "raise --max-mamba-cache-size"
        )
    return ""
