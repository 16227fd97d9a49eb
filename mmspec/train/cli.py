"""``mmspec train WHAT``: training recipes (bf16 on CPU, resumable)."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    train = subparsers.add_parser("train", help="training recipes for the embedded models (resumable)")
    recipes = train.add_subparsers(dest="recipe", metavar="RECIPE")
    from . import caption_draft, captioner, clip, drafter, eval_captioner, t2i, vq

    parser = recipes.add_parser("captioner", help="the embedded captioner's vision encoder + connector")
    captioner.add_arguments(parser)
    parser.set_defaults(handler=captioner.run)
    parser = recipes.add_parser("caption-draft", help="the captioner's small text-only draft model (SPD)")
    caption_draft.add_arguments(parser)
    parser.set_defaults(handler=caption_draft.run)
    parser = recipes.add_parser("drafter", help="a trained drafter (EAGLE head) by self-distillation on a target")
    drafter.add_arguments(parser)
    parser.set_defaults(handler=drafter.run)
    parser = recipes.add_parser("eval-captioner", help="validation metrics of the captioner, per family")
    eval_captioner.add_arguments(parser)
    parser.set_defaults(handler=eval_captioner.run)
    parser = recipes.add_parser("vq", help="the embedded text-to-image model's VQ tokenizer")
    vq.add_arguments(parser)
    parser.set_defaults(handler=vq.run)
    parser = recipes.add_parser("t2i", help="the embedded text-to-image generator (or its draft: --preset draft)")
    t2i.add_arguments(parser)
    parser.set_defaults(handler=t2i.run)
    parser = recipes.add_parser("clip", help="the text-to-image metric model (a small CLIP on rendered scenes)")
    clip.add_arguments(parser)
    parser.set_defaults(handler=clip.run)
