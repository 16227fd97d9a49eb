"""``mmspec train codec``: fit the embedded voice's codec (:class:`~mmspec.modeling.mel_codec.MelRVQCodec`)
on the speech shards of ``mmspec train speech-data`` and measure what its round trip costs in
intelligibility: Whisper tiny.en's word error rate on held-out sentences, source audio against
decode(encode(audio)).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..hub import models_dir
from ..modeling.mel_codec import MelCodecConfig, MelRVQCodec
from .checkpoint import check_fresh_out


def speech_shards(data: str | Path, split: str) -> list[Path]:
    """The shard files of ``split`` in ``data`` (sorted); ValueError when there are none."""
    shards = sorted(Path(data).glob(f"{split}-*.pt"))
    if not shards:
        raise ValueError(f"no {split} shards in {data}; run mmspec train speech-data --out {data} "
                         f"--split {split} first")
    return shards


def iter_utterances(data: str | Path, split: str, alignments: bool = False):
    """Yield (text, phoneme ids [P], float audio [samples], sample rate) of every sentence of
    ``split``, and with ``alignments`` the samples the voice spent on each phoneme id [P]."""
    for shard in speech_shards(data, split):
        yield from shard_utterances(shard, alignments)


def shard_utterances(shard: Path, alignments: bool = False):
    """:func:`iter_utterances` for one shard file."""
    saved = torch.load(shard, weights_only=True)
    if alignments and "samples_per_phoneme" not in saved:
        raise ValueError(f"{shard} has no phoneme durations (made by an older mmspec); move {shard.parent} away and "
                         "rerun mmspec train speech-data")
    spent = saved.get("samples_per_phoneme") or [None] * len(saved["texts"])
    for text, ids, audio, samples in zip(saved["texts"], saved["phoneme_ids"], saved["audio"], spent):
        item = (text, ids, audio.float() / 32768.0, saved["sample_rate"])
        yield (*item, samples) if alignments else item


def add_arguments(parser) -> None:
    parser.add_argument("--data", default="runs/speech-data", help="shards of mmspec train speech-data")
    parser.add_argument("--out", default=str(models_dir() / "tts-codec"), help="default: the embedded codec, models/tts-codec")
    parser.add_argument("--minutes", type=float, default=15.0, help="minutes of training speech to fit on")
    parser.add_argument("--num-codebooks", type=int, default=8)
    parser.add_argument("--codebook-size", type=int, default=256)
    parser.add_argument("--stack", type=int, default=2, help="log-mel frames per codec frame")
    parser.add_argument("--eval-sentences", type=int, default=40, help="held-out (test split) sentences for the WER")


def evaluate(codec: MelRVQCodec, data: str | Path, sentences: int) -> dict:
    """WER of Whisper tiny.en on the source audio and on the codec's round trip of the first
    ``sentences`` test sentences, and the codec's real-time factors."""
    from ..metrics.speech import transcribe, word_error_rate

    texts, source, coded = [], [], []
    encode_s = decode_s = audio_s = 0.0
    for i, (text, _, audio, rate) in enumerate(iter_utterances(data, "test")):
        if i == sentences:
            break
        started = time.perf_counter()
        codes = codec.encode(audio)
        encode_s += time.perf_counter() - started
        started = time.perf_counter()
        again = codec.decode(codes)
        decode_s += time.perf_counter() - started
        audio_s += audio.shape[0] / rate
        texts.append(text)
        source.append(transcribe(audio, rate))
        coded.append(transcribe(again, codec.config.sample_rate))
    return {"sentences": len(texts), "wer_source": word_error_rate(texts, source),
            "wer_round_trip": word_error_rate(texts, coded), "encode_rtf": encode_s / audio_s,
            "decode_rtf": decode_s / audio_s, "examples": [{"text": t, "source": s, "round_trip": c}
                                                            for t, s, c in list(zip(texts, source, coded))[:5]]}


def run(args) -> None:
    check_fresh_out(Path(args.out), args)
    config = MelCodecConfig(num_codebooks=args.num_codebooks, codebook_size=args.codebook_size, stack=args.stack)
    codec = MelRVQCodec(config)
    vectors, seconds = [], 0.0
    for _, _, audio, rate in iter_utterances(args.data, "train"):
        if rate != config.sample_rate:
            raise ValueError(f"the shards are at {rate} Hz, the codec at {config.sample_rate} Hz")
        vectors.append(codec.features(audio))
        seconds += audio.shape[0] / rate
        if seconds >= args.minutes * 60:
            break
    count = sum(v.shape[0] for v in vectors)
    if count < config.codebook_size:
        raise ValueError(f"{args.data} gave {count} speech vectors in {seconds / 60:.1f} min, fewer than --codebook-size "
                         f"{config.codebook_size}: k-means needs at least one vector a code; pass more --minutes or data")
    started = time.time()
    errors = codec.fit(torch.cat(vectors))
    fit_s = time.time() - started
    print(f"fitted on {seconds / 60:.1f} min ({count} vectors) in {fit_s:.0f} s; "
          f"residual MSE per stage: {', '.join(f'{e:.3f}' for e in errors)}", flush=True)
    codec.save(args.out)
    metrics = evaluate(MelRVQCodec.from_pretrained(args.out), args.data, args.eval_sentences)  # what ships (fp16)
    print(json.dumps({k: v for k, v in metrics.items() if k != "examples"}), flush=True)
    record = {"command": "mmspec train codec " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                          if k not in ("handler", "output_args", "command", "recipe")),
              "fit_minutes": seconds / 60, "fit_seconds": fit_s, "residual_mse": errors, **metrics}
    (Path(args.out) / "training.json").write_text(json.dumps(record, indent=1))
