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

    real_open = builtins.open

    def fake_cpuinfo(flags):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor : 0\nflags\t\t: fpu {flags}\n")
        return lambda name, *a, **k: real_open(path if name == "/proc/cpuinfo" else name, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_cpuinfo("avx avx2 fma"))
    assert not hub.fast_bf16("cpu")
    monkeypatch.setattr(builtins, "open", fake_cpuinfo("avx2 avx512f amx_bf16 amx_tile"))
    assert hub.fast_bf16("cpu")
