"""The server's one /metrics page, assembled from the services' expositions.

Each service renders its own registry (`metrics_report.py`); the front door serves them as one
page: families merged (each service's `himamba_process_*` series share one HELP/TYPE),
`himamba_build_info` added, and a `model_name` label on every series, as vLLM does, so a fleet
serving several models is told apart in PromQL.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from typing import NamedTuple

from himamba.common.config import Config
from himamba.common.metrics import BUILD_INFO, BUILD_INFO_LABELS, MODEL_NAME_LABEL


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_info_text(cfg: Config) -> str:
    """`himamba_build_info{version=..., dtype=..., ...} 1` for this server's config."""
    values = {
        "version": _version("himamba"),
        "torch_version": _version("torch"),
        "dtype": cfg.model.dtype,
        "device": cfg.model.device,
        "page_size": str(cfg.cache.page_size),
        "max_context_len": str(cfg.model.max_context_len),
        "mamba_scheduler_strategy": cfg.scheduler.mamba_scheduler_strategy,
        "storage_backend": cfg.cache.hicache_storage_backend if cfg.cache.enable_hierarchical_cache else "none",
    }
    assert tuple(values) == BUILD_INFO_LABELS
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in values.items())
    name = BUILD_INFO.name
    return f"# HELP {name} {BUILD_INFO.help}\n# TYPE {name} gauge\n{name}{{{labels}}} 1.0\n"


class _Family(NamedTuple):
    meta: list[str]  # its HELP and TYPE lines
    samples: list[str]


def _with_label(sample: str, label: str) -> str:
    """`name{a="b"} 1` -> `name{model_name="m",a="b"} 1`; `name 1` -> `name{model_name="m"} 1`."""
    cut = min((i for i in (sample.find("{"), sample.find(" ")) if i >= 0), default=len(sample))
    if sample[cut : cut + 1] == "{":
        rest = sample[cut + 1 :]
        return f"{sample[:cut]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:cut]}{{{label}}}{sample[cut:]}"


def merge_expositions(texts: Iterable[str], model_name: str) -> str:
    """One exposition from several: each family once (its HELP and TYPE from the first text that
    has it, the samples of all), every sample labelled model_name=<model_name>."""
    label = f'{MODEL_NAME_LABEL}="{_escape(model_name)}"'
    families: dict[str, _Family] = {}
    loose: list[str] = []  # samples before any HELP/TYPE (not produced by prometheus_client)
    for text in texts:
        current: _Family | None = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, _Family([], []))
                if not any(m.startswith(line[:7]) for m in current.meta):  # HELP once, TYPE once
                    current.meta.append(line)
            elif line and not line.startswith("#"):
                (current.samples if current is not None else loose).append(_with_label(line, label))
    out: list[str] = []
    for family in families.values():
        out.extend(family.meta)
        out.extend(family.samples)
    out.extend(loose)
    return "\n".join(out) + "\n"
