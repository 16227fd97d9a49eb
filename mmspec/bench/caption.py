"""``mmspec bench caption``: drafters on a captioning VLM, per task family, temperature 0 and 1.

Items: the first ``--per-family`` test-split samples of each of the six families of
:mod:`mmspec.train.data` (scenes ~ MMT, counting ~ SEED, text ~ OCRBench, charts ~ ChartQA,
math ~ MathVista, photos ~ ScienceQA-style captions), each with its own prompt (caption, short
answer or detailed description). Protocol as ``mmspec bench text``
(docs/benchmarks.md, "How a figure is measured"): one process, methods interleaved over ``--repeats`` rounds after a
warm-up round, medians per item; a family's S is the sum of AR's median times over the sum of the
method's; tau = tokens per verification step. At temperature 1 every method uses the same seed
per item and round. Results are checkpointed after every measurement (rerun to resume).

Methods: ``ar`` and any drafter spec (``spd`` = the embedded captioner's small text-only draft,
``spd:PATH``, ``prompt-lookup``, ``layer-skip:N``, ``eagle2``, ...), each optionally ``@K`` for K
draft tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

from ..api import generate, optimize_components
from ..hub import dtype_name
from ..pipelines.methods import split_specs
from ..cli.args import add_trust_remote_code_arg, number_list
from ..cli.output import write_text
from .results import (add_device_args, add_threads_arg, command_line, load_results, machine_info, run_settings,
                      save_results)
from .throughput import parse_batch_sizes, throughput_tables
from ..train.data import FAMILIES, make_sample
from ..train.data.core import KINDS as TASK_KINDS

DEFAULT_METHODS = "ar,spd,prompt-lookup,layer-skip:8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="VLM directory or hub id (default: the embedded captioner)")
    add_trust_remote_code_arg(parser)
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma list: ar, spd[:PATH], prompt-lookup[:N], layer-skip:N, eagle2, ...; append @K to set K")
    parser.add_argument("--families", default=None,
                        help="comma list of the caption data families (default: all six), or with --data of its groups (default: all)")
    parser.add_argument("--per-family", type=int, default=4, help="test-split items per family (with --data: first rows per group)")
    parser.add_argument("--data", default=None,
                        help="benchmark these images instead: a JSONL of {image, prompt, group?}, image paths relative "
                             "to the JSONL's folder (e.g. `mmspec train caption-data --split test`); items are grouped by `group` ('data' where it has none)")
    parser.add_argument("--tasks", default="all",
                        help="task kinds to draw items from: all, or a comma list of caption, detailed, short "
                             "(short answers are 1-3 tokens: nothing to speed up)")
    parser.add_argument("--temperatures", default="0,1", help="comma list; 0: greedy decoding")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="most tokens of a caption")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds after the warm-up; each time is their median")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where fast, else fp32) | bf16 | fp32")
    add_threads_arg(parser)
    parser.add_argument("--batch-sizes", default=None, metavar="1,4,16",
                        help="measure throughput instead: all items decoded B at a time, per batch size (items/s, "
                             "tokens/s, crossover); see mmspec.bench.throughput")
    add_device_args(parser)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="run the target's forwards as CUDA graphs (--device cuda, batch size 1; every method, AR included)")
    parser.add_argument("--results", default="bench-out/caption.json", help="JSON checkpoint / results file")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    parser.add_argument("--write-drafters-file", action="store_true",
                        help="write the model directory's mmspec_drafters.json, the table drafter='auto' reads: each drafter's "
                             "speedup at temperature 0 (and per token at the other temperature), with this machine")


def parse_method(method: str) -> tuple[str, int | None]:
    """'prompt-lookup:10@6' -> ('prompt-lookup:10', 6); a draft length that is not a positive
    integer is one ValueError line."""
    spec, _, k = method.partition("@")
    if k and not (k.isdigit() and int(k) > 0):
        raise ValueError(f"--methods {method!r}: the draft length after '@' must be a positive integer, got {k!r}")
    return spec, int(k) if k else None


def check_methods(methods: list[str]) -> None:
    """--methods before anything loads: ar among them (every speedup is against it), each drafter
    name known and each '@K' a positive integer."""
    from ..pipelines.captioning import check_drafter_name

    if "ar" not in methods:
        raise ValueError(f"--methods {','.join(methods) or repr('')}: include ar, the plain decoding every speedup "
                         "is measured against (e.g. --methods ar,eagle)")
    for method in methods:
        spec, _ = parse_method(method)
        if spec != "ar":
            check_drafter_name(spec)


def drafter_for(pipe, method: str, do_sample: bool = False):
    """A method name -> the drafter object the pipeline's generate call takes (None for ar), its
    networks optimized as the pipeline optimizes its own (``mmspec caption --drafter`` runs them so).
    ``auto`` is what drafter="auto" runs for a greedy or, with ``do_sample``, a sampled caption."""
    spec, k = parse_method(method)
    if spec == "ar":
        return None
    drafter = pipe.auto_choice(do_sample)[0] if spec == "auto" and k is None else pipe.resolve_drafter(spec, k)[0]
    if pipe.optimization is not None:
        optimize_components(drafter)
    return drafter


def bench_items(families: list[str], per_family: int, tasks: str = "all") -> list[tuple[str, int, object, str]]:
    """The first ``per_family`` test-split samples of each family whose task kind is in ``tasks``
    -> [(family, test index, image, prompt)]."""
    kinds = None if tasks == "all" else set(tasks.split(","))
    unknown = (kinds or set()) - set(TASK_KINDS)
    if unknown:
        raise ValueError(f"unknown task kinds {sorted(unknown)}; use 'all' or a comma list of {', '.join(TASK_KINDS)}")
    strangers = [family for family in families if family not in FAMILIES]
    if strangers:
        raise ValueError(f"unknown families {strangers}; use a comma list of {', '.join(FAMILIES)}")
    items = []
    for family in families:
        index, found = 0, 0
        while found < per_family:
            sample = make_sample(family, "test", index)
            if kinds is None or sample.kind in kinds:
                items.append((family, index, sample.image, sample.prompt))
                found += 1
            index += 1
            if index > 50 * per_family + 100:
                raise ValueError(f"the {family} family has too few {tasks} items in the test split")
    return items


def data_items(data: str, groups: str | None, per_group: int, images: bool | None = True) -> list[tuple[str, int, object, str]]:
    """``--data`` JSONL -> [(group, row within its group, image, prompt)]: the first ``per_group``
    rows of each group (of ``groups``, a comma list, when given), checked before any model loads.
    ``images=False``: prompts for a text model (the image None), a row with an image refused;
    ``None``: prompts alone where no row has an image, else images for every row."""
    from ..train.any_target import format_skipped, open_image, read_examples

    examples, skipped = read_examples(data, prompt_given=False,  # (a caption-data folder's rows, not its bare images)
                                      bare_images="move it out of the folder to measure every image with that prompt")
    if images is None:
        images = any(example.image is not None for example in examples)
    unfit = sum((example.image is None) == images for example in examples)
    if unfit:
        skipped["row without an image" if images else "row with an image (a text model takes prompts)"] = unfit
    if skipped:
        raise ValueError(f"--data {data}: {format_skipped(skipped)}; a benchmark measures every row it is given: fix or drop them")
    wanted = groups.split(",") if groups else None
    present = {example.group or "data" for example in examples}
    if wanted and set(wanted) - present:
        raise ValueError(f"--families {groups}: --data {data} has no rows of {', '.join(sorted(set(wanted) - present))} "
                         f"(its groups: {', '.join(sorted(present))})")
    counts: dict[str, int] = {}
    items = []
    for example in examples:
        group = example.group or "data"
        if (wanted and group not in wanted) or counts.get(group, 0) >= per_group:
            continue
        try:
            image = open_image(example) if images else None
        except ValueError as error:
            raise ValueError(f"--data {data}: {example.image if isinstance(example.image, Path) else 'a row'}: {error}") from None
        items.append((group, counts.get(group, 0), image, example.prompt))
        counts[group] = counts.get(group, 0) + 1
    return items


def check_same_rows(results: dict, items: list[tuple[str, int, object, str]], path: Path) -> None:
    """Record a fingerprint of each ``--data`` row measured (its prompt and pixels) in ``results``
    ("rows", by group/index, the key its runs are stored under), and refuse a resume whose row at a
    key changed since (the data file edited): its runs would pass for the new row's. More rows
    (a larger --per-family) resume."""
    import hashlib

    held = results.setdefault("rows", {})
    for group, index, image, prompt in items:
        digest = hashlib.sha256(json.dumps([prompt, list(image.size)]).encode() + image.tobytes()).hexdigest()[:16]
        key = f"{group}/{index}"
        if held.get(key, digest) != digest:
            raise ValueError(f"{path} holds runs of another row {index + 1} of group {group!r} (its prompt or image changed "
                             "in --data since); pass another --results file, or restore the data")
        held[key] = digest


def run(args) -> int:
    from ..pipelines.captioning import ImageCaptioningPipeline

    temperatures = number_list(args.temperatures, "--temperatures", float, 0)  # 0: greedy
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    if batch_sizes and args.cuda_graphs:
        raise ValueError("--cuda-graphs decodes one image at a time: drop --batch-sizes or --cuda-graphs")
    methods = split_specs(args.methods)
    check_methods(methods)
    if args.write_drafters_file:  # before anything is measured
        from ..modeling.captioner import default_captioner_dir

        check_drafters_file_target(args.model or default_captioner_dir(), [f"{t:g}" for t in temperatures])
    results_path = Path(args.results)
    model_name = args.model or "embedded captioner (models/smolcap)"
    items = data_items(args.data, args.families, args.per_family) if args.data else None
    results = load_results(results_path, "caption", {"model": model_name, "dtype": args.dtype, "data": args.data,
                                                     "max_new_tokens": args.max_new_tokens, **run_settings(args, args.device)})
    results.setdefault("runs", {})
    if items:
        check_same_rows(results, items, results_path)
    families = list(dict.fromkeys(f for f, *_ in items)) if items else (args.families or ",".join(FAMILIES)).split(",")
    items = items or bench_items(families, args.per_family, args.tasks)  # (bad family or task names: before the model loads)
    results["meta"] = {
        "model": model_name, "dtype": args.dtype, "threads": args.threads,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "per_family": args.per_family, "tasks": args.tasks,
        "data": args.data,
        "command": command_line("caption", args, ("model", "data", "families", "methods", "per_family", "tasks", "temperatures",
                                                   "max_new_tokens", "num_draft_tokens", "repeats", "dtype", "threads", "device",
                                                   "batch_sizes"))
        + (" --cuda-graphs" if args.cuda_graphs else ""),
        "cuda_graphs": args.cuda_graphs,
    }
    pipe = ImageCaptioningPipeline(model=args.model, drafter="ar", device=args.device, dtype=args.dtype, optimize=args.optimize,
                                   cuda_graphs=args.cuda_graphs, trust_remote_code=args.trust_remote_code)
    results["meta"].update(machine=machine_info(dtype_name(pipe.dtype), args.threads, args.device),
                           linears=pipe.optimization.label if pipe.optimization else "as loaded")
    drafters = {method: drafter_for(pipe, method) for method in methods}
    # drafter="auto" samples with the drafters file's per-token choice: timed as it runs
    sampled = {method: drafter_for(pipe, method, do_sample=True) if method == "auto" and any(temperatures) else drafters[method]
               for method in methods}
    if batch_sizes:
        return run_throughput(args, results, results_path, pipe, drafters, items, batch_sizes, temperatures)
    for family, index, image, prompt in items:
        inputs = pipe.preprocess(image, prompt)
        for temperature in temperatures:
            for round_index in range(args.repeats + 1):  # round 0 is the warm-up
                for method in methods:
                    key = f"{temperature:g}/{family}/{index}/{method}/{round_index}"
                    if key in results["runs"]:
                        continue
                    out = generate(pipe.target, drafter=(sampled if temperature > 0 else drafters)[method], max_new_tokens=args.max_new_tokens,
                                   do_sample=temperature > 0, temperature=temperature or 1.0,
                                   seed=1000 * index + round_index, eos_token_id=pipe.eos_token_ids, **inputs)
                    new = out.sequences[0, inputs["input_ids"].shape[1]:]
                    results["runs"][key] = {
                        "seconds": out.stats.wall_time_s, "prefill": out.stats.prefill_time_s, "tokens": new.tolist(),
                        "tau": out.stats.mean_accepted_length,
                        "acceptance": out.stats.acceptance_rate, "text": pipe.tokenizer.decode(new, skip_special_tokens=True),
                    }
                    save_results(results_path, results)
                    print(f"{key}: {out.stats.wall_time_s:.2f}s tau {out.stats.mean_accepted_length:.2f}", file=sys.stderr, flush=True)
    indices = {family: [index for f, index, _, _ in items if f == family] for family in families}
    summary = summarise(results, methods, temperatures, indices, args.repeats)
    results["summary"] = summary
    save_results(results_path, results)
    if args.write_drafters_file:
        from ..pipelines.captioning import describe_auto_table

        machine = results["meta"]["machine"]
        path = write_drafters_file(pipe.model_dir, summary, methods, results["meta"], machine)
        print(f"wrote {path}; {quoted_as(path)}:\n{describe_auto_table(path.parent)}", file=sys.stderr)
    tables = render_tables(summary, results["meta"])
    if args.markdown:
        write_text(args.markdown, tables)
    print(json.dumps(summary, indent=1) if args.json else tables)
    return 0


def quoted_as(path: Path) -> str:
    """How the line after "wrote PATH" introduces the file's description: docs/captioning.md quotes
    the embedded captioner's file (and a test keeps the two equal); another model's is only read."""
    from ..modeling.captioner import default_captioner_dir

    if path.parent.resolve() == default_captioner_dir().resolve():
        return "docs/captioning.md quotes it as"
    return 'drafter="auto" reads it as'


def run_throughput(args, results: dict, results_path: Path, pipe, drafters: dict, items: list, batch_sizes: list[int],
                   temperatures: list[float]) -> int:
    """``--batch-sizes``: :mod:`mmspec.bench.throughput` over the benchmark's items."""
    rows = [pipe.preprocess(image, prompt) for _, _, image, prompt in items]
    settings = {f"{t:g}": dict(do_sample=t > 0, temperature=t or 1.0, eos_token_id=pipe.eos_token_ids) for t in temperatures}
    methods = list(drafters)
    summary, tables = throughput_tables(pipe.target, rows, {m: {"drafter": d} for m, d in drafters.items()}, batch_sizes,
                                        settings, args.repeats, args.max_new_tokens, results, results_path, results["meta"])
    if args.write_drafters_file:
        from ..pipelines.captioning import describe_auto_table

        path = write_batch_table(pipe.model_dir, summary, methods, results["meta"])
        print(f"wrote the batches of {path}; {quoted_as(path)}:\n{describe_auto_table(path.parent)}", file=sys.stderr)
    if args.markdown:
        write_text(args.markdown, tables)
    print(json.dumps(summary, indent=1) if args.json else tables)
    return 0


def write_drafters_file(model_dir: Path | None, summary: dict, methods: list[str], meta: dict, machine: dict) -> Path:
    """model_dir/mmspec_drafters.json, the table drafter="auto" reads: every drafter's mean speedup
    over AR at temperature 0 ("speedup") and, when a temperature > 0 was measured, its per-token
    speedup there ("sampled_speedup_per_token"), with the machine (:func:`machine_info`) and the
    benchmark's settings. Written only by this benchmark, so the file never holds a number it did
    not measure; a drafter whose greedy captions were not all plain decoding's is left out. Where the file's table was measured on another kind of machine
    (:func:`~mmspec.pipelines.captioning.machine_kind`: AMX, AVX-512 BF16, AVX2, GPU ...), this run's
    table goes into its ``"other_machines"``, replacing one of this kind; else it replaces the top
    table, keeping the batch table and the other kinds'."""
    from ..pipelines.captioning import DRAFTERS_FILE, machine_kind

    check_drafters_file_target(model_dir, list(summary))
    sampled = next((t for t in summary if t != "0"), None)
    entries = []
    for method in methods:
        spec, k = parse_method(method)
        if spec == "ar":
            continue
        same, runs = (sum(int(part) for part in counts) for counts in zip(*(
            cell[method]["exact"].split("/") for family, cell in summary["0"].items() if family != "mean")))
        if same < runs:  # (a drafter whose captions differ from plain decoding's, a shorter one faster, is not "auto"'s)
            print(f"{method}: {same}/{runs} greedy captions equal plain decoding's; left out of {DRAFTERS_FILE}", flush=True)
            continue
        entry = {"drafter": file_spec(spec, Path(model_dir)), "speedup": round(summary["0"]["mean"][method]["S"], 3)}
        if sampled is not None:
            entry["sampled_speedup_per_token"] = round(summary[sampled]["mean"][method]["S_token"], 3)
        if k is not None:
            entry["num_draft_tokens"] = k
        entries.append(entry)
    table = {
        "written_by": "mmspec bench caption --write-drafters-file (do not edit: rerun the benchmark)",
        "measured": datetime.date.today().isoformat(),
        "machine": machine,
        "benchmark": {**{key: meta[key] for key in ("command", "per_family", "tasks", "max_new_tokens", "repeats")},
                      "cuda_graphs": bool(meta.get("cuda_graphs"))},
        **({"sampled_temperature": float(sampled)} if sampled is not None else {}),
        "drafters": entries,
    }
    path = Path(model_dir) / DRAFTERS_FILE
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(earlier, dict):
        earlier = {}
    kind = machine_kind(machine)
    if earlier.get("drafters") and machine_kind(earlier.get("machine")) not in (None, kind):
        # another kind of machine measured the top-level table: this run's is one of "other_machines"
        others = [section for section in earlier.get("other_machines", []) if machine_kind(section.get("machine")) != kind]
        table = {**earlier, "other_machines": [*others, table]}
    else:  # the batch table and the other kinds' tables, measured by their own runs, are kept
        table.update({key: earlier[key] for key in ("batches", "batches_measured", "other_machines") if key in earlier})
    write_text(path, json.dumps(table, indent=1) + "\n")
    return path


def file_spec(spec: str, model_dir: Path) -> str:
    """A drafter spec as the drafters file records it: a path (the spec itself, or its argument:
    "eagle:models/smolcap-eagle-t1") relative to the model directory, which the pipeline resolves."""
    name, _, arg = spec.partition(":")
    for path, rebuild in ((spec, lambda rel: rel), (arg, lambda rel: f"{name}:{rel}")):
        if path and Path(path).is_dir():
            return rebuild(os.path.relpath(Path(path).resolve(), Path(model_dir).resolve()))
    return spec


def write_batch_table(model_dir: Path | None, summary: dict, methods: list[str], meta: dict) -> Path:
    """Add the ``"batches"`` table to model_dir/mmspec_drafters.json: every method's speedup over
    AR at each measured batch size at temperature 0 (AR itself 1.0), which drafter="auto" reads for
    batches (:func:`~mmspec.pipelines.captioning.choose_batch_drafter`), with the machine and command.
    The file's batch-1 ``"drafters"`` entries are kept; a new file takes them from the batch-size-1 pass."""
    from ..pipelines.captioning import DRAFTERS_FILE

    path = Path(model_dir) / DRAFTERS_FILE
    at_zero = summary["0"]
    batches = []
    for size, rows in sorted(at_zero.items(), key=lambda item: int(item[0])):
        for method in methods:
            spec, k = parse_method(method)
            if rows.get(method, {}).get("speedup") is None:
                continue
            entry = {"batch_size": int(size), "drafter": spec, "speedup": round(rows[method]["speedup"], 3),
                     "items_per_s": round(rows[method]["items_per_s"], 3)}
            if k is not None:
                entry["num_draft_tokens"] = k
            batches.append(entry)
    table = json.loads(path.read_text()) if path.is_file() else None
    if table is None:
        if "1" not in at_zero:
            raise ValueError(f"{path} does not exist yet: include batch size 1 in --batch-sizes (or write the batch-1 "
                             "table first, without --batch-sizes)")
        table = {"written_by": "mmspec bench caption --write-drafters-file (do not edit: rerun the benchmark)",
                 "measured": datetime.date.today().isoformat(), "machine": meta["machine"],
                 "drafters": [{"drafter": e["drafter"], "speedup": e["speedup"], **({"num_draft_tokens": e["num_draft_tokens"]}
                              if "num_draft_tokens" in e else {})} for e in batches if e["batch_size"] == 1 and e["drafter"] != "ar"]}
    table["batches"] = batches
    table["batches_measured"] = {"date": datetime.date.today().isoformat(), "machine": meta["machine"], "command": meta["command"]}
    write_text(path, json.dumps(table, indent=1) + "\n")
    return path


def check_drafters_file_target(model_dir: str | Path | None, temperatures: list[str]) -> None:
    """--write-drafters-file needs a local model directory and temperature 0 (checked before the benchmark)."""
    if model_dir is None or not Path(model_dir).expanduser().is_dir() or "0" not in temperatures:
        raise ValueError("--write-drafters-file needs a local model directory (--model DIR, or the embedded captioner) "
                         "and temperature 0 in --temperatures")


def summarise(results: dict, methods, temperatures, indices: dict[str, list[int]], repeats: int) -> dict:
    """``indices``: family -> the test indices benchmarked.
    -> {temperature: {family: {method: {"S", "tau", "acceptance", "exact", "seconds"}}}}, plus a
    "mean" family (S over all items' summed times, tau averaged over families)."""
    runs = results["runs"]
    summary = {}
    for temperature in temperatures:
        table = summary[f"{temperature:g}"] = {}
        totals = {m: {"seconds": 0.0, "base": 0.0, "all_seconds": 0.0, "all_tokens": 0, "decode_seconds": 0.0,
                      "decode_tokens": 0} for m in methods}
        prefills_recorded = True  # (results of runs before the prefill was recorded lack it)
        for family, family_indices in indices.items():
            row = table[family] = {}
            base_total = 0.0
            per_method = {m: {"seconds": 0.0, "tau": [], "acceptance": [], "exact": 0, "all_seconds": 0.0, "all_tokens": 0} for m in methods}
            for index in family_indices:
                def rounds(method):
                    return [runs[f"{temperature:g}/{family}/{index}/{method}/{r}"] for r in range(1, repeats + 1)]

                base = statistics.median(record["seconds"] for record in rounds("ar"))
                base_total += base
                ar_tokens = runs[f"{temperature:g}/{family}/{index}/ar/1"]["tokens"]
                for method in methods:
                    measured = rounds(method)
                    record = measured[0]
                    cell = per_method[method]
                    cell["seconds"] += statistics.median(r["seconds"] for r in measured)
                    cell["all_seconds"] += sum(r["seconds"] for r in measured)
                    cell["all_tokens"] += sum(len(r["tokens"]) for r in measured)
                    prefills_recorded = prefills_recorded and all(r.get("prefill") is not None for r in measured)
                    if prefills_recorded:  # decoding = the call less the prefill, image encoding and first token
                        totals[method]["decode_seconds"] += sum(r["seconds"] - r["prefill"] for r in measured)
                        totals[method]["decode_tokens"] += sum(len(r["tokens"]) - 1 for r in measured)
                    cell["tau"].append(record["tau"])
                    if record["acceptance"] is not None:
                        cell["acceptance"].append(record["acceptance"])
                    cell["exact"] += record["tokens"] == ar_tokens
            for method, cell in per_method.items():
                row[method] = {
                    "S": base_total / cell["seconds"], "S_token": _per_token_speedup(per_method["ar"], cell),
                    "tau": statistics.mean(cell["tau"]),
                    "acceptance": statistics.mean(cell["acceptance"]) if cell["acceptance"] else None,
                    "exact": f"{cell['exact']}/{len(family_indices)}", "seconds": cell["seconds"],
                }
                totals[method]["base"] += base_total
                for key in ("seconds", "all_seconds", "all_tokens"):
                    totals[method][key] += cell[key]
        table["mean"] = {m: {"S": totals[m]["base"] / totals[m]["seconds"], "S_token": _per_token_speedup(totals["ar"], totals[m]),
                             "tau": statistics.mean(table[f][m]["tau"] for f in indices)} for m in methods}
        if prefills_recorded:
            for m in methods:
                table["mean"][m]["S_decode"] = _per_token_speedup(totals["ar"], totals[m], "decode")
    return summary


def _per_token_speedup(ar: dict, method: dict, part: str = "all") -> float:
    """AR's seconds per generated token over the method's, over every measured round. Under
    sampling each method draws its own captions, whose lengths differ from AR's, so a ratio of
    whole-caption times mixes speed with length; the per-token ratio does not (prefill included).
    ``part="decode"``: the decoding alone, seconds less the prefill (what a drafter can shorten)
    over the tokens after the first."""
    seconds, tokens = f"{part}_seconds", f"{part}_tokens"
    return (ar[seconds] / max(1, ar[tokens])) / (method[seconds] / max(1, method[tokens]))


def render_tables(summary: dict, meta: dict) -> str:
    """Markdown in the seeds' VLM-table layout: rows = families, cells = S / tau."""
    lines = []
    for temperature, table in summary.items():
        methods = list(table["mean"])
        lines += [
            f"\n**Temperature {temperature}** ({meta['model']}, {meta['dtype']}, {meta['threads']} thread(s), "
            f"{meta['per_family']} test items per family ({meta.get('tasks', 'all')} tasks), median of {meta['repeats']} interleaved rounds; "
            + ("cell = S / tau; exact = greedy outputs identical to AR)\n" if temperature == "0" else
               "cell = S / tau / S per token: sampled captions differ in length, so S per token = AR's seconds per token "
               "over the method's, over every round)\n"),
            "| family | " + " | ".join(methods) + " |",
            "|---" * (len(methods) + 1) + "|",
        ]
        for family, row in table.items():
            cells = []
            for method in methods:
                cell = row[method]
                text = f"{cell['S']:.2f} / {cell['tau']:.2f}"
                if temperature == "0" and "exact" in cell and method != "ar":
                    text += f" ({cell['exact']})"
                if temperature != "0":
                    text += f" / {cell['S_token']:.2f}"
                cells.append(text)
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        if all("S_decode" in table["mean"][m] for m in methods):
            lines.append("| mean, decoding only (per token; prefill, image encoding and first token left out) | "
                         + " | ".join(f"{table['mean'][m]['S_decode']:.2f}" for m in methods) + " |")
    return "\n".join(lines) + "\n"
