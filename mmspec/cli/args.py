"""Command-line options shared by several subcommands."""

from __future__ import annotations

import argparse
import math
import os


def add_sampling_args(parser: argparse.ArgumentParser, seed: int | None) -> None:
    """The decoding options; ``seed``: --seed's default (the Python call's own: 0 for a pipeline,
    None -- a fresh seed, recorded in the stats -- for ``mmspec.generate``)."""
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated after the prompt")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="with --do-sample (default: 1)")
    parser.add_argument("--top-k", type=int, default=None, help="with --do-sample (0, as unset: every token)")
    parser.add_argument("--top-p", type=float, default=None, help="with --do-sample")
    parser.add_argument("--seed", type=int, default=seed,
                        help="seeds every random number of the call (default: " + ("a fresh seed each run, recorded in the stats)"
                                                                                  if seed is None else f"{seed}, as the pipeline's)"))


def add_model_args(parser: argparse.ArgumentParser, default_model: str | None) -> None:
    shown = default_model or "the embedded default"
    parser.add_argument("--model", default=default_model, help=f"built-in name, local path or hub id (default: {shown})")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where fast: GPU, CPU with AVX512-BF16 or AMX; else fp32) | bf16 | fp32 | fp16")
    add_optimize_arg(parser)
    add_threads_arg(parser)


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` as generate, caption, t2i and tts take it (default: PyTorch's own choice);
    :func:`apply_threads` sets it before the command runs (:func:`check_args` checks it is >= 1)."""
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice, the cores "
                        "this process may use)")


def apply_threads(args: argparse.Namespace) -> None:
    """Every command's ``--threads`` (where it has one and it is given: the training and benchmark
    commands default to theirs) as PyTorch's thread count, after :func:`check_args` and before the
    command loads anything (mmspec.cli.main)."""
    threads = getattr(args, "threads", None)
    if threads:
        import torch

        torch.set_num_threads(threads)


def add_trust_remote_code_arg(parser: argparse.ArgumentParser, whose: str = "the model's") -> None:
    """``--trust-remote-code`` (off by default): ``whose`` own Python code, from its directory or the
    hub, may run (transformers' ``trust_remote_code``)."""
    parser.add_argument("--trust-remote-code", action="store_true",
                        help=f"run {whose} own Python code from its directory or the hub (off: transformers' built-in "
                             "classes only)")


def add_optimize_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-optimize", dest="optimize", action="store_false",
                        help="keep the model's linears as loaded (default: few-row linears, mmspec.optimize)")


def add_int8_arg(parser: argparse.ArgumentParser) -> None:
    """``--int8``: the voice's AR stage with int8 weights (the text-to-speech pipeline's ``int8``)."""
    parser.add_argument("--int8", action="store_true",
                        help="read the voice's AR stage as int8 weights (CPU; faster without AMX; another, quantised "
                             "model, so --compare-baseline compares it with its own plain decoding; docs/speech.md)")


#: integer options that must be >= 1 when given, wherever a subcommand has them (counts, sizes)
POSITIVE_INTS = ("max_new_tokens", "num_draft_tokens", "threads", "repeats", "per_family", "rounds", "sentences", "batch_size",
                 "steps", "save_every", "prompts", "images", "val_images", "sequences", "val_sequences", "samples", "count",
                 "eval_pairs", "eval_sentences", "shard_size", "gen_batch", "codebook_size", "codebook_dim",
                 "num_codebooks", "image_size", "patch_size", "dim", "embed_dim", "ch", "z_channels", "heads",
                 "num_heads", "head_width", "layers", "text_layers", "text_width", "vision_layers", "vision_width",
                 "depth_ffn", "num_res_blocks", "max_parallel", "diffusion_repeat", "sampling_steps",
                 "neighbours_k", "window", "stack", "ttt_steps", "max_tokens", "context_length", "draft_tokens",
                 "ce_positions", "log_every", "restart_every", "clients", "requests",
                 "accept_top_k", "per_group", "num_images", "ch_mult", "ffn", "max_batch_size", "max_queue",
                 "max_body_bytes", "max_prompt_chars", "max_tokens_limit", "max_chat_images")
#: integer options that must be >= 0 when given (0: off / none)
NON_NEGATIVE_INTS = ("warmup", "skip", "lora_rank", "reader_layers", "vision_tokens", "draft_vocab", "workers",
                     "eval_examples", "top_k")
#: number options that must be finite and > 0 when given
POSITIVE_NUMBERS = ("max_seconds", "speed", "lr", "lora_lr", "reader_lr", "time_limit", "minutes", "lora_alpha",
                    "vision_lr_scale", "stream_stall_s", "body_timeout_s")
#: number options that must be finite and >= 0 when given
NON_NEGATIVE_NUMBERS = ("weight_decay", "kl_weight", "sample_temperature", "delta", "lam")
#: number options that are a fraction of something: in [0, 1) when given
FRACTIONS = ("input_noise", "prefix_dropout", "cfg_dropout", "held_out")
#: (options, whether a value holds, what it must be) for :func:`check_args`
RANGE_RULES = ((POSITIVE_INTS, lambda v: v >= 1, "be at least 1"), (NON_NEGATIVE_INTS, lambda v: v >= 0, "be at least 0"),
               (POSITIVE_NUMBERS, lambda v: v > 0, "be a positive number"),
               (NON_NEGATIVE_NUMBERS, lambda v: v >= 0, "be a number >= 0"), (FRACTIONS, lambda v: 0 <= v < 1, "lie in [0, 1)"),
               (("top_p",), lambda v: 0 < v <= 1, "lie in (0, 1]"))


def number_list(text: str, option: str, kind: type = int, low: float = 1) -> list:
    """A comma list option (``--temperatures 0,1``, ``--cost-curve 1,2,4``) -> its numbers, each
    of ``kind``, finite and >= ``low``. Raises one ValueError line naming ``option``."""
    values = []
    for item in (part.strip() for part in str(text).split(",")):
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low:
            what = "integers" if kind is int else "numbers"
            raise ValueError(f"{option} must be a comma list of {what} >= {low:g}, got {text!r}")
        values.append(value)
    return values


def check_args(args: argparse.Namespace) -> None:
    """Check the options every subcommand shares, before anything loads; raise ValueError with
    one line that says what to pass instead.

    Checked first: the kernel environment variables (``MMSPEC_CPU_FLAGS``, ``MMSPEC_ATTENTION``,
    ``MMSPEC_FUSED``, ``MMSPEC_BF16_KERNEL``). Checked where the subcommand has them: ``--device``
    (a device this machine has), ``--dtype`` (a dtype's name), no number option NaN or infinite, the ranges of
    :data:`RANGE_RULES` (counts >= 1, rates > 0, ...), ``--temperature`` > 0 where ``--greedy``
    exists and no sampling option given with ``--greedy``, guidance >= 1, ``--seed`` (0 to 2**63 - 1), the sampling
    options (``--temperature`` / ``--top-k`` / ``--top-p`` only with ``--do-sample``), and the
    output paths the subcommand names in its ``output_args`` default ({attribute: "file" | "dir" |
    "file or -"}, the last a file or ``-`` for standard output).
    """
    from ..hub import resolve_device, resolve_dtype
    from ..modeling.attention import attention_backend
    from ..modeling.fast_linear import KernelUnavailable, bf16_variants, cpu_flags
    from ..modeling.fused import fused_enabled

    cpu_flags(), attention_backend(), fused_enabled()  # MMSPEC_CPU_FLAGS / MMSPEC_ATTENTION / MMSPEC_FUSED: one line each
    try:
        bf16_variants()  # MMSPEC_BF16_KERNEL
    except KernelUnavailable:  # no kernel to choose: the pipelines say which linears they run
        pass
    if getattr(args, "device", None) is not None:
        resolve_device(args.device)
    if isinstance(getattr(args, "dtype", None), str):  # a dtype's name, before a results file or a model names it
        resolve_dtype(args.dtype)
    for name, value in vars(args).items():  # every number option: NaN and infinity are nobody's setting
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    zero = getattr(args, "zero_allowed", ())  # (a subcommand's counts where 0 means something: train drafter --steps 0)
    for names, holds, needs in RANGE_RULES:
        for name in names:
            value = getattr(args, name, None)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not holds(v) and not (v == 0 and name in zero):
                    raise ValueError(f"--{name.replace('_', '-')} must {'be at least 0' if name in zero else needs}, got {v}")
    # the sampling options given: refused with --greedy, and (below) without --do-sample
    given = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p") if getattr(args, name, None) is not None]
    if getattr(args, "greedy", False) and given:
        raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only when sampling; "
                         f"drop {'it' if len(given) == 1 else 'them'} or --greedy")
    if hasattr(args, "greedy") and isinstance(getattr(args, "temperature", None), (int, float)) and args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}; for greedy decoding pass --greedy")
    for name in ("guidance_scale", "guidance"):  # classifier-free guidance g: logits u + g (c - u)
        value = getattr(args, name, None)
        if isinstance(value, (int, float)) and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (1: no guidance), got {value}")
    if getattr(args, "seed", None) is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be between 0 and 2**63 - 1, got {args.seed}")
    if hasattr(args, "do_sample"):
        from ..core.sampling import SamplingConfig

        if given and not args.do_sample:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only when sampling; add "
                             "--do-sample (greedy decoding is the default)")
        if args.temperature is None:
            args.temperature = 1.0
        if args.do_sample and args.temperature == 0:
            raise ValueError("--temperature must be > 0; for greedy decoding leave out --do-sample")
        SamplingConfig(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    for name, kind in getattr(args, "output_args", {}).items():
        value = getattr(args, name, None)
        if value is not None and not (kind == "file or -" and value == "-"):  # "-": standard output
            check_output_path(value, "file" if kind == "file or -" else kind, f"--{name.replace('_', '-')}")
            setattr(args, name, os.path.expanduser(value))  # (a quoted ~ or --out=~/x: the home folder, as checked)


def check_output_path(path: str, kind: str, option: str) -> None:
    """Whether ``path`` can be written as a ``kind`` ("file" or "dir"): not the wrong kind where it
    exists (a file path that exists is a regular file, not a device), and its nearest existing
    parent is a directory where a file can be created (tried; missing parents are created by the
    writers). Raises ValueError naming ``option`` otherwise. Writing can still fail later (a full
    disk): :mod:`mmspec.cli.output` then names the path in one line and leaves no partial file."""
    import os
    from pathlib import Path

    import tempfile

    if not str(path).strip():
        raise ValueError(f"{option} is empty; give a {'directory' if kind == 'dir' else 'file name'}")
    target = Path(path).expanduser()
    if target.exists():
        if kind == "file" and target.is_dir():
            raise ValueError(f"{option} {path} is a directory; give a file name")
        if kind == "dir" and not target.is_dir():
            raise ValueError(f"{option} {path} is a file; give a directory")
        if kind == "file" and not target.is_file():
            raise ValueError(f"{option} {path} is not a regular file (a device or a pipe); give a file name")
    parent = target if target.is_dir() else target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{option} {path}: {parent} is not writable; choose another location")
    try:  # as root os.access passes everywhere (/proc too): make (and remove) a file there
        tempfile.NamedTemporaryFile(dir=parent, prefix=".mmspec-probe-").close()
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot create files in {parent} ({error.strerror or error}); "
                         "choose another location") from None
