"""dtype="auto" picks bfloat16 only where bfloat16 matmuls are fast."""

import pytest
import torch

from mmspec import hub


def test_auto_dtype_follows_the_hardware(monkeypatch):
    assert hub.resolve_dtype("auto", "cuda") == torch.bfloat16
    assert hub.resolve_dtype("fp32") == torch.float32 and hub.resolve_dtype(torch.float16) == torch.float16
    expected = torch.bfloat16 if hub.fast_bf16("cpu") else torch.float32
    assert hub.resolve_dtype("auto", "cpu") == expected
    monkeypatch.setattr(hub, "fast_bf16", lambda device="cpu": False)
    assert hub.resolve_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        hub.resolve_dtype("int8")


def test_fast_bf16_reads_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    from mmspec.modeling.fast_linear import cpu_flags, machine_cpu_flags

    real_open = builtins.open

    def fake_cpuinfo(flags):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor : 0\nflags\t\t: fpu {flags}\n")
        machine_cpu_flags.cache_clear(), cpu_flags.cache_clear()
        return lambda name, *a, **k: real_open(path if name == "/proc/cpuinfo" else name, *a, **k)

    try:
        monkeypatch.delenv("MMSPEC_CPU_FLAGS", raising=False)  # (the made-up CPUs' own flags, whatever the run narrows them to)
        monkeypatch.setattr(builtins, "open", fake_cpuinfo("avx avx2 fma"))
        assert not hub.fast_bf16("cpu")
        monkeypatch.setattr(builtins, "open", fake_cpuinfo("avx2 avx512f amx_bf16 amx_tile"))
        assert hub.fast_bf16("cpu")
        monkeypatch.setenv("MMSPEC_CPU_FLAGS", "avx2,avx512f")  # run as a CPU without the bf16 units
        cpu_flags.cache_clear()
        assert not hub.fast_bf16("cpu")
        monkeypatch.setenv("MMSPEC_CPU_FLAGS", "avx2,avx512_bf16")
        cpu_flags.cache_clear()
        with pytest.raises(ValueError, match=r"MMSPEC_CPU_FLAGS='avx2,avx512_bf16' names flags this CPU lacks \(avx512_bf16\)"):
            hub.fast_bf16("cpu")
        monkeypatch.setenv("MMSPEC_CPU_FLAGS", " ")  # set but empty (a CI matrix's blank): unset, not a CPU of no flags
        cpu_flags.cache_clear()
        assert hub.fast_bf16("cpu") and cpu_flags() == machine_cpu_flags()
    finally:
        monkeypatch.undo()
        machine_cpu_flags.cache_clear(), cpu_flags.cache_clear()


def test_intel_cpu_reads_cpuinfo_once(monkeypatch):
    """intel_cpu() is asked per linear of the voice's NAR stage (bf16 without AMX): /proc/cpuinfo,
    hundreds of kB on a many-core server, is read for its first call only."""
    from mmspec import cpu

    reads = []
    monkeypatch.setattr(cpu, "cpuinfo_fields", lambda: reads.append(1) or {"vendor_id": "AuthenticAMD"})
    cpu.intel_cpu.cache_clear()
    try:
        assert [cpu.intel_cpu() for _ in range(50)] == [False] * 50 and len(reads) == 1
    finally:
        cpu.intel_cpu.cache_clear()


def test_cpu_flags_emulate_an_avx2_cpu():
    """MMSPEC_CPU_FLAGS=avx2,fma on a CPU with more: the "auto" dtype, the kernels and the benchmark
    record are an AVX2-only CPU's (a fresh process: the kernel choices are made once per process), and
    the record says how far oneDNN was held (ONEDNN_MAX_CPU_ISA; unset: a warning)."""
    import json
    import os
    import subprocess
    import sys

    from mmspec.modeling.fast_linear import machine_cpu_flags

    if not {"avx2", "fma"} <= machine_cpu_flags():
        pytest.skip("needs a CPU with AVX2 and FMA")
    code = ("import json, torch; from mmspec import hub; from mmspec.bench.results import machine_info; "
            "from mmspec.modeling.fast_linear import bf16_variants, fp32_variants; "
            "print(json.dumps([str(hub.resolve_dtype('auto')), fp32_variants(), bf16_variants(), machine_info('float32', 1)]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MMSPEC_CPU_FLAGS": "avx2,fma", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                         capture_output=True, text=True, check=True).stdout
    dtype, fp32, bf16, machine = json.loads(out.strip().splitlines()[-1])
    assert dtype == "torch.float32" and fp32 == ["avx2"] and bf16 == []
    assert machine["cpu_flags"] == ["avx2"] and "avx2" in machine["emulated_from"]
    from mmspec.bench.results import machine_line

    assert machine["onednn_max_isa"] == "AVX2" and machine_line(machine).endswith(", oneDNN up to AVX2")
    # without ONEDNN_MAX_CPU_ISA PyTorch's matmuls keep every feature of this CPU: recorded, and a warning says so
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_MAX_CPU_ISA"}
    run = subprocess.run([sys.executable, "-c", code], env={**env, "MMSPEC_CPU_FLAGS": "avx2,fma"}, capture_output=True,
                         text=True, check=True)
    assert json.loads(run.stdout.strip().splitlines()[-1])[-1]["onednn_max_isa"] == "all"
    assert "set ONEDNN_MAX_CPU_ISA too" in run.stderr
