"""``mmspec train t2i``: the embedded text-to-image generator (LlamaGen-style) and its small draft.

Recipe: the trained VQ tokenizer (``mmspec train vq``) turns the rendered training scenes
(:mod:`mmspec.train.t2i_data`) into 16 x 16 token grids once (cached); each step draws a batch of
grids, one of each image's captions (short captions and the detailed description), encodes the
captions with the frozen text encoder (:class:`~mmspec.modeling.text_encoder.SmolTextEncoder`;
its first 40 tokens, as at generation: the longer detailed descriptions are cut without a warning),
replaces 10 % of them by the null caption (classifier-free guidance training, as LlamaGen), and
minimises the cross-entropy of the 256 image tokens. AdamW on fp32 weights (bf16 autocast where bf16 is fast), cosine
schedule; rerunning the same command resumes. ``--preset draft`` trains the small draft generator
used by ``method="spec"`` on the same data.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ..hub import models_dir
from ..modeling.llamagen import LlamaGenConfig, LlamaGenModel
from ..modeling.text_encoder import SmolTextEncoder
from ..modeling.vq import VQTokenizer
from .checkpoint import TrainingRun, add_run_arguments, autocast, set_lr, train_device, warmup_cosine
from .t2i_data import cache_root, content_stamp, pick_captions, scene_pool, to_model_range

PRESETS = {
    "target": dict(dim=256, n_layer=6, n_head=4),
    "draft": dict(dim=128, n_layer=2, n_head=2),
}
TEXT_ENCODER_LAYERS = 8
CAPTION_POSITIONS = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="target")
    parser.add_argument("--out", default=None, help="default: models/t2i (target) or models/t2i-draft (draft)")
    parser.add_argument("--vq", default=str(models_dir() / "t2i-vq"), help="the trained VQ tokenizer directory")
    parser.add_argument("--draft", default="../t2i-draft", help="the draft generator's directory, relative to --out (t2i.json)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--images", type=int, default=24000)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--cfg-dropout", type=float, default=0.1)
    add_run_arguments(parser, threads=2)


@torch.no_grad()
def token_grids(vq: VQTokenizer, vq_dir: Path, split: str, n: int, size: int) -> torch.Tensor:
    """LongTensor [n, grid * grid]: the VQ tokens of the split's first n scenes (cached per tokenizer)."""
    stamp = content_stamp(vq_dir / "vq.safetensors")
    path = cache_root() / f"tokens-{split}-{n}-{size}-{stamp}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    images, _ = scene_pool(split, n, size=size)
    grids = torch.cat([vq.encode(to_model_range(images[i : i + 200])).flatten(1) for i in range(0, n, 200)])
    torch.save(grids, path)
    return grids


def generator_loss(model: LlamaGenModel, tokens: torch.Tensor, caption: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the image tokens [B, N] given caption features [B, P, C]."""
    logits = model(tokens[:, :-1], caption).logits  # [B, P + N - 1, V]
    prefix = caption.shape[1]
    return F.cross_entropy(logits[:, prefix - 1 :].reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    device = train_device(args)
    out = Path(args.out or models_dir() / ("t2i" if args.preset == "target" else "t2i-draft"))
    vq = VQTokenizer.from_pretrained(args.vq)
    run_state = TrainingRun(out, args, args.time_limit)  # a folder holding a trained model: refused here,
    run_state.check_saved("model", "optimizer")  # as another recipe's checkpoint, before the scenes render
    text_encoder = SmolTextEncoder(TEXT_ENCODER_LAYERS).to(device)
    grids = token_grids(vq, Path(args.vq), "train", args.images, args.image_size)
    _, captions = scene_pool("train", args.images, size=args.image_size)
    config = LlamaGenConfig(**PRESETS[args.preset], vocab_size=vq.vocab_size, cls_token_num=CAPTION_POSITIONS,
                            caption_dim=text_encoder.feature_dim, block_size=grids.shape[1], rope_prefix="identity")
    model = LlamaGenModel(config).to(device)
    print(f"generator ({args.preset}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    run_state.resume_into(model=model, optimizer=optimizer)
    manifest = {"vq": os.path.relpath(Path(args.vq).resolve(), out.resolve()), "text_encoder_layers": TEXT_ENCODER_LAYERS}
    if args.preset == "target":
        manifest["draft"] = args.draft
    (out / "t2i.json").write_text(json.dumps(manifest, indent=1))  # read by the text-to-image pipeline
    generator = torch.Generator().manual_seed(run_state.step)
    model.train()
    while run_state.step < args.steps:
        step = run_state.step
        lr = warmup_cosine(step, args.steps, args.lr, args.warmup)
        set_lr(optimizer, lr)
        rows = torch.randint(len(grids), (args.batch_size,), generator=generator)
        texts = pick_captions(captions, rows, generator)
        caption = text_encoder.encode(texts, model.cls_embedding.uncond_embedding.detach(), warn_cut=False)
        drop = torch.rand(args.batch_size, generator=generator) < args.cfg_dropout
        caption = torch.where(drop[:, None, None].to(device), model.null_caption(args.batch_size), caption)
        with autocast(device):
            loss = generator_loss(model, grids[rows].to(device), caption)
        run_state.optimizer_step(loss, optimizer, model.parameters())
        if run_state.step % 20 == 0:
            run_state.record(loss=loss.item(), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            run_state.save_model(model, optimizer)
        if run_state.stop_if_out_of_time():
            break
    return 0
