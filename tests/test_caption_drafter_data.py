"""Drafter data outside the caption generator's families: ``mmspec train caption-data`` (the six
families at varied sizes and crops, plus renders the generator never makes), ``mmspec train drafter
--hold-out-groups`` (whole groups kept out of a head's training and evaluated), ``mmspec bench
caption --data`` (a benchmark over such a JSONL), and ``--target captioner --method eagle3``."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_checkpoints import cached_tiny_checkpoint

from mmspec.cli import main
from mmspec.train.any_target import read_examples, split_held_out
from mmspec.train.caption_data import GROUPS
from mmspec.train.data.renders import RENDERS, make_render


@pytest.mark.parametrize("kind", sorted(RENDERS))
def test_renders_are_deterministic_sized_and_split(kind):
    image, prompt = make_render(kind, "train", 3, size=48)
    again, prompt_again = make_render(kind, "train", 3, size=48)
    other, _ = make_render(kind, "test", 3, size=48)
    assert image.size == (48, 48) and image.mode == "RGB" and prompt == prompt_again and prompt.strip()
    pixels = np.asarray(image)
    assert np.array_equal(pixels, np.asarray(again)) and not np.array_equal(pixels, np.asarray(other))
    assert pixels.std() > 1  # not a blank canvas


def test_render_bad_arguments():
    with pytest.raises(ValueError, match="unknown render kind"):
        make_render("nope", "train", 0)
    with pytest.raises(ValueError, match="at least 16"):
        make_render("abstract", "train", 0, size=8)


def test_caption_data_writes_every_group_interleaved(tmp_path, capsys):
    out = tmp_path / "data"
    argv = ["train", "caption-data", "--out", str(out), "--per-group", "2", "--sizes", "40,56", "--crop", "1"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert [r["group"] for r in rows] == list(GROUPS) * 2
    for row in rows:
        image = Image.open(out / row["image"])
        assert image.size[0] in (40, 56) and row["prompt"].strip()
    first = (out / "data.jsonl").read_bytes(), (out / rows[0]["image"]).read_bytes()
    assert main(argv) == 0  # the same arguments give the same files
    assert ((out / "data.jsonl").read_bytes(), (out / rows[0]["image"]).read_bytes()) == first
    examples, skipped = read_examples(out / "data.jsonl")
    assert not skipped and [e.group for e in examples] == [r["group"] for r in rows]
    # short-answer questions are replaced by caption / description prompts
    assert not any(r["prompt"].endswith(("Answer with a number.", "Give just the number.")) for r in rows)


@pytest.mark.parametrize("argv,message", [(["--groups", "scenes,nope"], "unknown ['nope']"),
                                          (["--sizes", "8"], "at least 16 pixels"),
                                          (["--sizes", "big"], "comma-separated pixel sides"),
                                          (["--crop", "2"], "share in [0, 1]")])
def test_caption_data_bad_arguments(argv, message, tmp_path, capsys):
    assert main(["train", "caption-data", "--out", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_split_by_groups():
    groups = ["a", "b", "a", None, "c"]
    assert split_held_out(5, 0.5, 0, groups, {"a", "c"}) == ([1, 3], [0, 2, 4])
    train, held = split_held_out(5, 0.4, 0)
    assert len(held) == 2 and sorted(train + held) == list(range(5))


def grouped_images(tmp_path, groups=("red", "blue", "green"), per_group=2):
    rng = np.random.default_rng(0)
    rows = []
    (tmp_path / "images").mkdir()
    for i in range(per_group):
        for group in groups:
            name = f"images/{group}-{i}.png"
            Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(tmp_path / name)
            rows.append({"image": name, "prompt": "Describe the image.", "group": group})
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hold_out_groups_train_on_the_others_and_evaluate_them(tmp_path_factory, tmp_path, capsys):
    import mmspec
    from mmspec.pipelines.captioning.components import load_captioning_model

    target = cached_tiny_checkpoint("llava", tmp_path_factory)
    data = grouped_images(tmp_path)
    out = tmp_path / "head"
    argv = ["train", "drafter", "--target", str(target), "--data", str(data), "--out", str(out), "--dtype", "float32",
            "--method", "eagle3", "--draft-vocab", "0", "--batch-size", "2", "--steps", "2", "--max-new-tokens", "5",
            "--save-every", "2", "--eval-examples", "2", "--hold-out-groups", "blue"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "held out of training: groups blue (2 sequences); training on 4 sequences of groups green, red" in text
    report = json.loads((out / "eval.json").read_text())
    assert report["held_out_prompts"] == 2 and report["identical_to_target"] == "2/2"
    # the head decodes exactly on a held-out group's image
    model, processor = load_captioning_model(target, torch.device("cpu"), torch.float32)
    chat = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                         add_generation_prompt=True)
    inputs = dict(processor(text=[chat], images=[Image.open(tmp_path / "images/blue-1.png").convert("RGB")], return_tensors="pt"))
    plain = mmspec.generate(model, None, max_new_tokens=10, **inputs)
    assert torch.equal(mmspec.generate(model, f"eagle3:{out}", max_new_tokens=10, **inputs).sequences, plain.sequences)


@pytest.mark.parametrize("groups,message", [("purple", "no row of --data"), ("red,blue,green", "holds out every row"),
                                            ("red --held-out 0.5", "--held-out and --hold-out-groups: give one")])
def test_hold_out_groups_are_checked_before_the_target_loads(groups, message, tmp_path, capsys):
    data = grouped_images(tmp_path)
    (tmp_path / "not-a-model").mkdir()  # (it would fail to load: the groups are checked first)
    argv = ["train", "drafter", "--target", str(tmp_path / "not-a-model"), "--data", str(data), "--out", str(tmp_path / "o"),
            "--hold-out-groups", *groups.split()]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_integer_group_labels_are_groups(tmp_path, capsys):
    """The drafter audit: {"group": 2} was read as no group, so --hold-out-groups 2 was refused with
    'its groups: none: give the rows a "group" field', a field every row had."""
    from mmspec.train.any_target import read_examples

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Topic {i}?", "group": i % 3}) + "\n" for i in range(6)))
    assert [e.group for e in read_examples(data)[0]] == ["0", "1", "2", "0", "1", "2"]
    (tmp_path / "not-a-model").mkdir()
    assert main(["train", "drafter", "--target", str(tmp_path / "not-a-model"), "--data", str(data), "--out",
                 str(tmp_path / "o"), "--hold-out-groups", "7"]) == 2
    assert "has group 7 (its groups: 0, 1, 2)" in capsys.readouterr().err


def test_captioner_eagle3_needs_data(tmp_path, capsys):
    assert main(["train", "drafter", "--target", "captioner", "--method", "eagle3", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "needs --data DATA" in err and "mmspec train caption-data" in err


def test_bench_caption_over_a_data_file(tmp_path_factory, tmp_path, capsys):
    checkpoint = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    data = grouped_images(tmp_path)
    results = tmp_path / "bench.json"
    argv = ["bench", "caption", "--model", str(checkpoint), "--data", str(data), "--families", "red,green", "--per-family", "1",
            "--methods", "ar,prompt-lookup@3", "--repeats", "1", "--temperatures", "0", "--max-new-tokens", "6", "--dtype", "fp32",
            "--threads", "1", "--results", str(results), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["0"]) == {"red", "green", "mean"} and summary["0"]["red"]["prompt-lookup@3"]["exact"] == "1/1"
    meta = json.loads(results.read_text())["meta"]
    assert meta["data"] == str(data) and "--data" in meta["command"]
    # the same --results over edited rows was resumed: the old rows' runs passed for the new rows'
    rows = data.read_text().splitlines()
    data.write_text("".join(line + "\n" for line in [rows[0].replace("Describe the image.", "What colour is it?"), *rows[1:]]))
    assert main(argv) == 2
    assert "holds runs of another row 1 of group 'red' (its prompt or image changed in --data since)" in capsys.readouterr().err
    data.write_text("".join(line + "\n" for line in rows))
    assert main(argv) == 0  # the same rows again: resumed
    capsys.readouterr()
    assert main([*argv[:7], "purple", *argv[8:]]) == 2
    assert "has no rows of purple" in capsys.readouterr().err
    # every row is measured or the run is refused: a row without an image, an image that cannot be decoded
    with open(data, "a") as file:
        file.write(json.dumps({"prompt": "No image here.", "group": "red"}) + "\n")
    assert main([*argv, "--results", str(tmp_path / "b.json")]) == 2
    assert "1 row without an image" in capsys.readouterr().err
    (tmp_path / "images/red-0.png").write_bytes(b"not a png")
    data.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:-1]))
    assert main([*argv, "--results", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "red-0.png: unreadable image" in err and "Traceback" not in err
    # the folder that holds the JSONL (what train caption-data writes) was measured as bare images with the
    # default prompt, the rows' prompts and groups dropped (the drafter audit after stop 86)
    assert main([*argv[:5], str(data.parent), "--methods", "ar", "--results", str(tmp_path / "d.json")]) == 2
    assert (f"holds {data.name}: pass --data {data} to use its rows, or move it out of the folder to measure every image "
            "with that prompt") in capsys.readouterr().err


def test_captioner_data_routes_to_the_any_target_loop_unless_it_is_the_recipes_cache(tmp_path):
    from types import SimpleNamespace

    from mmspec.train.drafter import reads_any_data

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "chunk-00000.pt").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    data = grouped_images(tmp_path)
    cases = {None: False, str(tmp_path / "new-cache"): False, str(tmp_path / "empty"): False, str(tmp_path / "cache"): False,
             str(data): True, str(tmp_path / "images"): True, str(tmp_path / "*.parquet"): True}
    for path, expected in cases.items():
        assert reads_any_data(SimpleNamespace(target="captioner", method="eagle", data=path)) is expected, path
    assert reads_any_data(SimpleNamespace(target="smollm2", method="eagle3", data=str(data))) is False
