"""``drafter="auto"`` for captioning: the table of benchmarked drafters beside a checkpoint.

1. If the model directory holds ``mmspec_drafters.json`` -- written by ``mmspec bench caption
   --write-drafters-file``: the machine it was measured on and a list ``"drafters"`` of
   ``{"drafter": <spec or path>, "speedup": <float>}`` entries (optionally with
   ``"num_draft_tokens": K``; a bare list of entries is read too) -- the entry with the highest
   ``speedup`` is used. ``drafter`` is a spec ("prompt-lookup", "prompt-lookup:10",
   "layer-skip:8", "ar") or the path of a draft model directory, relative to the model directory
   (a text-only causal LM sharing the target's tokenizer: the SPD setting; or a smaller VLM of a
   supported family).
2. Otherwise "prompt-lookup": training-free, never slower than a few percent, and captions often
   repeat words of the prompt and of themselves.

Speedups over plain decoding differ by the kind of machine (a verification of many rows costs
about one row's time on AMX tiles and GPUs, several rows' on AVX2), so a file may hold one table per
kind (:func:`machine_kind`): the top-level one and ``"other_machines"``, each written by the
benchmark run on a machine of that kind. The pipeline reads the table of its own machine's kind
(:func:`table_for`), else the top-level one.

When sampling, a file that measured a temperature > 0 (entries with
``"sampled_speedup_per_token"``) gives the entry fastest per token there instead
(:func:`choose_sampling_drafter`); batches use the file's ``"batches"`` table
(:func:`choose_batch_drafter`). Nothing here loads a model: these are pure functions of the file,
so the pipeline, ``mmspec bench caption`` and the docs read the same table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...core import words

#: benchmarked drafters of a checkpoint, read by drafter="auto"
DRAFTERS_FILE = "mmspec_drafters.json"
#: drafter="auto" without a DRAFTERS_FILE
AUTO_FALLBACK = "prompt-lookup"
#: machine kinds (:func:`machine_kind`), as the descriptions name them
KIND_NAMES = {"cuda": "GPUs", "amx": "CPUs with AMX", "avx512bf16": "CPUs with AVX-512 BF16 and no AMX",
              "avx512": "AVX-512 CPUs without BF16", "avx2": "AVX2-only CPUs"}


def machine_kind(machine: dict[str, Any] | None) -> str | None:
    """The kind of a table's "machine" record (:func:`mmspec.bench.results.machine_info`): "cuda"
    (any GPU), else by the CPU's best matrix unit: "amx", "avx512bf16", "avx512" or "avx2"; None
    where the file recorded no machine."""
    if not machine:
        return None
    if machine.get("device", "cpu") != "cpu":
        return "cuda"
    flags = set(machine.get("cpu_flags") or ())
    return next((kind for kind, flag in (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"))
                 if flag in flags), "avx2")


def running_kind(device_type: str = "cpu") -> str:
    """This process's :func:`machine_kind` on ``device_type`` (the CPU flags mmspec runs by,
    ``MMSPEC_CPU_FLAGS`` included)."""
    from ...cpu import cpu_flags

    return machine_kind({"device": device_type, "cpu_flags": sorted(cpu_flags())})


def table_for(table: dict[str, Any], runs_on: tuple[str, bool] | None) -> dict[str, Any]:
    """The part of a drafters file (:func:`read_auto_table`) measured on the kind of machine the
    pipeline runs on (``runs_on`` = (device type, CUDA graphs); None: this CPU): an entry of
    ``"other_machines"`` of that kind, with the file's batch table; else the top-level table."""
    kind = running_kind(runs_on[0] if runs_on else "cpu")
    for section in table.get("other_machines", []):
        if machine_kind(section.get("machine")) == kind:
            return {**{key: table[key] for key in ("batches", "batches_measured") if key in table}, **section}
    return table


def read_auto_table(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``model_dir/mmspec_drafters.json`` (None if there is no such file): the table drafter="auto"
    reads, written by ``mmspec bench caption --write-drafters-file``.

    Returns:
        {"drafters": [{"drafter": str, "speedup": float, ...}], "machine": {...} | None, ...}: the
        file's object, or ``{"drafters": <list>, "machine": None}`` for a bare list of entries
        (a file written by hand or by an older mmspec).
    Raises:
        ValueError: the file is not such an object or list (entries need "drafter" and "speedup").
    """
    path = Path(model_dir) / DRAFTERS_FILE
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if isinstance(table, list):
        table = {"drafters": table, "machine": None}
    sections = [table, *(table.get("other_machines") or [])] if isinstance(table, dict) else [None]
    for section in sections:
        entries = section.get("drafters") if isinstance(section, dict) else None
        if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) and isinstance(e.get("drafter"), str) and isinstance(e.get("speedup"), (int, float))
            for e in entries
        ):
            raise ValueError(f'{path} must hold a non-empty list "drafters" of {{"drafter": "<spec or path>", "speedup": '
                             '<number>}, and so must each of its "other_machines" (write it with mmspec bench caption '
                             "--write-drafters-file)")
    table.setdefault("machine", None)
    return table


def read_drafters_file(model_dir: str | os.PathLike) -> list[dict[str, Any]] | None:
    """The drafter entries of :func:`read_auto_table` (None if there is no file)."""
    table = read_auto_table(model_dir)
    return None if table is None else table["drafters"]


def describe_machine(machine: dict[str, Any] | None) -> str:
    """A table's "machine" record -> "bfloat16, 1 thread, AMD EPYC with avx512f avx512_bf16, torch 2.14.1"
    (a machine run as another kind by ``MMSPEC_CPU_FLAGS`` says so: "..., run as such on a CPU with ...")."""
    if not machine:
        return "machine not recorded"
    cpu = machine.get("cpu", "CPU not recorded") + (f" ({machine['cpu_model']})" if "cpu_model" in machine else "")
    flags = machine.get("cpu_flags")
    if flags:
        cpu += f" with {' '.join(flags)}"
    if machine.get("emulated_from"):  # (MMSPEC_CPU_FLAGS: run as such a CPU, not one)
        cpu += f", run as such on a CPU with {' '.join(machine['emulated_from'])}"
    threads = machine.get("threads")
    parts = [str(machine.get("dtype", "dtype not recorded")),
             words.count(threads, 'thread') if threads else "threads not recorded",
             cpu if machine.get("device", "cpu") == "cpu" else str(machine["device"]),
             f"torch {machine.get('torch', 'not recorded')}"]
    return ", ".join(parts)


def describe_picks(table: dict[str, Any], opening: str) -> str:
    """``opening`` + what one table of a drafters file picks at temperature 0 and when sampling, and
    the machine it measured."""
    entries = table["drafters"]
    best = max(entries, key=lambda e: e["speedup"])
    text = (f'{opening} `{best["drafter"]}`: {best["speedup"]:.2f}x over plain decoding at temperature 0, '
            f"measured on {describe_machine(table.get('machine'))}.")
    sampled = [e for e in entries if isinstance(e.get("sampled_speedup_per_token"), (int, float))]
    if sampled:
        fastest = max(sampled, key=lambda e: e["sampled_speedup_per_token"])
        temperature = table.get("sampled_temperature")
        text += (f" At temperature {temperature:g}" if isinstance(temperature, (int, float)) else " When sampling")
        text += (f", `{fastest['drafter']}` is the fastest "
                 f"per token: {fastest['sampled_speedup_per_token']:.2f}x")
        if fastest is not best and best in sampled:
            text += f" (`{best['drafter']}` {best['sampled_speedup_per_token']:.2f}x)"
        text += "; auto uses it when sampling."
    return text


def describe_auto_table(model_dir: str | os.PathLike) -> str:
    """One sentence on what drafter="auto" picks for the model in ``model_dir`` and why, made from
    its drafters file only (docs/captioning.md quotes the embedded captioner's; a test keeps them equal)."""
    table = read_auto_table(model_dir)
    if table is None:
        return f'`drafter="auto"` uses `{AUTO_FALLBACK}` (no {DRAFTERS_FILE} beside the model).'
    text = describe_picks(table, '`drafter="auto"` picks')
    for section in table.get("other_machines", []):
        kind = machine_kind(section.get("machine"))
        text += " " + describe_picks(section, f"On {KIND_NAMES.get(kind, 'other machines')} it picks")
    sizes = sorted({e["batch_size"] for e in table.get("batches", []) if e["batch_size"] > 1})
    if sizes:
        picks = []
        for size in sizes:
            best = max((e for e in table["batches"] if e["batch_size"] == size), key=lambda e: e["speedup"])
            picks.append(f"`{best['drafter']}` from batch size {size} ({best['speedup']:.2f}x plain decoding's throughput there)")
        machine = (table.get("batches_measured") or {}).get("machine", table["machine"])
        text += (f" In batches it picks {', '.join(picks)}, measured at temperature 0 on {describe_machine(machine)}; "
                 "sampled batches take the same.")
    return text


def measured_elsewhere(table: dict[str, Any], machine: dict[str, Any] | None, runs_on: tuple[str, bool] | None) -> str:
    """The clause a choice's reason gets where the drafters file measured another way of running
    than the pipeline's, ``runs_on`` = (device type, CUDA graphs): the speedups of drafters over
    plain decoding differ most between a CPU, a GPU and a GPU with CUDA graphs (docs/benchmarks.md).
    "" where they match, or where the file or the caller does not say."""
    if runs_on is None or not machine or "device" not in machine:
        return ""
    measured = ("cpu" if machine["device"] == "cpu" else "cuda", bool((table.get("benchmark") or {}).get("cuda_graphs")))
    if measured == tuple(runs_on):
        return ""
    way = lambda device, graphs: device + (" with CUDA graphs" if graphs else "")
    device, graphs = runs_on
    return (f"; measured on {way(*measured)}, not on this pipeline's {way(device, graphs)}: `mmspec bench caption "
            f"--device {device}{' --cuda-graphs' if graphs else ''} --write-drafters-file` measures it there")


def choose_auto_drafter(model_dir: str | os.PathLike | None, runs_on: tuple[str, bool] | None = None) -> tuple[dict[str, Any], str]:
    """drafter="auto": the fastest benchmarked entry of the model's drafters file, else prompt lookup.

    Args:
        runs_on: (device type, CUDA graphs) of the pipeline, to say in the reason when the file
            measured another (:func:`measured_elsewhere`); the choice is the file's either way.
    Returns:
        (entry, reason): ``entry`` has "drafter" (a spec, or a path relative to ``model_dir``) and
        optionally "num_draft_tokens"; ``reason`` says how it was chosen, and on what machine.
    """
    table = read_auto_table(model_dir) if model_dir is not None else None
    if table is None:
        return {"drafter": AUTO_FALLBACK}, f"auto: no {DRAFTERS_FILE} beside the model, training-free default"
    table = table_for(table, runs_on)
    best = max(table["drafters"], key=lambda e: e["speedup"])
    return best, (f"auto: highest measured speedup ({best['speedup']:.2f}x on {describe_machine(table['machine'])}) "
                  f"in {DRAFTERS_FILE}{measured_elsewhere(table, table['machine'], runs_on)}")


def choose_sampling_drafter(model_dir: str | os.PathLike | None, runs_on: tuple[str, bool] | None = None
                            ) -> tuple[str, int | None, str] | None:
    """drafter="auto" when sampling: the entry of the drafters file with the highest per-token
    speedup at its sampled temperature (``"sampled_speedup_per_token"``); ``runs_on`` as
    :func:`choose_auto_drafter`'s.

    Returns:
        (spec, num_draft_tokens or None, reason), or None when the file measured no temperature > 0.
    """
    table = read_auto_table(model_dir) if model_dir is not None else None
    table = table_for(table, runs_on) if table is not None else None
    sampled = [e for e in (table or {}).get("drafters", []) if isinstance(e.get("sampled_speedup_per_token"), (int, float))]
    if not sampled:
        return None
    best = max(sampled, key=lambda e: e["sampled_speedup_per_token"])
    temperature = table.get("sampled_temperature")
    at = f"temperature {temperature:g}" if isinstance(temperature, (int, float)) else "its sampled temperature"
    reason = (f"auto when sampling: highest measured speedup per token at {at} ({best['sampled_speedup_per_token']:.2f}x "
              f"on {describe_machine(table['machine'])}) in {DRAFTERS_FILE}{measured_elsewhere(table, table['machine'], runs_on)}")
    return best["drafter"], best.get("num_draft_tokens"), reason


def choose_batch_drafter(model_dir: str | os.PathLike | None, batch_size: int, runs_on: tuple[str, bool] | None = None,
                         sampled: bool = False) -> tuple[str, int | None, str] | None:
    """drafter="auto" for a batch: the method with the highest measured throughput at the largest
    batch size from 2 to ``batch_size`` of the drafters file's ``"batches"`` table (written by
    ``mmspec bench caption --batch-sizes ... --write-drafters-file``, at temperature 0), which may
    be "ar"; ``runs_on`` as :func:`choose_auto_drafter`'s. A ``sampled`` batch takes the same
    choice, its reason saying that the table measured greedy decoding.

    Returns:
        (spec, num_draft_tokens or None, reason), or None when the file measured no such batch
        size: below its smallest batch the single-image choice holds (:func:`choose_auto_drafter`,
        which knows the machine kinds; the batch table's batch-size-1 rows, one machine's, do not
        override it).
    """
    table = read_auto_table(model_dir) if model_dir is not None else None
    entries = [e for e in (table or {}).get("batches", []) if 1 < e.get("batch_size", batch_size + 1) <= batch_size]
    if not entries:
        return None
    size = max(e["batch_size"] for e in entries)
    best = max((e for e in entries if e["batch_size"] == size), key=lambda e: e["speedup"])
    machine = (table.get("batches_measured") or {}).get("machine", table["machine"])
    reason = (f"auto for batch size {batch_size}: highest measured throughput at batch size {size} ({best['speedup']:.2f}x "
              f"plain decoding's there, on {describe_machine(machine)}) in {DRAFTERS_FILE}"
              f"{measured_elsewhere({}, machine, runs_on)}"
              f"{'; measured at temperature 0 (no sampled batches were measured)' if sampled else ''}")
    return best["drafter"], best.get("num_draft_tokens"), reason


