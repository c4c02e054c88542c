"""The native entry points' ctypes signatures, read from the C definitions: the C is the one source.

An entry point is a function named `hm_*` whose definition starts a line of a .c file beside this
module (everything else there is `static`). Its result is `void` or `int64_t`; each parameter is an
`int64_t`, a `float` or a pointer (the wrappers pass tensors' data pointers). ctypes checks every call
against these, so a binding cannot drift from the C it calls; a type outside that list stops the
build with the parameter's name rather than guessing a conversion.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

_DEFINITION = re.compile(r"^(\w+)\s+(hm_\w+)\s*\(([^)]*)\)\s*\{", re.MULTILINE)
_SCALARS: dict[str, type] = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}
_RESULTS: dict[str, type | None] = {"void": None, "int64_t": ctypes.c_int64}


class Signature(NamedTuple):
    """One entry point's argument types and result type (None for void), as ctypes wants them."""

    args: tuple[type, ...]
    result: type | None


def _argument(param: str, where: str) -> type:
    decl = " ".join(param.replace("*", " * ").split())
    if "*" in decl or "[" in decl:  # an array parameter (`float x[]`) is a pointer in C
        return ctypes.c_void_p
    words = [w for w in decl.split() if w != "const"]
    if len(words) != 2 or words[0] not in _SCALARS:
        raise ValueError(f"{where}: parameter {decl!r} is not int64_t, float or a pointer")
    return _SCALARS[words[0]]


def read_signatures(sources: Iterable[Path]) -> dict[str, Signature]:
    """Every `hm_*` definition in `sources`, by name; ValueError naming the file and function on a
    definition this binding cannot express, or on a name defined twice."""
    out: dict[str, Signature] = {}
    for path in sources:
        for m in _DEFINITION.finditer(path.read_text()):
            result, name, params = m.groups()
            where = f"{path.name}: {name}"
            if name in out:
                raise ValueError(f"{where} is defined twice")
            if result not in _RESULTS:
                raise ValueError(f"{where}: result type {result!r} is not void or int64_t")
            parts = [p for p in params.split(",") if p.strip() not in ("", "void")]
            out[name] = Signature(tuple(_argument(p, where) for p in parts), _RESULTS[result])
    return out
