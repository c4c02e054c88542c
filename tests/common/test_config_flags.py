"""The server's command line: one documented flag per field, typed by the field, errors naming
the flag, HIMAMBA_API_KEY, and the vLLM/sglang spellings (each mapped, converted or refused)."""

from __future__ import annotations

import argparse

import pytest

from himamba.common.config import Config, ConfigError, fields
from himamba.common.config_flags import (
    COMPAT_FLAGS,
    ENV_API_KEY,
    add_config_flags,
    config_from_args,
    formatter_class,
)
from himamba.services.cli import _parser


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _parse(argv, monkeypatch=None):
    p = argparse.ArgumentParser(formatter_class=formatter_class(), allow_abbrev=False)
    p.add_argument("--config")
    add_config_flags(p, positional_model=True)
    return config_from_args(p.parse_args(argv))


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv(ENV_API_KEY, raising=False)


def test_every_flag_help_is_its_field_documentation_and_debug_hooks_are_hidden():
    parser = _serve_parser()
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for info in fields():
        action = by_flag[info.flag]
        if info.hidden:
            assert action.help == argparse.SUPPRESS
        else:
            assert action.help == info.doc, info.flag
    text = parser.format_help()
    assert "--debug-" not in text
    assert "CFG__" not in text
    assert "(default: 16)" in text  # the default is shown after the documentation


def test_flags_are_generated_from_fields():
    cfg = _parse(
        ["--page-size", "32", "--disable-radix-cache", "--model", "/x/y", "--hicache-write-policy", "write_back"]
    )
    assert cfg.cache.page_size == 32
    assert cfg.cache.disable_radix_cache is True
    assert cfg.model.model == "/x/y"
    assert cfg.cache.hicache_write_policy == "write_back"
    assert cfg.scheduler == Config().scheduler


def test_debug_hooks_still_work_when_hidden():
    assert _parse(["--debug-storage-fail-rate", "0.5"]).debug.storage_fail_rate == 0.5


def test_the_debug_table_holds_every_test_hook_under_its_old_flag(tmp_path):
    """The hooks moved from [cache]/[scheduler] into one [debug] table; their flags kept the names
    they had (`--debug-` + the field), and nothing else in the tree is a test hook."""
    flags = {info.flag: info for info in fields() if info.section == "debug"}
    assert set(flags) == {
        "--debug-fail-lazy-alloc", "--debug-storage-fail-rate", "--debug-storage-slow-s",
        "--debug-storage-prefetch-stall-pages", "--debug-transfer-direction", "--debug-transfer-fail-at",
        "--debug-batch-fail-at-transfer", "--debug-worker-exit-at-transfer",
    }  # fmt: skip
    assert all(info.hidden for info in flags.values())
    cfg = _parse(["--debug-transfer-direction", "h2d", "--debug-transfer-fail-at", "2", "--debug-fail-lazy-alloc"])
    assert (cfg.debug.transfer_direction, cfg.debug.transfer_fail_at, cfg.debug.fail_lazy_alloc) == ("h2d", 2, True)
    assert cfg.cache == Config().cache and cfg.scheduler == Config().scheduler
    f = tmp_path / "c.toml"
    f.write_text("[debug]\nworker_exit_at_transfer = 3\n")
    assert _parse(["--config", str(f)]).debug.worker_exit_at_transfer == 3
    f.write_text("[cache]\ndebug_worker_exit_at_transfer = 3\n")  # the old place is refused, by name
    with pytest.raises(ConfigError, match="debug_worker_exit_at_transfer"):
        _parse(["--config", str(f)])
    with pytest.raises(ConfigError, match=r"--debug-transfer-fail-at \(debug\.transfer_fail_at\)"):
        f.write_text("[debug]\ntransfer_fail_at = -1\n")
        _parse(["--config", str(f)])


@pytest.mark.parametrize(
    ("argv", "section", "field", "value"),
    [
        (["--api-key", "12345"], "http", "api_key", "12345"),
        (["--api-key", "true"], "http", "api_key", "true"),
        (["--served-model-name", "7"], "model", "served_model_name", "7"),
        (["--hicache-storage-dir", "123"], "cache", "hicache_storage_dir", "123"),
        (["--model", "2024"], "model", "model", "2024"),
        (["--hicache-ratio", "3"], "cache", "hicache_ratio", 3.0),
        (["--tool-call-parser", "hermes"], "http", "tool_call_parser", "hermes"),  # vLLM's flag and values
        (["--reasoning-parser", "deepseek_r1"], "http", "reasoning_parser", "deepseek_r1"),
    ],
)
def test_strings_are_strings(argv, section, field, value):
    got = getattr(getattr(_parse(argv), section), field)
    assert got == value and type(got) is type(value)


def test_value_errors_name_the_flag(capsys):
    with pytest.raises(ConfigError, match=r"--page-size 0: Expected `int` >= 1"):
        _parse(["--page-size", "0"])
    with pytest.raises(ConfigError, match=r"--memory-fraction 1.5"):
        _parse(["--memory-fraction", "1.5"])
    with pytest.raises(ConfigError, match=r"--mamba-track-interval \(scheduler.mamba_track_interval\) = 40"):
        _parse(["--mamba-track-interval", "40"])
    with pytest.raises(SystemExit):
        _parse(["--page-size", "sixteen"])
    assert "argument --page-size: invalid int value: 'sixteen'" in capsys.readouterr().err


def test_api_key_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_API_KEY, "from-env 1")
    assert _parse([]).http.api_key == "from-env 1"
    f = tmp_path / "c.toml"
    f.write_text('[http]\napi_key = "from-file"\n')
    assert _parse(["--config", str(f)]).http.api_key == "from-env 1"  # flag > env > file
    assert _parse(["--api-key", "from-flag"]).http.api_key == "from-flag"


# Every vLLM/sglang spelling that means one of our fields, and the field it sets.
ALIASES = [
    (["--model-path", "/m"], "model", "model", "/m"),
    (["/m"], "model", "model", "/m"),  # positional, as `vllm serve MODEL`
    (["--tokenizer", "/t"], "model", "tokenizer", "/t"),
    (["--tokenizer-path", "/t"], "model", "tokenizer", "/t"),
    (["--chat-template", "/t.jinja"], "model", "chat_template", "/t.jinja"),
    (["--max-model-len", "2048"], "model", "max_context_len", 2048),
    (["--context-length", "2048"], "model", "max_context_len", 2048),
    (["--max-num-seqs", "8"], "scheduler", "max_running_requests", 8),
    (["--hicache-size", "12"], "cache", "hicache_size_gb", 12.0),
    (["--radix-eviction-policy", "lru"], "cache", "eviction_policy", "lru"),
    (["--disable-overlap-schedule"], "scheduler", "disable_overlap", True),
    (["--log-level", "debug"], "log", "level", "debug"),
    (["--log-level", "WARNING"], "log", "level", "warning"),
    (["--dtype", "auto"], "model", "dtype", "auto"),
    (["--mem-fraction-static", "0.8"], "cache", "memory_fraction", 0.8),
    (["--mem-fraction-static", "0.8"], "cache", "memory_fraction_of", "total"),
    (["--gpu-memory-utilization", "0.9"], "cache", "memory_fraction", 0.9),
    (["--gpu-memory-utilization", "0.9"], "cache", "memory_fraction_of", "total"),
]


@pytest.mark.parametrize(("argv", "section", "field", "value"), ALIASES, ids=lambda v: str(v))
def test_aliases_map_to_the_field_they_name(argv, section, field, value):
    assert getattr(getattr(_parse(argv), section), field) == value


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable-metrics"],
        ["--enable-prefix-caching"],
        ["--trust-remote-code"],
        ["--tp", "1"],
        ["--pp", "1"],
        ["--kv-cache-dtype", "auto"],
        ["--enable-auto-tool-choice"],
    ],
)
def test_flags_that_ask_for_what_we_do_are_accepted(argv):
    assert _parse(argv) == Config()


REFUSED = [
    (["--pipeline-parallel-size", "2"], "tensor parallelism"),
    (["--dp-size", "4"], "one device"),
    (["--quantization", "fp8"], "Quantized"),
    (["--kv-cache-dtype", "fp8"], "model dtype"),
    (["--revision", "main"], "hf download"),
    (["--ssl-keyfile", "k.pem"], "TLS"),
]


@pytest.mark.parametrize(("argv", "why"), REFUSED, ids=lambda v: str(v))
def test_flags_we_cannot_honour_are_refused_with_the_reason(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{argv[0]}" in err and "not supported" in err and why in err


def test_every_refused_flag_is_tested_or_shares_a_tested_reason():
    tested = {a[0] for a, _ in REFUSED}
    for cf in COMPAT_FLAGS:
        if cf.kind != "accepted":
            assert (
                tested & set(cf.flags)
                or any(why in cf.why for _, why in REFUSED)
                or cf.flags[0]
                in (
                    "--speculative-config",
                    "--speculative-config",
                    "--enable-lora",
                    "--lora-modules",
                )
            ), cf.flags


def test_conflicting_spellings_are_refused():
    with pytest.raises(ConfigError, match="--mem-fraction-static and --memory-fraction"):
        _parse(["--mem-fraction-static", "0.8", "--memory-fraction", "0.5"])
    with pytest.raises(ConfigError, match="two models"):
        _parse(["/a", "--model", "/b"])
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        _parse(["--mem-fraction-static", "1.5"])


def test_no_abbreviations():
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--tok", "x"])


def test_the_disk_tier_is_off_unless_a_backend_or_a_directory_asks_for_it(tmp_path):
    from himamba.services.launch import storage_line

    assert _parse([]).cache.hicache_storage_backend == "none"
    assert "--hicache-storage-backend file" in storage_line(_parse([]))  # the banner says how to turn it on
    by_dir = _parse(["--hicache-storage-dir", str(tmp_path)])
    assert by_dir.cache.hicache_storage_backend == "file"
    assert storage_line(by_dir) == f"storage tier on: file backend in {tmp_path}"
    assert _parse(["--hicache-storage-backend", "file"]).cache.hicache_storage_backend == "file"
    remote = ["--hicache-storage-backend", "redis", "--hicache-storage-dir", str(tmp_path)]
    assert _parse(remote).cache.hicache_storage_backend == "redis"  # a directory never overrides a remote store
    toml = tmp_path / "c.toml"
    toml.write_text(f'[cache]\nhicache_storage_dir = "{tmp_path}"\n')
    assert config_from_args(argparse.Namespace(config=str(toml))).cache.hicache_storage_backend == "file"
    # An explicit "none" is the operator's opt-out: a directory (here or in the file) never overrides it.
    off = ["--hicache-storage-backend", "none", "--hicache-storage-dir", str(tmp_path)]
    assert _parse(off).cache.hicache_storage_backend == "none"
    assert _parse(["--config", str(toml), "--hicache-storage-backend", "none"]).cache.hicache_storage_backend == "none"
