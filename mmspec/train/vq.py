"""``mmspec train vq``: the embedded text-to-image model's VQ tokenizer (LlamaGen-style).

Recipe: :class:`~mmspec.modeling.vq.VQTokenizer` (VQ-8 layout: three 2x downsamplings, so a
128 x 128 image is a 16 x 16 = 256-token grid) trained from scratch on rendered scenes
(:mod:`mmspec.train.t2i_data`) with L1 + L2 reconstruction, the VQ codebook loss
||sg(z) - e||^2 and the commitment loss beta ||z - sg(e)||^2 (straight-through gradients), l2-
normalised codes (LlamaGen), AdamW in fp32 (convolutions in bf16 are slower than fp32 on CPUs). No GAN or perceptual loss (no
pretrained perceptual network is available offline, and flat rendered scenes do not need one).
Codes unused for ``--restart-every`` steps are restarted at random encoder outputs of the batch
(keeps the codebook in use). Rerunning the same command resumes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ..hub import models_dir
from ..modeling.vq import VQConfig, VQTokenizer
from .checkpoint import TrainingRun, add_run_arguments, set_lr, train_device, warmup_cosine
from .t2i_data import scene_pool, to_model_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(models_dir() / "t2i-vq"))
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--images", type=int, default=24000, help="training images (rendered once, cached)")
    parser.add_argument("--codebook-size", type=int, default=1024)
    parser.add_argument("--codebook-dim", type=int, default=8)
    parser.add_argument("--ch", type=int, default=32)
    parser.add_argument("--ch-mult", type=int, nargs="+", default=[1, 2, 2, 4])
    parser.add_argument("--num-res-blocks", type=int, default=1)
    parser.add_argument("--z-channels", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--restart-every", type=int, default=100)
    add_run_arguments(parser, threads=2)


def vq_losses(model: VQTokenizer, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """One forward: (total loss, its parts, code indices [B, h, w])."""
    z = model.encode_latents(images)
    indices, codes = model.quantize(z.float())
    codebook_loss = F.mse_loss(codes, z.detach().float())
    commit_loss = F.mse_loss(z.float(), codes.detach())
    straight_through = z + (codes - z).detach()
    recon = model.decode_codes(straight_through).float()
    l1, l2 = F.l1_loss(recon, images), F.mse_loss(recon, images)
    total = l1 + l2 + codebook_loss + model.config.commit_loss_beta * commit_loss
    return total, {"l1": l1.item(), "l2": l2.item(), "codebook": codebook_loss.item()}, indices


@torch.no_grad()
def evaluate(model: VQTokenizer, images: torch.Tensor, batch_size: int = 50) -> dict[str, float]:
    """Reconstruction PSNR (dB, images in [0, 1]) and codebook usage on ``images`` (uint8)."""
    model.eval()
    device = next(model.parameters()).device
    squared, used = [], torch.zeros(model.vocab_size, dtype=torch.bool, device=device)
    for start in range(0, len(images), batch_size):
        x = to_model_range(images[start : start + batch_size]).to(device)
        indices = model.encode(x)
        recon = model.decode(indices).float()
        used[indices.flatten()] = True
        squared.append(((recon - x) / 2).pow(2).flatten(1).mean(1))
    model.train()
    mse = torch.cat(squared)
    return {"psnr": float((-10 * torch.log10(mse)).mean()), "codebook_usage": float(used.float().mean())}


def run(args: argparse.Namespace) -> int:
    factor = 2 ** (len(args.ch_mult) - 1)  # the encoder halves the image at each level after the first
    if args.image_size % factor:
        raise ValueError(f"--image-size must be a multiple of {factor} (2 ** (levels of --ch-mult - 1)), got {args.image_size}")
    torch.manual_seed(0)
    device = train_device(args)
    config = VQConfig(codebook_size=args.codebook_size, codebook_embed_dim=args.codebook_dim, ch=args.ch,
                      encoder_ch_mult=args.ch_mult, decoder_ch_mult=args.ch_mult, num_res_blocks=args.num_res_blocks,
                      z_channels=args.z_channels, image_size=args.image_size)
    model = VQTokenizer(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.5, 0.9), weight_decay=0.0)
    run_state = TrainingRun(args.out, args, args.time_limit)
    run_state.resume_into(model=model, optimizer=optimizer)
    train_images, _ = scene_pool("train", args.images, size=args.image_size)
    val_images, _ = scene_pool("validation", 200, size=args.image_size)
    print(f"VQ tokenizer: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{config.grid_size}x{config.grid_size} tokens per image", flush=True)
    generator = torch.Generator().manual_seed(run_state.step)
    last_used = torch.zeros(config.codebook_size, dtype=torch.long, device=device)
    model.train()
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, warmup=100)
        set_lr(optimizer, lr)
        batch = to_model_range(train_images[torch.randint(len(train_images), (args.batch_size,), generator=generator)]).to(device)
        loss, parts, indices = vq_losses(model, batch)
        run_state.optimizer_step(loss, optimizer, model.parameters())
        last_used[indices.flatten().unique()] = run_state.step
        if run_state.step % args.restart_every == 0:
            dead = (last_used < run_state.step - args.restart_every).nonzero().flatten()
            if len(dead):
                with torch.no_grad():
                    latents = model.encode_latents(batch).float().permute(0, 2, 3, 1).reshape(-1, config.codebook_embed_dim)
                    pick = latents[torch.randint(len(latents), (len(dead),), generator=generator).to(device)]
                    model.quantize.embedding.weight.data[dead] = pick + 0.01 * torch.randn_like(pick)
                last_used[dead] = run_state.step
            run_state.record(loss=loss.item(), **parts, restarted=len(dead), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            metrics = evaluate(model, val_images)
            run_state.record_eval(metrics)
            run_state.save_model(model, optimizer)
        if run_state.stop_if_out_of_time():
            break
    return 0
