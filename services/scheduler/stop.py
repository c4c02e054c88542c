"""Token-level stop conditions. (Stop strings are matched on text by the tokenizer service.)"""

from __future__ import annotations

from himamba.common.types import FinishReason
from himamba.services.scheduler.request import Req


def check_stop(req: Req, max_context_len: int) -> FinishReason | None:
    """Why `req` is finished after its newest token, or None to keep going."""
    if not req.output_ids:
        return None
    last = req.output_ids[-1]
    if not req.sampling.ignore_eos and last in req.eos_ids:
        return "stop"
    if last in req.sampling.stop_token_ids:
        return "stop"
    if len(req.output_ids) >= req.max_tokens:
        return "length"
    if req.context_len >= max_context_len:
        return "length"
    return None
