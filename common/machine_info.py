"""What machine a benchmark ran on: cores, CPU, torch and its threads, device."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import NamedTuple


class MachineInfo(NamedTuple):
    """The machine a figure was measured on; `line()` is how every benchmark states it."""

    cores: int
    torch_threads: int  # per server worker, as resolved (0 on the command line = torch's default)
    device: str
    cpu_model: str
    gpu_model: str
    torch_version: str

    def line(self) -> str:
        gpu = f", {self.gpu_model}" if self.gpu_model else ""
        return (
            f"machine: {self.cores} cores ({self.cpu_model}), torch {self.torch_version} with {self.torch_threads} "
            f"thread(s) per worker, device {self.device}{gpu}"
        )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(torch_threads: int, device: str) -> MachineInfo:
    """`torch_threads` as given to the server (0: torch's default on this machine)."""
    import torch  # only to resolve the default thread count and name the GPU

    threads = torch_threads or torch.get_num_threads()
    gpu = ""
    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return MachineInfo(
        cores=os.cpu_count() or 0,
        torch_threads=threads,
        device=device,
        cpu_model=_cpu_model(),
        gpu_model=gpu,
        torch_version=torch.__version__,
    )
