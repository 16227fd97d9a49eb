"""``mmspec caption IMAGE...``: caption images with speculative decoding and show the speed.

Every image is checked (exists, is an image, not too large) before the model loads; an image
that fails is reported on stderr and skipped, the others are still captioned, and the exit code
is 2 at the end after one summary line, with or without ``--out`` (where a failure is an
``{"path", "error"}`` record; ``--retry-errors`` redoes only those). With ``--json`` stdout holds one JSON list, one object per image in the order
given: ``{"path", "text", "prompt", "stats", "baseline_text", "baseline_stats",
"identical_to_baseline"}``, or ``{"path", "error"}`` for an image that failed.

Inputs may be files, folders (their images, recursively) and globs. With ``--out FILE.jsonl`` the
same records stream to the file as they finish (a progress bar shows images/s, tokens/s and the
running speedup), a killed run resumes where it stopped, and ``accelerate launch -m mmspec caption
... --out FILE.jsonl`` shards the inputs over processes and gathers one file in input order
(:mod:`mmspec.cli.dataset`).
"""

from __future__ import annotations

import json
import sys
import textwrap
from typing import Any

import torch

from . import command_help
from ..pipelines.captioning import (DEFAULT_PROMPT, CaptionOutput, ImageCaptioningPipeline, check_drafter_name,
                                   check_prompt, check_tree_drafter)
from ..drafters import check_draft_length_use
from ..pipelines.images import open_image_file
from .dataset import (Progress, ShardedResults, add_row_args, check_sharded_output, expand_images, failed_rows_exit,
                      interrupted_rows)
from .output import difference_note, speedup_words
from ..core import words

IMAGE_ERRORS = (FileNotFoundError, ValueError)
#: what the model's own code raises on one input it cannot take (e.g. transformers' Mistral3 on an
#: image of a single image token): that image's row error, the other images go on
MODEL_ERRORS = (RuntimeError, IndexError)


def add_parser(subparsers) -> None:
    from .args import add_model_args, add_sampling_args, add_trust_remote_code_arg

    cap = subparsers.add_parser("caption", help=command_help("caption"))
    cap.add_argument("images", nargs="+", metavar="IMAGE",
                     help="image files (PNG, JPEG, WebP, TIFF, ...), folders of them, or globs ('photos/**/*.jpg')")
    cap.add_argument("--out", default=None, metavar="FILE.jsonl",
                     help="stream one JSON record per image to this file; rerun to resume (accelerate launch: one file)")
    add_row_args(cap)
    cap.add_argument("--prompt", default=None, help=f'the instruction or question (default: "{DEFAULT_PROMPT}")')
    cap.add_argument("--drafter", default="auto",
                     help="auto (the model's benchmarked best, else prompt-lookup) | ar | prompt-lookup[:K] | "
                          "layer-skip:N | eagle2[:DIR] | assistant:DIR (Gemma 4's) | ... (a spec name[:key=value,...], e.g. "
                          "layer-skip:layers=8) | "
                          "a draft model directory")
    cap.add_argument("--num-draft-tokens", type=int, default=None, help="K (default: the drafter's own)")
    cap.add_argument("--compare-baseline", action="store_true", help="also run plain AR decoding and report the speedup")
    cap.add_argument("--batch-size", type=int, default=1,
                     help="images decoded together (each caption equals its batch-size-1 caption in fp32; in bf16 up to "
                          "rounding near ties; sampled with a tree drafter -- eagle2, eagle3-tree, medusa, hydra -- "
                          "an exact sample of its chain form, not the batch-size-1 caption; see docs/usage.md)")
    cap.add_argument("--json", action="store_true", help="print one JSON list of results")
    add_model_args(cap, default_model=None)
    add_trust_remote_code_arg(cap, "the model's (and a draft model's)")
    cap.add_argument("--cuda-graphs", action="store_true",
                     help="run the target's forwards as CUDA graphs (a CUDA device, one image at a time)")
    add_sampling_args(cap, seed=0)
    cap.set_defaults(handler=run_caption_command, output_args={"out": "file"}, interrupted=interrupted)


def interrupted(args, command: str) -> str:
    """What Ctrl-C leaves (the line mmspec prints): the rows of --out and how to resume."""
    if args.out:
        return interrupted_rows(args.out, "path", command)
    return "nothing was saved (without --out the captions go to the screen only)"


def format_result(path: str, result: CaptionOutput, half_precision: bool = False) -> str:
    """Human-readable lines: the path, the caption, the speed (and the baseline when compared;
    ``half_precision``: the model runs in bf16/fp16, which explains a differing greedy output)."""
    lines = [f"{path}:", textwrap.indent(result.text or "(empty caption)", "  ", lambda line: True),
             f"  {result.stats.summary()}"]
    if result.baseline_stats is not None:
        same = "identical to" if result.identical_to_baseline else "DIFFERENT from"
        lines.append(f"  {result.baseline_stats.summary()}  [baseline, same run]")
        lines.append(f"  output {same} plain decoding; {speedup_words(result.stats, result.baseline_stats)}")
        note = difference_note(result.stats.config.get("acceptance", "greedy") != "greedy", half_precision)
        if not result.identical_to_baseline and note:
            lines.append(f"  {note}")
    return "\n".join(lines)


def run_caption_command(args) -> int:
    if args.prompt is not None:  # before any loading
        check_prompt(args.prompt)
    check_drafter_name(args.drafter)
    check_draft_length_use(args.drafter, args.num_draft_tokens)
    check_tree_drafter(args.model, args.drafter, args.trust_remote_code)
    if args.retry_errors and not args.out:
        raise ValueError("--retry-errors redoes the failed rows of an output file: pass --out FILE.jsonl")
    if args.cuda_graphs and args.batch_size > 1:
        raise ValueError("--cuda-graphs decodes one image at a time: drop --batch-size or --cuda-graphs")
    check_sharded_output(args.out)
    listed = next((p for p in args.images if p.lower().endswith((".jsonl", ".json", ".csv", ".parquet"))), None)
    if listed is not None:  # (it became a row error, "not an image file", that --retry-errors could not mend)
        raise ValueError(f"{listed}: mmspec caption takes images, folders of them or globs, not a data file (a JSONL of "
                         "prompts and images is training data: mmspec train drafter --data)")
    paths = expand_images(args.images)
    shaping = ("model", "dtype", "drafter", "num_draft_tokens", "prompt", "max_new_tokens", "do_sample", "temperature",
               "top_k", "top_p", "seed", "compare_baseline")  # what a row's record depends on: a resume keeps them
    settings = {name: getattr(args, name) for name in shaping}
    settings["prompt"] = DEFAULT_PROMPT if args.prompt is None else args.prompt  # (the default written out is the same run)
    results = ShardedResults(args.out, paths, key="path", retry_errors=args.retry_errors, settings=settings) if args.out else None
    records: list[dict[str, Any]] = [{"path": path} for path in (results.todo if results else paths)]
    progress: Progress | None = None

    def finish(record: dict[str, Any]) -> None:
        if results is not None:
            results.write(record)

    def fail(record: dict[str, Any], error: Exception) -> None:
        if isinstance(error, MODEL_ERRORS):
            first = next((line for line in str(error).splitlines() if line.strip()), "")
            error = f"{record['path']}: the model failed on this image ({type(error).__name__}: {first}); the other images go on"
        record["error"] = str(error)
        message = f"mmspec: error: {error}"
        if progress is not None:
            progress.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)
        finish(record)

    for record in records:  # cheap header checks, so bad paths fail before the model loads
        try:
            open_image_file(record["path"]).close()
        except IMAGE_ERRORS as error:
            fail(record, error)
    todo = [r for r in records if "error" not in r]
    quiet = args.json or results is not None  # a dataset run shows the progress bar, then one line
    if todo:
        device = results.process.device_for(args.device) if results else args.device
        captioner = ImageCaptioningPipeline(model=args.model, drafter=args.drafter, device=device,
                                            dtype=args.dtype, num_draft_tokens=args.num_draft_tokens, optimize=args.optimize,
                                            cuda_graphs=args.cuda_graphs, trust_remote_code=args.trust_remote_code)
        for size in {min(args.batch_size, len(todo) - start) for start in range(0, len(todo), args.batch_size)}:
            captioner.check_batch(size, args.do_sample)  # (a refused batch is one line, not image by image unsaid)
        if not args.json:
            linears = captioner.optimization.summary() if captioner.optimization else "linears as loaded"
            sizes = dict.fromkeys(min(args.batch_size, len(todo) - start) for start in range(0, len(todo), args.batch_size))
            picks = {}  # what the calls run, per call size: a lone last image may sample with another drafter
            for size in sizes:
                _, name, reason = captioner.drafter_for(args.do_sample, size)
                picks.setdefault((name, reason), []).append(size)
            drafters = "; ".join(f"{name} ({reason})" + ("" if len(picks) == 1 else
                                                         " for " + " and ".join("an image alone" if n == 1 else f"batches of {n}" for n in ns))
                                 for (name, reason), ns in picks.items())
            print(f"drafter: {drafters}; "
                  f"{str(captioner.dtype).removeprefix('torch.')} on {captioner.device}; {linears}",
                  file=sys.stderr if results is not None else sys.stdout)
        progress = Progress(len(todo), always=results is not None, unit="image")
        options = dict(prompt=args.prompt, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       compare_baseline=args.compare_baseline)

        def done(record: dict[str, Any], result: CaptionOutput, seconds: float | None = None) -> None:
            record.update(result.to_dict())
            finish(record)
            progress.step(result.stats.new_tokens, result.stats.wall_time_s if seconds is None else seconds,
                          result.stats.speedup)
            if not quiet:
                progress.write(format_result(record["path"], result, captioner.dtype in (torch.bfloat16, torch.float16)))

        def one_by_one(chunk: list[dict[str, Any]]) -> None:
            for record in chunk:
                progress.start(record["path"])
                try:
                    result = captioner(record["path"], **options)
                except IMAGE_ERRORS + MODEL_ERRORS as error:  # e.g. a file truncated after its header
                    fail(record, error)
                else:
                    done(record, result)

        try:
            for start in range(0, len(todo), args.batch_size):
                chunk = todo[start : start + args.batch_size]
                if len(chunk) == 1:
                    one_by_one(chunk)
                    continue
                progress.start(chunk[0]["path"])
                try:
                    results_of_chunk = captioner([r["path"] for r in chunk], batch_size=len(chunk), **options)
                except IMAGE_ERRORS + MODEL_ERRORS:  # one unreadable image: the others still get their (identical) captions
                    one_by_one(chunk)
                    continue
                for record, result in zip(chunk, results_of_chunk):
                    done(record, result, result.stats.config["batch_wall_time_s"] / len(chunk))
        finally:
            progress.close()
    rank = results.process.rank if results is not None else 0
    if results is not None:
        records = results.finish()
        if not args.json and rank == 0:  # (one summary, every process's counts)
            captioned, errors = results.made(records)
            retried = f" (retried {words.count(results.retried, 'failed row')})" if results.retried else ""
            print(f"{args.out}: {len(records)} of {words.count(len(paths), 'input')} done; this run captioned {captioned}, "
                  f"{words.count(errors, 'error')}{retried}")
    if args.json and rank == 0:
        print(json.dumps(records, indent=2))
    where = args.out or ("the JSON records" if args.json else "the error lines above")
    alone = len(records) == 1 and results is None and not args.json  # (its error line said it all)
    return failed_rows_exit(records, where, retry=results is not None, show=rank == 0 and not alone,  # one rule, with or without --out
                            process=results.process if results is not None else None)
