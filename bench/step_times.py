"""Where a worker step's time goes (build the batch, run the model, sample), as the benches time it.

Its own file so the engines that fill it (forward.py's OurEngine) and the loops that drive them
(generate.py, ttft_limit.py, launches.py) need not import each other."""

from __future__ import annotations


class StepTimes:
    """Seconds spent per step in each part of the worker's step."""

    def __init__(self) -> None:
        self.build: list[float] = []
        self.model: list[float] = []
        self.sample: list[float] = []
        self.collective: list[float] = []  # within model: all-reduces and all-gathers (tensor parallel)

    def total(self) -> list[float]:
        return [a + b + c for a, b, c in zip(self.build, self.model, self.sample, strict=True)]
