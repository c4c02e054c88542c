from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from himamba.common.config import Config, ConfigError, add_config_flags, config_from_args, load

ROOT = Path(__file__).resolve().parents[2]


def test_default_toml_equals_embedded_default():
    assert load(ROOT / "configs" / "default.toml") == Config()


def _parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_config_flags(p)
    return config_from_args(p.parse_args(argv))


def test_flags_are_generated_from_fields():
    cfg = _parse(["--page-size", "32", "--disable-radix-cache", "--model", "/x/y", "--hicache-write-policy", "write_back"])
    assert cfg.cache.page_size == 32
    assert cfg.cache.disable_radix_cache is True
    assert cfg.model.model == "/x/y"
    assert cfg.cache.hicache_write_policy == "write_back"
    assert cfg.scheduler == Config().scheduler


def test_bad_values_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"cache.page_size"):
        _parse(["--page-size", "0"])
    f = tmp_path / "c.toml"
    f.write_text("[cache]\npagesize = 3\n")
    with pytest.raises(ConfigError, match="pagesize"):
        load(f)


def test_file_then_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[cache]\npage_size = 4\nmax_total_tokens = 1024\n")
    cfg = _parse(["--config", str(f), "--max-total-tokens", "2048"])
    assert (cfg.cache.page_size, cfg.cache.max_total_tokens) == (4, 2048)
