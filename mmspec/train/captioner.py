"""``mmspec train captioner``: train the embedded captioner's vision encoder and connector.

Recipe: the real SmolLM2-135M-Instruct decoder is frozen (bf16 weights, no weight gradients; the
backward pass only carries input gradients through it to the image tokens). The vision encoder and
connector train from scratch with AdamW on fp32 master weights (their bf16 copies run the forward),
on an endless stream of fresh samples of the six generated families (``mmspec.train.data``,
split "train"), cross-entropy on the answer tokens only. Checkpoints (weights, optimizer, step)
are written every ``--save-every`` steps; rerunning the same command resumes.

Three stages (a from-scratch ViT learns to see far faster behind a small trainable reader than
behind the frozen 30-layer decoder, whose backward costs most of a step; and the frozen decoder
alone barely learns to read the image tokens):
  1. ``--reader-layers 4 --out runs/smolcap-stage1``: the decoder is cut to its first 4 layers
     (+ final norm and the frozen LM head) and those 4 layers train too (``--reader-lr``);
  2. ``--init runs/smolcap-stage1/vision_connector.safetensors``: the full frozen decoder; the
     vision encoder and connector start from stage 1;
  3. ``--init <stage 2> --lora-rank 16``: as stage 2, plus LoRA adapters on every projection of
     the decoder (:mod:`mmspec.modeling.lora`; shipped in the same file, merged at load).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ..modeling.captioner import WEIGHTS_FILE, build_captioner, default_captioner_dir, save_trained
from ..modeling.lora import add_lora
from .checkpoint import STATE_FILE, TrainingRun, add_device_argument, to_device, train_device
from .data import FAMILIES, make_sample

IGNORE = -100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(default_captioner_dir()), help="output dir (models/smolcap)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="data-generation processes")
    parser.add_argument("--time-limit", type=float, default=None, help="stop (after a checkpoint) after this many minutes")
    add_device_argument(parser)
    parser.add_argument("--reader-layers", type=int, default=0,
                        help="stage 1: cut the decoder to its first N layers and train them too (0 = full frozen decoder)")
    parser.add_argument("--reader-lr", type=float, default=1e-4, help="learning rate of the reader layers (stage 1)")
    parser.add_argument("--init", default=None, help="start the vision encoder + connector from this safetensors file")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on every decoder projection (0 = frozen decoder)")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-lr", type=float, default=2e-4, help="learning rate of the LoRA adapters")


class StreamDataset(torch.utils.data.IterableDataset):
    """Sample i of the stream is family FAMILIES[i % 6], item i // 6 of the train split; the stream
    starts at ``start`` so a resumed run sees new samples, in the same order as an unbroken run."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        step, offset = (1, 0) if info is None else (info.num_workers, info.id)
        index = self.start + offset
        while True:
            sample = make_sample(FAMILIES[index % len(FAMILIES)], "train", index // len(FAMILIES))
            yield sample.image, sample.prompt, sample.answer
            index += step


def build_batch(processor, samples) -> dict[str, torch.Tensor]:
    """Tokenise (image, prompt, answer) triples; labels cover the answer and its <|im_end|>."""
    tokenizer = processor.tokenizer
    prompts, images, answer_ids = [], [], []
    for image, prompt, answer in samples:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        prompts.append(processor.apply_chat_template(messages, add_generation_prompt=True))
        images.append([image])
        answer_ids.append(tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"])
    encoded = processor(text=prompts, images=images, return_tensors="pt", padding=True)
    # append answers after each prompt's last real token (prompts are right-padded)
    prompt_lengths = encoded["attention_mask"].sum(1).tolist()
    total = max(p + len(a) for p, a in zip(prompt_lengths, answer_ids))
    batch = len(samples)
    input_ids = torch.full((batch, total), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, total), dtype=torch.long)
    labels = torch.full((batch, total), IGNORE, dtype=torch.long)
    for row, (length, answer) in enumerate(zip(prompt_lengths, answer_ids)):
        input_ids[row, :length] = encoded["input_ids"][row, :length]
        input_ids[row, length : length + len(answer)] = torch.tensor(answer)
        attention[row, : length + len(answer)] = 1
        labels[row, length : length + len(answer)] = torch.tensor(answer)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "pixel_values": encoded["pixel_values"],
        "pixel_attention_mask": encoded["pixel_attention_mask"],
        "labels": labels,
    }


def answer_vocabulary(processor, samples: int = 6000) -> torch.Tensor:
    """Stage 1's output vocabulary: the token ids of the first ``samples`` training answers
    (~1.3k ids cover ~98 % of validation answer tokens), sorted."""
    ids = {processor.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for index in range(samples):
        answer = make_sample(FAMILIES[index % len(FAMILIES)], "train", index // len(FAMILIES)).answer
        ids.update(processor.tokenizer(answer, add_special_tokens=False)["input_ids"])
    return torch.tensor(sorted(ids))


def answer_loss(model, batch: dict[str, torch.Tensor], vocabulary: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of the answer tokens; the LM head runs on those positions only.

    With ``vocabulary`` (sorted ids), the head is restricted to those rows (stage 1: ~30x cheaper
    than the 49k-row head) and answer tokens outside it are ignored."""
    labels = batch["labels"]
    hidden = model.model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        pixel_values=batch["pixel_values"].to(model.dtype),
        pixel_attention_mask=batch["pixel_attention_mask"],
        use_cache=False,
    ).last_hidden_state
    # hidden at position t predicts token t + 1
    targets = labels[:, 1:]
    picked = targets != IGNORE
    hidden, targets = hidden[:, :-1][picked], targets[picked]
    if vocabulary is None:
        return torch.nn.functional.cross_entropy(model.lm_head(hidden).float(), targets)
    logits = hidden @ model.lm_head.weight[vocabulary].T
    position = torch.searchsorted(vocabulary, targets).clamp(max=len(vocabulary) - 1)
    targets = torch.where(vocabulary[position] == targets, position, IGNORE)
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE)


def learning_rate(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def run(args) -> int:
    if args.lora_rank and args.reader_layers:  # (checked before the captioner is built and --out is made)
        raise ValueError("--lora-rank is for the full decoder (stage 2); drop --reader-layers")
    if args.init and not Path(args.init).is_file():
        raise ValueError(f"--init {args.init}: no such file; give the vision_connector.safetensors a captioner run wrote")
    device = train_device(args)
    out = Path(args.out)
    run = TrainingRun(out, args, args.time_limit)  # a folder holding a trained model: refused before the build,
    run.check_saved("master", "optimizer")  # as another recipe's checkpoint
    fresh = not (out / STATE_FILE).exists()
    model, processor = build_captioner(dtype=torch.bfloat16, weights=args.init if fresh else None)
    trained_prefixes = ("model.vision_model.", "model.connector.")
    if args.reader_layers:
        text_model = model.model.text_model
        text_model.layers = text_model.layers[: args.reader_layers]
        text_model.config.num_hidden_layers = args.reader_layers
        trained_prefixes += ("model.text_model.layers.", "model.text_model.norm.")
    if args.lora_rank:
        add_lora(model.model.text_model, args.lora_rank, args.lora_alpha)
    vocabulary = answer_vocabulary(processor).to(device) if args.reader_layers else None
    model.to(device)
    # Measured here (batch 32, ~70 tokens): eager attention's backward is ~30 % faster than SDPA's
    # CPU flash-attention backward at these short lengths.
    model.set_attn_implementation("eager")
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if n.startswith(trained_prefixes) or ".lora_" in n}
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    master = {n: p.detach().float().clone().requires_grad_(True) for n, p in trainable.items()}
    groups = []
    decoder_lr = args.lora_lr if args.lora_rank else args.reader_lr
    for is_reader, lr_scale in ((False, 1.0), (True, decoder_lr / args.lr)):
        for decays in (True, False):
            params = [p for n, p in master.items()
                      if n.startswith("model.text_model.") == is_reader and (p.dim() >= 2) == decays]
            if params:
                groups.append({"params": params, "weight_decay": args.weight_decay if decays else 0.0, "lr_scale": lr_scale})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
    state = run.resume()
    if state is not None:
        with run.restoring():  # a run of another --lora-rank or --reader-layers: one line
            if set(state["master"]) != set(master):
                raise ValueError("its trained parameters differ from this run's")
            for name, tensor in state["master"].items():
                master[name].data.copy_(tensor)
            optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        for name, param in trainable.items():
            param.copy_(master[name])

    loader = torch.utils.data.DataLoader(
        StreamDataset(start=run.step * args.batch_size), batch_size=args.batch_size,
        collate_fn=lambda samples: samples, num_workers=args.workers, prefetch_factor=4 if args.workers else None,
    )
    running = None
    for samples in loader:
        if run.step >= args.steps:
            break
        batch = to_device(build_batch(processor, samples), device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(run.step, args) * group["lr_scale"]
        loss = answer_loss(model, batch, vocabulary)
        loss.backward()
        with torch.no_grad():
            for name, param in trainable.items():
                master[name].grad = param.grad.float()
                param.grad = None
            torch.nn.utils.clip_grad_norm_(list(master.values()), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for name, param in trainable.items():
                param.copy_(master[name])
        run.step += 1
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if run.step % 10 == 0:
            run.record(loss=running, lr=learning_rate(run.step, args))
        if run.should_save(args.save_every, args.steps):
            save_trained(model, out / WEIGHTS_FILE)  # bf16 weights that ship
            run.save(master={n: p.detach() for n, p in master.items()}, optimizer=optimizer.state_dict())
        if run.stop_if_out_of_time():
            break
    return 0

