"""``mmspec train tts-self-data``: a voice's own codes for its drafters (self-distillation data).

A drafter's acceptance depends on what the target says, not on what the speech data says: at
decoding the drafter reads the target's *sampled* codes. This writes, for sentences of the open
corpus' train split, the phoneme ids, the voice's predicted durations and the codebook-0 codes its
AR stage samples by plain decoding at ``--temperature`` (several temperatures: each sentence takes
them in turn; ``--split validation`` for held-out data), as {"text", "phonemes" [P], "codes" [1, F], "durations" [P]}: the items
``mmspec train tts-drafter --data DIR`` trains on (:func:`self_items`), no codec or audio needed.

Resumable: shards ``self-NNNN.pt`` of ``--shard-size`` sentences, each written whole as
{"first": its first sentence, "sentences": how many it covers, "items": [...]} (a rerun skips the
shards that exist whole; with more ``--sentences``, the last shard an earlier run left short is
written again, whole; ``self-data.json`` keeps the settings, and a rerun with others is refused); the sentences, their temperatures and seeds are fixed by ``--sentences`` and
the shard index, so shards written in separate runs (``--shards a:b``, one process per core) make
the same data as one run. Sentences are decoded ``--batch-size`` at a time
(:func:`mmspec.api.generate_rows`: each row the codes it would get alone with its seed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .data.open_text import SOURCES
from ..core import words

#: shard file name pattern (the shard index, 4 digits), and the pattern that finds the shards
SHARD, SHARDS = "self-{:04d}.pt", "self-*.pt"
#: the settings the shards of a --out were made with (a rerun must give the same)
SETTINGS = "self-data.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="valle", help="the voice: an embedded one (valle) or a TTS model directory")
    parser.add_argument("--out", default="runs/tts-self", help="directory of the shards")
    parser.add_argument("--sentences", type=int, default=4096, help="sentences of the open corpus' split")
    parser.add_argument("--split", choices=("train", "validation"), default="train",
                        help="the open corpus' split (validation: held-out data for tts-drafter --eval)")
    parser.add_argument("--sources", default=None, help="comma list of open-corpus sources "
                        f"(of {', '.join(SOURCES)}; default: all)")
    parser.add_argument("--temperature", default="1.0,0.7",
                        help="comma list of sampling temperatures, taken by the sentences in turn")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--shards", default=None, help="a:b, the shard indices to write (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="sentences decoded together")
    parser.add_argument("--max-seconds", type=float, default=15.0, help="audio cap per sentence")
    parser.add_argument("--threads", type=int, default=1)


def check_settings(out: Path, settings: dict) -> None:
    """A rerun into ``out`` skips the shards there, so it must make the same data: ValueError (one
    line naming what differs) when ``out``'s :data:`SETTINGS` were written with other settings (a
    rerun with another ``--sources``, ``--split``, ``--model``... kept the old shards and wrote
    nothing, silently). ``--sentences`` may grow (the corpus' first sentences stay)."""
    path = out / SETTINGS
    if not path.is_file():
        return
    before = json.loads(path.read_text())
    said = lambda value: ",".join(map(str, value)) if isinstance(value, list) else value  # noqa: E731
    differ = [f"--{name.replace('_', '-')} {said(before[name])} there, {said(value)} now" for name, value in settings.items()
              if name in before and before[name] != value]
    if differ:
        raise ValueError(f"{out} holds self-distillation shards made with other settings ({'; '.join(differ)}); give "
                         "those, or another --out")


def parse_temperatures(text: str) -> list[float]:
    """``"1.0,0.7"`` -> [1.0, 0.7]; ValueError (one line) for an empty list or a value <= 0."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"--temperature must be a comma list of positive numbers, got {text!r}")
    return values


def shard_range(spec: str | None, total: int) -> range:
    """``"a:b"`` (either side may be empty) or None -> the shard indices, checked against ``total``."""
    if spec is None:
        return range(total)
    first, sep, last = spec.partition(":")
    try:
        start, stop = int(first or 0), int(last) if last else total
    except ValueError:
        start, stop = -1, -1
    if not sep or not 0 <= start < stop <= total:
        raise ValueError(f"--shards must be a:b with 0 <= a < b <= {total}, got {spec!r}")
    return range(start, stop)


def _items(saved: dict | list) -> list[dict]:
    # (a shard is {"first", "sentences", "items"}; one written before the counts were kept is the list of items)
    return saved["items"] if isinstance(saved, dict) else saved


def self_items(data: str | Path) -> list[dict]:
    """Every item of the ``self-*.pt`` shards in ``data`` (shard order); ValueError when there are none."""
    shards = sorted(Path(data).glob(SHARDS))
    if not shards:
        raise ValueError(f"no self-distillation shards in {data}; run mmspec train tts-self-data --out {data} first")
    return [item for shard in shards for item in _items(torch.load(shard, weights_only=True))]


def shard_is_whole(path: Path, sentences: int) -> bool:
    """Whether the shard at ``path`` covers the ``sentences`` sentences its index now names (a rerun
    keeps it). A shard an earlier run with fewer ``--sentences`` left short is not (it was kept, and
    the data held fewer sentences than asked, silently). A shard written before the counts were kept
    holds its items only: whole when it holds ``sentences`` of them; one with sentences skipped (the
    front end refused them, or they did not fit the context) is written again, to the same items."""
    if not path.exists():
        return False
    saved = torch.load(path, weights_only=True)
    return (saved["sentences"] if isinstance(saved, dict) else len(saved)) >= sentences


def is_self_data(data: str | Path) -> bool:
    """Whether ``data`` holds ``tts-self-data`` shards (rather than ``speech-data``'s)."""
    return any(Path(data).glob(SHARDS))


def run(args: argparse.Namespace) -> int:
    from ..api import generate_rows
    from ..pipelines.text_to_speech.methods import make_method
    from ..pipelines.text_to_speech.pipeline import TextToSpeechPipeline
    from .data.open_text import open_corpus, parse_sources

    temperatures = parse_temperatures(args.temperature)
    for name in ("sentences", "shard_size", "batch_size", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.max_seconds > 0:
        raise ValueError(f"--max-seconds must be positive, got {args.max_seconds}")
    total = -(-args.sentences // args.shard_size)
    indices = shard_range(args.shards, total)
    sources = parse_sources(args.sources) if args.sources is not None else None
    corpus = open_corpus(args.split, args.sentences, sources)
    out = Path(args.out)
    settings = {"model": args.model, "split": args.split, "sources": sources or list(SOURCES), "temperature": temperatures,
                "shard_size": args.shard_size, "max_seconds": args.max_seconds}
    check_settings(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    (out / SETTINGS).write_text(json.dumps(settings, indent=1))
    pipe = TextToSpeechPipeline(model=args.model)
    c = pipe.components
    if c.target.num_codebooks != 1 or not c.target.model.config.aligned:
        raise ValueError("tts-self-data makes data for a VALL-E-style voice (one codebook streamed, aligned); "
                         f"{args.model} streams {c.target.num_codebooks} codebook(s), aligned: {c.target.model.config.aligned}")
    drafter = make_method("ar").build_drafter(c)
    frames = int(args.max_seconds * c.codec.frame_rate)
    for index in indices:
        path = out / SHARD.format(index)
        chunk = range(index * args.shard_size, min((index + 1) * args.shard_size, len(corpus)))
        if shard_is_whole(path, len(chunk)):
            continue
        begin = time.perf_counter()
        items, skipped = [], 0
        for first in range(chunk.start, chunk.stop, args.batch_size):
            ready, made = {}, {}  # row -> (its text, its inputs) for the rows said, in order; row -> its item
            for r in range(first, min(first + args.batch_size, chunk.stop)):
                try:  # (a sentence the front end refuses, or too long for the context alone: counted, not said)
                    text = c.normalize(corpus[r][1]).text
                    inputs = c.model_inputs(text)
                except ValueError:
                    inputs = None
                if inputs is None or c.positions_needed(inputs, frames) > c.max_positions:
                    skipped += 1
                    continue
                ready[r] = (text, inputs)
            for temperature in sorted({temperatures[r % len(temperatures)] for r in ready}):
                group = [r for r in ready if temperatures[r % len(temperatures)] == temperature]
                texts, inputs = zip(*(ready[r] for r in group))
                budget = max(c.target.stream_length(c.frames_needed(i, frames)) for i in inputs) + 1
                result = generate_rows(c.target, inputs, drafter=drafter, max_new_tokens=budget, do_sample=True,
                                       temperature=temperature, seed=group)
                for b, (r, text, i) in enumerate(zip(group, texts, inputs)):
                    stats = result.row_stats[b]
                    codes = c.target.codes(result.sequences[b, 1 : 1 + stats.new_tokens])
                    made[r] = {"text": text, "source": corpus[r][0], "temperature": temperature,
                               "phonemes": i["phoneme_ids"][0].cpu(), "codes": codes[:1].cpu(),
                               "durations": i["durations"][0].cpu()}
            items.extend(made[r] for r in ready)  # (in sentence order, whatever the temperature groups)
        torch.save({"first": chunk.start, "sentences": len(chunk), "items": items}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        frames_made = sum(item["codes"].shape[1] for item in items)
        print(f"shard {index}: {words.count(len(items), 'sentence')}, {frames_made / c.codec.frame_rate / 60:.1f} min of speech, "
              f"{time.perf_counter() - begin:.0f} s" + (f"; {skipped} skipped (the front end refused them, or they "
                                                        "do not fit the context)" if skipped else ""), flush=True)
    return 0
