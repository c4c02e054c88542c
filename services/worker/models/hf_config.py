"""Reading an HF `config.json` without transformers: tagged floats, aliases and typed fields."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

# transformers 5 writes non-finite floats as {"__float__": "Infinity"}; older writers emit a bare
# `Infinity` token, which Python's json accepts as is.
_FLOAT_TAG = "__float__"
_TAGGED_FLOATS = MappingProxyType({"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan})


def _untag(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and _FLOAT_TAG in obj:
        value = obj[_FLOAT_TAG]
        if value not in _TAGGED_FLOATS:
            raise ValueError(f"config.json has an unknown tagged float {value!r}")
        return _TAGGED_FLOATS[value]
    return obj


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """Parse `model_dir/config.json`, decoding transformers' tagged non-finite floats."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model_dir must contain config.json, not found: {path}")
    raw = json.loads(path.read_text(), object_hook=_untag)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


class ConfigFields:
    """Typed access to a raw HF config dict; every error names the config field."""

    def __init__(self, raw: Mapping[str, Any], family: str) -> None:
        self.raw = raw
        self.family = family

    def _lookup(self, names: tuple[str, ...]) -> tuple[str, Any] | None:
        for name in names:
            if name in self.raw and self.raw[name] is not None:
                return name, self.raw[name]
        return None

    def _missing(self, names: tuple[str, ...]) -> ValueError:
        return ValueError(f"{self.family} config.json: field {names[0]!r} is required")

    def int(self, *names: str, default: int | None = None) -> int:
        """The first present of `names` as an int (bools rejected); `default` when absent."""
        found = self._lookup(names)
        if found is None:
            if default is None:
                raise self._missing(names)
            return default
        name, value = found
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.family} config.json: field {name!r} must be an integer, got {value!r}")
        return value

    def float(self, *names: str, default: float | None = None) -> float:
        found = self._lookup(names)
        if found is None:
            if default is None:
                raise self._missing(names)
            return default
        name, value = found
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{self.family} config.json: field {name!r} must be a number, got {value!r}")
        return float(value)

    def bool(self, *names: str, default: bool) -> bool:
        found = self._lookup(names)
        if found is None:
            return default
        name, value = found
        if not isinstance(value, bool):
            raise ValueError(f"{self.family} config.json: field {name!r} must be true or false, got {value!r}")
        return value

    def str(self, *names: str, default: str | None = None) -> str | None:
        found = self._lookup(names)
        if found is None:
            return default
        name, value = found
        if not isinstance(value, str):
            raise ValueError(f"{self.family} config.json: field {name!r} must be a string, got {value!r}")
        return value

    def float_pair(self, *names: str, default: tuple[float, float]) -> tuple[float, float]:
        found = self._lookup(names)
        if found is None:
            return default
        name, value = found
        if (
            not isinstance(value, (list, tuple))
            or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"{self.family} config.json: field {name!r} must be a pair of numbers, got {value!r}")
        return float(value[0]), float(value[1])

    def get(self, *names: str) -> Any:
        """The raw value of the first present of `names`, or None."""
        found = self._lookup(names)
        return None if found is None else found[1]
