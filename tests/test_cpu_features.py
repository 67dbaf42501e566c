"""CPU ISA flags and the bfloat16 warning: read from a faked /proc/cpuinfo and faked caps, never this machine's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cbatch.model import cpu_features
from cbatch.model.cpu_features import bf16_speed_warning, cpu_flags, has_native_bf16, vector_isa_flags
from ops_jobs import run_inprocess, token_rows, write_jsonl

ZEN3 = frozenset("fpu sse2 avx fma avx2 bmi2 sha_ni".split())  # AVX2, no AVX-512
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl"}  # AVX-512 without bf16 dot products
CPU = torch.device("cpu")


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu sse2\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_vector_isa_flags_keep_what_decides_llm_speed():
    assert vector_isa_flags(SAPPHIRE_RAPIDS) == ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16",
                                                 "avx512_vnni", "avx512bw", "avx512f", "avx512vl"]
    assert vector_isa_flags(ZEN3) == ["avx2"]


@pytest.mark.parametrize("flags, env, native", [
    (ZEN3, {}, False),
    (SKYLAKE_X, {}, False),
    (ZEN4, {}, True),
    (SAPPHIRE_RAPIDS, {}, True),
    (ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, False),  # run as an AVX2 machine
    (ZEN4, {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False),  # AVX-512 without its bf16 extension
    (ZEN4, {"ATEN_CPU_CAPABILITY": "avx2"}, False),
    (ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"}, True),
    (frozenset({"fp", "asimd", "bf16"}), {}, True),  # Arm with BFDOT
])
def test_native_bf16(flags, env, native):
    assert has_native_bf16(flags, env) is native


def test_bf16_warning_only_for_bf16_on_a_cpu_without_it():
    message = bf16_speed_warning(torch.bfloat16, CPU, ZEN3, {})
    assert message is not None and "slower than float32" in message and "\n" not in message
    assert bf16_speed_warning(torch.bfloat16, CPU, ZEN4, {}) is None
    assert bf16_speed_warning(torch.float32, CPU, ZEN3, {}) is None
    assert bf16_speed_warning(torch.float16, CPU, ZEN3, {}) is None
    assert bf16_speed_warning(torch.bfloat16, torch.device("cuda"), ZEN3, {}) is None
    assert bf16_speed_warning(torch.bfloat16, CPU, frozenset(), {}) is None  # unknown CPU: nothing to say
    assert bf16_speed_warning(torch.bfloat16, CPU, ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX2"}) is not None


@pytest.mark.parametrize("flags, dtype, warned", [(ZEN3, "bfloat16", True), (ZEN4, "bfloat16", False),
                                                  (ZEN3, "auto", False)])
def test_cli_run_warns_once(tiny_checkpoints, tmp_path, monkeypatch, flags, dtype, warned):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(3, vocab=384, seed=5))
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "o.jsonl"), "--model",
                                 str(tiny_checkpoints["llama"]), "--device", "cpu", "--dtype", dtype)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("cbatch: warning:")]
    assert warnings == ([f"cbatch: warning: {bf16_speed_warning(torch.bfloat16, CPU, ZEN3, {})}"] if warned else [])


def test_cpu_description_names_the_isa_caps(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Test CPU\ncpu family\t: 25\nmodel\t\t: 97\nflags\t\t: fpu avx2 fma avx512f\n")
    plain = cpu_features.cpu_description(cpuinfo, {})
    assert plain == "CPU: Test CPU (family 25, model 97); vector flags: avx2 avx512f"
    capped = cpu_features.cpu_description(cpuinfo, {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert capped == plain + "; capped by ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"
