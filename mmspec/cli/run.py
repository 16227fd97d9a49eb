"""``mmspec run PRESET INPUTS...``: a ready-made pipeline (``pipelines/PRESET.toml``) on inputs:
images to caption, prompts to draw or sentences to say, as the preset's task takes them."""

from __future__ import annotations

import json
from pathlib import Path

from . import command_help
from .output import OutputFiles, write_output
from .args import check_output_path
from ..core import words


def add_parser(subparsers) -> None:
    from ..pipelines.presets import preset_names

    cmd = subparsers.add_parser("run", help=command_help("run"))
    cmd.add_argument("preset", help=f"a name in pipelines/ ({', '.join(preset_names())}) or a path to a preset TOML file")
    cmd.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="image files (image-captioning), prompts (text-to-image) or sentences (text-to-speech)")
    cmd.add_argument("--out", default=None, help="folder for images and audio (text-to-image, text-to-speech; default "
                     "run-out); captioning prints its captions and writes no file")
    cmd.add_argument("--device", default=None, help="overrides the preset's device (auto | cpu | cuda | cuda:N)")
    cmd.add_argument("--seed", type=int, default=None, help="the calls' seed (default: the preset's [call] seed, else 0)")
    cmd.add_argument("--json", action="store_true", help="print one JSON list of results")
    cmd.set_defaults(handler=run, output_args={"out": "dir"}, interrupted=interrupted)


#: where text-to-image and text-to-speech presets write their files without --out
DEFAULT_OUT = "run-out"


def interrupted(args, command: str) -> str:
    """What Ctrl-C leaves (the line mmspec prints): the files of the inputs finished, if any."""
    task = getattr(args, "task", None)
    if task == "image-captioning":
        return "nothing was saved (captions are printed as each input finishes)"
    written = sorted(Path(args.out).glob("[0-9][0-9][0-9]*.*")) if task and Path(args.out).is_dir() else []
    if not written:
        return "no input was finished; nothing was saved"
    return (f"the files of the inputs finished so far are in {args.out} ({words.count(len(written), 'file')}, "
            "none partial); rerun with the remaining inputs to finish")


def _caption(pipe, index: int, path: str, args) -> tuple[dict, str]:
    from ..pipelines.images import load_image

    result = pipe(load_image(path), seed=args.seed)
    return {"text": result.text, "stats": result.stats.to_dict()}, f"{path}: {result.text}\n  {result.stats.summary()}"


def _draw(pipe, index: int, prompt: str, args) -> tuple[dict, str]:
    result = pipe(prompt, seed=args.seed)
    paths = [str(Path(args.out) / f"{index:03d}-{i}.png") for i in range(len(result.images))]
    with OutputFiles() as files:
        for image, path in zip(result.images, paths):
            files.write(path, lambda tmp, image=image: image.save(tmp))
    return {"images": paths, "stats": result.stats.to_dict()}, f"{prompt!r} -> {', '.join(paths)}\n  {result.stats.summary()}"


def _say(pipe, index: int, text: str, args) -> tuple[dict, str]:
    from ..adapters.audio.codec import write_wav

    result = pipe(text, seed=args.seed)
    path = write_output(Path(args.out) / f"{index:03d}.wav", lambda tmp: write_wav(tmp, result.audio, result.sampling_rate))
    s = result.stats
    return {"audio": str(path), "stats": s.to_dict()}, (
        f"{text!r} -> {path}\n  {s.method}: {s.seconds:.2f} s of speech in {s.wall_time_s:.2f} s "
        f"(real-time factor {s.real_time_factor:.2f}, tau {s.tau:.2f})")


#: task -> how one input is run: (pipeline, index, input, args) -> (its record, the line to print)
RUNNERS = {"image-captioning": _caption, "text-to-image": _draw, "text-to-speech": _say}


def _check_image(path: str) -> None:
    from ..pipelines.images import open_image_file

    open_image_file(path).close()  # the header: a missing file, a folder, not an image


def _check_prompt(prompt: str) -> None:
    from ..pipelines.text_to_image.prompts import check_prompt

    check_prompt(prompt)


def _check_text(text: str) -> None:
    from ..adapters.audio.phonemes import EMPTY_TEXT

    if not text.strip():
        raise ValueError(EMPTY_TEXT)


#: task -> the check of one input before the pipeline loads (ValueError / FileNotFoundError, one line)
INPUT_CHECKS = {"image-captioning": _check_image, "text-to-image": _check_prompt, "text-to-speech": _check_text}


def run(args) -> int:
    from dataclasses import replace

    from ..pipelines.presets import load_preset

    preset = load_preset(args.preset)
    if args.seed is None:
        args.seed = preset.call.get("seed", 0)
    if preset.task not in RUNNERS:
        raise ValueError(f"preset {preset.name}: mmspec run does not run {preset.task!r} yet")
    if preset.task == "image-captioning":
        if args.out is not None:
            raise ValueError(f"--out: preset {preset.name} captions images, which prints the captions and writes no "
                             "file; drop --out")
    elif args.out is None:
        args.out = DEFAULT_OUT
        check_output_path(args.out, "dir", "--out")
    args.task = preset.task
    for index, item in enumerate(args.inputs):  # every input before anything loads or is written
        try:
            INPUT_CHECKS[preset.task](item)
        except (ValueError, FileNotFoundError) as error:
            where = "" if len(args.inputs) == 1 else f"input {index + 1} of {len(args.inputs)}: "
            raise ValueError(f"{where}{error}") from None
    if args.device is not None:
        preset = replace(preset, init={**preset.init, "device": args.device})
    pipe = preset.build()  # checked, then loaded (the output files are made by mmspec.cli.output)
    records = []
    try:
        for index, item in enumerate(args.inputs):
            record, line = RUNNERS[preset.task](pipe, index, item, args)
            records.append({"input": item, **record})
            if not args.json:
                print(line)
    finally:  # with --json, the inputs finished before an error are still printed
        if args.json:
            print(json.dumps(records, indent=2))
    return 0
