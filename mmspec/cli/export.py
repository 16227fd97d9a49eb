"""``mmspec export drafter SRC --format vllm-eagle3|sglang-eagle3 --out DIR``: write a trained
EAGLE-3 head in the layout a serving engine loads (``config.json`` + ``model.safetensors``:
:meth:`mmspec.modeling.eagle3.Eagle3Head.export`)."""

from __future__ import annotations

import torch

from . import command_help
from ..modeling.eagle3 import ENGINE_ARCHITECTURES, Eagle3Head, check_export_directory

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_dtype(name: str) -> torch.dtype:
    """``--dtype``: a dtype's name as every command takes it (bf16 / bfloat16, fp16, fp32; one line
    for another), but not "auto": an export is read by another machine."""
    from ..hub import resolve_dtype

    try:
        dtype = resolve_dtype(name) if name != "auto" else None
    except ValueError:
        dtype = None
    if dtype not in DTYPES.values():
        raise ValueError(f"--dtype {name!r}: an export is bfloat16 (bf16), float16 (fp16) or float32 (fp32)")
    return dtype


def add_parser(subparsers) -> None:
    export = subparsers.add_parser("export", help=command_help("export"))
    what = export.add_subparsers(dest="what", metavar="WHAT")
    parser = what.add_parser("drafter", help="an EAGLE-3 head for vLLM or SGLang")
    parser.add_argument("src", help="the head's directory (mmspec train drafter --method eagle3, or an engine layout)")
    parser.add_argument("--format", required=True, choices=sorted(ENGINE_ARCHITECTURES), help="the engine's layout")
    parser.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    parser.add_argument("--dtype", default="bfloat16", help="weights' dtype in the export: bfloat16 (bf16), float16 "
                        "(fp16) or float32 (fp32)")
    parser.set_defaults(handler=run, output_args={"out": "dir"})


def run(args) -> int:
    import shutil
    from pathlib import Path

    from ..drafters.shipped import CHAIN_SETTINGS_FILE

    from safetensors import SafetensorError

    from .output import WRITE_ERRORS, output_error

    dtype = export_dtype(args.dtype)
    check_export_directory(args.out)  # (before loading: a model's own files are never replaced)
    head = Eagle3Head.load(args.src)
    tuned = Path(args.src) / CHAIN_SETTINGS_FILE  # mmspec's tuned chain (bench chain-stop): kept for eagle3:OUT
    try:
        out = head.export(args.out, args.format, dtype)
        copy = Path(out) / CHAIN_SETTINGS_FILE
        if tuned.is_file() and not (copy.exists() and copy.samefile(tuned)):  # (an export converted in place keeps its own)
            shutil.copyfile(tuned, copy)
        elif not tuned.is_file():
            copy.unlink(missing_ok=True)  # an earlier export's settings, for another head: eagle3:OUT drafts as eagle3:SRC
    except (*WRITE_ERRORS, SafetensorError) as error:  # (a full disk: one line, as every output file's)
        raise output_error(args.out, error) from None
    config = head.config
    print(f"wrote {out}: {ENGINE_ARCHITECTURES[args.format]}, draft vocabulary {config.draft_vocab_size} of {config.vocab_size}, "
          f"target layers {list(config.aux_layers)}" + (f"; {CHAIN_SETTINGS_FILE} copied (the engines ignore it)" if tuned.is_file()
                                                        else ""))
    return 0
