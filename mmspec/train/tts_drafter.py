"""``mmspec train tts-drafter``: the trained drafters of a codec LM, by self-distillation on the
frozen target: Medusa heads (``--kind medusa``: methods ``medusa`` and ``vadusa`` of the
text-to-speech pipeline) or an EAGLE head (``--kind eagle``: method ``eagle``).

On the speech shards' teacher-forced steps, the target gives its last hidden states f_t and its
distributions p_{t+1} of every next step.

- Medusa head i (0-based) reads f_t and learns the target's own distribution of step t + 2 + i,
  KL(p_{t+2+i} || Heads(f_t + SiLU(W_i f_t + b_i))) per code, the K output heads shared with the
  target (Medusa-2's self-distillation: the heads learn what the target would say, which is what
  their acceptance depends on).
- The EAGLE head reads (E_t, f_{t-1}), E_t the LM's input of step t, and predicts f^_t, trained as
  EAGLE is: SmoothL1(f^_t, f_t) + w KL(p_{t+1} || Heads(f^_t)) per code (the KL in place of
  EAGLE's cross-entropy with the data's tokens: self-distillation, as above; w = ``--kl-weight``,
  EAGLE's 0.1 by default), causally over a whole utterance's steps (positions = step indices, as
  the drafter runs it); ``--ffn`` narrows the head layer's MLP.

Resumable: rerun the same command. The target's tts.json gains ``"medusa"`` / ``"eagle"`` so the
pipeline finds the drafter.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from pathlib import Path

import torch

from ..hub import models_dir
from ..modeling.codec_lm import CodecLM
from ..modeling.heads import DraftHeads, EagleHead
from ..modeling.mel_codec import MelRVQCodec
from .checkpoint import TrainingRun, add_run_arguments, to_device, train_device, warmup_cosine
from .tts import collate, encoded_utterances


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="the codec LM directory (default: models/tts)")
    parser.add_argument("--data", default="runs/speech-data", help="shards of mmspec train speech-data")
    parser.add_argument("--codec", default=None, help="codec directory (default: the target's, from its tts.json)")
    parser.add_argument("--kind", choices=("medusa", "eagle"), default="medusa")
    parser.add_argument("--out", default=None, help="default: models/tts-medusa (models/tts-eagle for --kind eagle)")
    parser.add_argument("--heads", type=int, default=3, help="Medusa heads (steps drafted beyond the target's own)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--kl-weight", type=float, default=0.1,
                        help="EAGLE: weight of the KL term against the feature regression (EAGLE's 0.1; more "
                             "weight fits the head's distributions, which acceptance at temperature 1 depends on)")
    parser.add_argument("--ffn", type=int, default=None,
                        help="EAGLE: the head layer's MLP width (default: the target's); narrower reads fewer bytes a draft")
    add_run_arguments(parser, threads=2, save_every=100)


@torch.no_grad()
def teacher_forced(target: CodecLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frozen target on a collated batch: logits [B, S, K, C + 1] (row t: step t + 1), last
    hidden states [B, S, D] (row t: f_t) and the logits' log-probabilities in fp32."""
    inputs = {name: batch[name] for name in ("phonemes", "text_mask", "steps", "step_mask", "alignment") if name in batch}
    logits, hidden = target.step_logits(**inputs, return_hidden=True)
    return logits, hidden, logits.float().log_softmax(-1)


def heads_loss(heads: DraftHeads, target: CodecLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over heads and predicted codes of KL(target's step t + 2 + i || head i at t)."""
    logits, hidden, reference = teacher_forced(target, batch)
    valid = batch["targets"] != -100  # [B, S, K]
    shape = logits.shape
    losses = []
    for i in range(heads.num_heads):
        shift = i + 1
        if shape[1] <= shift:
            break
        guess = target.heads(heads.head_state(i, hidden[:, :-shift])).view(shape[0], shape[1] - shift, *shape[2:])
        teacher = reference[:, shift:]
        kl = (teacher.exp() * (teacher - guess.float().log_softmax(-1))).sum(-1)
        mask = valid[:, shift:]
        losses.append((kl * mask).sum() / mask.sum().clamp_min(1))
    return torch.stack(losses).mean()


def eagle_loss(head: EagleHead, target: CodecLM, batch: dict[str, torch.Tensor], kl_weight: float = 0.1) -> torch.Tensor:
    """SmoothL1(f^_t, f_t) + w KL(p_{t+1} || Heads(f^_t)), f^_t = Head(E_t, f_{t-1}), over steps
    t = 1 .. S - 1 (module doc; w = ``kl_weight``, EAGLE's 0.1); padded steps and codes without a
    target excluded."""
    logits, hidden, reference = teacher_forced(target, batch)
    with torch.no_grad():
        embeds = target.step_embeddings(batch["steps"], batch.get("alignment"))  # E_t
    steps = hidden.shape[1]
    positions = torch.arange(1, steps, device=hidden.device)[None]
    predicted = head(hidden[:, :-1], embeds[:, 1:], None, positions)  # f^_t for t = 1 .. S - 1
    real = batch["step_mask"][:, 1:].bool()
    regression = torch.nn.functional.smooth_l1_loss(predicted[real], hidden[:, 1:][real])
    guess = target.heads(predicted).view(*logits[:, 1:].shape).float().log_softmax(-1)
    teacher = reference[:, 1:]
    kl = (teacher.exp() * (teacher - guess)).sum(-1)
    valid = (batch["targets"][:, 1:] != -100) & real[..., None]
    return regression + kl_weight * (kl * valid).sum() / valid.sum().clamp_min(1)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = train_device(args)
    target_dir = Path(args.target or models_dir() / "tts")
    out = Path(args.out or models_dir() / f"tts-{args.kind}")
    if args.heads < 1:
        raise ValueError(f"--heads must be at least 1, got {args.heads}")
    if args.ffn is not None and args.ffn < 1:
        raise ValueError(f"--ffn must be at least 1, got {args.ffn}")
    if not math.isfinite(args.kl_weight) or args.kl_weight < 0:
        raise ValueError(f"--kl-weight must be a finite number >= 0, got {args.kl_weight}")
    target = CodecLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    manifest_path = target_dir / "tts.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    codec_dir = Path(args.codec) if args.codec else target_dir / manifest.get("codec", "../tts-codec")
    codec = MelRVQCodec.from_pretrained(codec_dir)
    items = encoded_utterances(args.data, codec_dir, codec, "train")
    if args.kind == "eagle":
        heads = EagleHead(target.backbone.config, args.ffn)
        loss_of = functools.partial(eagle_loss, kl_weight=args.kl_weight)
        what = "an EAGLE head"
    else:
        heads, loss_of = DraftHeads(target.config.dim, args.heads, "medusa"), heads_loss
        what = f"{args.heads} Medusa heads"
    print(f"{what} on {target_dir} ({sum(p.numel() for p in heads.parameters()) / 1e6:.2f}M "
          f"parameters), {len(items)} utterances", flush=True)
    heads.to(device)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run_state = TrainingRun(out, args, args.time_limit)
    run_state.resume_into(heads=heads, optimizer=optimizer)
    generator = torch.Generator().manual_seed(run_state.step)
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, args.warmup, floor=0.1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(len(items), (args.batch_size,), generator=generator).tolist()
        loss = loss_of(heads, target, to_device(collate([items[r] for r in rows], target.config), device))
        run_state.optimizer_step(loss, optimizer, heads.parameters())
        if run_state.step % 20 == 0 or run_state.step == args.steps:
            run_state.record(loss=loss.item(), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            heads.save(out, target=os.path.relpath(target_dir.resolve(), out.resolve()))
            run_state.save(heads=heads.state_dict(), optimizer=optimizer.state_dict())
        if run_state.stop_if_out_of_time():
            break
    if manifest_path.is_file():
        manifest[args.kind] = os.path.relpath(out.resolve(), target_dir.resolve())
        manifest_path.write_text(json.dumps(manifest, indent=1))
    return 0
