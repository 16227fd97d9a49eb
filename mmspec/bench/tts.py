"""``mmspec bench tts``: every text-to-speech method on held-out sentences, side by side.

Sentences (``--text``, :data:`TEXTS`): ``grammar``, the first ``--sentences`` of the test split of
:mod:`mmspec.train.data.sentences` (the voice's small world); ``open``, the test split of the
open-domain corpus (:mod:`mmspec.train.data.open_text`, its sources taken in turn, the WER also
given per source); ``handwritten``, the hand-written everyday sentences that no training source
made (:mod:`mmspec.train.data.held_out`). None is ever drawn for training. Each method says each
sentence once per round with the same seed as AR, methods interleaved per sentence after a warm-up (the bench protocol: each method once, then
every sentence once, so that no method pays a sentence's first-shape kernel builds); times are sums
over every sentence and round, speedup = AR's time / the method's. Columns: speedup, tau (stream
sub-tokens per verification), real-time factor (generation seconds / audio seconds), the word
error rate of Whisper tiny.en on the method's audio and its speaker similarity to a reference
(Resemblyzer; by default the Piper voice the embedded model learned from, saying the same sentence
without its sampling noise, so the reference is the same every run),
each also per round, the run-to-run spread (``--no-quality`` skips both). Results are
checkpointed in ``--results`` after every measurement: rerun to resume, or with a complete file to
re-derive the table without measuring.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..hub import dtype_name
from ..cli.args import add_int8_arg
from ..cli.output import write_text
from .results import add_device_args, check_meta, load_results, machine_info, machine_line, method_specs, save_results
from .throughput import parse_batch_sizes, throughput_tables


def grammar_texts(n: int) -> list[tuple[str, str]]:
    from ..train.data.sentences import sentence

    return [("grammar", sentence("test", i)) for i in range(n)]


#: the open corpus' sources ``--text open`` measures on: the five the voice's first sittings were
#: measured on (``smollm2-more``, added in stop 54, is SmolLM2's text again: left out, so that the
#: figures of every sitting are over the same sentences)
OPEN_SOURCES = ("smollm2", "fortunes", "words", "numbers", "grammar")


def open_texts(n: int) -> list[tuple[str, str]]:
    from ..train.data.open_text import open_corpus

    return open_corpus("test", n, list(OPEN_SOURCES))


def open_validation_texts(n: int) -> list[tuple[str, str]]:
    """The open corpus' validation split (the same sources): where a method's settings are tuned,
    so that ``open`` and ``handwritten`` stay unseen."""
    from ..train.data.open_text import open_corpus

    return open_corpus("validation", n, list(OPEN_SOURCES))


def handwritten_texts(n: int) -> list[tuple[str, str]]:
    from ..train.data.held_out import test_sentences

    texts = test_sentences()
    if n > len(texts):
        raise ValueError(f"--sentences {n}: the hand-written test split has {len(texts)} sentences; pass at most that")
    return [("handwritten", text) for text in texts[:n]]


#: --text name -> n -> [(source, sentence)] of held-out sentences
TEXTS = {"grammar": grammar_texts, "open": open_texts, "open-validation": open_validation_texts, "handwritten": handwritten_texts}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..pipelines.text_to_speech.methods import METHODS

    parser.add_argument("--model", default=None, help="TTS model directory, or an embedded voice: valle (the default) or delay")
    parser.add_argument("--methods", default="ar,spec,prompt-lookup,sjd", help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--sentences", type=int, default=20, help="how many of --text's sentences")
    parser.add_argument("--text", choices=sorted(TEXTS), default="grammar",
                        help="held-out sentences: grammar (the voice's small world), open (the open-domain corpus' test "
                        "split, WER per source too), open-validation (its validation split: for tuning a method's settings) or handwritten "
                        "(everyday sentences no training source made)")
    parser.add_argument("--rounds", type=int, default=2, help="times every sentence is said per method (the times summed)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0; not with --greedy)")
    parser.add_argument("--greedy", action="store_true",
                        help="argmax decoding instead of sampling (exact: the codes of plain decoding)")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="audio cap per sentence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_device_args(parser)
    parser.add_argument("--dtype", default="auto", help="the codec LMs' weights: auto (bfloat16 where fast) | float32 | bfloat16")
    add_int8_arg(parser)
    parser.add_argument("--results", default="bench-out/tts.json", help="JSON checkpoint / results file (a rerun resumes it)")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--no-quality", action="store_true", help="skip the WER (Whisper tiny.en) and speaker similarity")
    parser.add_argument("--speaker-reference", default="piper",
                        help="speaker similarity against: 'piper' (the Piper voice en_US-joe-medium saying each sentence: "
                             "the embedded voice's source), a WAV file (one reference for every sentence), or 'none'")
    parser.add_argument("--batch-sizes", default=None,
                        help="measure throughput instead: the sentences said B at a time, per batch size (items/s, "
                             "stream tokens/s, crossover; no WER); see mmspec.bench.throughput")


def run(args: argparse.Namespace) -> int:
    import mmspec
    from ..pipelines.text_to_speech.methods import make_method
    specs = method_specs(args.methods, "ar,sjd-coupled")
    args.temperature = 1.0 if args.temperature is None else args.temperature
    reference = args.speaker_reference
    if reference not in ("piper", "none") and not Path(reference).is_file():
        raise ValueError(f"--speaker-reference takes 'piper', 'none' or a WAV file; {reference!r} is none of them")
    if not args.no_quality:
        from ..metrics.speech import check_speech_metrics

        check_speech_metrics(similarity=reference != "none")
    methods = {spec: make_method(spec) for spec in specs}  # checked before the model loads
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    if batch_sizes and "ar" not in methods:
        raise ValueError("--batch-sizes compares every method with plain decoding: include ar in --methods")
    sourced = TEXTS[args.text](args.sentences)
    texts, sources = [text for _, text in sourced], [source for source, _ in sourced]
    path = Path(args.results)
    int8 = {"int8": True} if args.int8 else {}  # (in the settings and meta only when on: older files stay valid)
    results = load_results(path, "tts", {"model": args.model, "dtype": args.dtype, **int8})  # before the model loads
    pipe = mmspec.pipeline("text-to-speech", model=args.model, device=args.device, optimize=args.optimize,
                           dtype=args.dtype, int8=args.int8)  # one model for every method
    meta = {"sentences": args.sentences, "text": args.text, "rounds": args.rounds, "temperature": args.temperature, "greedy": args.greedy,
            "max_seconds": args.max_seconds,
            "model": args.model or "embedded (models/tts-valle)", "machine": machine_info(dtype_name(pipe.components.dtype), args.threads, args.device),
            "linears": pipe.components.linears, **int8, **({"batch_sizes": batch_sizes} if batch_sizes else {})}
    check_meta(path, results, meta)
    results["meta"] = meta
    if batch_sizes:
        return run_throughput(args, results, path, pipe.components, methods, texts, batch_sizes)
    runs = results.setdefault("runs", {})
    sampling = {"do_sample": not args.greedy, "temperature": args.temperature, "max_seconds": args.max_seconds}
    todo = [(r, i) for r in range(args.rounds) for i in range(len(texts))
            if any(f"{spec}|{i}|{r}" not in runs for spec in specs)]
    if todo:
        for method in methods.values():  # warm-up: every method's models once
            pipe(texts[0], method=method, **{**sampling, "max_seconds": min(1.0, args.max_seconds)})
        # and every sentence once, untimed: oneDNN builds a kernel per new shape (the NAR stage's
        # frame count, a long prompt's rows), which the first method timed on a sentence would pay
        first = next(iter(methods.values()))
        for i in sorted({i for _, i in todo}):
            pipe(texts[i], method=first, **sampling)
    for round_, i in todo:
        for spec, method in methods.items():
            key = f"{spec}|{i}|{round_}"
            if key in runs:
                continue
            started = time.perf_counter()
            out = pipe(texts[i], seed=i + 1000 * round_, method=method, **sampling)
            call = time.perf_counter() - started  # (the whole call: front end, LM, NAR stage and the codec's decode)
            s = out.stats
            runs[key] = {"time": s.wall_time_s, "nar_time": s.nar_time_s, "call_time": call, "seconds": s.seconds,
                         "tau": s.tau, "frames": s.frames, "codes": out.codes.tolist(),
                         "prefill_time": (s.generation or {}).get("prefill_time_s"),
                         **{f"{kind}_per_position": (s.generation or {}).get(f"{kind}_per_position") for kind in ("drafted", "accepted")}}
            save_results(path, results)
        print(f"round {round_} sentence {i + 1}/{len(texts)} done", file=sys.stderr, flush=True)
    references = None
    if not args.no_quality and reference != "none":
        references, results["reference_rows"] = speaker_references(reference, texts, pipe)
    summary = summarise(results, specs, texts, pipe, quality=not args.no_quality, references=references, sources=sources)
    results["summary"] = summary
    save_results(path, results)
    table = markdown_table(summary, meta, results.get("reference_rows", {}))
    print(table)
    if args.markdown:
        write_text(args.markdown, table + "\n")
    return 0


def run_throughput(args, results: dict, path: Path, components, methods: dict, texts: list[str], batch_sizes: list[int]) -> int:
    """``--batch-sizes``: :mod:`mmspec.bench.throughput` over the sentences (each row one
    sentence, at most ``--max-seconds`` of audio); tokens are stream sub-tokens."""
    options = {spec: {"drafter": method.build_drafter(components), "acceptance": method.rule,
                      "rule_kwargs": method.rule_kwargs(components)} for spec, method in methods.items()}
    label = "0 (greedy)" if args.greedy else f"{args.temperature:g}"
    settings = {label: dict(do_sample=not args.greedy, temperature=args.temperature)}
    budget = components.target.stream_length(int(args.max_seconds * components.codec.frame_rate)) + 1
    meta = {**results["meta"], "model": args.model or "embedded voice (models/tts-valle)"}
    _, table = throughput_tables(components.target, [components.model_inputs(t) for t in texts], options, batch_sizes,
                                 settings, args.rounds, budget, results, path, meta)
    print(table)
    if args.markdown:
        write_text(args.markdown, table + "\n")
    return 0


def speaker_references(reference: str, texts: list[str], pipe) -> tuple[list[torch.Tensor], dict]:
    """One speaker embedding [256] per sentence: of the Piper voice saying it (``"piper"``), or of
    one WAV file for all. With Piper, also the rows that bound the methods' quality: Piper's own
    WER, the WER and speaker similarity of Piper's audio through the model's codec and, for a
    VALL-E-style voice, of Piper's codebook 0 through its NAR stage (Piper's own alignment, codec
    frames per phoneme as in training): what the voice would say were its AR stage perfect."""
    from ..metrics.speech import speaker_embedding, transcribe, word_error_rate

    if reference != "piper":
        from ..adapters.audio.codec import read_wav

        audio, rate = read_wav(reference)
        return [speaker_embedding(audio.mean(0), rate)] * len(texts), {}
    from ..train.speech_data import load_voice, synthesise

    voice = load_voice()
    rate, codec_rate = voice.config.sample_rate, pipe.sampling_rate
    components = pipe.components
    said = [synthesise(voice, text, noise=False) for text in texts]
    source = [audio.float() / 32768 for _, audio, _ in said]
    codes = [components.codec.encode(a, rate) for a in source]
    embeddings = [speaker_embedding(a, rate) for a in source]
    rows = {"piper (the reference)": {"wer": word_error_rate(texts, [transcribe(a, rate) for a in source])},
            "piper through the codec": _reference_row(texts, [components.waveform(c)[0] for c in codes], codec_rate, embeddings)}
    if components.nar is not None:
        from ..train.tts import frame_durations

        per_frame = round(rate / components.codec.frame_rate)  # Piper's samples per codec frame
        filled = [components.nar.complete(c[0], ids.to(c.device), frame_durations(spent, c.shape[1], per_frame).to(c.device))
                  for c, (ids, _, spent) in zip(codes, said)]
        rows["piper's codebook 0 through the NAR stage"] = _reference_row(
            texts, [components.waveform(c)[0] for c in filled], codec_rate, embeddings)
    return embeddings, rows


def _reference_row(texts: list[str], audio: list[torch.Tensor], rate: int, embeddings: list[torch.Tensor]) -> dict:
    """A reference row of the table: the WER of ``audio`` (one clip per sentence) and its mean
    speaker similarity to ``embeddings``."""
    from ..metrics.speech import speaker_embedding, transcribe, word_error_rate

    sims = [float(speaker_embedding(a, rate) @ e) for a, e in zip(audio, embeddings)]
    return {"wer": word_error_rate(texts, [transcribe(a, rate) for a in audio]), "speaker_similarity": sum(sims) / len(sims)}


def summarise(results: dict, specs: list[str], texts: list[str], pipe, quality: bool,
              references: list[torch.Tensor] | None = None, sources: list[str] | None = None) -> dict:
    """Per method: time, audio seconds, speedup over AR (and, for a VALL-E-style voice, that of
    the code stream alone, its NAR stage's time left out), tau, real-time factor, where the runs
    timed it (stop 92 on) the prompt's prefill and the speedup of the decoding loop alone (the
    prefill and the NAR stage left out: the part a drafter changes), and, with
    ``quality``, the WER of every round's audio (decoded from the stored codes), overall and per
    round, and with ``references`` (a speaker embedding per sentence) the mean speaker similarity,
    overall and per round; with ``sources`` (one name per sentence) naming more than one source, the
    WER per source too."""
    runs, rounds = results["runs"], results["meta"]["rounds"]
    n = len(texts)
    cells = {spec: [runs[f"{spec}|{i}|{r}"] for r in range(rounds) for i in range(n)] for spec in specs}
    ar_time = sum(c["time"] for c in cells["ar"]) if "ar" in cells else None
    ar_nar = sum(c.get("nar_time", 0.0) for c in cells["ar"]) if "ar" in cells else 0.0
    ar_prefill = _prefill(cells["ar"]) if "ar" in cells else None
    from ..pipelines.text_to_speech.methods import make_method

    greedy = results["meta"].get("greedy", False)
    ar_call = sum(c["call_time"] for c in cells["ar"]) if "ar" in cells and all("call_time" in c for c in cells["ar"]) else None
    summary = {}
    for spec in specs:
        time_ = sum(c["time"] for c in cells[spec])
        nar = sum(c.get("nar_time", 0.0) for c in cells[spec])
        seconds = sum(c["seconds"] for c in cells[spec])
        row = {"time_s": time_, "audio_s": seconds, "speedup": ar_time / time_ if ar_time else None,
               "tau": sum(c["tau"] for c in cells[spec]) / len(cells[spec]), "rtf": time_ / max(seconds, 1e-9),
               "exact": make_method(spec).exact}
        if all("call_time" in c for c in cells[spec]):  # (results files before stop 78 did not time the whole call)
            call = sum(c["call_time"] for c in cells[spec])
            row.update(call_time_s=call, call_rtf=call / max(seconds, 1e-9), call_speedup=ar_call / call if ar_call else None)
        if greedy and "ar" in cells:  # greedy decoding: every method's codes are plain decoding's, where it is exact
            row["identical"] = sum(c["codes"] == a["codes"] for c, a in zip(cells[spec], cells["ar"]))
            row["runs"] = len(cells[spec])
        if nar > 0:
            row["nar_time_s"] = nar
            row["stream_speedup"] = (ar_time - ar_nar) / (time_ - nar) if ar_time else None
        per_position = _acceptance_per_position(cells[spec])
        if per_position:
            row["acceptance_per_position"] = per_position
        prefill = _prefill(cells[spec])
        if prefill is not None:
            row["prefill_time_s"] = prefill
            if ar_time and ar_prefill is not None:
                row["loop_speedup"] = (ar_time - ar_nar - ar_prefill) / max(time_ - nar - prefill, 1e-9)
        if quality:
            from ..metrics.speech import speaker_embedding, transcribe, word_error_rate

            rate = pipe.sampling_rate
            audio = [pipe.components.waveform(torch.tensor(c["codes"]))[0] for c in cells[spec]]
            hypotheses = [transcribe(a, rate) for a in audio]
            row["wer"] = word_error_rate([t for _ in range(rounds) for t in texts], hypotheses)
            row["wer_rounds"] = [word_error_rate(texts, hypotheses[r * n:(r + 1) * n]) for r in range(rounds)]
            if sources and len(set(sources)) > 1:
                row["wer_by_source"] = {
                    name: word_error_rate(*zip(*[(texts[k % n], h) for k, h in enumerate(hypotheses) if sources[k % n] == name]))
                    for name in dict.fromkeys(sources)}
            if references is not None:
                sims = [float(speaker_embedding(a, rate) @ references[k % n]) for k, a in enumerate(audio)]
                row["speaker_similarity"] = sum(sims) / len(sims)
                row["speaker_similarity_rounds"] = [sum(sims[r * n:(r + 1) * n]) / n for r in range(rounds)]
        summary[spec] = row
    return summary


def _prefill(cells: list[dict]) -> float | None:
    """The runs' prefill time summed (the prompt's forward and the first code), or None where a run
    did not record it (results files before stop 92)."""
    times = [c.get("prefill_time") for c in cells]
    return None if not times or None in times else sum(times)


def _acceptance_per_position(cells: list[dict]) -> list[float] | None:
    """Accepted / drafted codes at each draft position over the runs (position 1: the first code
    after the last committed one), or None for a method that drafts nothing or runs that did not
    record them (results files before stop 92)."""
    drafted, accepted = [c.get("drafted_per_position") for c in cells], [c.get("accepted_per_position") for c in cells]
    if not cells or None in drafted or None in accepted:
        return None
    width = max(map(len, drafted))
    totals = [[sum(row[i] for row in rows if i < len(row)) for i in range(width)] for rows in (drafted, accepted)]
    return [a / d for d, a in zip(*totals) if d] or None


def fixed_costs_line(summary: dict) -> str | None:
    """Where plain decoding's time went, from its row: the prefill, the NAR stage and the decoding
    loop, and the speedup no drafter can pass (the first two cost every method the same), or None
    without the times."""
    row = summary.get("ar", {})
    prefill, nar, total = row.get("prefill_time_s"), row.get("nar_time_s", 0.0), row.get("time_s")
    if prefill is None or not total:
        return None
    loop = total - prefill - nar
    stage = f"NAR stage {100 * nar / total:.0f} %, " if nar else ""  # (a delay-pattern LM has none)
    return (f"plain decoding's time: prefill {100 * prefill / total:.0f} %, {stage}decoding loop {100 * loop / total:.0f} %; "
            f"a method that made the loop free would be {total / (prefill + nar):.2f}x")


def _with_rounds(value: float, rounds: list[float], fmt: str) -> str:
    return f"{fmt.format(value)} ({', '.join(fmt.format(v) for v in rounds)})" if len(rounds) > 1 else fmt.format(value)


def markdown_table(summary: dict, meta: dict, reference_rows: dict | None = None) -> str:
    m = meta["machine"]
    mode = "greedy" if meta["greedy"] else f"temperature {meta['temperature']}"
    lines = [f"{meta['sentences']} held-out {meta.get('text', 'grammar')} sentences x {meta['rounds']} rounds, {mode}, {m.get('dtype', 'dtype not recorded')}{' with int8 weights (--int8)' * bool(meta.get('int8'))}, "
             f"{m['threads']} thread(s), {machine_line(m)}, torch {m['torch']}", "",
             "speedup and real-time factor: the codec LM and NAR stage (what the methods change); stream: the NAR "
             "stage left out; loop: the prefill left out too; whole call: the front end and the codec's decode to a "
             "waveform included", "",
             "| method | exact | speedup | whole call | tau | real-time factor (whole call) | WER (per round) | "
             "speaker similarity (per round) |",
             "|---|---|---|---|---|---|---|---|"]
    for spec, row in summary.items():
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        if row.get("stream_speedup"):
            speedup += f" (stream {row['stream_speedup']:.2f}x"
            speedup += f", loop {row['loop_speedup']:.2f}x)" if row.get("loop_speedup") else ")"
        elif row.get("loop_speedup"):
            speedup += f" (loop {row['loop_speedup']:.2f}x)"
        exact = {True: "yes", False: "no (tolerant)", None: "?"}[row.get("exact")]
        if "identical" in row:
            exact += f", {row['identical']}/{row['runs']} identical"
        call = f"{row['call_speedup']:.2f}x" if row.get("call_speedup") else "-"
        rtf = f"{row['rtf']:.3f}" + (f" ({row['call_rtf']:.3f})" if "call_rtf" in row else "")
        wer = (_with_rounds(100 * row["wer"], [100 * w for w in row.get("wer_rounds", [])], "{:.1f}") + " %"
               if "wer" in row else "-")
        sim = (_with_rounds(row["speaker_similarity"], row["speaker_similarity_rounds"], "{:.3f}")
               if "speaker_similarity" in row else "-")
        lines.append(f"| {spec} | {exact} | {speedup} | {call} | {row['tau']:.2f} | {rtf} | {wer} | {sim} |")
    for name, row in (reference_rows or {}).items():
        sim = f"{row['speaker_similarity']:.3f}" if "speaker_similarity" in row else "1 (itself)"
        lines.append(f"| {name} | - | - | - | - | - | {100 * row['wer']:.1f} % | {sim} |")
    fixed = fixed_costs_line(summary)
    if fixed:
        lines += ["", fixed]
    # (plain decoding "drafts" only a delay-pattern step's forced sub-tokens: not listed)
    positions = {spec: row["acceptance_per_position"] for spec, row in summary.items()
                 if spec != "ar" and row.get("acceptance_per_position")}
    if positions:
        lines += ["", "accepted / drafted codes by draft position (1 = the first code after the committed ones):", ""]
        lines += [f"- {spec}: " + ", ".join(f"{a:.2f}" for a in rates) for spec, rates in positions.items()]
    by_source = {spec: row["wer_by_source"] for spec, row in summary.items() if "wer_by_source" in row}
    if by_source:
        names = list(next(iter(by_source.values())))
        lines += ["", "WER per source:", "", "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {spec} | " + " | ".join(f"{100 * wers[name]:.1f} %" for name in names) + " |"
                  for spec, wers in by_source.items()]
    return "\n".join(lines)
