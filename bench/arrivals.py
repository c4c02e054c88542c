"""When the benchmark launches its next request: gaps drawn like sglang's bench_multiturn."""

from __future__ import annotations

import math
import random
from typing import Literal

Distribution = Literal["poisson", "uniform"]


class Arrivals:
    """Gaps between launches for `rate` requests/s: exponential (poisson) or U(0, 2/rate)
    (uniform, same mean). An infinite rate means no gap: a closed loop bounded only by the
    number of requests allowed in flight."""

    def __init__(self, distribution: Distribution, rate: float, seed: int):
        if distribution not in ("poisson", "uniform"):
            raise ValueError(f"distribution must be 'poisson' or 'uniform', got {distribution!r}")
        if not rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for a closed loop), got {rate}")
        self.distribution = distribution
        self.rate = rate
        self._rng = random.Random(seed)

    @property
    def is_closed_loop(self) -> bool:
        return math.isinf(self.rate)

    def next_gap_s(self) -> float:
        if self.is_closed_loop:
            return 0.0
        if self.distribution == "poisson":
            return self._rng.expovariate(self.rate)
        return self._rng.uniform(0.0, 2.0 / self.rate)
