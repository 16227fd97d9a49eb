"""Files a command reads back or writes beside its output are never damaged by it: a file given
as --out that is not a results file is refused as it was (not cut first), an earlier run's rows
stay, a run that failed before its first row blocks no rerun, a training run does not replace a
finished model, the voice does not replace a picture that shares the WAV's name, and a write
that fails mid-way is one line (no traceback)."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from mmspec.cli import build_parser, interrupted_note, main
from mmspec.cli.dataset import ProcessState, ShardedResults, read_records

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("content, message", [
    ((ROOT / "samples" / "photo.png").read_bytes(), "not UTF-8 text"),
    (b"my notes line 1\nimportant line 2 no newline", "line 1 is not JSON"),
    (b'{"config": {"a": 1}, "important": true}', "line 1 has no 'path' field"),
    (b'{"path": ["a"], "text": "x"}\n', "line 1 has no 'path' field naming its input"),
])
def test_a_file_that_is_not_a_results_file_is_refused_as_it_was(tmp_path, content, message):
    path = tmp_path / "out.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_records(path, "path")
    assert path.read_bytes() == content


def test_a_line_cut_short_is_dropped_and_a_last_line_without_newline_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"path": "a", "text": "x"}\n{"path": "b", "te')  # a kill mid-line
    assert list(read_records(path, "path")) == ["a"] and path.read_bytes() == b'{"path": "a", "text": "x"}\n'
    path.write_bytes(b'{"path": "a", "text": "x"}\n{"path": "b", "text": "y"}')  # complete, its newline missing
    assert list(read_records(path, "path")) == ["a", "b"] and path.read_bytes().endswith(b'"y"}\n')


def test_an_earlier_runs_rows_for_other_inputs_stay(tmp_path):
    out = tmp_path / "acc.jsonl"
    first = ShardedResults(out, ["text.png"], "path", ProcessState())
    first.write({"path": "text.png", "text": "a sign"})
    first.finish()
    second = ShardedResults(out, ["photo.png"], "path", ProcessState())
    second.write({"path": "photo.png", "text": "a photo"})
    assert [r["path"] for r in second.finish()] == ["photo.png"]  # this run's rows
    assert [json.loads(line)["path"] for line in out.read_text().splitlines()] == ["photo.png", "text.png"]


def test_settings_left_by_a_run_that_wrote_no_row_block_no_rerun(tmp_path):
    out = tmp_path / "s.jsonl"
    ShardedResults(out, ["a.png"], "path", ProcessState(), settings={"model": "/nomodel"})  # then it failed to load
    assert not out.exists()
    ShardedResults(out, ["a.png"], "path", ProcessState(), settings={"model": None})  # the corrected rerun
    held = ShardedResults(out, ["a.png"], "path", ProcessState(), settings={"model": None})
    held.write({"path": "a.png", "text": "x"})
    held.finish()
    with pytest.raises(ValueError, match="holds rows made with other settings"):  # with rows it still guards them
        ShardedResults(out, ["a.png"], "path", ProcessState(), settings={"model": "other"})


def test_a_quoted_tilde_in_an_output_path_is_the_home_folder(tmp_path, monkeypatch):
    from mmspec.cli.args import check_args
    from mmspec.hub import cache_dir

    monkeypatch.setenv("MMSPEC_CACHE", str(cache_dir()))  # (the kernels built already, not again under the new HOME)
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["tts", "Hi.", "--out=~/x.wav"])
    check_args(args)
    assert args.out == str(tmp_path / "x.wav")


def test_a_prompts_files_byte_order_mark_is_not_part_of_its_first_prompt(tmp_path):
    from mmspec.cli.t2i import read_prompts

    (tmp_path / "p.txt").write_bytes(b"\xef\xbb\xbfa red circle\nbig green triangle\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["a red circle", "big green triangle"]


def test_training_does_not_replace_a_finished_model_without_overwrite(tmp_path):
    from mmspec.train.checkpoint import TrainingRun

    (tmp_path / "vq.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match=r"holds a trained model \(vq.safetensors\) and no checkpoint to resume; choose "
                                         "another --out, or pass --overwrite"):
        TrainingRun(tmp_path, argparse.Namespace(overwrite=False))
    TrainingRun(tmp_path, argparse.Namespace(overwrite=True))
    assert (tmp_path / "vq.safetensors").read_bytes() == b"weights"  # (replaced only when the run saves)


def test_every_training_recipe_takes_overwrite_and_the_shipped_models_are_refused(capsys):
    from mmspec.train.cli import TRAINING_RUNS

    def commands(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    recipes = commands(commands(build_parser())["train"])
    assert all("--overwrite" in recipes[name]._option_string_actions for name in TRAINING_RUNS)
    assert main(["train", "vq", "--steps", "1", "--images", "4", "--batch-size", "2"]) == 2  # models/t2i-vq
    assert "holds a trained model (vq.safetensors)" in capsys.readouterr().err


@pytest.mark.parametrize("recipe, weights, costly", [
    ("t2i", "model.safetensors", ("scene_pool", "SmolTextEncoder")), ("mar", "mar.safetensors", ("scene_pool", "SmolTextEncoder")),
    ("clip", "model.safetensors", ("scene_pool",)), ("caption-draft", "model.safetensors", ("build_processor",)),
    ("captioner", "vision_connector.safetensors", ("build_captioner",)),
])
def test_a_finished_model_or_another_runs_checkpoint_is_refused_before_the_costly_preparation(recipe, weights, costly,
                                                                                             tmp_path, monkeypatch, capsys):
    """The h5 audit: train t2i / mar / clip loaded the text encoder and rendered (and encoded) all
    --images scenes, minutes on a cold cache, train caption-draft tokenised its --samples pairs and
    train captioner built the captioner, before refusing an --out that holds a finished model (their default, the shipped one) or
    another recipe's checkpoint (clip: a KeyError traceback)."""
    import importlib

    module = importlib.import_module(f"mmspec.train.{recipe.replace('-', '_')}")

    def too_late(*args, **kwargs):
        raise AssertionError("the data are prepared (or the text encoder loads) before --out is checked")

    for name in costly:
        monkeypatch.setattr(module, name, too_late)
    out = tmp_path / "finished"
    out.mkdir()
    (out / weights).write_bytes(b"weights")
    assert main(["train", recipe, "--steps", "1", "--out", str(out)]) == 2
    assert f"holds a trained model ({weights}) and no checkpoint to resume" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"head": {}, "step": 1, "log": [], "elapsed": 0.0}, other / "train_state.pt")
    assert main(["train", recipe, "--steps", "1", "--out", str(other)]) == 2
    entry = "master" if recipe == "captioner" else "model"
    assert f"train_state.pt is a checkpoint of another run (no '{entry}' saved)" in capsys.readouterr().err


def test_the_voice_does_not_replace_a_picture_sharing_the_wavs_name(tmp_path, capsys):
    from mmspec.cli.tts import replaceable_png, spectrogram_png

    photo = tmp_path / "holiday.png"
    photo.write_bytes((ROOT / "samples" / "photo.png").read_bytes())
    assert main(["tts", "Hi there.", "--out", str(tmp_path / "holiday.wav")]) == 2  # before the voice loads
    assert "holiday.png, which exists and is not one mmspec wrote; move that file" in capsys.readouterr().err
    assert photo.read_bytes() == (ROOT / "samples" / "photo.png").read_bytes()
    ours = tmp_path / "say.png"
    ours.write_bytes(spectrogram_png([("hi", torch.zeros(1, 4096))], 22050))
    assert replaceable_png(ours) and replaceable_png(tmp_path / "none.png") and not replaceable_png(photo)


def test_a_stream_whose_write_fails_is_one_line(tmp_path, capsys):
    out = tmp_path / "s.wav"
    (tmp_path / "s.wav.part").symlink_to("/dev/full")  # (its writes fail as a full disk's: ENOSPC)
    assert main(["tts", "Hi there. Bye now.", "--stream", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"mmspec: error: cannot write {out}: No space left on device\n"
    assert not list(tmp_path.iterdir())


def test_an_export_whose_write_fails_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    from mmspec.modeling.eagle3 import Eagle3Head

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Eagle3Head, "export", full_disk)
    assert main(["export", "drafter", str(ROOT / "models" / "smolcap-eagle3"), "--format", "vllm-eagle3",
                 "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == f"mmspec: error: cannot write {tmp_path / 'x'}: No space left on device\n"


def test_a_bench_results_file_of_something_else_is_left_as_it_was(tmp_path):
    from mmspec.bench.results import load_results

    foreign = tmp_path / "settings.json"
    foreign.write_text('{"my_settings": {"a": 1}, "notes": "keep me"}')
    with pytest.raises(ValueError, match="is not a results file of mmspec bench"):
        load_results(foreign, "t2i", {})
    assert json.loads(foreign.read_text()) == {"my_settings": {"a": 1}, "notes": "keep me"}


def test_run_says_what_an_interrupt_left(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["run", "t2i-sjd", "a red circle"]
    args = build_parser().parse_args(argv)
    assert interrupted_note(args, argv) == "no input was finished; nothing was saved"  # (while the preset loaded)
    args.task, args.out = "text-to-image", "run-out"
    (tmp_path / "run-out").mkdir()
    (tmp_path / "run-out" / "000-0.png").write_bytes(b"png")
    assert interrupted_note(args, argv).startswith("the files of the inputs finished so far are in run-out (1 file, none partial)")
    args.task = "image-captioning"
    assert interrupted_note(args, argv) == "nothing was saved (captions are printed as each input finishes)"
