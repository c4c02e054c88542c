"""The wheel ships every package: pyproject's list equals the folders holding __init__.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_package_list_is_complete():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = cfg["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]))
    assert set(cfg["packages"]) == found


def test_the_wheel_ships_the_native_kernels_sources():
    """kernels/native compiles its C sources on the machine that runs it: every one of them (and every
    header they include) must be package data, or an installed server silently runs the references."""
    from fnmatch import fnmatch

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = cfg["package-data"]["himamba.kernels.native"]
    sources = [p.name for p in (ROOT / "kernels" / "native").iterdir() if p.suffix in (".c", ".h")]
    assert sources and all(any(fnmatch(name, pat) for pat in patterns) for name in sources)


def test_our_kernels_folder_does_not_shadow_hf_kernels():
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or "site-packages" in (spec.origin or "")


def test_license_is_apache_2_and_shipped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
