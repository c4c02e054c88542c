"""Token-level stop conditions. (Stop strings are matched on text by the tokenizer service.)"""

from __future__ import annotations

from himamba.common.types import FinishReason
from himamba.services.scheduler.request import Req


def check_stop(req: Req, token: int, num_output: int, context_len: int, max_context_len: int) -> FinishReason | None:
    """Why `req` is finished after its newest token `token` (its output now `num_output` tokens,
    its context `context_len`), or None to keep going. The lengths come from the caller, which
    has them at hand: this runs for every running request on every step."""
    sampling = req.sampling
    if token in req.eos_ids and not sampling.ignore_eos:
        return "stop"
    if sampling.stop_token_ids and token in sampling.stop_token_ids:
        return "stop"
    if num_output >= req.max_tokens or context_len >= max_context_len:
        return "length"
    return None
