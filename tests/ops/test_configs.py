"""The supervisor configs run each of the four services as `himamba service NAME` with the
settings operations rely on (restart, clean stop, PYTHONSAFEPATH)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.system_packages import SYSTEMD, requires

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("worker", "cache", "scheduler", "tokenizer")


def _supervisord() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(inline_comment_prefixes=(";",))
    parser.read(ROOT / "configs" / "supervisord.conf")
    return parser


def test_supervisord_runs_the_four_services_as_separate_programs():
    conf = _supervisord()
    programs = {s.split(":", 1)[1] for s in conf.sections() if s.startswith("program:")}
    assert programs == set(SERVICES)
    assert set(conf.get("group:himamba", "programs").split(",")) == set(SERVICES)
    for name in SERVICES:
        sec = f"program:{name}"
        # The venv's himamba by its path (supervisord would look on PATH, where a venv rarely is).
        assert re.fullmatch(
            rf"/opt/himamba/venv/bin/himamba service {name} --config \S+ --hicache-storage-dir /var/cache/himamba/storage",
            conf.get(sec, "command"),
        )
        assert conf.get(sec, "user") == "himamba"
        env = conf.get(sec, "environment")
        assert 'PYTHONSAFEPATH="1"' in env and 'RUNTIME_DIRECTORY="/run/himamba"' in env
        assert conf.get(sec, "autorestart") == "true"
        assert conf.get(sec, "stopsignal") == "TERM"
        assert 5 <= int(conf.get(sec, "stopwaitsecs")) <= 60
        assert conf.get(sec, "stopasgroup") == "true"
    # one config file for all four
    assert len({conf.get(f"program:{n}", "command").split("--config ")[1] for n in SERVICES}) == 1
    assert conf.has_section("rpcinterface:supervisor") and conf.has_section("supervisorctl")


def test_systemd_template_unit():
    unit = (ROOT / "configs" / "systemd" / "himamba@.service").read_text()
    # A fixed venv path (systemd expands no variable in ExecStart's first word; a drop-in overrides
    # it), the storage tier in the unit's cache directory.
    assert re.search(
        r"^ExecStart=/opt/himamba/venv/bin/himamba service %i --config \S+ --hicache-storage-dir %C/himamba/storage$",
        unit,
        re.MULTILINE,
    )
    assert "Environment=PYTHONSAFEPATH=1" in unit
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith(("#", "Environment"))
    )
    assert settings["User"] == "himamba" and settings["Group"] == "himamba" and "DynamicUser" not in settings
    assert settings["RuntimeDirectory"] == "himamba" and settings["RuntimeDirectoryPreserve"] == "yes"
    assert settings["StateDirectory"] == "himamba" and settings["CacheDirectory"] == "himamba"
    assert int(settings["LimitNOFILE"]) >= 65536
    sysusers = (ROOT / "configs" / "systemd" / "himamba.sysusers.conf").read_text()
    assert re.search(r"^u\s+himamba\s+-\s", sysusers, re.MULTILINE)  # creates the static User=
    assert re.search(r"^Restart=(always|on-failure)$", unit, re.MULTILINE)
    assert "KillSignal=SIGTERM" in unit
    target = (ROOT / "configs" / "systemd" / "himamba.target").read_text()
    for name in SERVICES:
        assert f"himamba@{name}.service" in target


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@requires(SYSTEMD)
def test_systemd_analyze_verify_passes_on_the_shipped_units(tmp_path: Path):
    """`systemd-analyze verify` on the shipped units, with ExecStart overridden by a drop-in as the
    unit's comment and docs/operations/supervisors.md say (the fixed /opt/himamba/venv path does not exist here): no
    warning at all; and the sysusers.d file creates the user and group."""
    for f in (ROOT / "configs" / "systemd").iterdir():
        shutil.copy(f, tmp_path / f.name)
    venv_himamba = Path(sys.executable).parent / "himamba"
    assert venv_himamba.exists()
    dropin = tmp_path / "himamba@.service.d"
    dropin.mkdir()
    (dropin / "venv.conf").write_text(
        "[Service]\nExecStart=\n"
        f"ExecStart={venv_himamba} service %i --config /etc/himamba/himamba.toml --hicache-storage-dir %C/himamba/storage\n"
    )
    out = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "himamba@.service", "himamba.target"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stdout + out.stderr
    # The same check fails on a unit that systemd would reject (the test can fail).
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "himamba@.service").write_text((tmp_path / "himamba@.service").read_text().replace("/opt/himamba", "/nowhere"))
    out = subprocess.run([SYSTEMD_ANALYZE, "verify", "himamba@.service"], cwd=bad, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode != 0 and "/nowhere" in out.stderr
    sysusers = shutil.which("systemd-sysusers")
    if sysusers:
        (tmp_path / "root" / "etc").mkdir(parents=True)
        out = subprocess.run(
            [sysusers, "--dry-run", f"--root={tmp_path / 'root'}", str(ROOT / "configs/systemd/himamba.sysusers.conf")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "Creating user 'himamba'" in out.stdout + out.stderr
