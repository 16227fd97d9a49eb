"""``mmspec bench chain-stop`` on a tiny saved SmolVLM checkpoint and a random EAGLE-3 head: the
grid measured side by side with plain decoding, greedy outputs identical to AR's, the fastest
written to the head's chain_settings.json (which the drafter then reads), bad options refused
before the model loads."""

import json

import pytest
from PIL import Image
from tiny_checkpoints import cached_tiny_checkpoint, write_eagle3_images, write_eagle3_lm

from mmspec.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    checkpoint = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    folder = tmp_path_factory.mktemp("chain-stop")
    write_eagle3_images(checkpoint, folder)
    return checkpoint, folder


def test_the_grid_is_measured_and_the_fastest_written_beside_the_head(setup, capsys):
    checkpoint, folder = setup
    argv = ["bench", "chain-stop", "--model", str(checkpoint), "--drafter", f"eagle3:{folder / 'head'}", "--data",
            str(folder / "data.jsonl"), "--per-family", "1", "--lengths", "2,3", "--stops", "0,0.05", "--repeats", "1",
            "--max-new-tokens", "6", "--dtype", "fp32", "--results", str(folder / "r.json"), "--write"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| K \\ stop | 0 | 0.05 |" in out and "fastest: K=" in out
    results = json.loads((folder / "r.json").read_text())
    # the grid and the head's own setting as loaded (K = 6, no stop), each against AR
    assert set(results["table"]) == {"K=2,stop=0", "K=2,stop=0.05", "K=3,stop=0", "K=3,stop=0.05", "K=6,stop=0"}
    assert all(row["identical_to_ar"] and row["speedup"] > 0 for row in results["table"].values())  # fp32 greedy
    assert len(results["runs"]) == 2 * 2 * 6  # items x rounds (warm-up + 1) x (AR + 5 settings)
    saved = json.loads((folder / "head" / "chain_settings.json").read_text())
    best = results["table"][results["best"]]
    assert saved["float32"]["greedy"] == {"num_draft_tokens": best["num_draft_tokens"], "stop_below": best["stop_below"]}
    measured = saved["measured"]["float32"]["greedy"]
    assert measured["grid"] == results["table"] and "chain-stop" in measured["command"] and measured["machine"]["dtype"] == "float32"
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.drafters import Eagle3Drafter
    from mmspec.pipelines.captioning import ImageCaptioningPipeline

    pipe = ImageCaptioningPipeline(model=str(checkpoint), drafter="ar", dtype="fp32")
    drafter = Eagle3Drafter.from_spec(pipe.target, str(folder / "head"))
    assert (drafter.greedy_draft_tokens, drafter.stop_below) == (best["num_draft_tokens"], best["stop_below"])
    assert isinstance(pipe.target, TransformersTarget)


@pytest.mark.parametrize("extra,message", [(["--drafter", "eagle2"], "name an EAGLE or EAGLE-3 chain drafter"),
                                           (["--stops", "0,1"], "--stops=1.0"), (["--lengths", "0,2"], "every K must be >= 1"),
                                           (["--lengths", "a"], "comma lists")])
def test_bad_options_are_one_line_errors(setup, capsys, extra, message):
    _, folder = setup
    argv = ["bench", "chain-stop", "--data", str(folder / "data.jsonl"), "--results", str(folder / "bad.json"), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (folder / "bad.json").exists()


def test_a_causal_lm_head_is_tuned_on_prompts(tmp_path, capsys):
    """Rows of prompts alone tune a causal LM's head (each prompt in its chat template); a file
    mixing prompts and images is refused in one line."""
    rows = write_eagle3_lm(tmp_path)
    argv = ["bench", "chain-stop", "--model", str(tmp_path / "lm"), "--drafter", f"eagle3:{tmp_path / 'head'}", "--data",
            str(tmp_path / "prompts.jsonl"), "--per-family", "1", "--lengths", "2", "--stops", "0,0.05", "--repeats", "1",
            "--max-new-tokens", "6", "--dtype", "fp32", "--results", str(tmp_path / "r.json"), "--write"]
    assert main(argv) == 0
    results = json.loads((tmp_path / "r.json").read_text())
    assert set(results["table"]) == {"K=2,stop=0", "K=2,stop=0.05", "K=6,stop=0"}
    assert all(row["identical_to_ar"] for row in results["table"].values())
    assert set(json.loads((tmp_path / "head" / "chain_settings.json").read_text())) == {"float32", "measured"}
    capsys.readouterr()
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    (tmp_path / "mixed.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"image": "x.png", "prompt": "What is it?"}) + "\n")
    argv[argv.index("--data") + 1] = str(tmp_path / "mixed.jsonl")
    assert main(argv) == 2
    assert "row without an image" in capsys.readouterr().err
