"""The CPU's feature flags, as mmspec chooses its kernels and its "auto" dtype by them, and the
rest of /proc/cpuinfo's first processor (the benchmarks' machine record: name, family, model).

A module of its own beneath everything that asks (:mod:`mmspec.hub` for the "auto" dtype,
:mod:`mmspec.modeling` for the C kernels, :mod:`mmspec.bench` for the machine record): reading
/proc/cpuinfo needs nothing of mmspec, and the hub sits below the modeling layer, so the flags
cannot live in :mod:`mmspec.modeling.fast_linear` (which re-exports them under their old names).
"""

from __future__ import annotations

import functools
import os


def parse_cpuinfo(text: str) -> dict[str, str]:
    """/proc/cpuinfo's text -> the first processor's fields ("model name", "cpu family", "model",
    "flags", ...)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (read at each call; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {}


@functools.cache
def machine_cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (read once; empty where there is none)."""
    return frozenset(cpuinfo_fields().get("flags", "").split())


@functools.cache
def intel_cpu() -> bool:
    """Whether /proc/cpuinfo names an Intel CPU (vendor_id GenuineIntel): its cores retire vdpbf16ps
    at half the rate of two vfmadd231ps, so the bf16 vector kernel sums through the latter there
    (:func:`mmspec.modeling.fast_linear.load_kernel`; the same bits). Read once per process: the
    voice's NAR stage asks for each of its linears (~50 a sentence), and /proc/cpuinfo runs to
    hundreds of kB on a many-core server (stop 92: the reads cost 3 ms a sentence on a 2-core VM)."""
    return cpuinfo_fields().get("vendor_id") == "GenuineIntel"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU flags mmspec chooses its kernels and its "auto" dtype by (read once per process, as
    the kernel choices are made): the machine's, or the subset that ``MMSPEC_CPU_FLAGS`` names
    (comma-separated), so that one machine runs mmspec as a CPU with fewer features would (``avx2,fma``: an AVX2-only CPU, float32 and the 8-lane
    kernels; with PyTorch's own ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and
    ``MKL_ENABLE_INSTRUCTIONS=AVX2`` for its operators).

    Raises:
        ValueError: ``MMSPEC_CPU_FLAGS`` names a flag this CPU lacks.
    """
    wanted = os.environ.get("MMSPEC_CPU_FLAGS")
    if wanted is None or not wanted.strip():  # (set but empty, as a CI matrix may leave it: unset)
        return machine_cpu_flags()
    named = frozenset(wanted.replace(",", " ").split())
    if missing := named - machine_cpu_flags():
        raise ValueError(f"MMSPEC_CPU_FLAGS={wanted!r} names flags this CPU lacks ({', '.join(sorted(missing))}); "
                         "name a subset of its flags (e.g. avx2,fma) or unset it")
    return named
