"""The supervisor configs run each of the four services as `himamba service NAME` with the
settings operations rely on (restart, clean stop, PYTHONSAFEPATH)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

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
        assert re.fullmatch(rf"himamba service {name} --config \S+", conf.get(sec, "command"))
        assert 'PYTHONSAFEPATH="1"' in conf.get(sec, "environment")
        assert conf.get(sec, "autorestart") == "true"
        assert conf.get(sec, "stopsignal") == "TERM"
        assert 5 <= int(conf.get(sec, "stopwaitsecs")) <= 60
        assert conf.get(sec, "stopasgroup") == "true"
    # one config file for all four
    assert len({conf.get(f"program:{n}", "command").split("--config ")[1] for n in SERVICES}) == 1
    assert conf.has_section("rpcinterface:supervisor") and conf.has_section("supervisorctl")


def test_systemd_template_unit():
    unit = (ROOT / "configs" / "systemd" / "himamba@.service").read_text()
    assert re.search(r"^ExecStart=\S*himamba service %i --config \S+$", unit, re.M)
    assert "Environment=PYTHONSAFEPATH=1" in unit
    assert re.search(r"^Restart=(always|on-failure)$", unit, re.M)
    assert "KillSignal=SIGTERM" in unit
    target = (ROOT / "configs" / "systemd" / "himamba.target").read_text()
    for name in SERVICES:
        assert f"himamba@{name}.service" in target
