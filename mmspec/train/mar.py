"""``mmspec train mar``: the embedded continuous-token (MAR-style) text-to-image generator and its
small draft (``--preset draft``), for ``method="cspd"``.

Recipe: the trained KL autoencoder (``mmspec train kl``) turns the rendered training scenes into
8 x 8 grids of 16-channel latents once (posterior means times the scale factor; cached). The model
is :class:`~mmspec.modeling.mar.MARModel` with ``attention="causal"``: each step draws a random
generation order per image, and one forward trains every token at once, token j predicted from the
first ``j - m_j`` tokens of the order (m_j uniform in [0, --max-parallel), so MAR's k-tokens-per-step
decoding is trained too) with MAR's diffusion loss (eps MSE + the learned variance's bound),
``--diffusion-repeat`` noise draws per token. Captions are encoded by the frozen text encoder of
the embedded text-to-image model (first 8 SmolLM2 layers, 40 positions) into the 40 buffer slots;
10 % become the unconditional buffer (classifier-free guidance). AdamW, cosine; rerunning resumes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from ..hub import models_dir
from ..modeling.kl_vae import KLAutoencoder
from ..modeling.mar import MARConfig, MARModel
from ..modeling.text_encoder import SmolTextEncoder
from .checkpoint import TrainingRun, add_run_arguments, autocast, set_lr, train_device, warmup_cosine
from .t2i_data import cache_root, content_stamp, pick_captions, scene_pool, to_model_range

PRESETS = {
    "target": dict(encoder_embed_dim=256, encoder_depth=4, encoder_num_heads=4, decoder_embed_dim=256, decoder_depth=4,
                   decoder_num_heads=4, diffloss_d=3, diffloss_w=256),
    "draft": dict(encoder_embed_dim=128, encoder_depth=1, encoder_num_heads=2, decoder_embed_dim=128, decoder_depth=1,
                  decoder_num_heads=2, diffloss_d=2, diffloss_w=128),
}
TEXT_ENCODER_LAYERS = 8
CAPTION_POSITIONS = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="target")
    parser.add_argument("--out", default=None, help="default: models/mar (target) or models/mar-draft (draft)")
    parser.add_argument("--kl", default=str(models_dir() / "mar-kl"), help="the trained KL autoencoder directory")
    parser.add_argument("--draft", default="../mar-draft", help="the draft's directory, relative to --out (mar.json)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--images", type=int, default=24000)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--cfg-dropout", type=float, default=0.1)
    parser.add_argument("--max-parallel", type=int, default=4, help="largest k of k-tokens-per-step decoding trained")
    parser.add_argument("--diffusion-repeat", type=int, default=4, help="noise draws per token per step (MAR: 4)")
    parser.add_argument("--sampling-steps", type=int, default=50, help="reverse diffusion steps at generation")
    add_run_arguments(parser, threads=1)


@torch.no_grad()
def latent_tokens(vae: KLAutoencoder, kl_dir: Path, split: str, n: int, size: int) -> torch.Tensor:
    """[n, h * w, C] scaled latent means of the split's first n scenes, raster order (cached)."""
    stamp = content_stamp(kl_dir / "kl.safetensors")
    path = cache_root() / f"kl-latents-{split}-{n}-{size}-{stamp}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    images, _ = scene_pool(split, n, size=size)
    latents = torch.cat([vae.encode(to_model_range(images[i : i + 200])) for i in range(0, n, 200)])
    tokens = latents.flatten(2).transpose(1, 2).contiguous()
    torch.save(tokens, path)
    return tokens


def mar_loss(model: MARModel, tokens: torch.Tensor, buffer: torch.Tensor, max_parallel: int, repeat: int,
             generator: torch.Generator) -> torch.Tensor:
    """Diffusion loss of every token [B, N, D] in a random order per image (causal MAR)."""
    batch, n, dim = tokens.shape
    order = torch.argsort(torch.rand(batch, n, generator=generator), dim=1).to(tokens.device)
    seq = torch.gather(tokens, 1, order.unsqueeze(-1).expand(-1, -1, dim))
    back = torch.randint(max_parallel, (n,), generator=generator)
    prefix = (torch.arange(n) - back).clamp(min=0).to(tokens.device)
    z = model.causal_contexts(seq, order, order, prefix, buffer)  # [B, N, W]
    x0 = seq.reshape(-1, dim).repeat(repeat, 1)
    cond = z.reshape(batch * n, -1).repeat(repeat, 1)
    return model.schedule.training_loss(model.diffloss.net, x0, cond, generator)


@torch.no_grad()
def validation_loss(model: MARModel, tokens: torch.Tensor, buffers: torch.Tensor, max_parallel: int) -> float:
    """The training loss on held-out scenes with fixed orders, times and noise (comparable across saves)."""
    model.eval()
    loss = mar_loss(model, tokens, buffers, max_parallel, 1, torch.Generator().manual_seed(0)).item()
    model.train()
    return loss


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    device = train_device(args)
    out = Path(args.out or models_dir() / ("mar" if args.preset == "target" else "mar-draft"))
    vae = KLAutoencoder.from_pretrained(args.kl)
    run_state = TrainingRun(out, args, args.time_limit)  # a folder holding a trained model: refused here,
    run_state.check_saved("model", "optimizer")  # as another recipe's checkpoint, before the scenes render
    text_encoder = SmolTextEncoder(TEXT_ENCODER_LAYERS).to(device)
    tokens = latent_tokens(vae, Path(args.kl), "train", args.images, args.image_size)
    _, captions = scene_pool("train", args.images, size=args.image_size)
    config = MARConfig(img_size=args.image_size, vae_stride=vae.config.stride, patch_size=1, vae_embed_dim=vae.config.embed_dim,
                       buffer_size=CAPTION_POSITIONS, class_num=0, text_dim=text_encoder.feature_dim,
                       num_sampling_steps=args.sampling_steps, attention="causal", **PRESETS[args.preset])
    model = MARModel(config).to(device)
    print(f"MAR ({args.preset}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{config.seq_len} tokens of {config.token_embed_dim} channels", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.02)
    run_state.resume_into(model=model, optimizer=optimizer)
    manifest = {"kl": os.path.relpath(Path(args.kl).resolve(), out.resolve()), "text_encoder_layers": TEXT_ENCODER_LAYERS}
    if args.preset == "target":
        manifest["draft"] = args.draft
    out.mkdir(parents=True, exist_ok=True)
    (out / "mar.json").write_text(json.dumps(manifest, indent=1))  # read by the text-to-image pipeline
    null_text = torch.zeros(CAPTION_POSITIONS, text_encoder.feature_dim)
    val_tokens = latent_tokens(vae, Path(args.kl), "validation", 64, args.image_size).to(device)
    val_text = text_encoder.encode([c[0] for c in scene_pool("validation", 64, size=args.image_size)[1]], null_text)
    generator = torch.Generator().manual_seed(run_state.step)
    model.train()
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, args.warmup)
        set_lr(optimizer, lr)
        rows = torch.randint(len(tokens), (args.batch_size,), generator=generator)
        texts = pick_captions(captions, rows, generator)
        buffer = model.buffer(text=text_encoder.encode(texts, null_text, warn_cut=False))
        drop = torch.rand(args.batch_size, generator=generator) < args.cfg_dropout
        buffer = torch.where(drop[:, None, None].to(device), model.buffer().expand_as(buffer), buffer)
        with autocast(device):
            loss = mar_loss(model, tokens[rows].to(device), buffer, args.max_parallel, args.diffusion_repeat, generator)
        run_state.optimizer_step(loss, optimizer, model.parameters())
        if run_state.step % 20 == 0:
            run_state.record(loss=loss.item(), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            run_state.record(val_loss=validation_loss(model, val_tokens, model.buffer(text=val_text), args.max_parallel))
            run_state.save_model(model, optimizer)
        if run_state.stop_if_out_of_time():
            break
    return 0
