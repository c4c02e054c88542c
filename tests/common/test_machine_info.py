"""How benchmarks name the machine: the CPU's vector extensions from its /proc/cpuinfo flags."""

from __future__ import annotations

from himamba.bench.machine_info import MachineInfo, vector_extensions

ZEN4 = "fpu sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni avx512vbmi"
SAPPHIRE_RAPIDS = ZEN4 + " avx512_fp16 amx_tile amx_bf16 amx_int8"
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve svebf16 bf16 i8mm"


def test_x86_names_avx2_the_avx512_subsets_and_amx() -> None:
    assert vector_extensions(ZEN4) == "AVX2, AVX-512 (bf16, vnni), no AMX"
    assert vector_extensions(SAPPHIRE_RAPIDS) == "AVX2, AVX-512 (bf16, vnni, fp16), AMX (bf16, int8)"
    assert vector_extensions("fpu sse2 avx avx2 fma") == "AVX2, no AVX-512, no AMX"


def test_arm_names_neon_sve_and_their_subsets() -> None:
    assert vector_extensions(GRAVITON3) == "NEON, SVE, bf16, i8mm"


def test_unknown_flags_say_nothing_rather_than_guess() -> None:
    assert vector_extensions("") == ""


def test_the_machine_line_carries_them() -> None:
    machine = MachineInfo(2, 2, "cpu", "AMD EPYC", "", "2.13.0+cpu", vector_extensions(ZEN4))
    assert machine.line().startswith("machine: 2 cores (AMD EPYC; AVX2, AVX-512 (bf16, vnni), no AMX), torch 2.13.0")
    assert "()" not in MachineInfo(2, 2, "cpu", "AMD EPYC", "", "2.13.0+cpu").line()
