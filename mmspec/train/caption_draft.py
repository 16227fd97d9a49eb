"""``mmspec train caption-draft``: the embedded captioner's small text-only draft (SPD).

SPD (Gagrani et al., 2024) drafts a VLM's answer with a small *text-only* language model: the
draft sees the prompt without the image tokens (``TransformersTarget.text_only_ids``), so it can
only learn what the answers' wording makes predictable (formats, templates, the grammar of a
caption); the target's verification keeps the output exact.

The draft is a 2-layer Llama (width 192, 3 heads, 1 KV head; 9.9M parameters, 19 MB in bf16) with
SmolLM2's tokenizer (+ the captioner's 3 image tokens). Its tied embedding starts from the top-192
principal components of SmolLM2's embedding matrix. Training data: the (prompt, answer) pairs of
the caption data's train split, formatted exactly as the draft sees them at generation time,
cross-entropy on the answer tokens (AdamW, fp32 weights; bf16 autocast where bf16 is fast). Resumable.

``--self-distill DIR`` (repeatable) adds the captioner's own greedy answers (the caches of
``mmspec train drafter --target captioner``): half of every batch is then drawn from them, since
what the draft must predict is the captioner's wording, not the references'. ``--init DIR``
starts from a trained draft (e.g. the reference-trained one).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..hub import models_dir
from ..modeling.captioner import build_processor
from .checkpoint import TrainingRun, add_device_argument, autocast, set_lr, to_device, train_device, warmup_cosine
from .data import FAMILIES, make_sample
from ..core import words

IGNORE = -100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(models_dir() / "smolcap-draft"), help="output dir (models/smolcap-draft)")
    parser.add_argument("--samples", type=int, default=24000, help="training pairs (tokenised once, cached in --cache)")
    parser.add_argument("--cache", default="runs/caption-draft-data.pt", help="tokenised training pairs")
    parser.add_argument("--self-distill", action="append", default=[],
                        help="captioner self-distillation cache (runs/captioner-selfdistill); repeatable")
    parser.add_argument("--init", default=None, help="start from this draft directory")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=None, help="stop (after a checkpoint) after this many minutes")
    add_device_argument(parser)


def draft_prompt_text(processor, prompt: str) -> str:
    """The chat text whose tokens equal the target's prompt ids minus the ``<image>`` tokens."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return text.replace("<image>", "<fake_token_around_image><global-img><fake_token_around_image>")


def tokenise_pairs(processor, count: int) -> list[tuple[list[int], list[int]]]:
    tokenizer = processor.tokenizer
    pairs = []
    for index in range(count):
        sample = make_sample(FAMILIES[index % len(FAMILIES)], "train", index // len(FAMILIES))
        prompt = tokenizer(draft_prompt_text(processor, sample.prompt), add_special_tokens=False)["input_ids"]
        answer = tokenizer(sample.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        pairs.append((prompt, answer))
    return pairs


def distilled_pairs(records, image_token_id: int) -> list[tuple[list[int], list[int]]]:
    """Self-distillation records ({"ids" [L], "learn" [L]}: the captioner's prompt with its image
    tokens + its own answer) -> (the prompt as the draft sees it, without the image tokens, answer)."""
    pairs = []
    for record in records:
        ids, learn = record["ids"], record["learn"]
        start = int(learn.nonzero()[0])
        prompt = ids[:start]
        pairs.append((prompt[prompt != image_token_id].tolist(), ids[start:][learn[start:]].tolist()))
    return pairs


def build_draft(tokenizer):
    """The untrained draft: LlamaForCausalLM whose embedding is SmolLM2's, PCA-reduced to 192."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from ..hub import smollm2_checkpoint

    smollm2 = AutoConfig.from_pretrained(smollm2_checkpoint())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        rope_parameters=dict(smollm2.rope_parameters), rms_norm_eps=smollm2.rms_norm_eps, tie_word_embeddings=True,
        bos_token_id=smollm2.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    embed = load_file(str(smollm2_checkpoint() / "model.safetensors"))["model.embed_tokens.weight"].float()
    centred = embed - embed.mean(0)
    _, _, v = torch.linalg.svd(centred[:: 4], full_matrices=False)  # every 4th row is plenty for the basis
    reduced = centred @ v[: config.hidden_size].T
    reduced = reduced / reduced.std() * config.initializer_range * 2
    with torch.no_grad():
        weight = model.model.embed_tokens.weight
        weight[: reduced.shape[0]] = reduced
        weight[reduced.shape[0]:] = reduced.mean(0)
    return model


def collate(pairs) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(p) + len(a) for p, a in pairs)
    ids = torch.zeros((len(pairs), length), dtype=torch.long)
    labels = torch.full((len(pairs), length), IGNORE, dtype=torch.long)
    for row, (prompt, answer) in enumerate(pairs):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    picked = targets != IGNORE
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[picked]).float(), targets[picked])


def run(args) -> int:
    if args.samples <= 512:
        raise ValueError(f"--samples must be more than 512 (the first 512 pairs are held out for the loss), got {args.samples}")
    from .selfdistill import load_chunks

    for directory in args.self_distill or []:  # before anything is tokenised
        load_chunks(Path(directory))
    if args.init and not (Path(args.init) / "config.json").is_file():
        raise FileNotFoundError(f"--init {args.init}: no draft model there (config.json); give a folder that "
                                "mmspec train caption-draft wrote")
    device = train_device(args)
    out = Path(args.out)
    run = TrainingRun(out, args, args.time_limit)  # a folder holding a trained model: refused here, as another
    run.check_saved("model", "optimizer")  # recipe's checkpoint, before --samples pairs are tokenised
    processor = build_processor()
    cache = Path(args.cache)
    if cache.exists():
        pairs = torch.load(cache, weights_only=True)
        if len(pairs) != args.samples:
            raise ValueError(f"--cache {cache} holds {len(pairs)} tokenised pairs, not --samples {args.samples}; pass "
                             f"--samples {len(pairs)}, or another --cache to tokenise {args.samples}")
    else:
        started = time.time()
        pairs = tokenise_pairs(processor, args.samples)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(pairs, cache)
        print(f"tokenised {words.count(len(pairs), 'pair')} in {time.time() - started:.0f} s", flush=True)
    held_out = pairs[:512]  # the first pairs measure the loss; training draws from the rest
    train = pairs[512:]
    distilled, distilled_held_out = [], []
    if args.self_distill:
        image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
        distilled = distilled_pairs([r for d in args.self_distill for r in load_chunks(Path(d))], image_token)
        distilled_held_out, distilled = distilled[:128], distilled[128:]
        print(f"{len(distilled)} self-distilled training pairs", flush=True)
    if args.init:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = build_draft(processor.tokenizer)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def on_device(pairs) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(collate(pairs), device)

    run.resume_into(model=model, optimizer=optimizer)
    while run.step < args.steps:
        step = run.step
        generator = torch.Generator().manual_seed(step)
        from_distilled = args.batch_size // 2 if distilled else 0
        batch = [train[i] for i in torch.randint(len(train), (args.batch_size - from_distilled,), generator=generator).tolist()]
        batch += [distilled[i] for i in torch.randint(max(1, len(distilled)), (from_distilled,), generator=generator).tolist()]
        ids, labels = on_device(batch)
        lr = warmup_cosine(step, args.steps, args.lr, warmup=100, floor=0.1)
        set_lr(optimizer, lr)
        with autocast(device):
            loss = answer_loss(model, ids, labels)
        run.optimizer_step(loss, optimizer, model.parameters())
        if run.should_save(100, args.steps):
            with torch.no_grad(), autocast(device):
                held = sum(answer_loss(model, *on_device(held_out[i : i + 128])).item() for i in range(0, 512, 128)) / 4
                distilled_held = answer_loss(model, *on_device(distilled_held_out)).item() if distilled_held_out else None
            run.record(loss=loss.item(), held_out_loss=held,
                       **({"held_out_self_distilled_loss": distilled_held} if distilled_held is not None else {}))
            run.save(model=model.state_dict(), optimizer=optimizer.state_dict())
            model.to(torch.bfloat16).save_pretrained(out)  # the shipped draft: bf16 safetensors
            model.float()
        if run.stop_if_out_of_time():
            break
    return 0
