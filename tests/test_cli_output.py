"""The commands' output files (mmspec.cli.output) and their exit codes (issue 44): a file that cannot
be opened or written is one line naming it, exit 2, with no partial file left; Ctrl-C is one line
saying what was saved and how to resume, exit 130."""

import json
import shlex
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import mmspec
from mmspec.adapters.audio.codec import write_wav
from mmspec.cli import build_parser, interrupted_note, main
from mmspec.cli.output import OutputError, OutputFiles


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name)


def test_files_are_written_together_or_not_at_all(tmp_path):
    (tmp_path / "a.txt").write_text("old")
    with OutputFiles() as out:
        out.write_text(tmp_path / "a.txt", "new")
        out.write_json(tmp_path / "sub" / "b.json", {"x": 1})  # missing folders are made
        assert (tmp_path / "a.txt").read_text() == "old"  # nothing in place before the block ends
    assert (tmp_path / "a.txt").read_text() == "new" and json.loads((tmp_path / "sub" / "b.json").read_text()) == {"x": 1}

    def fails(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match=f"^cannot write {tmp_path / 'c.txt'}: No space left on device$"):
        with OutputFiles() as out:
            out.write_text(tmp_path / "a.txt", "newer")
            out.write(tmp_path / "c.txt", fails)
    assert (tmp_path / "a.txt").read_text() == "new" and not (tmp_path / "c.txt").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_or_a_failed_run_leaves_no_partial_file(tmp_path, error):
    with pytest.raises(error):
        with OutputFiles() as out:
            out.write_text(tmp_path / "x.txt", "done")
            raise error()
    assert not list(tmp_path.iterdir())


def test_the_line_names_the_path_not_the_temporary_file(tmp_path):
    """/proc takes no new files, yet os.access says it is writable to root: soundfile raised a raw
    LibsndfileError; the writer's line names the path asked for."""
    with pytest.raises(OutputError) as caught:
        with OutputFiles() as out:
            out.write("/proc/x.wav", lambda path: write_wav(path, torch.zeros(1, 100), 8000))
    assert str(caught.value).startswith("cannot write /proc/x.wav: ") and ".partial-" not in str(caught.value)
    with pytest.raises(OutputError, match="it is not a regular file"):
        OutputFiles().write("/dev/null", lambda path: None)
    with pytest.raises(OutputError, match="it is a directory"):
        OutputFiles().write(tmp_path, lambda path: None)


class FakeSpeech:
    """A text-to-speech pipeline stand-in: one second of noise, as the real one returns it."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, text, **kwargs):
        audio = torch.randn(1, 24000, generator=torch.Generator().manual_seed(0)) * 0.1
        stats = SimpleNamespace(to_dict=lambda: {"method": "ar"}, speedup=None, seconds=1.0, wall_time_s=0.5,
                                real_time_factor=0.5, tau=1.0)
        return SimpleNamespace(audio=audio, sampling_rate=24000, baseline_audio=None, baseline_codes=None, stats=stats,
                               normalized=text, dropped=(), truncated=False)


def test_tts_writes_its_files_together_or_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mmspec, "pipeline", FakeSpeech)
    assert main(["tts", "Hello there.", "--out", str(tmp_path / "ok.wav")]) == 0
    assert (tmp_path / "ok.wav").stat().st_size > 1000 and (tmp_path / "ok.png").is_file()
    (tmp_path / "x.png").mkdir()  # the spectrogram cannot be written: refused before the voice loads
    assert main(["tts", "Hello there.", "--out", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err
    assert err == f"mmspec: error: --out {tmp_path / 'x.wav'} also writes x.png: {tmp_path / 'x.png'} is a directory; give a file name\n"
    from mmspec.cli import tts as tts_cli

    monkeypatch.setattr(tts_cli, "check_output_path", lambda *args: None)  # ... and were it not checked first,
    assert main(["tts", "Hello there.", "--out", str(tmp_path / "x.wav")]) == 2  # the WAV would not be left either
    err = capsys.readouterr().err
    assert err == f"mmspec: error: cannot write {tmp_path / 'x.png'}: it is a directory; give a file name\n"
    assert not (tmp_path / "x.wav").exists() and not leftovers(tmp_path)


def test_tts_without_its_spectrogram_writes_and_checks_no_png(tmp_path, monkeypatch, capsys):
    """--no-spectrogram: the WAV alone (said so), and a path where the PNG would go is no obstacle."""
    monkeypatch.setattr(mmspec, "pipeline", FakeSpeech)
    (tmp_path / "x.png").mkdir()
    assert main(["tts", "Hello there.", "--out", str(tmp_path / "x.wav"), "--no-spectrogram"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'x.wav'}"
    assert (tmp_path / "x.wav").stat().st_size > 1000 and not any((tmp_path / "x.png").iterdir())


def test_a_write_that_fails_after_the_check_is_one_line(tmp_path, monkeypatch, capsys):
    """As root, a check can pass where the write fails: the writer still gives one line, exit 2."""
    import mmspec.cli.args

    monkeypatch.setattr(mmspec, "pipeline", FakeSpeech)
    import mmspec.cli.tts

    monkeypatch.setattr(mmspec.cli.args, "check_output_path", lambda *args: None)
    monkeypatch.setattr(mmspec.cli.tts, "check_output_path", lambda *args: None)
    assert main(["tts", "Hello there.", "--out", "/proc/x.wav"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmspec: error: cannot write /proc/x.wav: ") and err.count("\n") == 1 and "Traceback" not in err


def test_ctrl_c_says_what_was_saved_and_how_to_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C printed a KeyboardInterrupt traceback; now one line and exit 130."""
    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), 50 * i, dtype=np.uint8)).save(images / f"{i}.png")

    class Captioner:  # captions two images, then the user presses Ctrl-C
        chosen_drafter, drafter_reason, dtype, device, optimization = "ar", "given", torch.float32, "cpu", None

        def __init__(self, **kwargs):
            self.calls = 0

        def drafter_for(self, do_sample, batch_size=1):
            return None, self.chosen_drafter, self.drafter_reason

        def check_batch(self, batch_size, do_sample=False):  # (any batch size goes)
            pass

        def __call__(self, path, **options):
            self.calls += 1
            if self.calls > 2:
                raise KeyboardInterrupt
            stats = SimpleNamespace(new_tokens=3, wall_time_s=0.1, speedup=None)
            return SimpleNamespace(stats=stats, to_dict=lambda: {"text": "a square", "stats": {}})

    import mmspec.cli.caption

    monkeypatch.setattr(mmspec.cli.caption, "ImageCaptioningPipeline", Captioner)
    out = tmp_path / "captions.jsonl"
    argv = ["caption", str(images), "--out", str(out)]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"mmspec: interrupted; 2 finished rows are saved in {out}; rerun the same command to resume: "
                       f"mmspec {shlex.join(argv)}")
    assert "Traceback" not in "\n".join(err) and len(out.read_text().splitlines()) == 2

    import mmspec.cli.generate

    def pressed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mmspec.cli.generate, "load_causal_lm", pressed)
    assert main(["generate", "hi"]) == 130
    assert capsys.readouterr().err == "mmspec: interrupted; nothing was saved\n"


@pytest.mark.parametrize("argv,note", [
    (["tts", "Hi."], "nothing was saved (the files are written once the audio is done)"),
    (["generate", "hi"], "nothing was saved"),
    (["t2i", "a red circle"], "nothing was saved (the images are written once they are all drawn)"),
    (["t2i", "--prompts", "p.txt", "--out", "OUT"],
     "no row was finished, nothing was saved; rerun the same command to start again: mmspec t2i --prompts p.txt --out OUT"),
    (["bench", "tts", "--results", "r.json"],
     "the measurements finished so far are saved in r.json; rerun the same command to resume: mmspec bench tts --results r.json"),
    (["train", "tts", "--out", "OUT", "--save-every", "50"],
     "the last checkpoint (one every 50 steps) and the data made so far are kept in OUT; rerun the same command to "
     "resume: mmspec train tts --out OUT --save-every 50"),
])
def test_every_command_says_what_ctrl_c_leaves(argv, note, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert interrupted_note(build_parser().parse_args(argv), argv) == note


def test_an_interrupted_drafter_run_says_resume_only_with_a_checkpoint(tmp_path, monkeypatch):
    """The stop-74 audit: Ctrl-C before the first checkpoint printed a ``--resume`` command that
    was then refused ("holds no checkpoint")."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "drafter", "--target", "my-model", "--data", "d.jsonl", "--out", "OUT", "--save-every", "25"]
    args = build_parser().parse_args(argv)
    command = "mmspec " + shlex.join(argv)
    assert interrupted_note(args, argv) == ("no checkpoint was saved yet (one every 25 steps); the data made so far are "
                                            f"kept in OUT; rerun the same command to start again from them: {command}")
    assert interrupted_note(args, [*argv, "--resume"]).endswith(f"start again from them: {command}")
    (tmp_path / "OUT").mkdir()
    (tmp_path / "OUT" / "train_state.pt").write_bytes(b"")
    assert interrupted_note(args, argv) == ("the last checkpoint (one every 25 steps) and the data made so far are kept in "
                                            f"OUT; rerun the same command to resume: {command} --resume")


def test_t2i_prompt_rows_follow_the_same_exit_rule(tmp_path, monkeypatch, capsys):
    """mmspec t2i --prompts: a prompt the pipeline refuses is an error row, the others are drawn,
    exit 2 with the summary line; --retry-errors redoes only that row."""
    refused = {"a blue star"}
    drawn = []

    def pipeline(*args, **kwargs):
        def call(prompts, **options):
            if refused & set(prompts):
                raise ValueError("the pipeline refuses this prompt")
            drawn.extend(prompts)
            stats = SimpleNamespace(tokens=16, wall_time_s=0.1, speedup=None, to_dict=lambda: {"tokens": 16})
            return [SimpleNamespace(images=[Image.new("RGB", (8, 8), "red")], stats=stats) for _ in prompts]
        return call

    monkeypatch.setattr(mmspec, "pipeline", pipeline)
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("a red circle\na blue star\na green square\n")
    argv = ["t2i", "--prompts", str(prompts), "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "mmspec: error: prompt 2: the pipeline refuses this prompt" in err
    assert err.splitlines()[-1] == (f"mmspec: 1 of 3 rows failed; see their error field in {out / 'results.jsonl'}; "
                                    "rerun with --retry-errors to redo only them")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert ["error" in r for r in rows] == [False, True, False] and (out / "000002-0.png").is_file()
    refused.clear()
    drawn.clear()
    assert main(argv) == 2 and drawn == []  # a resume keeps the failed row
    assert main([*argv, "--retry-errors"]) == 0 and drawn == ["a blue star"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["000000", "000001", "000002"] and not any("error" in r for r in rows)
    assert not leftovers(out)


def test_a_checkpoint_of_another_run_is_one_line(tmp_path, monkeypatch):
    """Resuming into another recipe's --out, or with other sizes, named the folder in one line
    instead of PyTorch's KeyError or state-dict traceback."""
    import argparse

    import torch

    from mmspec.train.checkpoint import TrainingRun

    first, first_head = TrainingRun(tmp_path, argparse.Namespace(steps=1)), torch.nn.Linear(4, 4)
    first.step = 1
    first.save(head=first_head.state_dict())
    for stateful, why in (({"head": torch.nn.Linear(4, 8)}, "size mismatch"), ({"heads": torch.nn.Linear(4, 4)}, "no 'heads' saved")):
        with pytest.raises(ValueError, match=f"is a checkpoint of another run .*{why}.*choose another --out") as error:
            TrainingRun(tmp_path, argparse.Namespace(steps=1)).resume_into(**stateful)
        assert "\n" not in str(error.value)
    checked = TrainingRun(tmp_path, argparse.Namespace(steps=1))
    checked.check_saved("head")  # before a recipe prepares its data
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    head = torch.nn.Linear(4, 4)
    checked.resume_into(head=head)  # the checkpoint check_saved read, not read again
    assert loads == [] and checked.step == 1 and torch.equal(head.weight, first_head.weight)
    with pytest.raises(ValueError, match="is a checkpoint of another run .*no 'optimizer' saved.*choose another --out"):
        TrainingRun(tmp_path, argparse.Namespace(steps=1)).check_saved("head", "optimizer")


def test_image_drafter_refuses_another_recipes_out_before_writing_data(tmp_path, capsys):
    """train image-drafter into a folder holding another recipe's checkpoint: one line, no shards written."""
    import argparse

    import torch

    from mmspec.cli import main
    from mmspec.train.checkpoint import TrainingRun

    TrainingRun(tmp_path, argparse.Namespace(steps=1)).save(heads=torch.nn.Linear(4, 4).state_dict())
    assert main(["train", "image-drafter", "--out", str(tmp_path), "--sequences", "8", "--steps", "1"]) == 2
    assert "is a checkpoint of another run" in capsys.readouterr().err and not (tmp_path / "data").exists()


def test_a_t2i_bench_resume_names_the_setting_that_differs(tmp_path, capsys):
    """``mmspec bench t2i --window 16`` over a file measured at the methods' own windows says so."""
    results = tmp_path / "t2i.json"
    argv = ["bench", "t2i", "--methods", "ar", "--prompts", "1", "--rounds", "1", "--threads", "1", "--results", str(results)]
    assert main(argv) == 2  # (a Frechet distance over one image: refused before the model loads)
    assert "--prompts 1: the Frechet CLIP distance compares sets of at least 2 images" in capsys.readouterr().err
    argv.append("--no-quality")
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--window", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds results of other settings (window None there, 16 now)" in err


def test_a_second_process_writing_the_same_output_is_refused(tmp_path):
    """The stop-78 audit: two runs appending to one results file lost 6 of 8 rows; two trainings into
    one folder crashed on each other's checkpoint. Another process holding the lock: one line."""
    import subprocess
    import sys

    from mmspec.cli.output import hold_lock

    lock = tmp_path / ".out.jsonl.lock-0"
    holder = subprocess.Popen([sys.executable, "-c", f"from mmspec.cli.output import hold_lock; import time; "
                               f"hold_lock({str(lock)!r}, 'x'); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"another mmspec run \(pid {holder.pid}\) is writing {tmp_path}/out.jsonl; wait"):
            hold_lock(lock, str(tmp_path / "out.jsonl"))
    finally:
        holder.kill()
        holder.wait()
    hold_lock(lock, "x")  # (released with its process; this one may take it, and again)
    hold_lock(lock, "x")


@pytest.mark.parametrize("argv, missing, said", [
    (["bench", "tts", "--sentences", "1", "--rounds", "1", "--methods", "ar"], "jiwer",
     "the speech metrics (--no-quality skips them) needs 'jiwer', which is not installed: pip install 'mmspec[speech]'"),
    (["bench", "t2i", "--prompts", "2", "--rounds", "1", "--methods", "ar"], "open_clip",
     "the Frechet CLIP distance (--no-quality skips it) needs 'open_clip', which is not installed"),
])
def test_a_benchmarks_missing_metric_package_is_one_line_before_any_decoding(argv, missing, said, monkeypatch, capsys):
    """The stop-78 audit: the metrics' packages were found missing after all of the decoding (a
    traceback for bench t2i)."""
    import importlib.util
    import time

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    started = time.perf_counter()
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().startswith(f"mmspec: error: {said}")
    assert time.perf_counter() - started < 5  # (before the model loads)


def test_counts_in_messages_agree_with_their_number():
    """The one helper every printed count goes through (``1 rows``, ``1 image(s)``, ``over 1
    prompts`` were printed before it)."""
    from mmspec.core.words import count

    assert [count(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]
    assert count(1, "entry", "entries") == "1 entry" and count(3, "entry", "entries") == "3 entries"
