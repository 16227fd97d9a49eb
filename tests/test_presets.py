"""Presets (pipelines/*.toml): every shipped one is checked up to its weights; from_preset and
mmspec run build and run them; bad presets give one line that says what to change."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_checkpoints import cached_tiny_checkpoint

import mmspec
from mmspec.cli import main
from mmspec.pipelines.presets import load_preset, preset_names

SHIPPED = preset_names()


def test_the_shipped_presets_cover_every_task():
    assert {load_preset(name).task for name in SHIPPED} == {"image-captioning", "text-to-image", "text-to-speech"}
    assert {"caption-embedded", "caption-llava", "caption-smolvlm", "caption-pixtral", "t2i-sjd", "t2i-lantern",
            "tts-embedded"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_preset_passes_its_checks(name):
    preset = load_preset(name)
    assert preset.description and preset.name == name
    preset.check()  # names against the pipeline's signatures, drafter / method and settings, dtype, device


@pytest.fixture
def write(tmp_path):
    def write(text, name="p"):
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        return path
    return write


@pytest.mark.parametrize("text,match", [
    ('task = "image-captioning"\ncolour = 1', r"unknown key\(s\) \['colour'\]"),
    ('task = "image-to-video"', "task must be one of"),
    ('description = "x"', r'no task key; add task = "\.\.\." \(one of image-captioning'),
    ('task = "text-to-image"\n[init]\nseed = 3', r"seed belongs under \[call\] \(an argument of each call\), not \[init\]"),
    ('task = "text-to-speech"\n[call]\nmethod = "sjd"\ndevice = "cpu"', r"device belongs under \[init\]"),
    ('task = "image-captioning"\n[init]\ndraftr = "auto"', r"unknown \[init\] key\(s\) \['draftr'\]"),
    ('task = "image-captioning"\n[call]\nmax_tokens = 3', r"unknown \[call\] key\(s\) \['max_tokens'\]"),
    ('task = "image-captioning"\n[init]\ndrafter = "eagel"', "unknown drafter 'eagel'"),
    ('task = "image-captioning"\n[init]\ndtype = "fp8"', "unknown dtype 'fp8'"),
    ('task = "text-to-image"\n[init]\nmethod = "sjd"\nwindow = 0', "window"),
    ('task = "text-to-speech"\n[init]\nmethod = "fast"', "unknown method 'fast'"),
    ('task = "image-captioning"\n[init', "not valid TOML"),
    # issue 44: [call] values are checked like [init] values, naming the file, the key and the type
    ('task = "text-to-speech"\n[call]\ntemperature = "hot"',
     r"preset p \(.*p\.toml\): \[call\] temperature must be a number or None, got 'hot' \(str\)"),
    ('task = "text-to-image"\n[call]\nseed = "x"', r"\[call\] seed must be an integer or None, got 'x'"),
    ('task = "image-captioning"\n[call]\ndo_sample = "yes"', r"\[call\] do_sample must be True or False"),
    ('task = "text-to-speech"\n[init]\noptimize = 1', r"preset p \(.*p\.toml\): \[init\] optimize must be True or False"),
    # ranges too, before any weights load
    ('task = "image-captioning"\n[call]\nmax_new_tokens = 0', r"preset p \(.*p\.toml\): \[call\] max_new_tokens must be >= 1"),
    ('task = "text-to-speech"\n[call]\nmax_seconds = -1.0', r"\[call\] max_seconds must be a positive number"),
    ('task = "text-to-speech"\n[call]\nspeed = 9.0', r"\[call\] speed must be at most"),
    ('task = "text-to-speech"\n[call]\nmethod = "fast"', r"\[call\] unknown method 'fast'"),
    ('task = "text-to-image"\n[call]\nguidance_scale = 0.5', r"\[call\] guidance_scale must be a number from 1 to 1000"),
    ('task = "text-to-image"\n[call]\ntemperature = 0.0', r"\[call\] temperature must be > 0"),
    ('task = "image-captioning"\n[call]\ndo_sample = true\ntop_p = 1.5', r"\[call\] top_p must be in"),
    ('task = "image-captioning"\n[call]\nseed = -3', r"\[call\] seed must be between 0 and 2\*\*63 - 1"),
])
def test_bad_presets_say_what_to_change(write, text, match):
    with pytest.raises(ValueError, match=match) as error:
        load_preset(write(text)).check()
    assert "\n" not in str(error.value) and str(error.value).startswith("preset ")


def test_an_unknown_name_lists_the_presets():
    with pytest.raises(FileNotFoundError, match="no preset 'nope'; use one of caption-embedded"):
        load_preset("nope")


def test_from_preset_applies_call_defaults_that_a_call_overrides(write, tmp_path_factory):
    model = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    path = write(f'task = "image-captioning"\n[init]\nmodel = "{model}"\ndrafter = "prompt-lookup"\ndtype = "fp32"\n'
                 '[call]\nmax_new_tokens = 3\nprompt = "What is this?"')
    pipe = mmspec.pipeline.from_preset(path)
    image = Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8))
    assert pipe(image).stats.new_tokens == 3 and pipe(image).prompt == "What is this?"
    assert pipe(image, max_new_tokens=5).stats.new_tokens == 5
    assert pipe.chosen_drafter == "prompt-lookup"  # the pipeline's attributes
    assert mmspec.pipeline.from_preset(path, drafter="ar").chosen_drafter == "ar"  # overrides [init]
    # a call's argument as an override: it was merged into [init] and the preset file blamed for it
    with pytest.raises(ValueError, match=r"^max_new_tokens is an argument of each call, not of the pipeline: pipe = "
                                         r"mmspec.pipeline.from_preset\('.*'\), then pipe\(..., max_new_tokens=5\)$"):
        mmspec.pipeline.from_preset(path, max_new_tokens=5)


def test_mmspec_run_every_task(tmp_path, capsys):
    image = tmp_path / "x.png"
    Image.fromarray(np.full((48, 48, 3), 200, dtype=np.uint8)).save(image)
    assert main(["run", "caption-embedded", str(image), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[0]["input"] == str(image) and records[0]["text"] and records[0]["stats"]["new_tokens"] > 0
    out = tmp_path / "out"
    assert main(["run", "t2i-sjd", "a red circle", "--out", str(out), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert Image.open(records[0]["images"][0]).size[0] > 0 and records[0]["stats"]["method"] == "sjd"
    assert main(["run", "tts-embedded", "two blue hearts.", "--out", str(out)]) == 0
    assert (out / "000.wav").stat().st_size > 1000 and "real-time factor" in capsys.readouterr().out


def test_mmspec_run_takes_the_presets_call_seed_unless_given(write, tmp_path, capsys):
    """The preset's [call] seed is the default of ``mmspec run --seed`` (which used to pass 0 always)."""
    preset = write((Path(__file__).resolve().parents[1] / "pipelines" / "t2i-sjd.toml").read_text().replace(
        "[call]", "[call]\nseed = 7"))
    images = {}
    for name, argv in (("preset", [str(preset)]), ("seed 7", ["t2i-sjd", "--seed", "7"]), ("seed 0", ["t2i-sjd"])):
        assert main(["run", *argv, "a red circle", "--out", str(tmp_path / name)]) == 0
        images[name] = (tmp_path / name / "000-0.png").read_bytes()
    capsys.readouterr()
    assert images["preset"] == images["seed 7"] != images["seed 0"]


@pytest.mark.parametrize("args,match", [(["nope", "x"], "no preset 'nope'"),
                                        (["caption-embedded", "missing.png"], "image file not found: missing.png"),
                                        (["caption-embedded", "samples"], "samples is a directory, not an image file"),
                                        (["caption-embedded", "samples/photo.png", "README.md"],
                                         "input 2 of 2: README.md is not an image file"),
                                        (["t2i-sjd", "a red circle", " "], "input 2 of 2: empty prompt"),
                                        (["tts-embedded", "Hello there.", ""], "input 2 of 2: the text is empty"),
                                        (["t2i-sjd", "x", "--device", "tpu"], "device")])
def test_run_errors_are_one_line(args, match, capsys, tmp_path, monkeypatch):
    """Every input is checked before the preset's model loads, so nothing is written for the good
    ones before a bad one stops the run."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    out = [] if args[0].startswith("caption") else ["--out", str(tmp_path / "out")]  # (captioning writes no file)
    assert main(["run", *args, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err
    assert not (tmp_path / "out").exists()
