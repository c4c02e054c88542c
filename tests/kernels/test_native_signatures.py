"""The native kernels' ctypes signatures are read from their C definitions (one source, no table)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from himamba.kernels.native import build
from himamba.kernels.native.signatures import Signature, read_signatures

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def test_every_entry_point_a_wrapper_calls_is_read_from_the_c() -> None:
    wrappers = Path(build.__file__).parent.glob("*.py")
    called = {name for w in wrappers for name in re.findall(r"library\.(hm_\w+)", w.read_text())}
    assert called and set(read_signatures(build.SOURCES)) == called


def test_a_definition_reads_in_parameter_order() -> None:
    # norm.c: void hm_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float eps,
    #                              float *out, int64_t rows, int64_t width)
    got = read_signatures(build.SOURCES)["hm_rms_norm_f32"]
    assert got == Signature((P, I64, P, F32, P, I64, I64), None)
    assert read_signatures(build.SOURCES)["hm_conv_scan_f32"].result is I64


def test_only_hm_definitions_count_and_declarations_span_lines(tmp_path) -> None:
    src = tmp_path / "k.c"
    src.write_text(
        "static int64_t helper(int64_t a) { return a; }\n"
        "int64_t hm_two_f32(const float *x, int64_t n,\n"
        "                   float scale, const int64_t *slots) {\n"
        "    return helper(n);\n"
        "}\n"
        "void hm_none(void) {}\n"
    )
    assert read_signatures([src]) == {
        "hm_two_f32": Signature((P, I64, F32, P), I64),
        "hm_none": Signature((), None),
    }


def test_an_array_parameter_is_a_pointer(tmp_path) -> None:
    """C reads `float x[]` (and `x[restrict]`, `x[static 4]`) as a pointer: bound as a float it would
    pass a number where the kernel reads memory."""
    src = tmp_path / "k.c"
    src.write_text("void hm_rows_f32(const float x[], int64_t n, float out[restrict], int64_t s[static 4]) {}\n")
    assert read_signatures([src]) == {"hm_rows_f32": Signature((P, I64, P, P), None)}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("void hm_bad(const float *x, double eps) {}\n", r"k\.c: hm_bad: parameter 'double eps'"),
        ("float hm_bad(int64_t n) { return 0; }\n", r"k\.c: hm_bad: result type 'float'"),
        ("void hm_twice(int64_t n) {}\nvoid hm_twice(int64_t n) {}\n", r"k\.c: hm_twice is defined twice"),
    ],
)
def test_a_definition_the_binding_cannot_express_is_named(tmp_path, text: str, message: str) -> None:
    src = tmp_path / "k.c"
    src.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_signatures([src])
