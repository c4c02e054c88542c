"""docs/reference/metrics.md and configuration.md are generated from the definitions they document
(scripts/docs/generate.py), are current, and say what they must: every metric with its meaning and
an example alert or query that names only real metrics (promtool-checked), every flag with the
text `--help` shows."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from himamba.common import config_flags
from himamba.common.metrics import exported_names
from tests.system_packages import PROMETHEUS, requires

ROOT = Path(__file__).resolve().parents[2]
METRIC_RE = re.compile(r"\bhimamba_[a-z0-9_]+")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("himamba_docs_generate", ROOT / "scripts" / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["metrics.md", "configuration.md"])
def test_generated_page_is_current(page):
    gen = _generator()
    path = ROOT / "docs" / "reference" / page
    assert path.read_text() == gen.pages()[path], f"docs/reference/{page} is stale: run python scripts/docs/generate.py"


def test_check_mode_names_a_stale_page_and_the_command(tmp_path, monkeypatch, capsys):
    gen = _generator()
    stale, current = tmp_path / "metrics.md", tmp_path / "configuration.md"
    stale.write_text("old\n")
    current.write_text(gen.render_configuration())
    monkeypatch.setattr(gen, "METRICS_PAGE", stale)
    monkeypatch.setattr(gen, "CONFIG_PAGE", current)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert capsys.readouterr().err == "metrics.md is stale: run python scripts/docs/generate.py\n"
    stale.write_text(gen.render_metrics())
    assert gen.main(["--check"]) == 0


def test_every_metric_family_has_a_note_and_no_note_is_orphaned():
    gen = _generator()
    notes = gen.load_notes()
    names = {d.name for d in gen.documented_families()}
    assert names - notes.keys() == set(), "families without a note in scripts/docs/metric_notes.toml"
    assert notes.keys() - names == set(), "notes for families that do not exist"
    for name, note in notes.items():
        assert note.means.strip(), name
        assert note.alert or note.query, f"{name}: give an example alert or query"


def test_every_example_names_only_exported_metrics():
    gen = _generator()
    exported = exported_names()
    for name, note in gen.load_notes().items():
        for expr in (note.alert.expr if note.alert else "", note.query):
            unknown = set(METRIC_RE.findall(expr)) - exported
            assert not unknown, f"{name}'s example names {unknown}"


def test_the_metrics_page_says_what_pool_used_bytes_means():
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    section = page.split("### `himamba_pool_used_bytes`", 1)[1].split("\n### ", 1)[0]
    assert "allocated" in section and "cached prefixes" in section and "running requests" in section
    assert "protected" in section  # how it relates to what cannot be freed


@requires(PROMETHEUS)
def test_the_example_alerts_pass_promtool(tmp_path):
    gen = _generator()
    alerts = [note.alert for note in gen.load_notes().values() if note.alert]
    assert alerts
    rules = "groups:\n  - name: himamba\n    rules:\n" + "\n".join(gen.alert_rule_yaml(a, "      ") for a in alerts)
    (tmp_path / "rules.yaml").write_text(rules + "\n")
    out = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts)} rules found" in out.stdout


def test_the_configuration_page_holds_every_flag_with_its_help_text():
    gen = _generator()
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    parser = argparse.ArgumentParser(add_help=False)
    config_flags.add_config_flags(parser)
    shown = 0
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        for flag in action.option_strings:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page), flag
        if action.dest.startswith("cfg__"):  # a config field: its help text, as --help prints it
            assert gen.prose(action.help) in page, action.option_strings[0]
            shown += 1
    assert shown > 50
    assert "debug-" not in page and "Test hook:" not in page  # hidden from --help, hidden here
