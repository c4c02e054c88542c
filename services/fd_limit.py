"""The process's file-descriptor limit: raised to the hard limit at start.

Distributions ship a soft RLIMIT_NOFILE of 1024 with a far higher hard limit; a front door
holding many HTTP connections would run out at the soft one (and libzmq aborts when it cannot
get a descriptor for a socket). Every himamba process raises its soft limit as far as the hard
limit allows; the HTTP connection cap is then derived from what it got.
"""

from __future__ import annotations

import resource


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft
