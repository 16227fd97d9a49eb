"""Benchmark result files: one JSON written atomically after every measurement, so a run resumes."""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path


def load_results(path: Path, suite: str, settings: dict) -> dict:
    """The results of ``mmspec bench SUITE`` at ``path`` to resume ({} when there are none yet),
    marked with the suite and the ``settings`` its runs depend on (model, token budget, dtype, ...:
    what a run's key does not name). A file of another suite, of other settings (named in the
    line) or not a JSON object is refused in one ValueError line, before anything is measured."""
    from ..cli.dataset import changed_settings

    results: dict = {}
    if path.exists():
        try:
            results = json.loads(path.read_text())
        except (ValueError, OSError) as error:
            raise ValueError(f"{path} is not a results file ({error.__class__.__name__}); pass another --results file") from None
        if (not isinstance(results, dict) or not isinstance(results.get("runs", {}), dict)
                or not {"suite", "runs"} & results.keys()):  # (a JSON object of something else: left as it is)
            raise ValueError(f"{path} is not a results file of mmspec bench; pass another --results file")
        if results.get("suite", suite) != suite:
            raise ValueError(f"{path} holds results of mmspec bench {results['suite']}, not {suite}; pass another --results file")
        shown = changed_settings(results.get("settings", {}), settings)
        if shown:
            raise ValueError(f"{path} holds runs of other settings ({shown}); rerun with those to resume, or pass "
                             "another --results file")
    results["suite"], results["settings"] = suite, settings
    return results


def check_meta(path: Path, results: dict, meta: dict) -> None:
    """Refuse a resume of ``results`` (a results file read by :func:`load_results`) whose recorded
    ``meta`` (what every run depends on: settings, machine, kernels) is not ``meta``, in one
    ValueError line naming what changed. The git commit is recorded, not compared: a rerun of a
    complete file after a later commit derives its tables again (it was refused as "other settings")."""
    from ..cli.dataset import changed_settings

    before = results.get("meta", meta)

    def bare(record: dict) -> dict:
        machine = record.get("machine")
        return {**record, "machine": {k: v for k, v in machine.items() if k != "commit"}} if isinstance(machine, dict) else record

    if not isinstance(before, dict) or bare(before) != bare(meta):
        settings = {key: value for key, value in meta.items() if key not in ("machine", "linears")}
        shown = changed_settings(before, settings) or "measured on another machine or kernels"
        raise ValueError(f"{path} holds results of other settings ({shown}); rerun with those to resume, or pass another "
                         "--results file")


def save_results(path: Path, results: dict) -> None:
    """Write ``results`` as ``path`` whole (through mmspec.cli.output: a failure names the path,
    and a failed write keeps the previous file)."""
    from ..cli.output import write_text

    write_text(path, json.dumps(results))


@functools.lru_cache(maxsize=1)
def source_commit() -> str | None:
    """The git commit of mmspec's source tree (with "-dirty" when files differ from it), or None
    outside a git checkout: a results file says which code measured it (read once a process: a
    benchmark asks for the machine twice, for its resume check and its results)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "mmspec"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def run_settings(args, device: str = "cpu") -> dict:
    """What every measurement of a resumed results file must share beyond the suite's own settings:
    threads, device, the kernels' use (few-row linears, the attention and decoder-layer kernels), CUDA
    graphs, the draft length and the machine (CPU model and speed flags, torch and transformers): a
    resume with other ones mixed both into one median. The git commit is recorded (machine_info), not
    compared, so that a complete file's tables can be derived again after a later commit."""
    machine = machine_info("-", args.threads, device)
    # the attention and layer kernels (MMSPEC_ATTENTION, MMSPEC_FUSED) at the top level, where a
    # file from before they were recorded does not hold them (its resume is not refused for that)
    return {"threads": args.threads, "device": device, "optimize": getattr(args, "optimize", True),
            "attention": machine["attention"], "layers": machine["layers"],
            "cuda_graphs": getattr(args, "cuda_graphs", False), "num_draft_tokens": getattr(args, "num_draft_tokens", None),
            "machine": {k: machine.get(k) for k in ("cpu", "cpu_model", "cpu_flags", "device", "torch", "transformers",
                                                    "emulated_from")}}


def command_line(suite: str, args, names: tuple[str, ...]) -> str:
    """The command that reruns a benchmark, as its results file records it: ``mmspec bench SUITE``
    and ``--name value`` for each of ``names`` that ``args`` has set (not None), then the flags
    set that change what loads (--no-optimize, --trust-remote-code)."""
    flags = " --no-optimize" if getattr(args, "optimize", True) is False else ""
    flags += " --trust-remote-code" if getattr(args, "trust_remote_code", False) is True else ""
    return f"mmspec bench {suite} " + " ".join(f"--{name.replace('_', '-')} {getattr(args, name)}" for name in names
                                               if getattr(args, name, None) is not None) + flags


#: CPU flags that decide which dtype is fast (bf16 matmuls: AVX512-BF16 or AMX; else fp32 on AVX2)
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def method_specs(text: str, example: str) -> list[str]:
    """``--methods`` TEXT -> its specs (:func:`~mmspec.pipelines.methods.split_specs`), or one
    ValueError line where it names none (``--methods ""`` ran the default set, or measured nothing);
    ``example``: a comma list the line suggests."""
    from ..pipelines.methods import split_specs

    specs = split_specs(text)
    if not specs:
        raise ValueError(f"--methods {text!r} names no method; give a comma list (e.g. --methods {example}), or leave "
                         "--methods out for the default set")
    return specs


def add_device_args(parser) -> None:
    """``--device`` (default cpu) and ``--no-optimize``, shared by the benchmarks that build a pipeline."""
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (timed with the device synchronised)")
    parser.add_argument("--no-optimize", dest="optimize", action="store_false",
                        help="measure the models' linears as loaded (default: few-row linears, mmspec.optimize)")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: ``taskset -c 1`` gives 1)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_threads_arg(parser) -> None:
    """``--threads``, by default the cores this process may run on (:func:`usable_cores`): more
    threads than those cores time their contention, not the methods."""
    parser.add_argument("--threads", type=int, default=usable_cores(),
                        help="torch threads (default: the cores this process may run on, here %(default)s)")


def machine_line(machine: dict) -> str:
    """A results file's "machine" record -> "AMD EPYC (avx2 avx512f)", or on a GPU
    "NVIDIA H100 80GB HBM3 (host: Intel Xeon)": what a table's numbers were measured on."""
    cpu = f"{machine.get('cpu')}{', ' + machine['cpu_model'] if 'cpu_model' in machine else ''} ({' '.join(machine.get('cpu_flags', []))})"
    if "emulated_from" in machine:
        cpu += f", run as such on a CPU with ({' '.join(machine['emulated_from'])}), PyTorch's operators at {machine.get('aten_cpu_capability')}"
        if "onednn_max_isa" in machine:  # (files before stop 87 did not record it)
            isa = machine["onednn_max_isa"]
            cpu += ", oneDNN unrestricted" if isa == "all" else f", oneDNN up to {isa}"
    device = machine.get("device", "cpu")
    return cpu if device == "cpu" else f"{device} (host: {machine.get('cpu')})"


def machine_info(dtype: str, threads: int, device: str = "cpu") -> dict:
    """What a measurement depends on: {"cpu", "cpu_model" (x86 Linux: "family F model M", e.g. Zen 4
    or Zen 5 behind one name), "cpu_flags" (those of SPEED_FLAGS present), "device"
    ("cpu" or the GPU's name), "threads", "dtype", "attention" (the decoding steps' attention:
    "c", the batch-invariant kernel, or "sdpa"), "layers" (decoder layers of few-row steps: "fused",
    one C call each, or "modules"), "torch", "transformers"}; where ``MMSPEC_CPU_FLAGS`` runs mmspec
    as a CPU with fewer features, also "emulated_from" (the machine's own SPEED_FLAGS),
    "aten_cpu_capability" (PyTorch's instruction set, ``ATEN_CPU_CAPABILITY``) and "onednn_max_isa"
    (``ONEDNN_MAX_CPU_ISA``, "all" where unset: then PyTorch's matmuls still use every feature of
    this CPU, AMX tiles included, and a warning says so)."""
    import platform

    import torch
    import transformers

    from ..cpu import cpu_flags, cpuinfo_fields, machine_cpu_flags
    from ..modeling.attention import attention_backend
    from ..modeling.fused import fused_enabled

    fields = cpuinfo_fields()
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    flags = [flag for flag in SPEED_FLAGS if flag in cpu_flags()]
    name = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "cpu"
    info = {"cpu": cpu, "cpu_flags": flags, "device": name, "threads": threads, "dtype": dtype,
            "attention": "sdpa" if name != "cpu" else attention_backend(),
            "layers": "fused" if name == "cpu" and fused_enabled() else "modules",
            "torch": torch.__version__, "transformers": transformers.__version__}
    if "cpu family" in fields and "model" in fields:  # (a name like "AMD EPYC" covers CPUs whose speedups differ)
        info["cpu_model"] = f"family {fields['cpu family']} model {fields['model']}"
    if cpu_flags() != machine_cpu_flags():  # MMSPEC_CPU_FLAGS: run as a CPU with fewer features
        info["emulated_from"] = [flag for flag in SPEED_FLAGS if flag in machine_cpu_flags()]
        info["aten_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["onednn_max_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip() or "all"
        if info["onednn_max_isa"] == "all":
            warnings.warn("MMSPEC_CPU_FLAGS runs mmspec as a CPU with fewer features, but PyTorch's oneDNN still uses all of "
                          "this one's (AMX tiles included): set ONEDNN_MAX_CPU_ISA too (e.g. AVX512_CORE_BF16, "
                          "AVX512_CORE_VNNI or AVX2) to measure such a CPU", stacklevel=2)
    info["commit"] = source_commit()
    return info
