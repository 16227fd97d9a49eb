"""Captioning at dataset scale: folders and globs, JSONL results streamed and resumed, inputs
sharded over processes (accelerate) and gathered into one file in input order."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_checkpoints import cached_tiny_checkpoint

from mmspec.cli import main
from mmspec.cli.dataset import ShardedResults, expand_images, read_records


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    for i, name in enumerate(["b.png", "a.jpg", "sub/c.png", "sub/d.webp"]):
        Image.fromarray(np.full((24, 24, 3), 40 * i, dtype=np.uint8)).save(root / name)
    (root / "notes.txt").write_text("not an image")
    (root / "sub" / "broken.png").write_text("not an image either")
    return root


def test_inputs_expand_from_files_folders_and_globs(folder):
    assert expand_images([str(folder)]) == [str(folder / n) for n in ("a.jpg", "b.png", "sub/broken.png", "sub/c.png", "sub/d.webp")]
    assert expand_images([str(folder / "sub" / "*.png"), str(folder / "b.png"), str(folder / "sub" / "c.png")]) == [
        str(folder / "sub" / "broken.png"), str(folder / "sub" / "c.png"), str(folder / "b.png")]  # each once, in order
    with pytest.raises(ValueError, match="matches no file"):
        expand_images([str(folder / "*.gif")])
    (folder / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        expand_images([str(folder / "empty")])


def test_a_glob_takes_the_images_of_the_folders_it_matches(folder):
    """``mmspec caption 'photos/*'`` made each subfolder an error row ("photos/sub is a directory,
    not an image file", exit 2, its images never captioned), where the shell's own ``photos/*``
    names the folder and its images are taken: a folder a glob matches is now its images too."""
    quoted = expand_images([str(folder / "*")])
    assert quoted == [str(folder / n) for n in ("a.jpg", "b.png", "notes.txt", "sub/broken.png", "sub/c.png", "sub/d.webp")]
    shell = expand_images(sorted(str(p) for p in folder.iterdir()))  # what an unquoted photos/* passes
    assert quoted == shell
    (folder / "empty").mkdir()
    with pytest.raises(ValueError, match="matches no image"):
        expand_images([str(folder / "emp*")])


def test_an_existing_file_named_with_glob_characters_is_that_file(folder):
    """``mmspec caption "[2024] trip.png"`` was read as a glob (a character class matching "2 trip.png"
    and the like) and refused before the model loaded: "'[2024] trip.png' matches no file"."""
    Image.fromarray(np.zeros((24, 24, 3), dtype=np.uint8)).save(folder / "[2024] trip.png")
    (folder / "2 trip.png").write_bytes((folder / "b.png").read_bytes())
    assert expand_images([str(folder / "[2024] trip.png")]) == [str(folder / "[2024] trip.png")]
    assert expand_images([str(folder / "[12] trip.png")]) == [str(folder / "2 trip.png")]  # (a pattern that names no file)


def test_a_line_cut_short_is_dropped(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"path": "a", "text": "x"}\n{"path": "b", "te')
    assert list(read_records(path, "path")) == ["a"] and path.read_text() == '{"path": "a", "text": "x"}\n'


@pytest.mark.parametrize("text, message", [
    ('{"id": "000001", "prompt": "x"}\n', "line 1 has no 'path' field naming its input: it holds another command's results"),
    ("[1, 2]\n", "line 1 has no 'path' field"),
    ("caption notes\n", "line 1 is not JSON, so the file is not a results file to resume"),
    (b"\x89PNG\r\n\x1a\n\x00\n", r"is not a JSONL results file \(not UTF-8 text\)"),
])
def test_an_output_file_of_something_else_is_one_line(tmp_path, text, message):
    path = tmp_path / "out.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=message) as error:
        read_records(path, "path")
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_resume_with_other_settings_or_changed_inputs_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    first = ShardedResults(out, ["a", "b"], "path", settings={"prompt": "Describe the image.", "seed": 0},
                           input_fields={"a": {"prompt": "x"}})
    first.write({"path": "a", "prompt": "x", "text": "A."})
    first.finish()
    again = ShardedResults(out, ["a", "b"], "path", settings={"prompt": "Describe the image.", "seed": 0})
    assert again.todo == ["b"]  # the same settings resume
    with pytest.raises(ValueError, match=r"holds rows made with other settings \(prompt 'Describe the image.' there, "
                                         r"'How many\?' now\); rerun with those to resume, or choose another output"):
        ShardedResults(out, ["a", "b"], "path", settings={"prompt": "How many?", "seed": 0})
    with pytest.raises(ValueError, match=r"row a was made for prompt 'x', but that input is now 'y'"):
        ShardedResults(out, ["a", "b"], "path", input_fields={"a": {"prompt": "y"}})


def test_an_interrupted_retry_leaves_one_record_per_input_and_says_how_many_failed(tmp_path):
    """Ctrl-C during --retry-errors left a retried input's failed record and its new one (92 lines
    for 81 inputs), and counted failed rows as finished."""
    from mmspec.cli.dataset import interrupted_rows

    out = tmp_path / "out.jsonl"
    rows = [{"path": "a", "text": "A."}, {"path": "b", "error": "x"}, {"path": "c", "error": "x"}, {"path": "z", "text": "Z."}]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    retry = ShardedResults(out, ["a", "b", "c"], "path", retry_errors=True)
    assert retry.todo == ["b", "c"] and retry.retried == 2
    retry.write({"path": "b", "text": "B."})  # ... then interrupted: no finish()
    retry._file.close()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["path"] for r in lines) == ["a", "b", "z"] and {"path": "b", "text": "B."} in lines
    assert interrupted_rows(out, "path", "CMD").startswith(f"3 finished rows are saved in {out}; rerun")
    out.write_text(out.read_text() + json.dumps({"path": "c", "error": "y"}) + "\n")
    said = interrupted_rows(out, "path", "CMD")
    assert "4 finished rows are saved" in said and "(1 of them failed)" in said


class FakeProcess:
    def __init__(self, rank, world):
        self.rank, self.world, self.device = rank, world, None

    def wait(self):
        pass


def test_shards_are_disjoint_resumable_and_merged_in_input_order(tmp_path):
    inputs = [f"img{i}" for i in range(7)]
    out = tmp_path / "out.jsonl"
    ranks = [ShardedResults(out, inputs, "path", FakeProcess(r, 3)) for r in range(3)]
    assert [r.todo for r in ranks] == [["img0", "img3", "img6"], ["img1", "img4"], ["img2", "img5"]]
    for r in ranks[1:]:
        for x in r.todo:
            r.write({"path": x, "text": x.upper()})
        r.finish()  # not rank 0: nothing merged yet
    ranks[0].write({"path": "img0", "text": "IMG0"})  # ... and rank 0 is killed here
    again = ShardedResults(out, inputs, "path", FakeProcess(0, 3))
    assert again.todo == ["img3", "img6"]  # nothing recomputed
    for x in again.todo:
        again.write({"path": x, "text": x.upper()})
    records = again.finish()
    assert [r["path"] for r in records] == inputs and not list(tmp_path.glob("out.jsonl.rank-*"))
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == [x.upper() for x in inputs]


def test_rows_of_inputs_not_given_again_are_kept_and_a_line_without_its_newline_is_mended(tmp_path):
    """The stop-78 test audit: dropping an earlier run's rows for inputs not given this time, or
    not mending a last line written without its newline (the next record joined it), passed."""
    out = tmp_path / "out.jsonl"
    first = ShardedResults(out, ["a", "b"], "path")
    for x in first.todo:
        first.write({"path": x, "text": x.upper()})
    first.finish()
    out.write_text(out.read_text().rstrip("\n"))  # (a complete last line, its newline lost)
    again = ShardedResults(out, ["b", "c"], "path")
    assert again.todo == ["c"]
    again.write({"path": "c", "text": "C"})
    records = again.finish()
    assert [r["path"] for r in records] == ["b", "c"]
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"path": "b", "text": "B"}, {"path": "c", "text": "C"}, {"path": "a", "text": "A"}]  # this run's inputs first, a kept


def test_a_retry_replaces_failed_rows_in_every_part_of_an_interrupted_launch(tmp_path):
    """The stop-78 audit: after an interrupted 2-process run, --retry-errors made the fixed row
    again, then the merge let the old part's failed record win (exit 2, the error kept)."""
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"path": "a", "text": "A."}) + "\n")
    (tmp_path / "out.jsonl.rank-1-of-2").write_text(json.dumps({"path": "b", "error": "not an image"}) + "\n")
    retry = ShardedResults(out, ["a", "b", "c"], "path", retry_errors=True)
    assert retry.todo == ["b", "c"] and retry.retried == 1 and retry.pending == ["b", "c"]
    for x in retry.todo:
        retry.write({"path": x, "text": x.upper() + "."})
    records = retry.finish()
    assert [r.get("text") for r in records] == ["A.", "B.", "C."] and retry.made(records) == (2, 0)
    assert not list(tmp_path.glob("out.jsonl.rank-*"))


def test_rows_without_their_settings_or_from_another_folder_are_not_resumed(tmp_path, monkeypatch):
    """A deleted OUT.settings.json let a resume mix settings silently; a relative path resumed from
    another folder captioned every image again under another name."""
    out = tmp_path / "out.jsonl"
    monkeypatch.chdir(tmp_path)
    first = ShardedResults(out, ["images/a.png"], "path", settings={"seed": 0})
    first.write({"path": "images/a.png", "text": "A."})
    first.finish()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=f"holds rows of paths relative to {tmp_path} \\('images/a.png'\\); run from there"):
        ShardedResults(out, ["images/a.png"], "path", settings={"seed": 0})
    monkeypatch.chdir(tmp_path)
    assert ShardedResults(out, ["images/a.png"], "path", settings={"seed": 0}).todo == []
    (tmp_path / "out.jsonl.settings.json").unlink()
    with pytest.raises(ValueError, match="holds rows, but not the settings they were made with"):
        ShardedResults(out, ["images/a.png"], "path", settings={"seed": 0})


def test_a_launch_without_an_output_file_or_with_a_data_file_is_one_line(folder, monkeypatch, capsys):
    """Under a launcher without --out every process captioned everything and printed it (--json:
    two lists on stdout); the first process alone prints the refusal. A JSONL given as an image was
    a row error --retry-errors could not mend."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, expected in (("0", "mmspec: error: 2 processes shard the inputs into one output file: pass --out FILE.jsonl "
                                  "(or run one process)"),
                           ("1", "")):
        monkeypatch.setenv("RANK", rank)
        assert main(["caption", str(folder), "--json"]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip() == expected and captured.out == ""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(["caption", str(folder / "data.jsonl")]) == 2
    assert "data.jsonl: mmspec caption takes images, folders of them or globs, not a data file" in capsys.readouterr().err


def caption_args(folder, model, out):
    return ["caption", str(folder), "--out", str(out), "--model", str(model), "--drafter", "prompt-lookup",
            "--dtype", "fp32", "--max-new-tokens", "4", "--device", "cpu"]


def test_a_dataset_run_streams_records_and_resumes(folder, tmp_path, tmp_path_factory, capsys):
    model = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    out = tmp_path / "captions.jsonl"
    assert main(caption_args(folder, model, out)) == 2  # a broken image is a record; the run goes on, then exit 2
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in records] == expand_images([str(folder)])
    assert "error" in records[2] and all(r["stats"]["new_tokens"] == 4 for i, r in enumerate(records) if i != 2)
    captured = capsys.readouterr()
    assert "5 of 5 inputs done; this run captioned 4, 1 error" in captured.out
    assert captured.err.splitlines()[-1] == (f"mmspec: 1 of 5 rows failed; see their error field in {out}; "
                                             "rerun with --retry-errors to redo only them")
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[3][:20])  # killed while writing the fourth record
    assert main(caption_args(folder, model, out)) == 2
    assert "this run captioned 2, 1 error" in capsys.readouterr().out  # the third (error) and the rest
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["path"], r.get("text"), r.get("error")) for r in again] == [
        (r["path"], r.get("text"), r.get("error")) for r in records]  # the same file, nothing lost
    # the default prompt written out is the same run: it resumes (nothing left to do), not refused
    assert main([*caption_args(folder, model, out), "--prompt", "Describe the image."]) == 2
    assert "this run captioned 0, 0 errors" in capsys.readouterr().out


def test_failed_rows_exit_2_and_retry_errors_redoes_only_them(folder, tmp_path, tmp_path_factory, capsys):
    """Issue 44: with --out, failed rows exited 0 (2 with --json). One rule now: exit 2 while a row
    of the file failed; --retry-errors reruns only the failed rows, keeping the done ones."""
    model = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    out = tmp_path / "captions.jsonl"
    assert main(caption_args(folder, model, out)) == 2
    assert main([*caption_args(folder, model, out), "--json"]) == 2  # the same rule with --json
    before = {r["path"]: r for r in map(json.loads, out.read_text().splitlines())}
    capsys.readouterr()
    broken = folder / "sub" / "broken.png"
    Image.fromarray(np.full((24, 24, 3), 7, dtype=np.uint8)).save(broken, format="PNG")  # the input is fixed
    assert main(caption_args(folder, model, out)) == 2  # a resume keeps the failed record
    assert "this run captioned 0, 0 errors" in capsys.readouterr().out
    assert main([*caption_args(folder, model, out), "--retry-errors"]) == 0
    captured = capsys.readouterr()
    assert "this run captioned 1, 0 errors (retried 1 failed row)" in captured.out and "rows failed" not in captured.err
    after = {r["path"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(after) == list(before) and "text" in after[str(broken)] and "error" not in after[str(broken)]
    assert all(after[p] == before[p] for p in before if p != str(broken))  # done rows kept as they were


def test_batched_dataset_run_equals_the_one_by_one_run(folder, tmp_path, tmp_path_factory, capsys):
    """--batch-size 3: the same records as batch size 1; an image truncated after its header (it
    passes the check before loading, fails in decoding) is an error record, its batch-mates still
    get their captions."""
    model = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    data = (folder / "b.png").read_bytes()
    (folder / "sub" / "e.png").write_bytes(data[: len(data) // 2])
    one, batched = tmp_path / "one.jsonl", tmp_path / "batched.jsonl"
    assert main(caption_args(folder, model, one)) == 2  # rows failed: exit 2, as with --json
    assert main([*caption_args(folder, model, batched), "--batch-size", "3"]) == 2
    capsys.readouterr()
    rows = [[(r["path"], r.get("text"), "error" in r) for r in map(json.loads, f.read_text().splitlines())] for f in (one, batched)]
    assert rows[0] == rows[1] and sum(error for *_, error in rows[0]) == 2
    stats = [json.loads(line)["stats"] for line in batched.read_text().splitlines() if "stats" in line]
    assert [s["config"].get("batch_size", 1) for s in stats] == [3, 3, 3, 1]  # a, b, c batched; d alone (e failed)


def test_two_processes_give_the_one_process_file(folder, tmp_path, tmp_path_factory, free_port):
    """accelerate launch (its torchrun launcher; the processes run on the CPU over gloo)."""
    model = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(caption_args(folder, model, one)) == 2  # broken.png failed
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port),
                           "-m", "mmspec", *caption_args(folder, model, two)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and done.stderr.count("mmspec: 1 of 5 rows failed") == 1, done.stderr[-2000:]
    texts = [[(r["path"], r.get("text"), r.get("error")) for r in map(json.loads, f.read_text().splitlines())] for f in (one, two)]
    assert texts[0] == texts[1] and len(texts[0]) == 5
    assert not list(tmp_path.glob("two.jsonl.rank-*"))


def test_progress_shows_the_running_tokens_per_second_and_speedup():
    from mmspec.cli.dataset import Progress

    bar = Progress(3, always=True, unit="prompt", show=False)
    bar.step(100, 2.0, 1.5)  # plain decoding took 3 s for this item
    bar.step(50, 1.0, 3.0)  # and 3 s for this one
    assert bar.summary() == "50.0 tok/s, 2.00x over plain decoding" and bar.done == 2
    assert Progress(2).summary() == ""


def test_a_quoted_home_folder_is_expanded(folder, monkeypatch):
    """``mmspec caption '~/photos'`` (quoted: the shell leaves the ``~``) was an error row, "is a
    directory"-like, with its images never captioned: a leading ``~`` is now the home folder."""
    monkeypatch.setenv("HOME", str(folder.parent))
    home = f"~/{folder.name}"
    assert expand_images([home]) == expand_images([str(folder)])
    assert expand_images([f"{home}/sub/*.png"]) == [str(folder / "sub" / n) for n in ("broken.png", "c.png")]
