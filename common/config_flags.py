"""The command line of a server: one flag per config field, plus the vLLM/sglang spellings users paste.

Each field of `config.py` is a flag named after it (`cache.page_size` is `--page-size`) whose
help text is the field's `doc(...)`, its one documentation; values are typed by the field
(`--api-key 12345` is the string "12345") and checked against its constraints, and errors name
the flag. A field's `doc` may list aliases that mean exactly the same (`--max-model-len`).
The other flags a vLLM or sglang user reaches for are in `COMPAT_FLAGS`: converted where our
meaning differs (`--mem-fraction-static`), accepted where they ask for what we always do
(`--enable-metrics`), and refused with the reason where we cannot honour them: nothing is
silently ignored.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import msgspec

from himamba.common.config import Config, ConfigError, FieldInfo, fields, load

ENV_API_KEY = "HIMAMBA_API_KEY"
_DEST = "cfg__{section}__{field}"
_POSITIONAL_MODEL = "compat__model"
_MEM_FRACTION_TOTAL = "compat__mem_fraction_total"


class CompatFlag(NamedTuple):
    """A vLLM/sglang flag that is not one of our fields: what we do with it, and why."""

    flags: tuple[str, ...]
    kind: Literal["accepted", "refused", "refused_unless"]
    why: str
    takes_value: bool = False
    allowed: str = ""  # kind "refused_unless": the one value we honour (it is what we do anyway)


COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(("--enable-metrics",), "accepted", "Metrics are always on, at /metrics on the HTTP port."),
    CompatFlag(
        ("--enable-prefix-caching",), "accepted", "The prefix cache is always on (--disable-radix-cache turns it off)."
    ),
    CompatFlag(
        ("--trust-remote-code",),
        "accepted",
        "Not needed: the architectures are native, no checkpoint code is ever run.",
    ),
    CompatFlag(("--disable-log-requests",), "accepted", "Requests are not logged unless --access-log."),
    CompatFlag(
        ("--enable-auto-tool-choice",),
        "accepted",
        "tool_choice auto is on whenever there is a tool-call parser (--tool-call-parser, auto by default).",
    ),
    CompatFlag(
        ("--pipeline-parallel-size", "--pp-size", "--pp"),
        "refused_unless",
        "A model is split across devices by tensor parallelism (--tensor-parallel-size), not by layers: "
        "pipeline stages pay off across nodes, and himamba serves on one node.",
        takes_value=True,
        allowed="1",
    ),
    CompatFlag(
        ("--data-parallel-size", "--dp-size", "--dp"),
        "refused_unless",
        "One server runs one copy of the model (on one device, or over --tensor-parallel-size devices): for more "
        "copies run one server per copy behind a router.",
        takes_value=True,
        allowed="1",
    ),
    CompatFlag(
        ("--quantization", "-q"),
        "refused",
        "Quantized checkpoints (FP8, AWQ, GPTQ...) are not supported yet.",
        takes_value=True,
    ),
    CompatFlag(
        ("--kv-cache-dtype",),
        "refused_unless",
        "The KV cache is kept in the model dtype (--dtype).",
        takes_value=True,
        allowed="auto",
    ),
    CompatFlag(
        ("--revision", "--download-dir"),
        "refused",
        "Hub downloads are not supported: download the checkpoint first "
        "(`hf download <repo> --local-dir DIR`) and pass DIR.",
        takes_value=True,
    ),
    CompatFlag(
        ("--ssl-keyfile", "--ssl-certfile"),
        "refused",
        "The API has no TLS of its own: put a TLS proxy in front.",
        takes_value=True,
    ),
    CompatFlag(
        ("--speculative-config", "--speculative-algorithm"),
        "refused",
        "Speculative decoding is not supported.",
        takes_value=True,
    ),
    CompatFlag(("--enable-lora",), "refused", "LoRA adapters are not supported."),
    CompatFlag(("--lora-modules",), "refused", "LoRA adapters are not supported.", takes_value=True),
)


class _Formatter(argparse.HelpFormatter):
    """Shows each field's default after its documentation (argparse's own default is None, which
    is how we tell a flag given from one left out)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        default = _DEFAULTS.get(action.dest)
        if text and text != argparse.SUPPRESS and action.dest in _DEFAULTS:
            text += f" (default: {default!r})" if default != "" else ' (default: "")'
        return text


_DEFAULTS: dict[str, Any] = {}


def formatter_class() -> type[argparse.HelpFormatter]:
    """The help formatter that shows the fields' defaults."""
    return _Formatter


def dest_of(info: FieldInfo) -> str:
    return _DEST.format(section=info.section, field=info.field)


def _metavar(base: Any) -> str:
    return {int: "N", float: "X"}.get(base, "TEXT")


def add_config_flags(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """Add one flag per config field (debug hooks hidden from --help), then the vLLM/sglang ones.
    `positional_model`: also take the model as the first positional argument (`serve MODEL`)."""
    seen: dict[str, str] = {}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for info in fields():
        group = groups.get(info.section)
        if group is None:
            group = groups[info.section] = parser.add_argument_group(
                f"{info.section} (config file section [{info.section}])"
            )
        names = (info.flag, *info.aliases)
        for name in names:
            if name in seen:
                raise AssertionError(f"config field {info.section}.{info.field} collides with {seen[name]} as {name}")
            seen[name] = f"{info.section}.{info.field}"
        dest = dest_of(info)
        _DEFAULTS[dest] = info.default
        help_text = argparse.SUPPRESS if info.hidden else info.doc
        if info.base is bool:
            group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(info.base) is Literal:
            group.add_argument(
                *names, dest=dest, choices=typing.get_args(info.base), type=str.lower, default=None, help=help_text
            )
        else:
            base = info.base if info.base in (int, float) else str
            group.add_argument(*names, dest=dest, type=base, metavar=_metavar(base), default=None, help=help_text)
    compat = parser.add_argument_group(
        "vLLM / sglang spellings (the flags above also accept the ones that mean exactly the same)"
    )
    if positional_model:
        parser.add_argument(
            _POSITIONAL_MODEL,
            nargs="?",
            default=None,
            metavar="MODEL",
            help="The model to serve, as --model (vLLM's `vllm serve MODEL`).",
        )
    compat.add_argument(
        "--mem-fraction-static",
        "--gpu-memory-utilization",
        dest=_MEM_FRACTION_TOTAL,
        type=float,
        metavar="X",
        default=None,
        help="sglang's and vLLM's share of TOTAL device memory this server may use: the same as "
        "--memory-fraction X --memory-fraction-of total (our --memory-fraction alone is a share of the free memory).",
    )
    for cf in COMPAT_FLAGS:
        for name in cf.flags:
            if name in seen:
                raise AssertionError(f"compat flag {name} collides with {seen[name]}")
            seen[name] = "compat"
        what = {"accepted": "Accepted: ", "refused": "Refused: ", "refused_unless": f"Only {cf.allowed}: "}[cf.kind]
        compat.add_argument(
            *cf.flags,
            action=_CompatAction,
            compat=cf,
            nargs=1 if cf.takes_value else 0,
            metavar="V",
            default=None,
            help=what + cf.why,
        )


class _CompatAction(argparse.Action):
    """A vLLM/sglang flag: recorded when accepted, refused (exit 2) with the reason otherwise."""

    def __init__(self, option_strings: Sequence[str], dest: str, compat: CompatFlag, **kwargs: Any):
        self.compat = compat
        super().__init__(option_strings, "compat__" + compat.flags[0].lstrip("-").replace("-", "_"), **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        cf = self.compat
        value = values[0] if values else None
        if cf.kind == "refused" or (cf.kind == "refused_unless" and str(value).lower() != cf.allowed):
            shown = f"{option_string} {value}" if value is not None else option_string
            parser.error(f"{shown}: not supported. {cf.why}")
        setattr(namespace, self.dest, value if value is not None else True)


def accepted_notes(args: argparse.Namespace) -> list[str]:
    """One line per accepted vLLM/sglang flag the user gave, saying what it means here (for the log)."""
    notes = []
    for cf in COMPAT_FLAGS:
        if (
            cf.kind != "refused"
            and getattr(args, "compat__" + cf.flags[0].lstrip("-").replace("-", "_"), None) is not None
        ):
            notes.append(f"{cf.flags[0]}: {cf.why}")
    if getattr(args, _MEM_FRACTION_TOTAL, None) is not None:
        notes.append("--mem-fraction-static: a share of total memory, as --memory-fraction-of total")
    return notes


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The fields the user set on the command line (and through HIMAMBA_API_KEY), each checked
    against its field's type and constraints: an error names the flag."""
    out: dict[str, dict[str, Any]] = {}
    given = vars(args)
    for info in fields():
        value = given.get(dest_of(info))
        if value is None:
            continue
        try:
            value = msgspec.convert(value, info.type)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{info.flag} {value!r}: {e}") from None
        out.setdefault(info.section, {})[info.field] = value
    positional = given.get(_POSITIONAL_MODEL)
    if positional is not None:
        flagged = out.get("model", {}).get("model")
        if flagged is not None and flagged != positional:
            raise ConfigError(f"two models given: {positional!r} and --model {flagged!r}")
        out.setdefault("model", {})["model"] = positional
    total_share = given.get(_MEM_FRACTION_TOTAL)
    if total_share is not None:
        if "memory_fraction" in out.get("cache", {}):
            raise ConfigError("--mem-fraction-static and --memory-fraction both given: pass one")
        if not 0 < total_share <= 1:
            raise ConfigError(f"--mem-fraction-static {total_share}: must be in (0, 1]")
        out.setdefault("cache", {}).update(memory_fraction=total_share, memory_fraction_of="total")
    env_key = os.environ.get(ENV_API_KEY)
    if env_key and "api_key" not in out.get("http", {}):
        out.setdefault("http", {})["api_key"] = env_key
    return out


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config a CLI invocation asks for: `--config FILE` (optional), then HIMAMBA_API_KEY, then flags."""
    return load(getattr(args, "config", None), overrides_from_args(args))
