"""What machine a benchmark ran on: cores, CPU and its vector extensions, torch and its threads, device."""

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
    vector_extensions: str = ""  # `vector_extensions()`: what decides the CPU kernels' speed

    def line(self) -> str:
        gpu = f", {self.gpu_model}" if self.gpu_model else ""
        cpu = f"{self.cpu_model}; {self.vector_extensions}" if self.vector_extensions else self.cpu_model
        return (
            f"machine: {self.cores} cores ({cpu}), torch {self.torch_version} with {self.torch_threads} "
            f"thread(s) per worker, device {self.device}{gpu}"
        )


def _cpuinfo_field(names: tuple[str, ...]) -> str:
    """The first /proc/cpuinfo line's value whose key is one of `names` ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in names:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else what `platform` knows)."""
    return _cpuinfo_field(("model name",)) or platform.processor() or platform.machine()


# The extensions a CPU's float kernels are built on, in the names vendors print: x86's AVX2,
# AVX-512 (with its bfloat16, VNNI and fp16 subsets) and AMX tiles; Arm's NEON, SVE and their bf16.
_AVX512_SUBSETS = (("avx512_bf16", "bf16"), ("avx512_vnni", "vnni"), ("avx512_fp16", "fp16"))
_AMX_SUBSETS = (("amx_bf16", "bf16"), ("amx_int8", "int8"), ("amx_fp16", "fp16"))
_ARM = (("asimd", "NEON"), ("sve", "SVE"), ("sve2", "SVE2"), ("bf16", "bf16"), ("i8mm", "i8mm"))


def vector_extensions(flags: str | None = None) -> str:
    """The CPU's vector and matrix extensions, as one phrase ("AVX2, AVX-512 (bf16, vnni), no AMX");
    "" where they are unknown. `flags`: a /proc/cpuinfo `flags` (x86) or `Features` (Arm) value,
    read from this machine when None."""
    have = set((_cpuinfo_field(("flags", "Features")) if flags is None else flags).split())
    if not have:
        return ""
    if "avx" in have or "sse2" in have:
        parts = ["AVX2" if "avx2" in have else "no AVX2"]
        if "avx512f" in have:
            subsets = [name for flag, name in _AVX512_SUBSETS if flag in have]
            parts.append(f"AVX-512 ({', '.join(subsets)})" if subsets else "AVX-512")
        else:
            parts.append("no AVX-512")
        if "amx_tile" in have:
            subsets = [name for flag, name in _AMX_SUBSETS if flag in have]
            parts.append(f"AMX ({', '.join(subsets)})" if subsets else "AMX")
        else:
            parts.append("no AMX")
        return ", ".join(parts)
    return ", ".join(name for flag, name in _ARM if flag in have)


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
        cpu_model=cpu_model(),
        gpu_model=gpu,
        torch_version=torch.__version__,
        vector_extensions=vector_extensions(),
    )
