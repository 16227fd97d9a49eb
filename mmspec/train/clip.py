"""``mmspec train clip``: the project's own text-to-image metric model (a small CLIP).

Recipe: an open_clip ``CLIP`` built from a config in code (no pretrained weights): a ViT on
64 x 64 images (patch 8 -> 64 patches, width 192, 6 layers) and a causal text transformer (context
96, width 192, 4 layers) over open_clip's own BPE tokenizer restricted to the tokens of the training
captions (:class:`~mmspec.metrics.image_quality.CompactTokenizer`), trained from scratch with the
contrastive CLIP loss (``open_clip.loss.ClipLoss``, learnt temperature clamped at 100) on the
rendered scenes (:mod:`mmspec.train.t2i_data`, 64 x 64), one random caption of each image per step
(short captions and the detailed description); the text tower runs each batch in length buckets
(:meth:`~mmspec.metrics.image_quality.MetricCLIP.encode_text`, exact, about half the text cost). AdamW in fp32 (bf16 is much slower on CPUs), linear
warmup then cosine schedule; rerunning the same command resumes.

Every ``--save-every`` steps: ``OUT/open_clip_config.json`` + ``OUT/model.safetensors`` (fp16) and
``OUT/eval.json``: text -> image retrieval top-1 / top-5 accuracy among ``--eval-pairs`` validation
scenes, with the detailed descriptions (``top1``/``top5``, each identifies its scene) and with the
first short caption (``short_top1``/``short_top5``; several scenes can share one, so lower).
Used by :mod:`mmspec.metrics.image_quality` (prompt score, Fréchet CLIP distance).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from ..metrics.image_quality import CompactTokenizer, MetricCLIP, clip_config
from ..hub import models_dir
from .checkpoint import TrainingRun, add_run_arguments, set_lr, train_device
from .t2i_data import scene_pool, to_model_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(models_dir() / "t2i-clip"))
    parser.add_argument("--steps", type=int, default=350)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--images", type=int, default=24000, help="training images (rendered once, cached)")
    parser.add_argument("--val-images", type=int, default=1000, help="validation scenes loaded (cached pool)")
    parser.add_argument("--eval-pairs", type=int, default=500, help="retrieval candidates/queries at save time")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--vision-width", type=int, default=192)
    parser.add_argument("--vision-layers", type=int, default=6)
    parser.add_argument("--context-length", type=int, default=96, help="the longest scene description is 92 tokens")
    parser.add_argument("--text-width", type=int, default=192)
    parser.add_argument("--text-layers", type=int, default=4)
    parser.add_argument("--head-width", type=int, default=64)
    parser.add_argument("--embed-dim", type=int, default=128)
    add_run_arguments(parser, threads=1)


@torch.no_grad()
def evaluate(metric: MetricCLIP, images: torch.Tensor, captions: list[list[str]]) -> dict[str, float]:
    """Text -> image retrieval accuracy among ``len(images)`` scenes (each caption's own image is the
    target): detailed descriptions (``top1``/``top5``) and first short captions (``short_*``)."""
    was_training = metric.model.training
    metric.model.eval()
    image = metric.image_features(images)
    target = torch.arange(len(images))
    k = min(5, len(images))
    results = {}
    for name, texts in (("", [c[-1] for c in captions]), ("short_", [c[0] for c in captions])):
        ranking = (metric.text_features(texts) @ image.T).topk(k, dim=1).indices
        results[f"{name}top1"] = round(float((ranking[:, 0] == target).float().mean()), 4)
        results[f"{name}top5"] = round(float((ranking == target[:, None]).any(1).float().mean()), 4)
    metric.model.train(was_training)
    return results


def run(args: argparse.Namespace) -> int:
    from open_clip.loss import ClipLoss

    if train_device(args).type != "cpu":
        raise ValueError("mmspec train clip trains on the CPU (the metric model is small); drop --device")
    torch.manual_seed(0)
    run_state = TrainingRun(args.out, args, args.time_limit)  # a folder holding a trained model: refused here,
    run_state.check_saved("model", "optimizer", "token_ids")  # as another recipe's checkpoint, before the scenes render
    train_images, train_captions = scene_pool("train", args.images, size=args.image_size)
    val_images, val_captions = scene_pool("validation", args.val_images, size=args.image_size)
    val_images, val_captions = val_images[: args.eval_pairs], val_captions[: args.eval_pairs]
    saved = run_state.resume()
    if saved:
        token_ids = saved["token_ids"].tolist()
    else:
        token_ids = CompactTokenizer.vocabulary([c for cs in train_captions for c in cs], args.context_length)
    config = clip_config(token_ids, image_size=args.image_size, patch_size=args.patch_size,
                         vision_width=args.vision_width, vision_layers=args.vision_layers,
                         context_length=args.context_length, text_width=args.text_width,
                         text_layers=args.text_layers, head_width=args.head_width, embed_dim=args.embed_dim)
    metric = MetricCLIP(config, token_ids)
    model = metric.model
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    if saved:
        with run_state.restoring():  # (a checkpoint of other sizes: one line)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
    loss_fn = ClipLoss()
    print(f"metric CLIP: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{metric.tokenizer.vocab_size} text tokens, {len(train_images)} training scenes", flush=True)
    generator = torch.Generator().manual_seed(run_state.step)
    counts = torch.tensor([len(c) for c in train_captions])
    model.train()
    while run_state.step < args.steps:
        step = run_state.step
        lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup))
        lr *= 0.5 * (1 + math.cos(math.pi * max(0, step - args.warmup) / max(1, args.steps - args.warmup)))
        set_lr(optimizer, lr)
        pick = torch.randint(len(train_images), (args.batch_size,), generator=generator)
        which = (torch.rand(args.batch_size, generator=generator) * counts[pick]).long()
        texts = [train_captions[i][j] for i, j in zip(pick.tolist(), which.tolist())]
        image_features = F.normalize(model.encode_image(to_model_range(train_images[pick])), dim=-1)
        text_features = F.normalize(metric.encode_text(metric.tokenizer(texts)), dim=-1)
        scale = model.logit_scale.exp()
        loss = loss_fn(image_features, text_features, scale)
        run_state.optimizer_step(loss, optimizer, model.parameters())
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if run_state.step % 10 == 0 or run_state.step == 1:
            run_state.record(loss=loss.item(), temperature=scale.item(), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            metrics = evaluate(metric, val_images, val_captions)
            run_state.record_eval(metrics, pairs=len(val_images), task="text->image retrieval")
            metric.save(args.out, step=run_state.step, trained_on=f"mmspec rendered scenes, train split, {len(train_images)} images",
                        eval=metrics)
            run_state.save(model=model.state_dict(), optimizer=optimizer.state_dict(),
                           token_ids=torch.tensor(token_ids))
        if run_state.stop_if_out_of_time():
            break
    return 0
