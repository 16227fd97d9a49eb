"""``mmspec tts "text" --out out.wav --method spec``: text-to-speech from the command line.

Writes the WAV (16-bit PCM, mono, at the codec's rate), ``<out>.png`` beside it (the log-mel
spectrogram of the method's audio, with AR's above it under ``--compare-baseline``; not with
``--no-spectrogram``) and, with
``--compare-baseline``, ``<out>-baseline.wav``. ``--json`` prints the stats as JSON. The files are
written together once the run has finished, or none of them (:mod:`mmspec.cli.output`).

``-f FILE`` reads the text from a file (``-`` for stdin). ``--stream`` says the text sentence by
sentence (:meth:`~mmspec.pipelines.text_to_speech.pipeline.TextToSpeechPipeline.stream`) and
appends each sentence's audio to ``<out>.part`` as soon as it is ready (a valid WAV after every
sentence: its header is rewritten each time, so a player can open it while it grows); the file is
renamed to ``<out>`` at the end (with the spectrogram), or removed if the run fails. It prints the
time to first audio.

``--out -`` writes the WAV (16-bit PCM) to standard output instead, and nothing else: no
spectrogram, no baseline WAV; messages and ``--json`` go to standard error. With ``--stream`` each
sentence is written and flushed as soon as it is ready, after a header whose sizes say "unknown
length" (0xFFFFFFFF, as streaming WAV writers do; fixed at the end when standard output is a
file), so a player reading a pipe starts with the first sentence:
``mmspec tts -f story.txt --stream --out - | aplay`` (or ``| ffplay -nodisp -autoexit -``). When
the player quits (the pipe closes) the command stops with one line on standard error, status 0.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch

from . import command_help
from .args import check_output_path
from .output import OutputFiles


def add_parser(subparsers) -> None:
    from ..pipelines.text_to_speech.methods import METHODS
    from .args import add_int8_arg, add_optimize_arg, add_threads_arg

    cmd = subparsers.add_parser("tts", help=command_help("tts"))
    cmd.add_argument("text", nargs="?", default=None, help="the text to say (or -f FILE)")
    cmd.add_argument("-f", "--file", default=None, help="read the text from FILE ('-': standard input)")
    cmd.add_argument("--out", default="tts.wav", help="output WAV file, its spectrogram written beside it as NAME.png "
                     "(and NAME-baseline.wav with --compare-baseline); '-': standard output, 16-bit PCM, nothing "
                     "else written; with --stream each sentence as it is ready: mmspec tts ... --stream --out - | aplay")
    cmd.add_argument("--stream", action="store_true", help="say it sentence by sentence, appending each sentence's "
                     "audio to OUT.part as it is ready (renamed to OUT at the end); prints the time to first audio")
    cmd.add_argument("--method", default="sjd-coupled",
                     help=METHODS.help() + "; settings as name:key=value,... (e.g. vadusa:top_k=5); default sjd-coupled (exact, "
                     "no trained drafter), so that --compare-baseline measures a speedup")
    cmd.add_argument("--model", default=None, help="an mmspec TTS model directory, or an embedded voice: valle (the "
                     "default, models/tts-valle) or delay (models/tts)")
    cmd.add_argument("--num-draft-tokens", type=int, default=None, help="draft length in stream sub-tokens "
                     "(default: the method's, a whole number of steps)")
    cmd.add_argument("--accept-top-k", type=int, default=None, help="spec-topk: accept a drafted code among the "
                     "target's top k (default: the method's)")
    cmd.add_argument("--delta", type=float, default=None, help="lantern: total-variation bound per code (default: the method's)")
    cmd.add_argument("--seed", type=int, default=0, help="the same seed gives the same audio")
    cmd.add_argument("--temperature", type=float, default=None,
                     help="sampling temperature (default: the model's, from its tts.json: 0.7 for the embedded voice)")
    cmd.add_argument("--top-k", type=int, default=None,
                     help="sample among the k most likely codes (default: all; not with --greedy)")
    cmd.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    cmd.add_argument("--max-seconds", type=float, default=20.0,
                     help="most audio per sentence (a longer one stops there, with a note)")
    cmd.add_argument("--speed", type=float, default=1.0, help="speaking rate of an aligned model (2.0: twice as fast)")
    cmd.add_argument("--compare-baseline", action="store_true", help="also run plain decoding with the same seed; "
                     "report the speedup")
    cmd.add_argument("--no-spectrogram", dest="spectrogram", action="store_false",
                     help="write no NAME.png beside the WAV (drawing it takes ~0.5 s, most of it loading matplotlib)")
    cmd.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda | cuda:N")
    cmd.add_argument("--dtype", default="auto", help="the codec LMs' weights: auto (default: bfloat16 where fast, a GPU "
                     "or a CPU with AMX / AVX-512 BF16; else float32) | float32 | bfloat16")
    add_optimize_arg(cmd)
    add_int8_arg(cmd)
    add_threads_arg(cmd)
    cmd.add_argument("--json", action="store_true", help="print the result (paths, stats) as one JSON object")
    cmd.set_defaults(handler=run, output_args={"out": "file or -"},
                     interrupted=lambda args, command: "nothing was saved (" + (
                         "the audio streamed so far was removed with its .part file" if args.stream and args.out != "-"
                         else "the files are written once the audio is done") + ")")


def written_files(args, out: Path) -> list[Path]:
    """What ``--out OUT`` writes: OUT, OUT-baseline.wav with ``--compare-baseline`` (which
    ``--stream`` refuses), OUT.png unless ``--no-spectrogram``."""
    return ([out] + ([baseline_wav(out)] if args.compare_baseline else [])
            + ([out.with_suffix(".png")] if args.spectrogram else []))


def listed(paths: list) -> str:
    """"a", "a and b", "a, b and c"."""
    names = [str(p) for p in paths]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


#: the PNG text field that marks a spectrogram as this command's (one it may replace)
SPECTROGRAM_SOFTWARE = "mmspec tts"


def replaceable_png(path: Path) -> bool:
    """Whether ``path`` may be replaced by a spectrogram: it does not exist, or it is one this
    command wrote (marked :data:`SPECTROGRAM_SOFTWARE`, or matplotlib's mark on those written before
    the mark) -- not a picture of the user's that happens to share the WAV's name."""
    if not path.is_file():  # (a folder there is check_output_path's to name)
        return True
    from PIL import Image

    try:
        with Image.open(path) as image:
            software = str(image.info.get("Software", ""))
    except Exception:  # not an image PIL reads: not ours
        return False
    return software == SPECTROGRAM_SOFTWARE or software.startswith("Matplotlib")


def spectrogram_png(panels: list[tuple[str, torch.Tensor]], sampling_rate: int) -> bytes:
    """One log-mel panel per (title, audio [1, samples]), stacked -> the PNG file's bytes (rendered
    before anything is written, so a failure leaves no partial output)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..adapters.audio.codec import log_mel

    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), squeeze=False)
    for axis, (title, audio) in zip(axes[:, 0], panels):
        axis.imshow(log_mel(audio[0], sampling_rate), origin="lower", aspect="auto", cmap="magma")
        axis.set_title(title, fontsize=9)
        axis.set_ylabel("mel bin")
    axes[-1, 0].set_xlabel(f"frame ({sampling_rate // 256} per second)")
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100, metadata={"Software": SPECTROGRAM_SOFTWARE})
    plt.close(figure)
    return png.getvalue()


def run(args) -> int:
    import mmspec
    from ..core.sampling import SamplingConfig

    from ..pipelines.text_to_speech.components import check_speed, read_manifest, spoken_text

    text = read_text(args)
    spoken_text(text, read_manifest(args.model)[1]["normalizer"])  # nothing sayable: before the voice loads
    check_speed(args.speed, "--speed")
    if args.stream and args.compare_baseline:
        raise ValueError("--stream cannot --compare-baseline; run the comparison without --stream")
    if args.out == "-" and sys.stdout.isatty():
        raise ValueError("--out - writes the WAV to standard output, which is a terminal here; pipe it to a player "
                         "(... --out - | aplay) or give --out FILE")
    SamplingConfig(do_sample=not args.greedy, temperature=1.0 if args.temperature is None else args.temperature,
                   top_k=args.top_k)  # checks the values
    if args.out != "-":  # the files written beside the WAV, checked before the voice loads
        out = Path(args.out)
        if out.suffix.lower() != ".wav":
            raise ValueError(f"--out {args.out}: the audio is written as WAV; give a file name ending in .wav")
        if args.spectrogram and not replaceable_png(out.with_suffix(".png")):
            raise ValueError(f"--out {args.out} also writes its spectrogram as {out.with_suffix('.png')}, which exists and "
                             "is not one mmspec wrote; move that file or choose another --out")
        for path in reversed(written_files(args, out)[1:]):  # (the spectrogram's path first)
            try:
                check_output_path(str(path), "file", "")
            except ValueError as error:
                raise ValueError(f"--out {args.out} also writes {path.name}:{error}") from None
    settings = rule_settings(args)
    pipe = mmspec.pipeline("text-to-speech", model=args.model, method=args.method, device=args.device,
                           num_draft_tokens=args.num_draft_tokens, optimize=args.optimize, dtype=args.dtype, int8=args.int8,
                           **settings)
    try:
        return (run_stream if args.stream else say)(args, pipe, text)
    except BrokenPipeError:  # the player reading standard output quit: the end, not an error
        if args.out != "-":
            raise
        import os

        try:  # no second error when Python flushes standard output at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, io.UnsupportedOperation):
            pass
        print("mmspec: standard output was closed (the player quit); stopped", file=sys.stderr)
        return 0


#: the options that set a tolerant rule's parameter -> the method setting they set
RULE_OPTIONS = {"accept_top_k": "top_k", "delta": "delta"}


def rule_settings(args) -> dict:
    """--accept-top-k / --delta -> the method's settings, refused in one line naming the option
    where the method does not read it or its spec sets it to another value."""
    from ..pipelines.methods import parse_spec
    from ..pipelines.text_to_speech.methods import METHODS

    spec = parse_spec(args.method)
    method = METHODS.resolve(spec.name)
    settings = {}
    for option, key in RULE_OPTIONS.items():
        value, flag = getattr(args, option), "--" + option.replace("_", "-")
        if value is None:
            continue
        if key not in method.defaults:
            readers = ", ".join(name for name, cls in METHODS.items() if key in cls.defaults)
            raise ValueError(f"{flag} sets {key}, which method {spec.name!r} does not read; use it with {readers}")
        written = dict(spec.pairs).get(key)
        if written is not None and method._parse(key, written, args.method) != value:
            raise ValueError(f"--method {args.method} sets {key} and {flag} {value} sets it too; give it once")
        settings[key] = value
    return settings


def say(args, pipe, text: str) -> int:
    """The text said in one call: the WAV (or ``--out -``), the spectrogram, the baseline's WAV
    under ``--compare-baseline``; prints the stats."""
    from ..adapters.audio.codec import pcm16, wav_header, write_wav

    # a bar of generated frames on stderr when it is a terminal (capped at --max-seconds; an aligned
    # model usually ends sooner)
    result = pipe(text, do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k,
                  seed=args.seed, max_seconds=args.max_seconds, speed=args.speed,
                  compare_baseline=args.compare_baseline, progress=sys.stderr.isatty())
    rate = result.sampling_rate
    if args.out == "-":
        samples = pcm16(result.audio)
        write_all(sys.stdout.buffer, wav_header(rate, len(samples), result.audio.shape[0]) + samples)
        wrote, report = "wrote the WAV to standard output", sys.stderr
    else:
        out = Path(args.out)
        # the method as given (its spec); the normalised text, which the font can draw
        panels = [(f"{args.method}: {short(result.normalized)}", result.audio)]
        if result.baseline_audio is not None:
            panels.insert(0, ("ar (plain decoding, same seed)", result.baseline_audio))
        png = spectrogram_png(panels, rate) if args.spectrogram else None  # everything computed before the first file is written
        with OutputFiles() as files:  # all of them or none
            files.write(out, lambda path: write_wav(path, result.audio, rate))
            if result.baseline_audio is not None:
                files.write(baseline_wav(out), lambda path: write_wav(path, result.baseline_audio, rate))
            if png is not None:
                files.write(out.with_suffix(".png"), lambda path: path.write_bytes(png))
        wrote, report = f"wrote {listed(written_files(args, out))}", sys.stdout
    stats = result.stats
    record = {"text": text, "normalized": result.normalized, "dropped": list(result.dropped),
              "truncated": result.truncated, "out": args.out, "stats": stats.to_dict()}
    if result.baseline_codes is not None:
        record["identical_to_baseline"] = bool(torch.equal(result.codes, result.baseline_codes))
    if args.json:
        print(json.dumps(record, indent=2), file=report)
        return 0
    say_dropped(result.dropped)
    say_truncated(result.truncated, args.max_seconds)
    speed = f", {stats.speedup:.2f}x over plain decoding" if stats.speedup is not None else ""
    print(f"{args.method}: {stats.seconds:.2f} s of speech in {stats.wall_time_s:.2f} s (real-time factor "
          f"{stats.real_time_factor:.2f}, tau {stats.tau:.2f}){speed}", file=report)
    print(wrote, file=report)
    return 0


def read_text(args) -> str:
    """The text to say: the argument, or ``-f FILE`` (``-``: stdin); exactly one of them."""
    if args.file is not None and args.text is not None:
        raise ValueError("give the text or -f FILE, not both")
    if args.file is None:
        text = args.text or ""
    elif args.file == "-":
        text = read_stdin()
    else:
        path = Path(args.file)
        if path.is_dir():
            raise ValueError(f"cannot read {path}: it is a directory; give a text file (or - for standard input)")
        if not path.is_file():
            raise ValueError(f"cannot read {path}: no such file; give a text file (or - for standard input)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"cannot read {path}: it is not UTF-8 text; save it as UTF-8") from None
    if "\x00" in text:  # UTF-16 without its byte-order mark decodes as UTF-8: "H\0e\0..." was said letter by letter
        where = "standard input" if args.file == "-" else args.file
        raise ValueError(f"cannot read {where}: it has NUL bytes (a binary or UTF-16 file), not UTF-8 text; "
                         "save it as UTF-8")
    if not text.strip():
        from ..adapters.audio.phonemes import EMPTY_TEXT

        raise ValueError(EMPTY_TEXT + (f" ({args.file} is empty)" if args.file else ""))
    return text


def read_stdin() -> str:
    """Standard input as UTF-8 text (line ends as a file's read gives them). Python's own stdin
    decodes other bytes with surrogateescape, which the normaliser then dropped without a word
    (Latin-1 ``caf\\xe9`` was said as "caf"); they are refused in one line, as ``-f FILE``'s are."""
    binary = getattr(sys.stdin, "buffer", None)
    if binary is None:  # (a text stream without bytes beneath it: already text)
        return sys.stdin.read()
    try:
        text = binary.read().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("cannot read standard input: it is not UTF-8 text; convert it to UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def baseline_wav(out: Path) -> Path:
    """``--compare-baseline``'s WAV beside ``out``: ``say.wav`` -> ``say-baseline.wav``."""
    return out.with_name(out.stem + "-baseline.wav")


def short(text: str, width: int = 70) -> str:
    """One line of at most ``width`` characters (a spectrogram's title)."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


def say_truncated(truncated: bool, max_seconds: float) -> None:
    if truncated:
        print(f"note: --max-seconds {max_seconds:g} cut the speech short; raise it to hear the whole text", file=sys.stderr)


def say_dropped(dropped) -> None:
    if dropped:
        shown = ", ".join(repr(d) for d in dropped[:12]) + (" ..." if len(dropped) > 12 else "")
        print(f"note: left out what the voice cannot say: {shown}", file=sys.stderr)


def write_all(out, data: bytes) -> None:
    """Write all of ``data`` to the binary stream ``out`` and flush it: a write into a pipe whose
    reader has quit can return short instead of raising; the next one raises BrokenPipeError."""
    view = memoryview(data)
    while view:
        view = view[out.write(view) or 0 :]
    out.flush()


def write_stream(out, chunks, rate: int, on_chunk, sizes_each_chunk: bool = False) -> list[torch.Tensor]:
    """``--stream``: into the binary stream ``out``, the header once the first chunk says how many
    channels, then each chunk's samples written and flushed as it comes (``on_chunk(chunk)`` after
    each). ``sizes_each_chunk`` (``--out FILE``'s ``.part``): the header's sizes rewritten after
    every chunk, so a reader, or a copy taken midway, finds a valid WAV of the chunks so far
    (soundfile's flush left them 0 until the file closed); else (``--out -``) a header of unknown
    length, its sizes fixed at the end where the output can seek (standard output redirected to a
    file). Returns the chunks' audio."""
    from ..adapters.audio.codec import pcm16, wav_header

    audio, written, channels = [], 0, None
    for chunk in chunks:
        if channels is None:
            channels = chunk.audio.shape[0]
            write_all(out, wav_header(rate, 0 if sizes_each_chunk else None, channels))
        samples = pcm16(chunk.audio)
        write_all(out, samples)
        written += len(samples)
        if sizes_each_chunk:
            _rewrite_header(out, rate, written, channels)
        audio.append(chunk.audio)
        on_chunk(chunk)
    if not sizes_each_chunk and _rewritable(out, written):
        _rewrite_header(out, rate, written, channels)
    return audio


def _rewrite_header(out, rate: int, written: int, channels: int) -> None:
    """The header at the start of the seekable ``out`` rewritten to count ``written`` bytes of samples."""
    from ..adapters.audio.codec import wav_header

    out.seek(0)
    write_all(out, wav_header(rate, written, channels))
    out.seek(0, 2)


def _rewritable(out, written: int) -> bool:
    """Whether the header before the ``written`` bytes of samples can be written over: a seekable
    output that our header begins (not appended to: with O_APPEND a write after a seek lands at
    the end)."""
    import fcntl
    import os

    if not out.seekable() or out.tell() != 44 + written:
        return False
    try:
        return not fcntl.fcntl(out.fileno(), fcntl.F_GETFL) & os.O_APPEND
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return True  # an in-memory buffer


def run_stream(args, pipe, text: str) -> int:
    """``--stream``: each sentence's audio appended to ``<out>.part`` as it is ready (its header
    rewritten after each chunk, so the file is a valid WAV of what it holds after every chunk), the
    spectrogram written and the file renamed to ``<out>`` at the end; on any failure the .part
    file is removed. ``--out -``: each sentence written to standard output instead
    (:func:`write_stream`). Prints the time to first audio (from the call, the voice
    already loaded)."""
    import os

    from .output import WRITE_ERRORS, check_writable_path, output_error

    chunks = pipe.stream(text, do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k,
                         seed=args.seed, max_seconds=args.max_seconds, speed=args.speed)  # checks the text first
    rate, records, dropped = pipe.sampling_rate, [], []
    report = sys.stderr if args.out == "-" else sys.stdout

    def record_chunk(chunk) -> None:
        records.append({"index": chunk.index, "text": chunk.text, "ready_s": round(chunk.elapsed_s, 4),
                        "seconds": chunk.audio.shape[-1] / rate, "truncated": chunk.truncated,
                        "stats": chunk.stats.to_dict()})
        dropped[:] = chunk.dropped
        if not args.json:
            print(f"[{chunk.index + 1}/{chunk.total}] {chunk.elapsed_s:.2f} s: {short(chunk.text)}", file=report, flush=True)

    if args.out == "-":
        whole = torch.cat(write_stream(sys.stdout.buffer, chunks, rate, record_chunk), dim=-1)
        wrote = "wrote the WAV to standard output"
    else:
        out = Path(args.out)
        check_writable_path(out)
        part, audio = out.with_name(out.name + ".part"), []
        try:
            try:
                part.parent.mkdir(parents=True, exist_ok=True)
                wav = open(part, "wb")
            except WRITE_ERRORS as error:
                raise output_error(part, error) from None
            try:
                with wav:
                    audio = write_stream(wav, chunks, rate, record_chunk, sizes_each_chunk=True)
            except OSError as error:  # (a full disk mid-stream; the voice's own errors pass)
                raise output_error(out, error) from None
            whole = torch.cat(audio, dim=-1)
            said = " ".join(r["text"] for r in records)
            if args.spectrogram:
                png = spectrogram_png([(f"{args.method} (streamed): {short(said)}", whole)], rate)
                with OutputFiles() as files:
                    files.write(out.with_suffix(".png"), lambda path: path.write_bytes(png))
            os.replace(part, out)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        wrote = f"wrote {listed(written_files(args, out))}"
    seconds = whole.shape[-1] / rate
    total = records[-1]["ready_s"]
    record = {"text": text, "out": args.out, "time_to_first_audio_s": records[0]["ready_s"], "total_s": total,
              "seconds": seconds, "real_time_factor": total / seconds, "dropped": list(dropped), "chunks": records}
    if args.json:
        print(json.dumps(record, indent=2), file=report)
        return 0
    say_dropped(dropped)
    say_truncated(any(r["truncated"] for r in records), args.max_seconds)
    print(f"{args.method}, streamed: first audio after {records[0]['ready_s']:.2f} s; {seconds:.2f} s of audio in "
          f"{len(records)} pieces in {total:.2f} s (real-time factor {total / seconds:.2f})", file=report)
    print(wrote, file=report)
    return 0
