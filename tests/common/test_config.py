from __future__ import annotations

from pathlib import Path

import pytest

from himamba.common.config import Config, ConfigError, DebugConfig, ModelConfig, fields, load, resolve_dtype

ROOT = Path(__file__).resolve().parents[2]


def test_default_toml_equals_embedded_default():
    assert load(ROOT / "configs" / "default.toml") == Config()


def test_every_field_is_documented_once():
    for info in fields():
        assert info.doc and info.doc[0].isupper(), info.flag
        assert info.doc.endswith("."), info.flag
    hidden = {(info.section, info.field) for info in fields() if info.hidden}
    assert hidden == {("debug", field) for field in DebugConfig.__struct_fields__}  # the test hooks, and only they
    assert len(hidden) == 8


def test_file_errors_name_the_flag_and_the_field(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[cache]\npage_size = 0\n")
    with pytest.raises(ConfigError, match=r"--page-size \(cache\.page_size\)"):
        load(f)
    f.write_text("[cache]\npagesize = 3\n")
    with pytest.raises(ConfigError, match="pagesize"):
        load(f)
    f.write_text("[cache]\npage_size = 48\n")
    with pytest.raises(ConfigError, match=r"--mamba-track-interval .* multiple of --page-size"):
        load(f)


@pytest.mark.parametrize(
    ("device", "dtype", "checkpoint", "want"),
    [
        ("cuda", "auto", {"dtype": "bfloat16"}, "bfloat16"),  # transformers 5
        ("cuda", "auto", {"torch_dtype": "float16"}, "float16"),  # older checkpoints
        ("cuda", "auto", {}, "float32"),
        ("cpu", "auto", {"dtype": "bfloat16"}, "float32"),  # CPU: the reference kernels run float32
        ("cpu", "bfloat16", {"dtype": "float32"}, "bfloat16"),  # an explicit dtype wins
        ("cuda", "float16", {"dtype": "bfloat16"}, "float16"),
    ],
)
def test_dtype_auto_has_one_definition(device, dtype, checkpoint, want):
    got = resolve_dtype(ModelConfig(device=device, dtype=dtype), checkpoint)
    assert got.dtype == want
    assert got.why  # the start-up log says why


def test_dtype_auto_refuses_a_dtype_it_cannot_serve():
    with pytest.raises(ConfigError, match=r"--dtype .*float8_e4m3fn.*pass one of"):
        resolve_dtype(ModelConfig(device="cuda"), {"dtype": "float8_e4m3fn"})
