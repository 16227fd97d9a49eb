"""``mmspec train image-drafter``: an EAGLE head for a guided image-token generator, by
self-distillation on both classifier-free-guidance rows.

1. Data (``OUT/data/shard-*.pt``, written batch by batch, so a restart resumes): the generator
   samples image-token sequences itself, with guidance (``--guidance``, temperature, top-k: the
   settings the drafter will serve), for captions of the rendered training scenes; then one
   teacher-forced forward per sequence records the last hidden states of both rows (conditional,
   unconditional): features [2, 1 + N, D] (the prompt's last position, then every code's).
   mmspec's own generator samples a whole batch of prompts at once; any other
   :class:`~mmspec.adapters.image_gen.GuidedImageTarget` (a user's LlamaGen, Janus, Emu3,
   Chameleon) goes one sequence at a time through :func:`mmspec.generate`.
2. Training (:func:`head_loss`): the head reads (f_{i-1}, x_i) on both rows and predicts f_i;
   loss = SmoothL1(f^, f) over both rows + ``--kl-weight`` * KL(p || q), with p and q the guided
   distributions softmax(u + g (c - u)) from the target's and the head's features — what the
   acceptance rules compare. AdamW on fp32 weights, warm-up + cosine; rerunning resumes.
3. Validation (``eval.json``, in the model card): on sequences sampled for held-out captions
   (the test split's samples 1000 onwards; the benchmark prompts are its first ones), the one-step acceptance rate sum_x min(p(x), q(x)) of speculative sampling
   and the top-1 agreement of the guided distributions.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.sampling import SamplingConfig, cfg_combine, logits_to_probs
from ..modeling.heads import ImageEagleConfig, ImageEagleHead, target_width
from .checkpoint import TrainingRun, add_run_arguments, set_lr, train_device, warmup_cosine
from ..core import words


VAL_START = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="what the text-to-image pipeline loads: an mmspec t2i directory "
                        "(default: the embedded models/t2i), or a transformers Janus / Emu3 path or hub id (a Chameleon "
                        "checkpoint is refused: the pipeline loads one only from Python, with its VQGAN decoder)")
    parser.add_argument("--processor", default=None, help="for transformers models: the processor / tokenizer path (default: the model's)")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--out", default="runs/t2i-eagle")
    parser.add_argument("--sequences", type=int, default=2048, help="self-distilled training sequences")
    parser.add_argument("--val-sequences", type=int, default=64)
    parser.add_argument("--gen-batch", type=int, default=64, help="prompts sampled together (mmspec's own generator)")
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--kl-weight", type=float, default=0.5)
    parser.add_argument("--heads", type=int, default=None, help="attention heads of the head's block (default: width / 64)")
    add_run_arguments(parser, threads=2)


# ---- 1. self-distillation ---------------------------------------------------------------------
@torch.no_grad()
def sample_llamagen_batch(model, captions: torch.Tensor, guidance: float, sampling: SamplingConfig,
                          generator: torch.Generator) -> torch.Tensor:
    """Guided sampling of B sequences at once with mmspec's LlamaGen-style generator.

    captions: [B, P, C] caption features -> LongTensor [B, N] codes (the distribution of
    ``mmspec.generate`` with the same guidance and sampling, batched)."""
    from ..core.cache import make_cache

    batch = captions.shape[0]
    cache = make_cache(None)
    out = model(None, torch.cat([captions, model.null_caption(batch).to(captions)]), past_key_values=cache)
    codes = []
    for _ in range(model.config.block_size):
        logits = out.logits[:, -1]
        probs = logits_to_probs(cfg_combine(logits[:batch], logits[batch:], guidance), sampling)
        code = torch.multinomial(probs.cpu(), 1, generator=generator).to(probs.device)  # [B, 1], drawn on the CPU
        codes.append(code)
        out = model(code.repeat(2, 1), past_key_values=cache)
    return torch.cat(codes, dim=1)


@torch.no_grad()
def guided_features(target, model_inputs: dict, codes: torch.Tensor) -> torch.Tensor:
    """Teacher-forced last hidden states of both guidance rows: [R, 1 + N, D] for the prompt's
    last position and each code of ``codes`` [1, N] (any guided image target)."""
    state, first = target.prefill(model_inputs, hidden_layer=-1)
    rest = target.forward(state, codes, hidden_layer=-1)
    return torch.cat([first.hidden_states, rest.hidden_states], dim=1)


def write_shards(target, prompt_inputs, prompts: list[str], directory: Path, args, split_seed: int,
                 llamagen_model=None) -> None:
    """Sample sequences for ``prompts`` and store codes + features in shards of ``--gen-batch``
    (existing shards are kept: a restart continues). ``prompt_inputs(prompt)`` gives the target's
    model inputs without the guidance scale (LlamaGen: {"caption": [1, P, C]}; the transformers
    families: {"input_ids": [1, T]})."""
    import mmspec

    directory.mkdir(parents=True, exist_ok=True)
    sampling = SamplingConfig(do_sample=True, temperature=args.temperature, top_k=args.top_k)
    for index, start in enumerate(range(0, len(prompts), args.gen_batch)):
        path = directory / f"shard-{index:04d}.pt"
        if path.exists():
            continue
        inputs = [{**prompt_inputs(p), "guidance_scale": args.guidance} for p in prompts[start : start + args.gen_batch]]
        if llamagen_model is not None:
            generator = torch.Generator().manual_seed(split_seed * 100003 + index)
            captions = torch.cat([i["caption"] for i in inputs])
            codes = sample_llamagen_batch(llamagen_model, captions, args.guidance, sampling, generator)
        else:
            codes = torch.cat([mmspec.generate(target, do_sample=True, temperature=args.temperature, top_k=args.top_k,
                                               max_new_tokens=target.num_image_tokens, seed=split_seed * 100003 + start + i,
                                               **model_inputs).sequences[:, -target.num_image_tokens :]
                               for i, model_inputs in enumerate(inputs)])
        features = torch.stack([guided_features(target, model_inputs, codes[i : i + 1]) for i, model_inputs in enumerate(inputs)])
        torch.save({"codes": codes.cpu(), "features": features.to("cpu", torch.bfloat16)}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        print(json.dumps({"shard": index, "sequences": start + len(inputs)}), flush=True)


def load_shards(directory: Path) -> tuple[torch.Tensor, torch.Tensor]:
    shards = [torch.load(p, weights_only=True) for p in sorted(directory.glob("shard-*.pt"))]
    return torch.cat([s["codes"] for s in shards]), torch.cat([s["features"] for s in shards])


# ---- 2. training ------------------------------------------------------------------------------
def head_loss(head: ImageEagleHead, target, codes: torch.Tensor, features: torch.Tensor, guidance: float,
              kl_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """codes [B, N], features [B, R, 1 + N, D] (R = 2: conditional, unconditional) -> loss.

    The head runs on the B * R rows without a cache (causal); the code embeddings are shared by
    the two rows of a sequence."""
    batch, rows, length, width = features.shape
    inputs = features[:, :, :-1].reshape(batch * rows, length - 1, width).float()
    wanted = features[:, :, 1:].reshape(batch * rows, length - 1, width).float()
    embeds = target.embed_codes(codes).detach().repeat_interleave(rows, dim=0)
    positions = torch.arange(length - 1, device=codes.device)
    predicted = head(inputs, embeds, None, positions)
    regression = F.smooth_l1_loss(predicted, wanted)

    def guided_log_probs(f: torch.Tensor) -> torch.Tensor:
        logits = target.code_logits(f).float().view(batch, rows, length - 1, -1)
        return torch.log_softmax(cfg_combine(logits[:, 0], logits[:, 1], guidance), dim=-1)

    log_p = guided_log_probs(wanted).detach()
    log_q = guided_log_probs(predicted)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    with torch.no_grad():
        acceptance = torch.minimum(log_p.exp(), log_q.exp()).sum(-1).mean()
        top1 = (log_p.argmax(-1) == log_q.argmax(-1)).float().mean()
    return regression + kl_weight * kl, {"smooth_l1": regression.item(), "kl": kl.item(),
                                         "acceptance": acceptance.item(), "top1": top1.item()}


def _setup(model: str | None, processor: str | None, trust_remote_code: bool, device: torch.device):
    """(target, prompt -> model inputs, mmspec's own generator or None, the model's name) of any
    model the text-to-image pipeline loads."""
    from ..adapters.image_gen import LlamaGenTarget
    from ..pipelines.text_to_image.components import T2IComponents

    components = T2IComponents.from_pretrained(model, device=device, processor=processor, trust_remote_code=trust_remote_code)
    own = components.generator if isinstance(components.target, LlamaGenTarget) else None
    if own is None:  # (a transformers processor cuts nothing)
        return components.target, components.prompt_inputs, own, str(components.model_dir)
    # the scenes' detailed descriptions (up to 92 tokens) are cut knowingly, as train t2i cuts them (warn_cut=False
    # there too): a warning per description told the user to shorten a prompt they never gave
    return components.target, partial(components.prompt_inputs, warn_cut=False), own, str(components.model_dir)


def _prompts(split: str, n: int, start: int) -> list[str]:
    from .t2i_data import scene_pool

    _, captions = scene_pool(split, n, start=start, size=64)
    return [c[i % len(c)] for i, c in enumerate(captions)]


@torch.no_grad()
def evaluate(head, target, codes, features, guidance) -> dict[str, float]:
    head.eval()
    totals: dict[str, float] = {}
    for start in range(0, len(codes), 8):
        _, metrics = head_loss(head, target, codes[start : start + 8].to(target.device), features[start : start + 8].to(target.device),
                               guidance, 0.0)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value * len(codes[start : start + 8])
    head.train()
    return {key: round(value / len(codes), 4) for key, value in totals.items()}


def link_head(given: str | None, model_dir: Path, out: Path) -> None:
    """The trained head named in the target's t2i.json (``"eagle"``, relative), as ``train tts-drafter``
    does, so that ``--method eagle`` finds it: for an mmspec t2i directory given with ``--model``;
    the embedded model's shipped manifest (no ``--model``) is left as it is (pass ``--eagle-head OUT``)."""
    manifest_path = model_dir / "t2i.json"
    if given is None or not manifest_path.is_file():
        print(f"the head is in {out}: give it with --eagle-head {out} (eagle_head=...)", flush=True)
        return
    manifest = json.loads(manifest_path.read_text())
    manifest["eagle"] = os.path.relpath(out.resolve(), model_dir.resolve())
    manifest_path.write_text(json.dumps(manifest, indent=1))
    print(f"linked the head into {manifest_path} (\"eagle\": {manifest['eagle']!r})", flush=True)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    device = train_device(args)
    out = Path(args.out)
    run_state = TrainingRun(out, args, args.time_limit)
    run_state.check_saved("head", "optimizer")  # another recipe's --out: refused before any data is written
    target, prompt_inputs, llamagen, model_dir = _setup(args.model, args.processor, args.trust_remote_code, device)
    # validation captions: the test split after the benchmark's prompts (bench t2i uses its first 500)
    for split, n, start, seed, name in (("train", args.sequences, 0, 1, "train"), ("test", args.val_sequences, VAL_START, 2, "val")):
        write_shards(target, prompt_inputs, _prompts(split, n, start), out / "data" / name, args, seed, llamagen)
    codes, features = load_shards(out / "data" / "train")
    val_codes, val_features = load_shards(out / "data" / "val")
    width = target_width(target)
    config = ImageEagleConfig(dim=width, n_head=args.heads or max(1, width // 64), grid=tuple(target.grid))
    head = ImageEagleHead(config).to(device)
    for p in target.model.parameters():
        p.requires_grad_(False)
    print(f"image EAGLE head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, "
          f"{words.count(len(codes), 'sequence')}", flush=True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run_state.resume_into(head=head, optimizer=optimizer)
    generator = torch.Generator().manual_seed(run_state.step)
    head.train()
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, args.warmup)
        set_lr(optimizer, lr)
        rows = torch.randint(len(codes), (args.batch_size,), generator=generator)
        loss, metrics = head_loss(head, target, codes[rows].to(device), features[rows].to(device), args.guidance, args.kl_weight)
        run_state.optimizer_step(loss, optimizer, head.parameters())
        if run_state.step % 20 == 0:
            run_state.record(loss=loss.item(), lr=lr, **metrics)
        if run_state.should_save(args.save_every, args.steps):
            validation = evaluate(head, target, val_codes, val_features, args.guidance)
            run_state.record_eval(validation, val_sequences=len(val_codes))
            head.save(out, model=str(model_dir), guidance=args.guidance)
            if run_state.step >= args.steps or run_state.out_of_time:
                link_head(args.model, Path(model_dir), out)
            run_state.save(head=head.state_dict(), optimizer=optimizer.state_dict())
        if run_state.stop_if_out_of_time():
            break
    return 0
