"""Imports run one way: services -> common/kernels; common and kernels import nothing of ours;
a service package never imports another service package (they talk by message)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE_PACKAGES = {"tokenizer", "scheduler", "worker", "cache"}
# Shared building blocks under services/ that any service may use, and the composition root.
SHARED = {"actor", "modelgen"}
ROOTS = {"cli", "launch", "bench"}  # composition roots: they start and drive whole servers


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return [m for m in out if m.startswith("himamba")]


def violations() -> list[str]:
    bad = []
    for folder in ("common", "kernels", "services"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            for mod in _imports(path):
                parts = mod.split(".")
                if folder in ("common", "kernels"):
                    if not mod.startswith(f"himamba.{folder}"):
                        bad.append(f"{rel} imports {mod}")
                    continue
                if parts[1] not in ("common", "kernels", "services"):
                    bad.append(f"{rel} imports {mod}")
                    continue
                if parts[1] != "services" or len(parts) < 3:
                    continue
                own = rel.parts[1] if len(rel.parts) > 2 else rel.stem
                target = parts[2]
                if own in ROOTS or target in SHARED or target == own:
                    continue
                if own in SHARED and target not in SERVICE_PACKAGES:
                    continue
                bad.append(f"{rel} imports {mod}")
    return bad


def test_dependencies_run_one_way():
    assert violations() == []


def test_the_rule_catches_a_service_importing_another(tmp_path, monkeypatch):
    bad = ROOT / "services" / "worker" / "_layering_probe.py"
    bad.write_text("from himamba.services.scheduler.batching import pick_batch\n")
    try:
        assert "services/worker/_layering_probe.py imports himamba.services.scheduler.batching" in violations()
    finally:
        bad.unlink()
