"""``mmspec train tts``: the embedded voice's codec LM (:class:`~mmspec.modeling.codec_lm.CodecLM`),
teacher-forced on the speech shards of ``mmspec train speech-data`` encoded by the embedded codec
(``mmspec train codec``); fp32 weights, bf16 autocast where bf16 is fast. ``--preset draft`` trains the small draft LM for ``spec`` on the same
data, from the data's codes or (``--distil-from models/tts``) by distillation from the target.
Resumable: rerun the same command.

The phoneme ids are the Piper voice's (its espeak-ng front end), so ``mmspec tts`` turns new text
into the same ids with the same voice package. Codes are computed once per codec and cached next
to the shards (``DATA/codes-<codec hash>.pt``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from ..hub import models_dir
from ..modeling.codec_lm import CodecLM, CodecLMConfig, delayed_steps, frame_alignment
from ..modeling.mel_codec import MelRVQCodec
from .checkpoint import TrainingRun, add_run_arguments, autocast, draw_rows, set_lr, to_device, train_device, warmup_cosine
from .codec import shard_utterances, speech_shards

PRESETS = {
    "target": {"dim": 256, "layers": 6, "heads": 4, "ffn": 768, "aligned": True},
    "draft": {"dim": 128, "layers": 2, "heads": 2, "ffn": 384, "aligned": True},
    # the target's width, twice its depth: grown from a trained target with --init (see grow_depth)
    "deep": {"dim": 256, "layers": 12, "heads": 4, "ffn": 768, "aligned": True},
}
TEXT_VOCAB = 256  # Piper's phoneme ids (en_US voices use < 160)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="runs/speech-data", help="shards of mmspec train speech-data")
    parser.add_argument("--codec", default=None, help="codec directory (default: models/tts-codec)")
    parser.add_argument("--out", default=None, help="default: models/tts (models/tts-draft for --preset draft); with "
                        "--codebooks 1: models/tts-valle (models/tts-valle-draft)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="target")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--init", default=None, help="start from this codec LM's weights (e.g. the shipped models/tts, "
                        "when its train_state.pt, which is not shipped, is gone; an unaligned one gives an aligned model "
                        "its shared parts); the step count restarts")
    parser.add_argument("--distil-from", default=None, help="train by distillation from this codec LM (e.g. models/tts "
                        "for the draft): KL(teacher || model) per code instead of the data's codes")
    parser.add_argument("--input-noise", type=float, default=0.0,
                        help="replace this fraction of the input steps' codes by random codes (targets stay clean), "
                        "so that the model leans on the phonemes rather than on its own code history, as Tacotron's "
                        "pre-net dropout does; 0.25 for the shipped voice")
    parser.add_argument("--codebooks", type=int, default=None,
                        help="model only the codec's first N codebooks (default: all); 1 is the autoregressive stage of a "
                        "VALL-E-style voice, whose other codebooks come from mmspec train tts-nar")
    parser.add_argument("--prefix-dropout", type=float, default=0.0,
                        help="hide the phoneme prefix from attention in this fraction of the rows (an aligned model then "
                        "reads the phonemes only from its alignment inputs, so it learns to use them)")
    parser.add_argument("--similar-lengths", action="store_true", help="batch utterances of similar length (neighbours "
                        "in length order) instead of uniform draws: much less padding on data of mixed lengths")
    add_run_arguments(parser, threads=2, save_every=100)


def noisy_steps(steps: torch.Tensor, rate: float, codebook_size: int, generator: torch.Generator) -> torch.Tensor:
    """Input steps [B, S, K] with each codec code (ids < ``codebook_size``: not the begin, end or
    pad ids) replaced, with probability ``rate``, by a uniformly drawn code. Teacher forcing
    shows a codec LM the data's codes, so it can predict the next step from them alone and learn to
    ignore the phonemes (measured on the embedded voice: docs/speech.md); noisy history makes the
    phonemes the reliable input."""
    if rate <= 0:
        return steps
    swap = (steps < codebook_size) & (torch.rand(steps.shape, generator=generator) < rate)
    return torch.where(swap, torch.randint(codebook_size, steps.shape, generator=generator), steps)


def frame_durations(samples_per_phoneme: torch.Tensor, num_frames: int, samples_per_frame: int) -> torch.Tensor:
    """The voice's samples per phoneme id [P] -> codec frames per phoneme [P] summing to
    ``num_frames``: frame f belongs to the phoneme that holds its centre sample."""
    centres = torch.arange(num_frames) * samples_per_frame + samples_per_frame // 4  # (the mel frames are centred)
    owner = torch.searchsorted(samples_per_phoneme.cumsum(0), centres, right=True).clamp_max(len(samples_per_phoneme) - 1)
    return torch.bincount(owner, minlength=len(samples_per_phoneme))


def encoded_utterances(data: str | Path, codec_dir: Path, codec: MelRVQCodec, split: str) -> list[dict]:
    """Every utterance of ``split`` as {"text", "phonemes" [P], "codes" [K, F], "durations" [P]
    (frames per phoneme)}, in shard order, encoded once and cached per codec; when shards appear or
    change (a resumed ``speech-data`` run rewrites a partial last shard: its size and modification
    time change) only they are encoded."""
    digest = hashlib.sha1((codec_dir / codec.weights_file).read_bytes()).hexdigest()[:10]
    shards = speech_shards(data, split)
    path = Path(data) / f"codes-{split}-{digest}.pt"
    saved = torch.load(path, weights_only=True) if path.exists() else {}
    by_shard = saved.get("by_shard", {})
    stamps = {shard.name: _stamp(shard) for shard in shards}
    # (a cache written before stamps were kept: its shards are taken as they are now)
    kept = saved.get("stamps", {name: stamps[name] for name in by_shard if name in stamps})
    if "stamps" not in saved or kept != stamps:
        per_frame = codec.config.hop_length * codec.config.stack
        for shard in shards:
            if shard.name in by_shard and kept.get(shard.name) == stamps[shard.name]:
                continue
            by_shard[shard.name] = []
            for text, ids, audio, _, spent in shard_utterances(shard, alignments=True):
                codes = codec.encode(audio)
                by_shard[shard.name].append({"text": text, "phonemes": ids, "codes": codes,
                                             "durations": frame_durations(spent, codes.shape[1], per_frame)})
        by_shard = {shard.name: by_shard[shard.name] for shard in shards}
        torch.save({"by_shard": by_shard, "stamps": stamps}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return [item for shard in shards for item in by_shard[shard.name]]


def _stamp(shard: Path) -> str:
    """A shard file's size and modification time: a rewritten shard gets a new stamp."""
    stat = shard.stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def collate(items: list[dict], config: CodecLMConfig) -> dict[str, torch.Tensor]:
    """Left-pad the phonemes, right-pad the delayed steps; targets -100 on padding; the steps'
    alignment rows and the durations for an aligned model."""
    phonemes = max(len(i["phonemes"]) for i in items)
    delayed = [delayed_steps(i["codes"][: config.num_codebooks], config) for i in items]
    steps = max(s.shape[0] for s, _ in delayed)
    k = config.num_codebooks
    batch = {"phonemes": torch.zeros(len(items), phonemes, dtype=torch.long),
             "text_mask": torch.zeros(len(items), phonemes, dtype=torch.long),
             "steps": torch.full((len(items), steps, k), config.pad_code, dtype=torch.long),
             "step_mask": torch.zeros(len(items), steps, dtype=torch.long),
             "targets": torch.full((len(items), steps, k), -100, dtype=torch.long)}
    if config.aligned:
        batch["alignment"] = torch.zeros(len(items), steps, 4, dtype=torch.long)
        batch["durations"] = torch.zeros(len(items), phonemes, dtype=torch.long)
    for row, (item, (s, t)) in enumerate(zip(items, delayed)):
        p = len(item["phonemes"])
        batch["phonemes"][row, phonemes - p :] = item["phonemes"]
        batch["text_mask"][row, phonemes - p :] = 1
        batch["steps"][row, : s.shape[0]] = s
        batch["step_mask"][row, : s.shape[0]] = 1
        batch["targets"][row, : t.shape[0]] = t
        if config.aligned:
            batch["alignment"][row] = frame_alignment(item["phonemes"], item["durations"], torch.arange(steps), config.text_vocab)
            batch["durations"][row, phonemes - p :] = item["durations"]
    return batch


def grow_depth(state: dict[str, torch.Tensor], layers: int, new_layers: int) -> dict[str, torch.Tensor]:
    """A state dict of ``layers`` decoder layers -> one of ``new_layers`` (a multiple): old layer i
    becomes layers i r .. i r + r - 1 (r = new_layers / layers), and every copy but the first has
    its residual branches' output projections (attention ``o_proj``, MLP ``down_proj``) zeroed, so
    it adds nothing to the residual stream: the grown model computes exactly the old one's function
    and training starts where the old one stopped (block expansion, as in LLaMA Pro)."""
    if new_layers == layers:
        return state
    r, out = new_layers // layers, {}
    for name, value in state.items():
        parts = name.split(".layers.", 1)
        if len(parts) == 1:
            out[name] = value
            continue
        index, rest = parts[1].split(".", 1)
        for copy in range(r):
            zero = copy > 0 and rest.endswith(("o_proj.weight", "down_proj.weight"))
            out[f"{parts[0]}.layers.{int(index) * r + copy}.{rest}"] = torch.zeros_like(value) if zero else value.clone()
    return out


def first_codebooks(state: dict[str, torch.Tensor], codebooks: int, outputs: int) -> dict[str, torch.Tensor]:
    """A codec LM's state dict -> that of one over its first ``codebooks`` codebooks: their input
    embeddings and output heads (``outputs`` = C + 1 rows per codebook) are kept, the rest dropped,
    so a VALL-E-style AR stage starts from a trained delay-pattern voice."""
    out = {}
    for name, value in state.items():
        if name.startswith("code_embeddings.") and int(name.split(".")[1]) >= codebooks:
            continue
        out[name] = value[: codebooks * outputs] if name == "heads.weight" else value
    return out


def voice_name(codebooks: int) -> str:
    """The embedded voice a codec LM over ``codebooks`` codebooks belongs to, as its directory
    name under ``models/`` (its draft's: the same + ``-draft``): ``tts-valle``, the VALL-E-style voice,
    for the codebook-0 AR stage (1), else ``tts``, the delay-pattern voice."""
    return "tts-valle" if codebooks == 1 else "tts"


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    device = train_device(args)
    codec_dir = Path(args.codec or models_dir() / "tts-codec")
    codec = MelRVQCodec.from_pretrained(codec_dir)
    codebooks = codec.config.num_codebooks if args.codebooks is None else args.codebooks
    if not 1 <= codebooks <= codec.config.num_codebooks:
        raise ValueError(f"--codebooks must lie in [1, {codec.config.num_codebooks}] (the codec's), got {codebooks}")
    voice = voice_name(codebooks)
    out = Path(args.out or models_dir() / (f"{voice}-draft" if args.preset == "draft" else voice))
    teacher = None
    if args.distil_from:  # checked before the data is encoded
        teacher = CodecLM.from_pretrained(args.distil_from, dtype=torch.float32).to(device).eval()
        expected = {"text_vocab": TEXT_VOCAB, "num_codebooks": codebooks,
                    "codebook_size": codec.config.codebook_size, "aligned": PRESETS[args.preset]["aligned"]}
        differ = [f"{name} {getattr(teacher.config, name)} there, {value} here" for name, value in expected.items()
                  if getattr(teacher.config, name) != value]  # (every field was named, whichever differed)
        if differ:
            raise ValueError(f"--distil-from {args.distil_from} differs from this codec LM in {'; '.join(differ)}")
    config = CodecLMConfig(text_vocab=TEXT_VOCAB, num_codebooks=codebooks,
                           codebook_size=codec.config.codebook_size, max_positions=1024, **PRESETS[args.preset])
    start = None
    if args.init:  # (checked before the data is encoded, as --distil-from)
        start = CodecLM.from_pretrained(args.init, dtype=torch.float32)
        if start.config.num_codebooks < codebooks:  # ("pass the matching --preset" below misled: the codebooks differ)
            raise ValueError(f"--init {args.init} models {start.config.num_codebooks} codebook(s), this codec LM "
                             f"{codebooks}: add --codebooks {start.config.num_codebooks}, or --init one over {codebooks}")
        if replace(start.config, aligned=config.aligned, max_positions=config.max_positions, layers=config.layers,
                   num_codebooks=codebooks) != config or config.layers % start.config.layers:
            raise ValueError(f"{args.init} is a codec LM of another shape ({start.config}); pass the "
                             f"matching --preset (or one of the same width and a multiple of its depth)")
    items = encoded_utterances(args.data, codec_dir, codec, "train")
    longest = max(len(i["phonemes"]) + i["codes"].shape[1] for i in items) + codec.config.num_codebooks + 2
    if max(int(i["phonemes"].max()) for i in items) >= TEXT_VOCAB:
        raise ValueError(f"phoneme ids beyond {TEXT_VOCAB}: not an English Piper voice?")
    config = replace(config, max_positions=max(1024, longest))
    model = CodecLM(config)
    if start is not None:
        state = first_codebooks(start.state_dict(), codebooks, config.codebook_size + 1)
        missing, unexpected = model.load_state_dict(grow_depth(state, start.config.layers, config.layers), strict=False)
        new_parts = ("durations.", "align_")
        if unexpected or any(not name.startswith(new_parts) for name in missing):
            raise ValueError(f"{args.init} does not fit this codec LM (missing {missing[:3]}, unexpected {unexpected[:3]})")
        with torch.no_grad():  # new alignment inputs start at zero: the model starts as the one it came from
            for name, parameter in model.named_parameters():
                if name in missing and name.startswith("align_"):
                    parameter.zero_()
    print(f"codec LM ({args.preset}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{len(items)} utterances, {sum(i['codes'].shape[1] for i in items) / codec.config.frame_rate / 3600:.2f} h",
          flush=True)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    run_state = TrainingRun(out, args, args.time_limit)
    run_state.resume_into(model=model, optimizer=optimizer)
    manifest_path = out / "tts.json"  # read by the text-to-speech pipeline; other keys (medusa) are kept
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest.update({"codec": os.path.relpath(codec_dir.resolve(), out.resolve()), "phonemizer": "piper:en_US-joe-medium"})
    # (a voice's own choice is kept; a codebook-0 stage's draft is the VALL-E-style voice's, not the delay-pattern one's)
    manifest.setdefault("draft", f"../{voice}-draft" if args.preset != "draft" else None)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    generator = torch.Generator().manual_seed(run_state.step)
    lengths = [len(i["phonemes"]) + i["codes"].shape[1] for i in items]
    model.train()
    while run_state.step < args.steps:
        lr = warmup_cosine(run_state.step, args.steps, args.lr, args.warmup, floor=0.1)
        set_lr(optimizer, lr)
        rows = draw_rows(lengths, args.batch_size, generator, args.similar_lengths)
        batch = collate([items[r] for r in rows], config)
        batch["steps"] = noisy_steps(batch["steps"], args.input_noise, config.codebook_size, generator)
        if args.prefix_dropout:
            batch["text_hidden"] = torch.rand(args.batch_size, generator=generator) < args.prefix_dropout
        with autocast(device):  # fp32 weights, bf16 matmuls where fast
            losses = model.loss(**to_device(batch, device), teacher=teacher)
        run_state.optimizer_step(sum(losses.values()), optimizer, model.parameters())
        if run_state.step % 20 == 0 or run_state.step == args.steps:
            run_state.record(**{"loss" if name == "codes" else f"{name}_loss": value.item()
                                for name, value in losses.items()}, lr=lr)
        if run_state.should_save(args.save_every, args.steps):
            run_state.save_model(model, optimizer)
        if run_state.stop_if_out_of_time():
            break
    return 0
