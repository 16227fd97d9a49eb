"""``mmspec train kl``: the KL autoencoder of the embedded continuous-token (MAR) generator.

Recipe: :class:`~mmspec.modeling.kl_vae.KLAutoencoder` (LDM / MAR "KL" layout; by default three 2x
downsamplings, so a 64 x 64 scene is an 8 x 8 grid of 16-channel latents: 64 continuous tokens)
trained from scratch on rendered scenes (:mod:`mmspec.train.t2i_data`) with L1 + L2 reconstruction
of a posterior sample plus ``--kl-weight`` x KL(posterior || N(0, I)) (LDM's regulariser; no GAN or
perceptual loss, as for the VQ tokenizer). At every save the latent scale factor is set so that
scaled latents have unit std over validation scenes (MAR's 0.2325 for KL-16). Rerunning resumes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ..hub import models_dir
from ..modeling.kl_vae import KLAutoencoder, KLConfig
from .checkpoint import TrainingRun, add_run_arguments, set_lr, train_device, warmup_cosine
from .t2i_data import scene_pool, to_model_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(models_dir() / "mar-kl"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--images", type=int, default=24000, help="training images (rendered once, cached)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--ch", type=int, default=32)
    parser.add_argument("--ch-mult", type=int, nargs="+", default=[1, 2, 2, 4])
    parser.add_argument("--num-res-blocks", type=int, default=1)
    parser.add_argument("--embed-dim", type=int, default=16)
    parser.add_argument("--kl-weight", type=float, default=1e-4)
    add_run_arguments(parser, threads=1)


def kl_losses(model: KLAutoencoder, images: torch.Tensor, kl_weight: float,
              generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    mean, logvar = model.posterior(images)
    z = mean + (0.5 * logvar).exp() * torch.randn(mean.shape, generator=generator).to(mean.device)
    recon = model.decoder(model.post_quant_conv(z))
    l1, l2 = F.l1_loss(recon, images), F.mse_loss(recon, images)
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).sum((1, 2, 3)).mean()
    return l1 + l2 + kl_weight * kl, {"l1": l1.item(), "l2": l2.item(), "kl": kl.item()}


@torch.no_grad()
def evaluate(model: KLAutoencoder, images: torch.Tensor, batch_size: int = 50) -> dict[str, float]:
    """Reconstruction PSNR (dB, images in [0, 1]) from the posterior mean, and the std of the
    unscaled latent means (the scale factor is its inverse)."""
    model.eval()
    squared, latents = [], []
    for start in range(0, len(images), batch_size):
        x = to_model_range(images[start : start + batch_size]).to(next(model.parameters()).device)
        mean, _ = model.posterior(x)
        latents.append(mean.flatten())
        recon = model.decoder(model.post_quant_conv(mean))
        squared.append(((recon - x) / 2).pow(2).flatten(1).mean(1))
    model.train()
    mse = torch.cat(squared)
    return {"psnr": float((-10 * torch.log10(mse)).mean()), "latent_std": float(torch.cat(latents).std())}


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    device = train_device(args)
    config = KLConfig(resolution=args.image_size, ch=args.ch, ch_mult=args.ch_mult, num_res_blocks=args.num_res_blocks,
                      attn_resolutions=[args.image_size // 2 ** (len(args.ch_mult) - 1)], embed_dim=args.embed_dim, scale=1.0)
    model = KLAutoencoder(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.5, 0.9), weight_decay=0.0)
    run_state = TrainingRun(args.out, args, args.time_limit)
    run_state.resume_into(model=model, optimizer=optimizer)
    train_images, _ = scene_pool("train", args.images, size=args.image_size)
    val_images, _ = scene_pool("validation", 200, size=args.image_size)
    grid = args.image_size // config.stride
    print(f"KL autoencoder: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{grid}x{grid} tokens of {config.embed_dim} channels per image", flush=True)
    generator = torch.Generator().manual_seed(run_state.step)
    model.train()
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, warmup=100)
        set_lr(optimizer, lr)
        batch = to_model_range(train_images[torch.randint(len(train_images), (args.batch_size,), generator=generator)]).to(device)
        loss, parts = kl_losses(model, batch, args.kl_weight, generator)
        run_state.optimizer_step(loss, optimizer, model.parameters())
        if run_state.step % 20 == 0:
            run_state.record(loss=loss.item(), **parts, lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            metrics = evaluate(model, val_images)
            model.config.scale = 1.0 / metrics["latent_std"]
            run_state.record_eval(metrics)
            run_state.save_model(model, optimizer)
        if run_state.stop_if_out_of_time():
            break
    return 0
