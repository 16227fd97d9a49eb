"""``mmspec train WHAT``: training recipes (CPU or GPU, resumable)."""

from __future__ import annotations

from pathlib import Path

from ..cli import command_help


#: recipe name -> (module in mmspec.train, help)
RECIPES = {
    "captioner": ("captioner", "the embedded captioner's vision encoder + connector"),
    "caption-data": ("caption_data", "images + prompts for a captioner's drafter (the six families at varied sizes and "
                     "crops, and renders they never make), as a --data JSONL"),
    "caption-draft": ("caption_draft", "the captioner's small text-only draft model (SPD)"),
    "drafter": ("drafter", "a trained drafter (EAGLE, EAGLE-3, Medusa, Hydra, Kangaroo) for a text LM or VLM by self-distillation"),
    "eval-captioner": ("eval_captioner", "validation metrics of the captioner, per family"),
    "vq": ("vq", "the embedded text-to-image model's VQ tokenizer"),
    "t2i": ("t2i", "the embedded text-to-image generator (or its draft: --preset draft)"),
    "kl": ("kl", "the embedded continuous-token (MAR) generator's KL autoencoder"),
    "mar": ("mar", "the embedded continuous-token (MAR) generator (or its draft: --preset draft)"),
    "image-drafter": ("image_drafter", "an EAGLE head for a text-to-image generator (both guidance rows)"),
    "clip": ("clip", "the text-to-image metric model (a small CLIP on rendered scenes)"),
    "open-text": ("open_text", "the SmolLM2-written sentences of the embedded voice's open-domain text"),
    "speech-data": ("speech_data", "real speech for the embedded voice (the Piper voice over the open-domain text or the sentence grammar)"),
    "codec": ("codec", "the embedded voice's codec (residual k-means over log-mel frames) and its round-trip WER"),
    "tts": ("tts", "the embedded voice's codec LM (or its draft: --preset draft)"),
    "tts-nar": ("tts_nar", "the non-autoregressive stage of a VALL-E-style voice (codebooks 1.. from codebook 0)"),
    "tts-self-data": ("tts_self_data", "a VALL-E-style voice's own sampled codes for its drafters (self-distillation data)"),
    "tts-drafter": ("tts_drafter", "Medusa heads (medusa, vadusa) or an EAGLE head (eagle, eagle-topk) for a codec LM by self-distillation"),
}


#: recipes that train into --out through mmspec.train.checkpoint.TrainingRun (resumable; a folder
#: holding a finished model is refused unless --overwrite)
TRAINING_RUNS = ("captioner", "caption-draft", "drafter", "vq", "t2i", "kl", "mar", "image-drafter", "clip", "codec", "tts",
                 "tts-nar", "tts-drafter")

#: recipes whose --out is a file (the others write a folder)
FILE_OUTPUTS = ("eval-captioner", "open-text")


def add_parser(subparsers) -> None:
    import importlib

    train = subparsers.add_parser("train", help=command_help("train"))
    recipes = train.add_subparsers(dest="recipe", metavar="RECIPE")
    for name, (module_name, help_text) in RECIPES.items():
        module = importlib.import_module(f"{__package__}.{module_name}")
        parser = recipes.add_parser(name, help=help_text)
        module.add_arguments(parser)
        if name in TRAINING_RUNS:
            parser.add_argument("--overwrite", action="store_true",
                                help="train anew into an --out that holds a trained model (replacing it); without it such "
                                     "a folder is refused, and one with a checkpoint is resumed (train drafter with "
                                     "--data: when --resume is given)")
        # --out is checked before training starts (cli.args.check_args)
        parser.set_defaults(handler=module.run, output_args={"out": "file" if name in FILE_OUTPUTS else "dir"},
                            interrupted=interrupted)


def interrupted(args, command: str) -> str:
    """What Ctrl-C leaves of a training run (the line mmspec prints): its checkpoints and how to resume."""
    if args.recipe == "eval-captioner":
        return "nothing was saved (the report is written at the end)"
    every = f" (one every {args.save_every} steps)" if getattr(args, "save_every", None) else ""
    if args.recipe == "drafter" and getattr(args, "data", None) and (args.target not in ("smollm2", "captioner")
                                                                     or _any_data(args)):
        # a drafter for any target continues its checkpoint only when asked, and only one that exists
        if not (Path(args.out) / "train_state.pt").is_file():
            command = " ".join(word for word in command.split(" ") if word != "--resume")
            return (f"no checkpoint was saved yet (one every {args.save_every} steps); the data made so far are kept "
                    f"in {args.out}; rerun the same command to start again from them: {command}")
        if "--resume" not in command.split():  # (an --overwrite run continues its own checkpoint now)
            command = " ".join(word for word in command.split(" ") if word != "--overwrite") + " --resume"
    return (f"the last checkpoint{every} and the data made so far are kept in {args.out}; rerun the same command to "
            f"resume: {command}")


def _any_data(args) -> bool:
    from .drafter import reads_any_data

    try:
        return reads_any_data(args)
    except ValueError:
        return False
