"""``mmspec train tts-nar``: the non-autoregressive stage of a VALL-E-style voice
(:class:`~mmspec.modeling.codec_nar.CodecNAR`: codebooks 1 .. K-1 from codebook 0 and the phoneme
alignment), on the speech shards of ``mmspec train speech-data`` encoded by the voice's codec.
Codebook 0's inputs are made noisy as the AR stage's are (``--input-noise``: a fraction replaced by
random codes, targets clean), so that sampled codebook-0 streams, not only recorded ones, get fine
codebooks that follow the phonemes. Resumable: rerun the same command. ``--voice`` (the AR stage's
directory, a codec LM over codebook 0) gains ``"nar"`` in its tts.json so the pipeline runs both.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from ..hub import models_dir
from ..modeling.codec_lm import frame_alignment
from ..modeling.codec_nar import CodecNAR, CodecNARConfig
from ..modeling.mel_codec import MelRVQCodec
from .checkpoint import TrainingRun, add_run_arguments, autocast, draw_rows, set_lr, to_device, train_device, warmup_cosine
from .tts import TEXT_VOCAB, encoded_utterances, noisy_steps

#: the stage's shape without --init (the shipped models/tts-valle-nar's)
DIM, LAYERS, DEPTH_FFN = 256, 4, 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="runs/speech-data", help="shards of mmspec train speech-data")
    parser.add_argument("--codec", default=None, help="codec directory (default: models/tts-codec)")
    parser.add_argument("--out", required=True, help="the NAR stage's directory (e.g. models/tts-valle-nar)")
    parser.add_argument("--voice", default=None, help="the AR stage's directory (a codec LM over codebook 0, mmspec train "
                        "tts --codebooks 1): its tts.json gets \"nar\"")
    parser.add_argument("--dim", type=int, default=None, help="width (default: 256; with --init: its width, and no other)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 4; with --init: its depth, and no other)")
    parser.add_argument("--depth-layers", type=int, default=None, help="a depth head of this many blocks: codebook k "
                        "reads the codes of codebooks 1..k-1 (0: all codebooks at once; default: --init's, else 0). With "
                        "--init of a one-pass stage, the head is added and starts as that stage")
    parser.add_argument("--depth-ffn", type=int, default=None, help="the depth head's hidden width (default: 512; with "
                        "--init of a stage with a depth head: its width, and no other)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--input-noise", type=float, default=0.1, help="fraction of codebook-0 input codes replaced by "
                        "random codes (and of the fine codes a depth head reads)")
    parser.add_argument("--init", default=None, help="start from this NAR stage's weights (e.g. the shipped "
                        "models/tts-valle-nar, to fine-tune it on new speech); its width and depth are used, and the step "
                        "count restarts")
    parser.add_argument("--similar-lengths", action="store_true", help="batch utterances of similar length (neighbours "
                        "in length order) instead of uniform draws: much less padding on data of mixed lengths")
    add_run_arguments(parser, threads=1, save_every=100)


def collate(items: list[dict], config: CodecNARConfig) -> dict[str, torch.Tensor]:
    """Right-padded codes [B, K, F], alignment rows [B, F, 4] and the frame mask [B, F]."""
    frames = max(i["codes"].shape[1] for i in items)
    batch = {"codes": torch.zeros(len(items), config.num_codebooks, frames, dtype=torch.long),
             "alignment": torch.zeros(len(items), frames, 4, dtype=torch.long),
             "mask": torch.zeros(len(items), frames, dtype=torch.bool)}
    for row, item in enumerate(items):
        f = item["codes"].shape[1]
        batch["codes"][row, :, :f] = item["codes"]
        batch["mask"][row, :f] = True
        batch["alignment"][row] = frame_alignment(item["phonemes"], item["durations"], torch.arange(frames), TEXT_VOCAB)
    return batch


def with_depth_head(stage: CodecNAR, config: CodecNARConfig) -> CodecNAR:
    """A one-pass NAR stage's weights in a stage of ``config`` (the same but for a depth head): the
    head's new parameters start at zero or fresh, so the result computes what ``stage`` did."""
    model = CodecNAR(config)
    missing, unexpected = model.load_state_dict(stage.state_dict(), strict=False)
    new = {name for name, _ in model.named_parameters()} - set(stage.state_dict())
    if unexpected or set(missing) != new:
        raise ValueError(f"cannot add a depth head: unexpected {unexpected}, missing {sorted(set(missing) - new)}")
    return model


def run(args: argparse.Namespace) -> int:
    if args.depth_layers is not None and args.depth_layers < 0:
        raise ValueError(f"--depth-layers {args.depth_layers}: give 0 (no depth head) or more")
    for name in ("dim", "layers", "depth_ffn"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    torch.manual_seed(0)
    device = train_device(args)
    voice = Path(args.voice) if args.voice else None
    if voice is not None and not (voice / "tts.json").is_file():
        raise ValueError(f"--voice {voice} has no tts.json; train the AR stage first (mmspec train tts --codebooks 1)")
    lm_config = voice / "codec_lm.json" if voice is not None else None
    if lm_config is not None and lm_config.is_file():  # (a delay-pattern voice's manifest would name this NAR stage)
        codebooks = json.loads(lm_config.read_text()).get("num_codebooks", 1)
        if codebooks != 1:
            raise ValueError(f"--voice {voice} is a codec LM over {codebooks} codebooks (a delay-pattern voice); the NAR "
                             "stage completes a codebook-0 AR stage: give a run of mmspec train tts --codebooks 1")
    codec_dir = Path(args.codec or models_dir() / "tts-codec")
    codec = MelRVQCodec.from_pretrained(codec_dir)
    out = Path(args.out)
    model = None
    if args.init:  # (its settings checked before the data is read)
        model = CodecNAR.from_pretrained(args.init, dtype=torch.float32)
        config = model.config
        # (its shape wins: a different --dim / --layers / --depth-ffn given with it was silently ignored)
        given = {"--dim": (args.dim, config.dim), "--layers": (args.layers, config.layers)}
        if config.depth_layers:
            given["--depth-ffn"] = (args.depth_ffn, config.depth_ffn)
        differ = [f"{option} {value} (it has {held})" for option, (value, held) in given.items()
                  if value is not None and value != held]
        if differ:
            raise ValueError(f"--init {args.init} fixes the stage's shape; drop {', '.join(differ)} or train anew "
                             "without --init")
        if args.depth_layers is not None and args.depth_layers != config.depth_layers:
            if config.depth_layers:
                raise ValueError(f"--init {args.init} has a depth head of {config.depth_layers} blocks; drop --depth-layers "
                                 "or give that number")
            config = replace(config, depth_layers=args.depth_layers, depth_ffn=args.depth_ffn or DEPTH_FFN)
            model = with_depth_head(model, config)
        if (config.num_codebooks, config.codebook_size) != (codec.config.num_codebooks, codec.config.codebook_size):
            raise ValueError(f"--init {args.init} predicts {config.num_codebooks} codebooks of {config.codebook_size} "
                             f"codes, the codec {codec_dir} has {codec.config.num_codebooks} of {codec.config.codebook_size}")
    items = encoded_utterances(args.data, codec_dir, codec, "train")
    longest = max(i["codes"].shape[1] for i in items)
    if model is not None:
        if config.max_positions < longest:
            raise ValueError(f"--init {args.init} takes at most {config.max_positions} frames; the data's longest "
                             f"utterance has {longest}: drop --init or shorten the data")
        model = model.to(device)
    else:
        dim, layers = args.dim or DIM, args.layers or LAYERS
        config = CodecNARConfig(text_vocab=TEXT_VOCAB, num_codebooks=codec.config.num_codebooks,
                                codebook_size=codec.config.codebook_size, dim=dim, layers=layers,
                                heads=max(1, dim // 64), ffn=3 * dim, max_positions=max(1024, longest),
                                depth_layers=args.depth_layers or 0, depth_ffn=args.depth_ffn or DEPTH_FFN)
        model = CodecNAR(config).to(device)
    args.dim, args.layers, args.depth_ffn = config.dim, config.layers, config.depth_ffn  # (training.json: the real shape)
    print(f"codec NAR stage: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {len(items)} utterances",
          flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    run_state = TrainingRun(out, args, args.time_limit)
    run_state.resume_into(model=model, optimizer=optimizer)
    if voice is not None:
        manifest = json.loads((voice / "tts.json").read_text())
        manifest["nar"] = os.path.relpath(out.resolve(), voice.resolve())
        (voice / "tts.json").write_text(json.dumps(manifest, indent=1))
    generator = torch.Generator().manual_seed(run_state.step)
    lengths = [i["codes"].shape[1] for i in items]
    model.train()
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, args.warmup, floor=0.1)
        set_lr(optimizer, lr)
        rows = draw_rows(lengths, args.batch_size, generator, args.similar_lengths)
        batch = collate([items[r] for r in rows], config)
        inputs0 = noisy_steps(batch["codes"][:, 0], args.input_noise, config.codebook_size, generator)
        fine = noisy_steps(batch["codes"][:, 1:], args.input_noise, config.codebook_size, generator) if config.depth_layers else None
        with autocast(device):
            loss = model.loss(**to_device(batch, device), inputs0=inputs0.to(device),
                              fine_inputs=None if fine is None else fine.to(device))
        run_state.optimizer_step(loss, optimizer, model.parameters())
        if run_state.step % 20 == 0 or run_state.step == args.steps:
            run_state.record(loss=loss.item(), lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            run_state.save_model(model, optimizer)
        if run_state.stop_if_out_of_time():
            break
    return 0
