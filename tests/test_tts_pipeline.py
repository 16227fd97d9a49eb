"""The text-to-speech pipeline and ``mmspec tts`` on a tiny random model directory (aligned codec LM +
draft + mel codec, character front end; an unaligned one too): every method runs, greedy methods give plain decoding's codes,
the baseline comparison, the WAV / spectrogram outputs, and one-line errors."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import mmspec
from mmspec.adapters.audio.codec import read_wav
from mmspec.adapters.audio.phonemes import CharacterPhonemizer
from mmspec.cli import main
from mmspec.hub import models_dir
from mmspec.modeling.codec_lm import CodecLM, CodecLMConfig
from mmspec.modeling.codec_nar import CodecNAR, CodecNARConfig
from mmspec.modeling.heads import DraftHeads, EagleHead
from mmspec.modeling.mel_codec import MelCodecConfig, MelRVQCodec
from mmspec.pipelines.text_to_speech.methods import METHODS

K, CODES = 3, 8


def tiny_lm(seed, layers, aligned=True, codebooks=K):
    torch.manual_seed(seed)
    config = CodecLMConfig(text_vocab=CharacterPhonemizer.vocab_size, num_codebooks=codebooks, codebook_size=CODES, dim=32,
                           layers=layers, heads=2, ffn=64, max_positions=256, aligned=aligned)
    model = CodecLM(config)
    with torch.no_grad():
        model.heads.weight.mul_(4.0)
    return model


def make_model_dir(root, aligned, valle=False):
    """A voice directory; ``valle``: its LMs stream codebook 0 alone and a NAR stage adds the rest."""
    codebooks = 1 if valle else K
    tiny_lm(0, 2, aligned, codebooks).save(root / "tts", dtype=torch.float32)
    tiny_lm(1, 1, aligned, codebooks).save(root / "tts-draft", dtype=torch.float32)
    torch.manual_seed(2)
    DraftHeads(32, 2, "medusa").save(root / "tts-medusa")
    EagleHead(CodecLM.from_pretrained(root / "tts").backbone.config).save(root / "tts-eagle")
    codec = MelRVQCodec(MelCodecConfig(num_codebooks=K, codebook_size=CODES, griffin_lim_iters=4))
    codec.codebooks.normal_(generator=torch.Generator().manual_seed(0))
    codec.codebooks[0] -= 4.0  # a quiet log-mel level
    codec.save(root / "tts-codec")
    manifest = {"codec": "../tts-codec", "phonemizer": "characters", "draft": "../tts-draft", "medusa": "../tts-medusa",
                "eagle": "../tts-eagle"}
    if valle:
        torch.manual_seed(3)
        CodecNAR(CodecNARConfig(text_vocab=CharacterPhonemizer.vocab_size, num_codebooks=K, codebook_size=CODES, dim=32,
                                layers=1, heads=2, ffn=64, max_positions=256)).save(root / "tts-nar")
        manifest["nar"] = "../tts-nar"
    (root / "tts" / "tts.json").write_text(json.dumps(manifest))
    return root / "tts"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tts"), aligned=True)


@pytest.fixture(scope="module")
def unaligned_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tts-unaligned"), aligned=False)


@pytest.fixture(scope="module")
def valle_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tts-valle"), aligned=True, valle=True)


@pytest.mark.parametrize("layout", ["model_dir", "unaligned_dir", "valle_dir"])
@pytest.mark.parametrize("method", [name for name, cls in METHODS.items() if cls.exact])
def test_greedy_methods_give_plain_decodings_codes(request, layout, method):
    tts = mmspec.pipeline("text-to-speech", model=request.getfixturevalue(layout), method=method)
    out = tts("a red star.", do_sample=False, max_seconds=0.4, compare_baseline=True)
    assert torch.equal(out.codes, out.baseline_codes)
    assert out.audio.dtype == torch.float32 and out.audio.shape[0] == 1 and out.audio.shape[1] > 0
    assert out.sampling_rate == 22050 and out.stats.frames == out.codes.shape[1] > 0
    assert out.stats.speedup > 0 and out.stats.real_time_factor > 0 and out.stats.method == method


@pytest.mark.parametrize("layout", ["model_dir", "unaligned_dir", "valle_dir"])
def test_max_seconds_caps_the_audio_and_says_when_it_cut(request, layout):
    """At most max_seconds of audio (the budget's last steps may hold a frame or two more: cut),
    and ``truncated`` says so; with room to spare the text ends by itself, not truncated."""
    tts = mmspec.pipeline("text-to-speech", model=request.getfixturevalue(layout), method="sjd")
    rate = tts.components.codec.frame_rate
    for seconds in (0.05, 0.1, 0.2):
        out = tts("a red star and two blue hearts.", do_sample=False, max_seconds=seconds)
        assert out.codes.shape[1] <= int(seconds * rate) and out.stats.seconds <= seconds
        if layout != "unaligned_dir" and seconds == 0.05:  # (an aligned voice's durations ask for more than 2 frames)
            assert out.truncated
    chunks = list(tts.stream("a red star. two blue hearts.", do_sample=False, max_seconds=0.05))
    for chunk in chunks:  # each piece capped and flagged as said alone
        assert chunk.codes.shape[1] <= int(0.05 * rate) and (not chunk.truncated or chunk.codes.shape[1] == int(0.05 * rate))
        assert chunk.truncated == tts(chunk.text, do_sample=False, max_seconds=0.05).truncated
    if layout != "unaligned_dir":
        assert not tts("a red star.", do_sample=False, max_seconds=20.0).truncated


@pytest.mark.parametrize("layout", ["model_dir", "valle_dir"])
@pytest.mark.parametrize("method", ["spec", "medusa", "eagle", "sjd"])
def test_bfloat16_codec_lms_keep_exact_methods_exact(request, layout, method):
    """dtype="bfloat16": the codec LMs' step models (and the heads that follow them) run in bf16,
    the duration predictor in fp32, and greedy exact methods give bf16 plain decoding's codes."""
    tts = mmspec.pipeline("text-to-speech", model=request.getfixturevalue(layout), method=method, dtype="bfloat16")
    out = tts("a red star.", do_sample=False, max_seconds=0.4, compare_baseline=True)
    assert torch.equal(out.codes, out.baseline_codes) and out.stats.config["dtype"] == "bfloat16"
    lm = tts.components.target.model
    assert lm.backbone.norm.weight.dtype == lm.heads.weight.dtype == torch.bfloat16
    assert {p.dtype for p in lm.durations.parameters()} == {torch.float32}
    drafter_dtypes = {"spec": lambda c: c.draft_target().model.heads.weight.dtype,
                      "medusa": lambda c: c.medusa_heads().blocks[0].linear.weight.dtype,
                      "eagle": lambda c: c.eagle_head().fc.weight.dtype}
    if method in drafter_dtypes:
        assert drafter_dtypes[method](tts.components) == torch.bfloat16
    float32 = mmspec.pipeline("text-to-speech", model=request.getfixturevalue(layout), method="ar", dtype="float32")
    assert float32("a red star.", do_sample=False, max_seconds=0.4).stats.config["dtype"] == "float32"
    assert float32.components.target.model.heads.weight.dtype == torch.float32


def test_the_default_dtype_is_auto(model_dir):
    from mmspec.hub import dtype_name, fast_bf16

    out = mmspec.pipeline("text-to-speech", model=model_dir)("a red star.", do_sample=False, max_seconds=0.2)
    assert out.stats.config["dtype"] == ("bfloat16" if fast_bf16("cpu") else "float32") == dtype_name(
        mmspec.pipeline("text-to-speech", model=model_dir).components.target.model.heads.weight.dtype)


@pytest.mark.parametrize("method,exact_setting,relaxed_setting", [("spec-topk", {"top_k": 1}, {"top_k": 4}),
                                                                  ("vadusa", {"top_k": 1}, {"top_k": 4}),
                                                                  ("sjd-topk", {"top_k": 1}, {"top_k": 4}),
                                                                  ("eagle-topk", {"top_k": 1}, {"top_k": 4}),
                                                                  ("lantern", {"delta": 0.0}, {"delta": 0.5})])
@pytest.mark.parametrize("layout", ["model_dir", "valle_dir"])
def test_tolerant_methods(request, layout, method, exact_setting, relaxed_setting):
    """With no tolerance they are greedy decoding; with some they run and say they are lossy (the
    rules themselves are tested in test_relaxed.py / test_rules.py)."""
    model_dir = request.getfixturevalue(layout)
    exact = mmspec.pipeline("text-to-speech", model=model_dir, method=method, **exact_setting)
    out = exact("a red star.", do_sample=False, max_seconds=0.4, compare_baseline=True)
    assert torch.equal(out.codes, out.baseline_codes)
    tolerant = mmspec.pipeline("text-to-speech", model=model_dir, method=method, **relaxed_setting)
    relaxed = tolerant("a red star.", do_sample=False, max_seconds=0.4)
    assert relaxed.stats.config["exact"] is False and relaxed.stats.config["acceptance"] == METHODS[method].rule
    assert relaxed.codes.shape[0] == K and relaxed.audio.shape[1] == relaxed.codes.shape[1] * 512


def test_group_acceptance_runs_greedy_and_sampled(model_dir):
    tts = mmspec.pipeline("text-to-speech", model=model_dir, method="pcg")
    for sample in (False, True):
        out = tts("a red star.", do_sample=sample, max_seconds=0.4)
        assert out.stats.config["exact"] is False and out.stats.config["acceptance"] == "group"
        assert out.codes.shape[0] == K and out.audio.shape[1] == out.codes.shape[1] * 512


@pytest.mark.parametrize("layout", ["model_dir", "valle_dir"])
def test_the_neighbour_table_stays_inside_each_codebook(request, layout):
    tts = mmspec.pipeline("text-to-speech", model=request.getfixturevalue(layout), method="lantern")
    c = tts.components
    table = c.neighbours(3)
    width = c.target.codebook_size
    assert table.shape == (c.target.vocab_size, 3)
    codes = torch.arange(c.target.num_codebooks * width)
    codes = codes[codes % width < CODES]  # the codes proper (width = CODES + the end code)
    assert ((table[codes] // width) == (codes // width)[:, None]).all() and (table[codes] != codes[:, None]).all()
    assert (table[codes] % width < CODES).all()  # a code's neighbours are codes, never the end code
    books = c.target.num_codebooks * width
    assert (table[books:] == torch.arange(books, c.target.vocab_size)[:, None]).all()


def test_progress_reports_steps_as_they_are_committed(model_dir):
    seen = []
    out = mmspec.pipeline("text-to-speech", model=model_dir, method="spec")("a red star.", max_seconds=0.4,
                                                                          progress=seen.append)
    assert seen and seen == sorted(seen) and len(seen) == out.stats.generation["verify_steps"]
    assert seen[-1] >= out.stats.frames  # steps, with the delay pattern's last K - 1 steps


def test_sampling_is_seeded(model_dir):
    tts = mmspec.pipeline("text-to-speech", model=model_dir, method="spec")
    first, second = (tts("two blue hearts.", seed=7, max_seconds=0.4) for _ in range(2))
    assert torch.equal(first.codes, second.codes) and torch.equal(first.audio, second.audio)


def test_the_output_dict_is_json(model_dir):
    """to_dict() holds every field, JSON-serialisable: the audio's samples and the codes as lists,
    the stats as their dict; keys() names the fields without converting anything."""
    out = mmspec.pipeline("text-to-speech", model=model_dir, method="sjd")("two blue hearts.", seed=7, max_seconds=0.4,
                                                                           compare_baseline=True)
    encoded = json.loads(json.dumps(out.to_dict()))
    assert encoded["audio"] == out.audio.tolist() and encoded["codes"] == out.codes.tolist()
    assert encoded["baseline_codes"] == out.baseline_codes.tolist() and encoded["stats"]["method"] == "sjd"
    assert list(out.keys()) == list(encoded) and out["codes"] is out.codes
    assert {"mean_accepted_length", "tokens_per_second"} <= set(encoded["stats"]["generation"])
    assert set(out.stats.generation.keys()) == set(encoded["stats"]["generation"])


@pytest.mark.parametrize("kwargs,call,match", [
    ({}, {"text": "  "}, "the text is empty"),
    ({}, {"text": "\u65e5\u672c \U0001F600"}, "nothing this voice can say: '\u65e5\u672c', '\U0001F600'"),  # issue 47
    ({}, {"text": "hi", "max_seconds": 0}, "max_seconds must be a positive number"),
    ({}, {"text": "hi", "speed": float("nan")}, "speed must be a positive number"),
    ({}, {"text": "hi.", "speed": 50}, "speed must be at most 4"),  # issue 44: a 512-sample clip crashed the CLI
    ({}, {"text": "hi.", "speed": 100.0}, "speed must be at most 4"),
    ({}, {"text": "ok.", "speed": 2.0}, "gets no audio frame; lower speed"),  # (the tiny voice gives it 0 frames)
    ({}, {"text": "redball" * 60}, r"too long for the model's 256 positions even alone \(\d+ phoneme ids \+ \d+ audio "
                                  r"frames\); shorten it$"),  # one word: nothing to split at, and no speed makes room
    ({"method": "beam"}, None, "unknown method 'beam'; choose one of ar, spec"),
    ({"method": "lantern", "delta": 2.0}, None, "delta must be a finite number >= 0 and <= 1"),
    ({"method": "spec", "top_k": 3}, None, "method 'spec' takes no setting 'top_k'"),
    ({"dtype": "float8"}, None, "unknown dtype 'float8'"),
    ({"dtype": "float16"}, None, "the voice runs in float32 or bfloat16"),  # (the CLI's --dtype fp16 ran, mislabelled)
    ({}, {"text": "hi", "seed": -1}, r"seed must be between 0 and 2\*\*63 - 1, got -1"),  # as the CLI's --seed
    ({}, {"text": "hi", "seed": -1, "stream": True}, r"seed must be between 0 and 2\*\*63 - 1, got -1"),
])
def test_bad_input(model_dir, kwargs, call, match):
    with pytest.raises(ValueError, match=match):
        tts = mmspec.pipeline("text-to-speech", model=model_dir, **kwargs)
        if call is not None and call.pop("stream", False):
            tts.stream(**call)
        else:
            tts(**call)


def test_the_context_check_counts_an_aligned_voices_own_frames(model_dir, unaligned_dir):
    """Issue 44: the context must hold the phoneme ids and the frames the generation can make: an
    aligned voice's durations' total (known before decoding) under a long max_seconds, an
    unaligned voice's whole budget."""
    out = mmspec.pipeline("text-to-speech", model=model_dir)("hi.", max_seconds=60)  # 1 frame, not 2584
    assert out.pieces == ["hi."] and out.stats.frames == 1
    # the budget alone past the context: said so, not blamed on the text ("'a' is too long ... even alone")
    with pytest.raises(ValueError, match=r"max_seconds asks for 2583 audio frames a generation, more than this model's 256 "
                                         r"positions hold .* below 5.94 s"):
        mmspec.pipeline("text-to-speech", model=unaligned_dir)("hi. a red star.", max_seconds=60, split="sentences")


SENTENCES = ["the green ball is under the small red table.", "two blue cubes sit on a big box.",
             "a red star is left of the ring.", "put the small pink heart near it.",
             "the yellow square is above the blue one.", "four green circles are on the right."]


def test_a_text_too_long_for_the_context_is_said_sentence_by_sentence(model_dir):
    """Issue 44: a paragraph whose phoneme ids and frames do not fit the context at once is said
    one sentence at a time (each as said alone, with the same seed), the audio joined by pauses and
    the stats summed; the same seed gives the same audio; its sentences batch like texts."""
    from mmspec.pipelines.text_to_speech.pipeline import PAUSE_SECONDS

    tts = mmspec.pipeline("text-to-speech", model=model_dir, method="spec")
    paragraph = " ".join(SENTENCES)
    c = tts.components
    assert c.positions_needed(c.model_inputs(paragraph), 10**6) > c.max_positions  # it does not fit at once
    out = tts(paragraph, seed=5)
    assert out.pieces == SENTENCES
    alone = [tts(sentence, seed=5) for sentence in SENTENCES]
    pause = torch.zeros(1, round(PAUSE_SECONDS * out.sampling_rate))
    joined = [part for a in alone for part in (a.audio, pause)][:-1]
    assert torch.equal(out.audio, torch.cat(joined, dim=-1))  # every sentence's audio, in order
    assert torch.equal(out.codes, torch.cat([a.codes for a in alone], dim=1))
    assert out.stats.frames == sum(a.stats.frames for a in alone) > 0
    assert out.stats.target_forwards == sum(a.stats.target_forwards for a in alone)
    assert out.stats.seconds == pytest.approx(sum(a.stats.seconds for a in alone))  # speech made, not the pauses
    pauses = (len(SENTENCES) - 1) * pause.shape[-1] / out.sampling_rate
    assert out.audio.shape[-1] / out.sampling_rate == pytest.approx(out.stats.seconds + pauses, abs=0.01)
    assert out.stats.generation["new_tokens"] == sum(a.stats.generation["new_tokens"] for a in alone)
    assert torch.equal(tts(paragraph, seed=5).audio, out.audio)  # same seed, same output
    batched = tts([paragraph, "a red star."], seed=5, batch_size=4)
    assert torch.equal(batched[0].codes, out.codes) and torch.equal(batched[1].codes, tts("a red star.", seed=5).codes)
    with_baseline = tts(paragraph, seed=5, compare_baseline=True)
    assert with_baseline.baseline_codes.shape[1] == with_baseline.stats.frames and with_baseline.stats.speedup > 0


def test_a_long_text_runs_the_duration_predictor_a_sentence_at_a_time(model_dir, monkeypatch):
    """A 10,000-line text ran the phonemizer's ids of all of it through the duration predictor
    at once (5 GB and 84 s before the first audio, the stop-77 audit): only pieces that can fit."""
    tts = mmspec.pipeline("text-to-speech", model=model_dir, method="spec")
    lm = tts.components.target.model
    lengths, predict = [], lm.predict_durations

    def recorded(ids, speed=1.0):
        lengths.append(ids.shape[1])
        return predict(ids, speed)

    monkeypatch.setattr(lm, "predict_durations", recorded)
    text = " ".join(SENTENCES * 40)
    chunk = next(iter(tts.stream(text, seed=5)))
    assert chunk.index == 0 and chunk.total == len(SENTENCES) * 40
    assert max(lengths) < tts.components.max_positions  # (never the whole text's ids)


def test_a_sentence_too_long_alone_is_said_clause_by_clause(model_dir):
    tts = mmspec.pipeline("text-to-speech", model=model_dir)
    clauses = [sentence[:-1] + "," for sentence in SENTENCES[:-1]] + [SENTENCES[-1]]
    out = tts(" ".join(clauses), seed=2)
    assert out.pieces == clauses and out.stats.frames == sum(tts(clause, seed=2).stats.frames for clause in clauses)


def test_a_clause_too_long_alone_is_said_by_halves_of_its_words(model_dir):
    """A run with no punctuation that does not fit the context is cut in halves by words until each
    part fits (the stop-74 audit: 5,000 characters of it were refused)."""
    tts = mmspec.pipeline("text-to-speech", model=model_dir)
    run = "the red ball and " * 20
    c = tts.components
    assert c.positions_needed(c.model_inputs(run), 10**6) > c.max_positions
    out = tts(run, seed=2, max_seconds=0.2)
    assert len(out.pieces) > 1 and " ".join(out.pieces) == " ".join(run.split())
    assert all(c.positions_needed(c.model_inputs(p), 10**6) <= c.max_positions for p in out.pieces)


@pytest.mark.skipif(not (models_dir() / "tts-valle" / "tts.json").is_file(), reason="no embedded voice")
def test_the_embedded_voice_says_a_long_sentence_at_the_default_budget():
    """Issue 44: 213 phoneme ids were refused at the default 20 s (213 + 861 budget frames > 1024
    positions), though the sentence needs 207 frames."""
    pytest.importorskip("piper")
    text = "It costs $49.99 on 3/4/2025."
    out = mmspec.pipeline("text-to-speech", method="ar", dtype="float32")(text, do_sample=False)
    assert out.normalized == "It costs forty-nine dollars and ninety-nine cents on March fourth, twenty twenty-five."
    assert out.pieces == [out.normalized] and out.stats.frames > 150


def test_speed_scales_an_aligned_models_durations(model_dir, unaligned_dir):
    c = mmspec.pipeline("text-to-speech", model=model_dir).components
    normal, fast = (int(c.model_inputs("a red star.", speed)["durations"].sum()) for speed in (1.0, 2.0))
    assert normal > 0 and abs(fast - normal / 2) <= 1
    with pytest.raises(ValueError, match="speed needs an aligned codec LM"):
        mmspec.pipeline("text-to-speech", model=unaligned_dir)("hi", speed=2.0)


def test_a_directory_without_a_manifest_or_a_draft(model_dir, tmp_path):
    with pytest.raises(ValueError, match="has no tts.json"):
        mmspec.pipeline("text-to-speech", model=tmp_path)
    manifest = json.loads((model_dir / "tts.json").read_text())
    no_draft = tmp_path / "tts"
    CodecLM.from_pretrained(model_dir).save(no_draft, dtype=torch.float32)
    (no_draft / "tts.json").write_text(json.dumps({**manifest, "codec": str(model_dir.parent / "tts-codec"), "draft": None,
                                                   "medusa": None}))
    with pytest.raises(ValueError, match="no draft codec LM"):
        mmspec.pipeline("text-to-speech", model=no_draft, method="spec")
    with pytest.raises(ValueError, match="no Medusa heads"):
        mmspec.pipeline("text-to-speech", model=no_draft, method="vadusa")


def test_an_ar_stage_without_its_nar_stage_says_how_to_link_one(tmp_path_factory):
    """The stop-78 audit: a voice trained with --codebooks 1 (the card's AR stage) failed with only
    "the codec (8 x 256) does not match the LM's codebooks (1 x 256)"."""
    voice = make_model_dir(tmp_path_factory.mktemp("valle-no-nar"), aligned=True, valle=True)
    manifest = json.loads((voice / "tts.json").read_text())
    del manifest["nar"]
    (voice / "tts.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"an AR stage of 1 codebook\(s\) says the rest through a NAR stage, which "
                                         r".*tts.json does not name \(\"nar\"\): train one with mmspec train tts-nar --voice"):
        mmspec.pipeline("text-to-speech", model=voice)


def _cli(capsys, *args):
    """``mmspec tts ARGS`` in this process (the CLI's ``main``): (exit code, stdout, stderr)."""
    code = main(["tts", *args])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_cli_writes_audio_and_spectrogram(model_dir, tmp_path, capsys):
    """The first run is a true ``python -m mmspec tts`` process (the entry point's smoke test); the
    second, in this process, gives the same audio for the same seed."""
    out = tmp_path / "say" / "x.wav"
    result = subprocess.run([sys.executable, "-m", "mmspec", "tts", "a green ring.", "--model", str(model_dir), "--out", str(out),
                             "--method", "sjd", "--max-seconds", "0.4", "--compare-baseline", "--json", "--seed", "3"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["stats"]["speedup"] > 0 and record["stats"]["method"] == "sjd"
    audio, rate = read_wav(out)
    assert rate == 22050 and audio.shape[-1] > 1000
    assert out.with_suffix(".png").stat().st_size > 1000 and (tmp_path / "say" / "x-baseline.wav").exists()
    again = tmp_path / "again.wav"
    assert _cli(capsys, "a green ring.", "--model", str(model_dir), "--out", str(again), "--method", "sjd", "--max-seconds", "0.4",
                "--seed", "3").returncode == 0
    assert torch.equal(read_wav(again)[0], audio)  # the same seed, the same audio


@pytest.mark.parametrize("args,match", [
    (["", "--out", "x.wav"], "the text is empty"),
    (["hi", "--temperature", "nan"], "temperature"),
    (["hi", "--speed", "0"], "--speed must be a positive number"),
    (["There are seven blue squares.", "--speed", "50"], "--speed must be at most 4"),  # issue 44: a traceback
    (["There are seven blue squares.", "--speed", "100"], "--speed must be at most 4"),
    (["redball" * 60], "too long for the model's 256 positions even alone"),
    (["hi", "--model", "/nonexistent"], "has no tts.json"),
    (["hi", "--dtype", "int4"], "unknown dtype 'int4'"),
    (["a red star.", "--max-seconds", "0.001"], "max_seconds=0.001 is shorter than one codec frame"),  # (was "codes have no frames")
    (["a red star.", "--max-seconds", "1e308"], "max_seconds=1e+308 is more than a day"),  # (was an OverflowError traceback)
])
def test_cli_errors_are_one_line(args, match, model_dir, tmp_path, capsys):
    model = [] if "--model" in args else ["--model", str(model_dir)]
    result = _cli(capsys, *args, *model, *([] if "--out" in args else ["--out", str(tmp_path / "x.wav")]))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and match in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_cli_says_a_one_frame_clip(model_dir, tmp_path, capsys):
    """Issue 44: a 512-sample clip (one codec frame: "a red star." at speed 3 on the tiny voice)
    gets its WAV, its spectrogram and its --json record."""
    out = tmp_path / "x.wav"
    result = _cli(capsys, "a red star.", "--model", str(model_dir), "--speed", "3", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stats"]["frames"] == 1
    assert read_wav(out)[0].shape[-1] == 512 and out.with_suffix(".png").stat().st_size > 1000


def test_cli_writes_nothing_when_the_run_fails_before_its_end(model_dir, tmp_path, capsys, monkeypatch):
    """Issue 44: the WAV was written before the spectrogram failed; now every output is computed
    before the first file is written."""
    import mmspec.cli.tts as tts_cli

    def fails(*args):
        raise ValueError("the spectrogram failed")

    monkeypatch.setattr(tts_cli, "spectrogram_png", fails)
    result = _cli(capsys, "a red star.", "--model", str(model_dir), "--out", str(tmp_path / "x.wav"), "--max-seconds", "0.4",
                  "--json")
    assert result.returncode == 2 and "the spectrogram failed" in result.stderr and result.stdout == ""
    assert not list(tmp_path.iterdir())


def test_bench_measures_every_method_and_rederives_from_its_results(model_dir, tmp_path, capsys):
    results, table = tmp_path / "tts.json", tmp_path / "tts.md"
    args = ["bench", "tts", "--model", str(model_dir), "--sentences", "2", "--rounds", "1", "--no-quality", "--max-seconds", "0.4",
            "--greedy", "--results", str(results), "--markdown", str(table)]
    assert main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    summary = json.loads(results.read_text())["summary"]
    assert set(summary) == {"ar", "spec", "prompt-lookup", "sjd"} and summary["ar"]["speedup"] == 1.0
    first = table.read_text()
    assert "| spec |" in first and "held-out grammar sentences" in first
    assert main(args) == 0
    assert table.read_text() == first and "sentence 1/2 done" not in capsys.readouterr().out


@pytest.mark.parametrize("family", ["encodec", "dac", "mimi"])
def test_transformers_codecs_run_every_lossless_method(family, tmp_path):
    """A model directory whose tts.json names a transformers EnCodec / DAC / Mimi checkpoint: every
    lossless method gives plain decoding's codes, and the audio comes out at the codec's rate."""
    from test_codecs import RATE, tiny_dac, tiny_encodec, tiny_mimi

    from mmspec.adapters.audio.codec import load_codec

    build = {"encodec": tiny_encodec, "dac": tiny_dac, "mimi": tiny_mimi}[family]
    build().save_pretrained(tmp_path / "codec")
    codec = load_codec(tmp_path / "codec")
    for name, layers in (("tts", 2), ("tts-draft", 1)):
        torch.manual_seed(layers)
        config = CodecLMConfig(text_vocab=CharacterPhonemizer.vocab_size, num_codebooks=codec.num_codebooks,
                               codebook_size=codec.codebook_size, dim=32, layers=layers, heads=2, ffn=64, max_positions=256,
                               aligned=True)
        CodecLM(config).save(tmp_path / name, dtype=torch.float32)
    torch.manual_seed(3)
    DraftHeads(32, 2, "medusa").save(tmp_path / "tts-medusa")
    EagleHead(CodecLM.from_pretrained(tmp_path / "tts").backbone.config).save(tmp_path / "tts-eagle")
    (tmp_path / "tts" / "tts.json").write_text(json.dumps({"codec": "../codec", "phonemizer": "characters",
                                                            "draft": "../tts-draft", "medusa": "../tts-medusa",
                                                            "eagle": "../tts-eagle"}))
    frames = 12
    for method in [name for name, cls in METHODS.items() if cls.exact]:
        tts = mmspec.pipeline("text-to-speech", model=tmp_path / "tts", method=method)
        out = tts("a red star.", do_sample=False, max_seconds=frames / codec.frame_rate, compare_baseline=True)
        assert torch.equal(out.codes, out.baseline_codes), method
        assert out.sampling_rate == RATE and out.audio.shape[0] == codec.channels and out.audio.shape[1] > 0


def test_linears_are_optimized_at_load_unless_opted_out(model_dir):
    from mmspec.modeling.fast_linear import FewRowLinear

    fast = mmspec.pipeline("text-to-speech", model=model_dir, method="spec")
    out = fast("a red star.", max_seconds=0.3)
    assert out.stats.config["linears"].split(" (")[0] in ("c", "transposed")  # with the variants, e.g. "c (bf16 amx)"
    draft = fast.components.draft_target().model  # loaded for spec, optimized as it loaded
    assert any(isinstance(m, FewRowLinear) for m in draft.modules())
    plain = mmspec.pipeline("text-to-speech", model=model_dir, method="spec", optimize=False)
    assert plain("a red star.", max_seconds=0.3).stats.config["linears"] == "as loaded"
    assert not any(isinstance(m, FewRowLinear) for m in plain.components.target.model.modules())


def test_the_default_temperature_is_the_models(model_dir):
    """tts.json's "temperature" is the pipeline's default (recorded in the stats); an explicit one wins."""
    import shutil

    cold = model_dir.parent / "tts-cold"
    if not cold.exists():
        shutil.copytree(model_dir, cold)
        manifest = json.loads((cold / "tts.json").read_text())
        (cold / "tts.json").write_text(json.dumps({**manifest, "temperature": 0.5}))
    said = dict(seed=1, max_seconds=0.4)
    out = mmspec.pipeline("text-to-speech", model=cold)("a red star.", **said)
    assert out.stats.config["temperature"] == 0.5
    plain = mmspec.pipeline("text-to-speech", model=model_dir)
    assert torch.equal(out.codes, plain("a red star.", temperature=0.5, **said).codes)
    default = plain("a red star.", **said)
    assert default.stats.config["temperature"] == 1.0 and not torch.equal(out.codes, default.codes)


@pytest.mark.parametrize("value", [0, -1, "hot", True])
def test_a_bad_default_temperature_is_refused_before_loading(model_dir, value):
    import shutil

    bad = model_dir.parent / f"tts-bad-{value}"
    shutil.copytree(model_dir, bad, dirs_exist_ok=True)
    manifest = json.loads((bad / "tts.json").read_text())
    (bad / "tts.json").write_text(json.dumps({**manifest, "temperature": value}))
    with pytest.raises(ValueError, match='"temperature" must be a positive number'):
        mmspec.pipeline("text-to-speech", model=bad)


def test_a_valle_voice_streams_codebook_0_and_its_nar_stage_adds_the_rest(valle_dir):
    tts = mmspec.pipeline("text-to-speech", model=valle_dir, method="spec")
    c = tts.components
    assert c.target.num_codebooks == 1 and c.nar is not None
    out = tts("a red star.", max_seconds=0.4, seed=3, compare_baseline=True)
    assert out.codes.shape == (K, out.stats.frames) and out.baseline_codes.shape[0] == K
    inputs = c.model_inputs("a red star.")
    assert torch.equal(out.codes, c.nar.complete(out.codes[0], inputs["phoneme_ids"][0], inputs["durations"][0]))
    s = out.stats  # the NAR stage's time is part of the wall time, the stream's alone in generation
    assert 0 < s.nar_time_s < s.wall_time_s and s.wall_time_s == pytest.approx(s.generation["wall_time_s"] + s.nar_time_s)
    assert s.speedup == pytest.approx(s.baseline_wall_time_s / s.wall_time_s)


def test_a_nar_stage_needs_an_aligned_codebook_0_lm(model_dir, valle_dir, tmp_path):
    import shutil

    voice = tmp_path / "voice"
    shutil.copytree(model_dir.parent, voice)  # a delay-pattern voice over every codebook ...
    shutil.copytree(valle_dir.parent / "tts-nar", voice / "tts-nar")
    manifest = json.loads((voice / "tts" / "tts.json").read_text())
    (voice / "tts" / "tts.json").write_text(json.dumps({**manifest, "nar": "../tts-nar"}))  # ... naming a NAR stage
    with pytest.raises(ValueError, match="not an aligned LM over codebook 0"):
        mmspec.pipeline("text-to-speech", model=voice / "tts")


def test_bench_gives_a_valle_voices_stream_speedup_beside_the_whole(valle_dir, tmp_path, capsys):
    results = tmp_path / "tts.json"
    code = main(["bench", "tts", "--model", str(valle_dir), "--methods", "ar,spec", "--sentences", "1", "--rounds", "1",
                 "--no-quality", "--max-seconds", "0.4", "--greedy", "--results", str(results)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    data = json.loads(results.read_text())
    runs, summary = data["runs"], data["summary"]
    ar, spec = runs["ar|0|0"], runs["spec|0|0"]
    assert ar["nar_time"] > 0 and len(ar["codes"]) == K
    assert summary["spec"]["stream_speedup"] == pytest.approx((ar["time"] - ar["nar_time"]) / (spec["time"] - spec["nar_time"]))
    assert summary["ar"]["stream_speedup"] == pytest.approx(1.0) and "(stream " in stdout


def test_method_specs_carry_their_settings():
    from mmspec.pipelines.text_to_speech.methods import make_method

    assert make_method("vadusa:top_k=5").rule_settings == {"top_k": 5}
    assert make_method("lantern:delta=0.25").rule_settings["delta"] == 0.25
    assert make_method("medusa:num_draft_tokens=2").num_draft_tokens == 2
    for bad, match in (("vadusa:top_k", "settings are key=number"), ("vadusa:top_k=many", "settings are key=number"),
                       ("vadusa:delta=0.1", "takes no setting 'delta'"), ("lantern:delta=2.0", "delta must be")):
        with pytest.raises(ValueError, match=match):
            make_method(bad)


def test_eagle_drafts_six_codes_in_one_call_on_a_single_stream(model_dir, valle_dir):
    """On a single-stream voice EAGLE's chain is 6 codes (5 or 3 on a CPU without AMX tiles), drafted by
    the fused C chain where the kernels run (the stats say so); with several codebooks, 3 whole
    steps through the loop."""
    from mmspec.modeling.fast_linear import KernelUnavailable, load_kernel
    from mmspec.modeling.fused import fused_enabled

    try:
        fused = load_kernel() is not None and fused_enabled()
    except KernelUnavailable:
        fused = False
    for directory, length in ((valle_dir, 6), (model_dir, K - 1 + 3 * K)):  # (the rest of a step, then 3 whole steps)
        tts = mmspec.pipeline("text-to-speech", model=directory, method="eagle")
        if directory == valle_dir and not tts.components.wide_verification:
            length = {"medium": 5, "narrow": 3}[tts.components.verification_width]  # EagleMethod's
        out = tts("a red star.", max_seconds=0.4, seed=1)
        config = out.stats.config
        assert config["num_draft_tokens"] == length and config.get("fused_chain", False) == (fused and directory == valle_dir)


@pytest.mark.parametrize("device, linears, dtype, fma, width, sjd, sjd_topk, coupled", [
    ("cpu", "c (fp32 avx512 packed, bf16 amx packed)", torch.bfloat16, True, "wide", 12, 24, 24),
    ("cpu", "c (fp32 avx512 packed, bf16 avx512bf16 packed)", torch.bfloat16, False, "narrow", 5, 10, 5),
    ("cpu", "c (fp32 avx512 packed, bf16 avx512bf16 packed)", torch.bfloat16, True, "medium", 8, 16, 8),
    ("cpu", "c (fp32 avx512 packed, bf16 avx512bf16)", torch.bfloat16, True, "narrow", 5, 10, 5),  # (not packed: vdpbf16ps)
    ("cpu", "c (fp32 avx512 packed)", torch.float32, False, "medium", 8, 16, 8),  # (an AMX CPU's float32 too)
    ("cpu", "c (fp32 avx2)", torch.float32, True, "narrow", 5, 10, 5), ("cpu", "as loaded", torch.float32, True, "narrow", 5, 10, 5),
    ("cuda", "as loaded", torch.bfloat16, False, "wide", 12, 24, 24)])
def test_windowed_methods_draft_fewer_codes_where_a_wide_verification_is_dear(monkeypatch, device, linears, dtype, fma,
                                                                              width, sjd, sjd_topk, coupled):
    """Each method's window by the codec LM's kernel: wide on AMX tiles and GPUs, medium for float32 on
    the 16-lane AVX-512 kernel and for bf16 on the packed AVX512-BF16 kernel where it sums through FMAs
    (Intel cores), narrow elsewhere: a bf16 LM on a CPU whose float32 parts run the AVX-512 kernel
    and whose bf16 kernel sums through vdpbf16ps (AMD) is narrow."""
    from mmspec.modeling import fast_linear
    from mmspec.pipelines.text_to_speech.components import TTSComponents
    from mmspec.pipelines.text_to_speech.methods import make_method

    monkeypatch.setattr(fast_linear, "bf16_fma_sums", lambda: fma)
    components = SimpleNamespace(device=torch.device(device), linears=linears, dtype=dtype, target=SimpleNamespace(num_codebooks=1))
    components.verification_width = TTSComponents.verification_width.fget(components)
    assert components.verification_width == width
    assert make_method("sjd").draft_length(components) == sjd
    assert make_method("sjd-coupled").draft_length(components) == coupled
    assert make_method("sjd-topk").draft_length(components) == sjd_topk
    assert make_method("eagle").draft_length(components) == {"wide": 6, "medium": 5, "narrow": 3}[width]
    assert make_method("eagle-topk").draft_length(components) == (8 if sjd == 12 else 6)
    assert make_method("sjd:num_draft_tokens=7").draft_length(components) == 7  # an explicit length always wins
    components.target.num_codebooks = 8
    assert make_method("sjd").draft_length(components) == 16  # several codebooks: whole steps, as before


def test_sjd_drafts_a_window_of_codes_on_a_single_stream(model_dir, valle_dir):
    for directory, window in ((model_dir, 2 * K), (valle_dir, 12)):  # 2 steps; 12 codes (docs/benchmarks.md)
        tts = mmspec.pipeline("text-to-speech", model=directory, method="sjd")
        out = tts("a red star.", max_seconds=0.4, seed=2)
        if directory == valle_dir and not tts.components.wide_verification:  # a CPU without AMX tiles: a narrower
            window = {"medium": 8, "narrow": 5}[tts.components.verification_width]  # window (JacobiMethod)
        assert tts.method.draft_length(tts.components) == window
        assert out.stats.config["num_draft_tokens"] == window and out.stats.frames > 0  # what the drafter ran
    tts = mmspec.pipeline("text-to-speech", model=valle_dir, method="sjd", num_draft_tokens=3)
    assert tts.method.draft_length(tts.components) == 3
    coupled = mmspec.pipeline("text-to-speech", model=valle_dir, method="sjd-coupled")  # its window by the LM's kernel
    expected = {"wide": 24, "medium": 8, "narrow": 5}[coupled.components.verification_width]
    assert coupled("a red star.", max_seconds=0.4, seed=2).stats.config["num_draft_tokens"] == expected


def test_seed_none_is_a_fresh_random_seed_as_in_every_pipeline(model_dir):
    """The stop-74 audit: text-to-speech refused ``seed=None``, which captioning and text-to-image
    take; the default stays seed 0 (the same output call after call)."""
    tts = mmspec.pipeline("text-to-speech", model=model_dir, method="spec")
    outs = [tts("two blue hearts.", seed=None, max_seconds=0.4) for _ in range(3)]
    assert all(o.audio.shape[0] == 1 for o in outs) and len({o.codes.flatten().tolist().__repr__() for o in outs}) > 1
    assert torch.equal(tts("two blue hearts.", max_seconds=0.4).codes, tts("two blue hearts.", seed=0, max_seconds=0.4).codes)
    assert len(list(tts.stream("two blue hearts.", seed=None, max_seconds=0.4))) == 1


@pytest.mark.parametrize("manifest,match", [
    ('{codec: oops', "tts.json is not valid JSON (Expecting property name"),
    ("[]", "must hold a JSON object of the voice's parts"),
    ('{"codec": "codec"}', "names no phonemizer; add \"phonemizer\": one of characters"),
    ('{"codec": "codec", "phonemizer": "espeak-xx"}', "names phonemizer 'espeak-xx', which mmspec does not have"),
])
def test_a_bad_manifest_is_one_line_before_the_weights_load(manifest, match, model_dir, tmp_path):
    """A tts.json that is not JSON, not an object, or names no phonemizer or an unknown one was a
    traceback (or, for an unknown phonemizer, a pipeline whose every call failed)."""
    import shutil

    bad = tmp_path / "voice"
    shutil.copytree(model_dir, bad)
    (bad / "tts.json").write_text(manifest)
    with pytest.raises(ValueError, match=re.escape(match)):
        mmspec.pipeline("text-to-speech", model=str(bad))
