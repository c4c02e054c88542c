"""A benchmark's files: a JSON of what it measured and, where matplotlib is installed, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple


class PlotOutcome(NamedTuple):
    """Whether the PNG was written; `note` says why not."""

    written: bool
    note: str


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """`payload` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def open_pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend (no display needed), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def no_matplotlib() -> PlotOutcome:
    """The outcome, and the note to print, when matplotlib is not installed."""
    return PlotOutcome(False, "matplotlib is not installed (pip install 'himamba[bench]'): wrote JSON only")


def save_figure(plt: Any, fig: Any, path: Path, title: str) -> PlotOutcome:
    """Titles `fig` with what it ran on, writes it to `path` and closes it."""
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return PlotOutcome(True, "")
