"""The docs site builds with `mkdocs build --strict` (every link and anchor resolves, every page is in
the nav), outside the source tree, and its navigation leads to the pages users look for first."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _nav() -> list[Any]:
    # mkdocs.yml may hold !!python tags in other projects; ours is plain YAML.
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]


def nav_pages(entries: list[Any], depth: int = 1) -> Iterator[tuple[int, str, str]]:
    """(depth, title, page) for every page of an mkdocs nav: a top-level page is at depth 1."""
    for entry in entries:
        if isinstance(entry, str):
            yield depth, "", entry
            continue
        ((title, value),) = entry.items()
        if isinstance(value, list):
            yield from nav_pages(value, depth + 1)
        else:
            yield depth, title, value


def test_the_site_builds_strictly_outside_the_tree(tmp_path):
    pytest.importorskip("material", reason="needs mkdocs-material (pip; in the test extra)")
    site = tmp_path / "site"
    default_output = ROOT / "site"  # where a bare `mkdocs build` writes
    was_there = default_output.exists()
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (site / "index.html").is_file()
    assert (site / "reference" / "metrics" / "index.html").is_file()
    assert default_output.exists() == was_there, "the build wrote into the source tree"


def test_the_nav_leads_to_what_users_look_for_first():
    pages = {page: depth for depth, _, page in nav_pages(_nav())}
    wanted = {
        "serving a checkpoint": "serving/checkpoint.md",
        "enabling the device tier": "cache/device-tier.md",
        "enabling the host tier": "cache/host-tier.md",
        "enabling the storage tier": "cache/storage-tier.md",
        "running behind a router": "operations/fleet.md",
        "the metrics reference": "reference/metrics.md",
        "the configuration reference": "reference/configuration.md",
        "the architecture": "design/architecture.md",
        "the benchmarks": "benchmarks/index.md",
    }
    for what, page in wanted.items():
        assert page in pages, f"mkdocs.yml's nav has no page for {what} ({page})"
        assert pages[page] <= 2, f"{page} ({what}) is at depth {pages[page]} of the nav; it must be at most 2"


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    in_nav = {page for _, _, page in nav_pages(_nav())}
    for page in in_nav:
        assert (ROOT / "docs" / page).is_file(), page
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == in_nav, f"pages outside the nav: {sorted(on_disk - in_nav)}"


def test_the_test_extra_brings_mkdocs_and_the_material_theme():
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in test_extra}
    assert {"mkdocs", "mkdocs-material"} <= names


def test_build_output_is_ignored_by_git():
    assert "site/" in (ROOT / ".gitignore").read_text().split()
