"""``mmspec t2i "prompt" --method sjd --out DIR``: text-to-image from the command line.

Writes ``DIR/image-<i>.png`` (and ``DIR/baseline-<i>.png`` with ``--compare-baseline``),
``DIR/grid.png`` (method vs AR side by side, with the acceptance map) and ``DIR/acceptance-<i>.png``:
each token cell coloured by how many tokens its verification step committed (dark = one token, as
AR would; bright = a long accepted run). ``--json`` prints the stats as JSON. The files are written
together once the images are drawn, or none of them (:mod:`mmspec.cli.output`).

With ``--prompts FILE`` one JSON record per prompt streams to ``OUT/results.jsonl`` (resumable,
sharded under accelerate; :mod:`mmspec.cli.dataset`): a prompt the pipeline refuses becomes a
record with an ``error`` field, the exit code is 2 when any row failed, and ``--retry-errors``
redoes only those rows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from . import command_help
from .dataset import (IMAGE_SUFFIXES, ProcessState, Progress, ShardedResults, add_row_args, check_sharded_output,
                      failed_rows_exit, interrupted_rows)
from .output import OutputFiles
from ..core import words


def add_parser(subparsers) -> None:
    from ..pipelines.text_to_image.methods import METHODS, SETTINGS
    from .args import add_optimize_arg, add_threads_arg, add_trust_remote_code_arg

    cmd = subparsers.add_parser("t2i", help=command_help("t2i"))
    cmd.add_argument("prompt", nargs="?", default=None, help="the prompt (or --prompts FILE)")
    cmd.add_argument("--prompts", default=None, metavar="FILE",
                     help="one prompt per line: images go to --out as NNNNNN-I.png, one JSON record per prompt to "
                          "OUT/results.jsonl as they finish; rerun to resume; accelerate launch shards the prompts")
    add_row_args(cmd)
    cmd.add_argument("--method", default="sjd-coupled", help=METHODS.help()
                     + "; a spec name[:key=value,...] (sjd:init=vertical,window=4) or the short forms sjd[:init], "
                     "lantern[:drafter], mar-parallel[:num_iter]")
    for name, setting in SETTINGS.items():  # the methods' settings; unset = the method's default
        cmd.add_argument(f"--{name.replace('_', '-')}", type=setting.kind, default=None,
                         help=f"{setting.help} (default: the method's)")
    cmd.add_argument("--model", default=None, help="an mmspec t2i directory (default: the embedded models/t2i), or a "
                     "transformers Janus / Emu3 path or hub id (Chameleon: from Python, "
                     "with its VQGAN decoder; docs/text-to-image.md)")
    cmd.add_argument("--processor", default=None, help="transformers models: the processor / tokenizer (default: the model's)")
    cmd.add_argument("--eagle-head", default=None, help="image EAGLE head directory (mmspec train image-drafter)")
    cmd.add_argument("--draft", default=None, help="draft generator (path) for spec / --drafter draft")
    add_trust_remote_code_arg(cmd, "a hub model's")
    add_optimize_arg(cmd)
    cmd.add_argument("--out", default="t2i-out", help="output directory")
    cmd.add_argument("--num-images", type=int, default=1, help="images per prompt (seeds seed, seed + 1, ...)")
    cmd.add_argument("--batch-size", type=int, default=1,
                     help="images decoded together, across the prompts of --prompts too (each equals its batch-size-1 "
                          "image up to float rounding, except eagle2's, which drafts its chain in a batch: an exact "
                          "sample, not the batch-size-1 one; not Emu3, nor sjd-pac, which drafts trees)")
    cmd.add_argument("--seed", type=int, default=0, help="the same seed gives the same images")
    cmd.add_argument("--guidance-scale", type=float, default=3.0,
                     help="classifier-free guidance g >= 1 (logits = u + g (c - u); 1: none)")
    cmd.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1; not with --greedy)")
    cmd.add_argument("--top-k", type=int, default=None, help="sample among the k most likely image tokens (not with --greedy)")
    cmd.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    cmd.add_argument("--compare-baseline", action="store_true", help="also run AR with the same seeds; report the speedup")
    cmd.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda | cuda:N")
    cmd.add_argument("--cuda-graphs", action="store_true",
                     help="verify through CUDA graphs (the embedded LlamaGen-style layout on a CUDA device)")
    cmd.add_argument("--dtype", default="float32", help="the generator's weights: float32 (default) | bfloat16 | auto "
                     "(bfloat16 where fast: GPU, CPU with AMX / AVX-512 BF16); not MAR")
    add_threads_arg(cmd)
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    cmd.add_argument("--json", action="store_true", help="print the result (paths, stats) as one JSON object")
    cmd.set_defaults(handler=run, output_args={"out": "dir"}, interrupted=interrupted)


def interrupted(args, command: str) -> str:
    """What Ctrl-C leaves (the line mmspec prints): the rows of --prompts and how to resume."""
    if args.prompts:
        return interrupted_rows(Path(args.out) / "results.jsonl", "id", command)
    return "nothing was saved (the images are written once they are all drawn)"


def acceptance_picture(step_map: torch.Tensor, size: int):
    """step_map [rows, cols] (step index per token) -> PIL image: each cell's brightness grows with
    the number of tokens committed in its step (1 token = dark blue ... >= 8 tokens = yellow)."""
    from PIL import Image

    counts = torch.bincount(step_map.flatten())[step_map]  # tokens committed by each token's step
    level = ((counts.float() - 1) / 7).clamp(0, 1)
    low, high = torch.tensor([30.0, 40.0, 110.0]), torch.tensor([250.0, 220.0, 40.0])
    rgb = (low + level[..., None] * (high - low)).round().byte().numpy()
    return Image.fromarray(rgb).resize((size, size), Image.NEAREST)


def side_by_side(rows: list[list], cell: int):
    from PIL import Image

    sheet = Image.new("RGB", (cell * max(len(r) for r in rows), cell * len(rows)), "white")
    for y, row in enumerate(rows):
        for x, image in enumerate(row):
            sheet.paste(image.resize((cell, cell), Image.NEAREST), (x * cell, y * cell))
    return sheet


def read_prompts(path: str) -> list[str]:
    """A prompts file -> its non-empty lines, stripped (a leading byte-order mark dropped)."""
    try:
        prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    except OSError as error:
        raise ValueError(f"cannot read --prompts {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot read --prompts {path}: it is not UTF-8 text; save it as UTF-8") from None
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompt (one per line)")
    return prompts


def prompt_results(prompts: list[str], args, process: ProcessState) -> ShardedResults:
    """OUT/results.jsonl of a prompts file (read before the model loads: a resume with other
    settings, or of a file whose lines changed, is refused in one line)."""
    from ..pipelines.text_to_image.methods import SETTINGS

    shaping = ("model", "method", "dtype", "guidance_scale", "seed", "num_images", "greedy", "temperature", "top_k",
               "compare_baseline", "draft", "eagle_head", "processor", *SETTINGS)
    settings = {name: getattr(args, name) for name in shaping if hasattr(args, name)}
    for name in ("draft", "eagle_head", "processor"):  # ("./head" and "/abs/head": one head; the model: ShardedResults)
        if isinstance(settings.get(name), str) and os.path.exists(os.path.expanduser(settings[name])):
            settings[name] = os.path.abspath(os.path.expanduser(settings[name]))
    ids = [f"{i:06d}" for i in range(len(prompts))]
    return ShardedResults(Path(args.out) / "results.jsonl", ids, key="id", process=process, retry_errors=args.retry_errors,
                          settings=settings,
                          input_fields={key: {"prompt": prompt} for key, prompt in zip(ids, prompts)})


def run_prompts_file(pipe, prompts: list[str], args, results: ShardedResults) -> int:
    """Every prompt of a file, streamed to OUT/results.jsonl (mmspec.cli.dataset: resumed, sharded);
    with --batch-size B, the images of B / num-images prompts at a time are decoded together."""

    out = Path(args.out)
    group = max(1, args.batch_size // args.num_images)
    bar = Progress(len(results.todo), always=True, unit="prompt", show=not (args.no_progress or args.json))

    def draw(keys: list[str]) -> list[tuple[str, object]]:
        """(key, output) of the prompts drawn together; a prompt the pipeline refuses (it checks
        every prompt before decoding) is its own failed row: its batch-mates are drawn without it."""
        try:
            outputs = pipe([prompts[int(key)] for key in keys], guidance_scale=args.guidance_scale, seed=args.seed,
                           num_images=args.num_images, do_sample=not args.greedy, temperature=args.temperature,
                           top_k=args.top_k, compare_baseline=args.compare_baseline, progress=False,
                           batch_size=args.batch_size)
        except ValueError as error:
            if len(keys) > 1:  # one of them refused: each alone, so that its row alone fails
                return [pair for key in keys for pair in draw([key])]
            results.write({"id": keys[0], "prompt": prompts[int(keys[0])], "error": str(error)})
            bar.write(f"mmspec: error: prompt {int(keys[0]) + 1}: {error}", file=sys.stderr)
            bar.step()
            return []
        return list(zip(keys, outputs))

    try:
        for start in range(0, len(results.todo), group):
            for key, result in draw(results.todo[start : start + group]):
                paths = [str(out / f"{key}-{i}.png") for i in range(len(result.images))]
                with OutputFiles() as files:  # a row's images, all or none, before its record
                    for image, path in zip(result.images, paths):
                        files.write(path, lambda tmp, image=image: image.save(tmp))
                results.write({"id": key, "prompt": prompts[int(key)], "images": paths, "stats": result.stats.to_dict()})
                bar.step(result.stats.tokens, result.stats.wall_time_s, result.stats.speedup)
    finally:
        bar.close()
    records = results.finish()
    if results.process.rank == 0 and args.json:  # (one JSON document and one summary, every process's counts)
        print(json.dumps(records, indent=2))
    elif results.process.rank == 0:
        retried = f" (retried {words.count(results.retried, 'failed row')})" if results.retried else ""
        print(f"{out / 'results.jsonl'}: {len(records)} of {words.count(len(prompts), 'prompt')} done; this run drew "
              f"{sum(results.made(records))}{retried}")
    return failed_rows_exit(records, str(out / "results.jsonl"), show=results.process.rank == 0, process=results.process)


def check_method_options(args, prompts: int) -> None:
    """What the method and the model's kind decide, before the model loads (one line each): an
    --eagle-head or --draft the method does not read, --processor for mmspec's own layout, a rule
    that needs sampling under --greedy, a MAR model's sampling, a batch for a method that decodes
    one image at a time."""
    from ..core.rules import RULES
    from ..core.sampling import SamplingConfig
    from ..pipelines.text_to_image import METHODS, T2IComponents, make_method
    from ..pipelines.text_to_image.components import looks_local
    from ..pipelines.text_to_image.mar_components import check_continuous_sampling
    from ..pipelines.text_to_image.methods import SETTINGS
    from ..pipelines.text_to_image.pipeline import check_batches

    method = make_method(args.method, **{name: getattr(args, name) for name in SETTINGS})
    for option, part, what in (("--eagle-head", "eagle_head", "an image EAGLE head"), ("--draft", "draft", "a draft generator")):
        if getattr(args, part) is not None and part not in method.parts():
            readers = [name for name, cls in METHODS.items() if cls.argument != "drafter" and part in cls().parts()]
            raise ValueError(f"{option}: method {method.name!r} drafts without {what}; drop it, or choose a method that "
                             f"reads one ({', '.join(readers)}, or a relaxed method over them)")
    continuous = T2IComponents.names_continuous(args.model)
    own_layout = args.model is None or continuous or (Path(args.model).expanduser() / "t2i.json").is_file()
    if args.processor is not None and own_layout:
        raise ValueError("--processor is for transformers models (Janus, Emu3, Chameleon); mmspec's own models take none: "
                         "drop it")
    needs = method.parts()  # a transformers model brings no draft or head (mmspec's t2i.json names its own)
    transformers = not own_layout and (not looks_local(args.model) or (Path(args.model).expanduser() / "config.json").is_file())
    if transformers and needs and all(getattr(args, part) is None for part in needs):
        wanted = [(option, what) for option, part, what in (
            ("--eagle-head DIR", "eagle_head", "an image EAGLE head (mmspec train image-drafter --model ...)"),
            ("--draft PATH", "draft", "a draft generator (a smaller model of the same family)")) if part in needs]
        raise ValueError(f"method {method.name!r} drafts with {' or '.join(what for _, what in wanted)}, which a "
                         f"transformers model does not bring: pass {' or '.join(option for option, _ in wanted)}")
    if method.rule:
        RULES[method.rule].check_mode(SamplingConfig(do_sample=not args.greedy, temperature=args.temperature))
    if continuous:
        check_continuous_sampling(not args.greedy, args.top_k, None)
    model_reason = T2IComponents.batch_size_one_reason(args.model, args.trust_remote_code) if args.batch_size > 1 else None
    check_batches(method, prompts * args.num_images, args.batch_size, "--batch-size", model_reason)  # (Emu3: before it loads)


def run(args) -> int:
    import mmspec
    from ..pipelines.text_to_image.methods import SETTINGS
    from ..pipelines.text_to_image.prompts import check_prompt
    from ..pipelines.text_to_image import check_call_arguments

    # every argument is checked before the model loads (--threads and --out by mmspec.cli.args.check_args)
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("pass a prompt or --prompts FILE (one prompt per line)" + (", not both" if args.prompts else ""))
    if args.retry_errors and not args.prompts:
        raise ValueError("--retry-errors redoes the failed rows of --prompts FILE's results.jsonl: pass --prompts")
    check_sharded_output(args.prompts, "--prompts FILE (one prompt per line)")
    if Path(args.out).suffix.lower() in IMAGE_SUFFIXES and not Path(args.out).is_dir():
        raise ValueError(f"--out is the folder the images go in, and {args.out} names an image file; give a folder "
                         f"(--out {Path(args.out).with_suffix('')})")
    prompts = read_prompts(args.prompts) if args.prompts else [args.prompt]
    for prompt in prompts:
        check_prompt(prompt)
    args.temperature = 1.0 if args.temperature is None else args.temperature  # given with --greedy: refused by check_args
    check_call_arguments(args.guidance_scale, args.num_images, not args.greedy, args.temperature, args.top_k, seed=args.seed)
    check_method_options(args, len(prompts))
    settings = {name: getattr(args, name) for name in SETTINGS}
    process = ProcessState() if args.prompts else None  # under accelerate: this process's rank and device
    results = prompt_results(prompts, args, process) if args.prompts else None
    device = process.device_for(args.device) if process else args.device
    pipe = mmspec.pipeline("text-to-image", model=args.model, method=args.method, device=device,
                           processor=args.processor, eagle_head=args.eagle_head, draft=args.draft,
                           trust_remote_code=args.trust_remote_code, optimize=args.optimize, dtype=args.dtype,
                           cuda_graphs=args.cuda_graphs, **settings)
    if args.prompts:
        return run_prompts_file(pipe, prompts, args, results)
    result = pipe(args.prompt, guidance_scale=args.guidance_scale, seed=args.seed, num_images=args.num_images,
                  do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k,
                  compare_baseline=args.compare_baseline, progress=not args.no_progress and not args.json,
                  batch_size=args.batch_size)
    out = Path(args.out)
    cell = max(128, result.images[0].width)
    rows = []
    with OutputFiles() as files:  # every file of the run, or none
        for i, image in enumerate(result.images):
            files.write(out / f"image-{i}.png", image.save)
            accepted = acceptance_picture(result.accepted_map[i], cell)
            files.write(out / f"acceptance-{i}.png", accepted.save)
            row = [image, accepted]
            if result.baseline_images is not None:
                files.write(out / f"baseline-{i}.png", result.baseline_images[i].save)
                row.insert(0, result.baseline_images[i])
            rows.append(row)
        files.write(out / "grid.png", side_by_side(rows, cell).save)
    stale = earlier_files(out, len(result.images), result.baseline_images is not None)
    for path in stale:  # an earlier run's images in the folder would pass for this run's
        path.unlink(missing_ok=True)
    record = {"prompt": args.prompt, "out": str(out), "stats": result.stats.to_dict(),
              "removed": [str(path) for path in stale]}
    if result.baseline_stats is not None:
        record["baseline_stats"] = result.baseline_stats.to_dict()
        record["identical_to_baseline"] = bool(torch.equal(result.tokens, result.baseline_tokens))
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    print(result.stats.summary())
    if result.baseline_stats is not None:
        print(result.baseline_stats.summary() + "  [baseline, same seeds]")
    columns = "AR | method | acceptance map" if result.baseline_images is not None else "method | acceptance map"
    removed = f"; removed {words.count(len(stale), 'image')} an earlier run left there" if stale else ""
    print(f"wrote {words.count(len(result.images), 'image')} to {out}/ (grid.png: {columns}){removed}")
    return 0


#: the images one prompt's run writes in its --out folder (and grid.png)
RUN_IMAGES = ("image", "acceptance", "baseline")


def earlier_files(out: Path, images: int, baseline: bool) -> list[Path]:
    """The files of :data:`RUN_IMAGES` in ``out`` that a run of ``images`` images (``baseline``:
    with its AR images) did not write: an earlier run's, which this run replaces."""
    written = {f"{kind}-{i}.png" for i in range(images) for kind in RUN_IMAGES if kind != "baseline" or baseline}
    return sorted(path for kind in RUN_IMAGES for path in out.glob(f"{kind}-*.png")
                  if path.name not in written and path.stem.split("-", 1)[1].isdigit())
