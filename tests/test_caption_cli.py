"""``mmspec caption``: JSON shape, human output, per-file errors, exit codes, no tracebacks."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_checkpoints import cached_tiny_checkpoint

from mmspec.cli import build_parser, main

MODELS = Path(__file__).parents[1] / "models"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(cached_tiny_checkpoint("llava", tmp_path_factory))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two image files (PNG, JPEG) of different content."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for name, shape in (("a.png", (20, 30, 3)), ("b.jpg", (32, 24, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(folder / name)
        paths.append(str(folder / name))
    return paths


def run(capsys, *argv):
    code = main(["caption", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_listed_in_help():
    assert "caption" in build_parser().format_help()


def test_json_shape_with_baseline(capsys, checkpoint, images):
    code, out, err = run(capsys, *images, "--model", checkpoint, "--dtype", "fp32", "--max-new-tokens", "6",
                         "--compare-baseline", "--json")
    assert code == 0
    results = json.loads(out)
    assert [r["path"] for r in results] == images
    for r in results:
        assert {"path", "text", "prompt", "stats", "baseline_text", "baseline_stats", "identical_to_baseline"} <= set(r)
        assert r["identical_to_baseline"] is True and r["text"] == r["baseline_text"]
        assert r["stats"]["speedup"] > 0 and r["stats"]["config"]["drafter"] == "prompt-lookup"
        assert r["stats"]["new_tokens"] == 6 and r["prompt"] == "Describe the image."


def test_human_output(capsys, checkpoint, images):
    code, out, _ = run(capsys, images[0], "--model", checkpoint, "--dtype", "fp32", "--max-new-tokens", "4",
                       "--drafter", "layer-skip:1", "--prompt", "What is it?", "--compare-baseline")
    assert code == 0
    assert out.startswith("drafter: layer-skip:1 (given); float32 on cpu")
    assert f"{images[0]}:" in out and "tok/s" in out and "[baseline, same run]" in out
    assert "identical to plain decoding; speedup" in out


def test_bad_files_are_reported_and_the_others_captioned(capsys, checkpoint, images, tmp_path):
    fake = tmp_path / "notes.png"
    fake.write_text("not an image")
    missing = tmp_path / "missing.jpg"
    code, out, err = run(capsys, str(missing), images[0], str(fake), "--model", checkpoint, "--dtype", "fp32",
                         "--max-new-tokens", "3", "--json")
    assert code == 2
    assert f"image file not found: {missing}" in err and f"{fake} is not an image file" in err
    results = json.loads(out)  # the progress bar went to stderr: stdout is one JSON document
    assert [r["path"] for r in results] == [str(missing), images[0], str(fake)]
    assert "error" in results[0] and "error" in results[2]
    assert "text" in results[1] and "error" not in results[1]


def test_only_bad_files_fail_before_loading_the_model(capsys, tmp_path):
    code, _, err = run(capsys, str(tmp_path / "gone.png"), "--model", str(tmp_path / "no-model"))
    assert code == 2 and "image file not found" in err and "model directory not found" not in err
    assert err.strip().splitlines() == [f"mmspec: error: image file not found: {tmp_path / 'gone.png'}"]  # one line


def test_empty_prompt_exits_before_loading(capsys, images, tmp_path):
    code, _, err = run(capsys, images[0], "--prompt", "  ", "--model", str(tmp_path / "no-model"))
    assert code == 2 and "prompt is empty" in err and "model directory" not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--drafter", "medusa-9"], "unknown drafter 'medusa-9'"),
        (["--drafter", "/nonexistent/draft"], "draft model directory not found"),
        (["--drafter", "eagle2:/nonexistent/head"], "eagle2:/nonexistent/head: no such directory"),
        (["--drafter", f"medusa:{MODELS / 'smolcap-eagle'}"],  # (the audit's: after the model loaded, a traceback)
         "holds no medusa drafter (heads_config.json missing); it holds what eagle / eagle2 reads: use 'eagle:"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--device", "bogus"], "unknown device 'bogus'"),
    ],
)
def test_bad_options_exit_before_loading(capsys, images, tmp_path, extra, message):
    code, _, err = run(capsys, images[0], "--model", str(tmp_path / "no-model"), *extra)
    assert code == 2 and message in err and "model directory not found: " + str(tmp_path) not in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "/nonexistent/model"], "model directory not found: /nonexistent/model"),
        (["--drafter", "medusa-9"], "unknown drafter"),
        (["--dtype", "fp8"], "unknown dtype"),
    ],
)
def test_user_errors_exit_2(capsys, checkpoint, images, extra, message):
    argv = [images[0], "--model", checkpoint, "--dtype", "fp32", *extra]
    code, _, err = run(capsys, *argv)
    errors = [line for line in err.splitlines() if line.startswith("mmspec: error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0]


def test_a_differing_half_precision_caption_is_explained():
    from mmspec.core.stats import SpecStats
    from mmspec.cli.caption import format_result
    from mmspec.pipelines.captioning import CaptionOutput

    stats, baseline = SpecStats(method="eagle2", new_tokens=4, wall_time_s=1.0), SpecStats(method="ar", new_tokens=4, wall_time_s=2.0)
    stats.speedup = 2.0
    result = CaptionOutput(text="a b", stats=stats, baseline_text="a c", baseline_stats=baseline, identical_to_baseline=False)
    assert "DIFFERENT" in format_result("x.png", result) and "--dtype fp32" not in format_result("x.png", result)
    assert "--dtype fp32" in format_result("x.png", result, half_precision=True)
    result.identical_to_baseline = True
    assert "--dtype fp32" not in format_result("x.png", result, half_precision=True)
    result.identical_to_baseline, stats.config["acceptance"] = False, "speculative"  # a sampled caption
    text = format_result("x.png", result, half_precision=True)
    assert "keeps plain decoding's distribution, not its random draws" in text and "--dtype fp32" not in text


def test_a_speedup_over_outputs_of_other_lengths_is_given_per_token_too():
    """A sampled caption and its baseline can differ in length: the wall-time ratio alone would
    compare different amounts of work (11 tokens in 0.38 s read as 2.05x over 23 in 0.78 s)."""
    from mmspec.core.stats import SpecStats
    from mmspec.cli.caption import format_result
    from mmspec.pipelines.captioning import CaptionOutput

    stats, baseline = SpecStats(method="eagle", new_tokens=11, wall_time_s=0.38), SpecStats(method="ar", new_tokens=23, wall_time_s=0.78)
    stats.speedup = 0.78 / 0.38
    result = CaptionOutput(text="a b", stats=stats, baseline_text="a c", baseline_stats=baseline, identical_to_baseline=False)
    assert "speedup 2.05x in time, 0.98x per token (11 and 23 tokens)" in format_result("x.png", result)
    baseline.new_tokens = 11  # the same length: the one ratio says it all
    assert "speedup 2.05x\n" in format_result("x.png", result) + "\n" and "per token" not in format_result("x.png", result)


def test_sampling_without_a_seed_repeats_as_the_pipeline_does(capsys, checkpoint, images):
    """--seed defaults to 0, as the pipeline's call does (it drew a fresh seed each run before):
    two sampled runs without --seed give the same caption; `mmspec generate` keeps its fresh seed."""
    argv = [images[0], "--model", checkpoint, "--dtype", "fp32", "--max-new-tokens", "6", "--do-sample", "--json"]
    first, second = (json.loads(run(capsys, *argv)[1])[0] for _ in range(2))
    assert first["text"] == second["text"] and first["stats"]["config"]["seed"] == 0
    assert build_parser().parse_args(["generate", "hi"]).seed is None


def test_an_image_the_model_fails_on_is_its_rows_error(capsys, checkpoint, images, monkeypatch):
    """The model's own code failing on one image (transformers' Mistral3 on an image of one image
    token raised a RuntimeError that ended the run): that image's one error line, the others captioned."""
    from mmspec.pipelines.captioning import ImageCaptioningPipeline

    call = ImageCaptioningPipeline.__call__

    def failing(self, image, **kwargs):
        if image == images[0] or (isinstance(image, list) and images[0] in image):
            raise RuntimeError("split_with_sizes expects split_sizes to sum exactly to 32\nmore")
        return call(self, image, **kwargs)

    monkeypatch.setattr(ImageCaptioningPipeline, "__call__", failing)
    for batch in ("1", "2"):
        code, out, err = run(capsys, *images, "--model", checkpoint, "--dtype", "fp32", "--max-new-tokens", "4", "--batch-size", batch)
        errors = [line for line in err.splitlines() if line.startswith("mmspec: error:")]
        assert code == 2 and len(errors) == 1 and "more" not in errors[0]
        assert f"{images[0]}: the model failed on this image (RuntimeError: split_with_sizes" in errors[0]
        assert f"{images[1]}:" in out


def test_a_batch_the_drafter_cannot_decode_is_refused_in_one_line(capsys, checkpoint, images):
    """--batch-size 2 with a drafter that runs at batch size 1 only (Gemma 4's assistant, SJD-PAC's
    trees) was captioned image by image without a word (the refused batch fell back as if one image
    had failed); the docs promise one error line."""
    code, out, err = run(capsys, *images, "--model", checkpoint, "--drafter", "sjd-pac", "--max-new-tokens", "4",
                         "--batch-size", "2")
    errors = [line for line in err.splitlines() if "mmspec:" in line]  # (after transformers' loading bar)
    assert code == 2 and out == "" and len(errors) == 1 and "runs at batch size 1" in errors[0]
    assert errors[0].split("\r")[-1].startswith("mmspec: error: the sjd-pac drafter drafts token trees")


def test_an_image_the_processor_refuses_is_named_with_its_size(capsys, tmp_path_factory):
    """Qwen2-VL's processor refuses an aspect ratio over 200: the line names the image and its
    size and says what to do (it spoke of "this conversation" for a plain image)."""
    wide = tmp_path_factory.mktemp("wide") / "wide.png"
    Image.new("RGB", (4000, 10), (200, 10, 10)).save(wide)
    code, _, err = run(capsys, str(wide), "--model", str(cached_tiny_checkpoint("qwen2_vl", tmp_path_factory)), "--dtype", "fp32",
                       "--max-new-tokens", "4")
    assert code == 2 and f"could not take the image {wide} (4000x10): absolute aspect ratio" in err
    assert "resize or crop the image" in err and "conversation" not in err


def test_a_checkpoint_without_a_chat_template_is_refused_before_its_weights_load(capsys, checkpoint, tmp_path, monkeypatch):
    """Found after the weights loaded, with a hint ("set processor.chat_template") a command cannot
    follow: now before, saying where the template goes."""
    import shutil

    import transformers

    bare = tmp_path / "no-template"
    shutil.copytree(checkpoint, bare)
    for file in bare.glob("chat_template*"):
        file.unlink()
    for name in ("processor_config.json", "tokenizer_config.json"):
        if (bare / name).is_file():
            config = json.loads((bare / name).read_text())
            config.pop("chat_template", None)
            (bare / name).write_text(json.dumps(config))
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
    code, _, err = run(capsys, str(Path(__file__).parents[1] / "samples" / "photo.png"), "--model", str(bare), "--dtype", "fp32")
    assert code == 2 and "has no chat template: add the model's template to its directory (chat_template.jinja" in err


def test_trust_remote_code_reaches_the_pipeline_and_is_off_by_default(capsys, images, monkeypatch):
    """The audit's: ``mmspec caption`` had no --trust-remote-code although the pipeline takes
    trust_remote_code (and ``mmspec t2i`` has the flag): a remote-code VLM could not be captioned
    from the command line."""
    import mmspec.cli.caption as caption_cli

    seen = []

    def recording_pipeline(**kwargs):
        seen.append(kwargs)
        raise ValueError("stop here")  # (nothing loads)

    monkeypatch.setattr(caption_cli, "ImageCaptioningPipeline", recording_pipeline)
    assert build_parser().parse_args(["caption", images[0]]).trust_remote_code is False
    for extra, expected in (([], False), (["--trust-remote-code"], True)):
        code, _, err = run(capsys, images[0], "--drafter", "ar", *extra)
        assert code == 2 and "stop here" in err and seen[-1]["trust_remote_code"] is expected


def _larger_vocabulary_draft(folder: Path, target_vocab: int) -> Path:
    """A draft model directory whose config says a vocabulary one larger than the target's (a config
    alone: the refusal comes before any weights load)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=target_vocab + 1, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(folder)
    return folder


def test_a_draft_of_a_larger_vocabulary_is_refused_before_either_model_loads(capsys, checkpoint, images, tmp_path,
                                                                             monkeypatch):
    """The audit's: found when the first caption decoded, after both models loaded, and then as
    every image's row error; now from the two config.json files, one line, before any weights."""
    import transformers

    from mmspec.drafters.model import config_vocab_size

    target_vocab = config_vocab_size(checkpoint)
    assert target_vocab is not None
    draft = _larger_vocabulary_draft(tmp_path / "draft", target_vocab)
    for auto in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(auto, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    code, out, err = run(capsys, *images, "--model", checkpoint, "--drafter", str(draft), "--dtype", "fp32")
    errors = [line for line in err.splitlines() if line.startswith("mmspec: error:")]
    assert code == 2 and out == "" and errors == [
        f"mmspec: error: the draft's vocabulary ({target_vocab + 1}) is larger than the target's ({target_vocab}); "
        "the draft must share the target's tokenizer"]


def test_a_draft_of_a_larger_vocabulary_than_a_loaded_target_is_refused_before_the_draft_loads(checkpoint, tmp_path,
                                                                                                monkeypatch):
    """A target without a config to read first (a loaded model, the embedded captioner) is compared
    with the draft's config before the draft's weights load."""
    import transformers

    import mmspec

    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype="float32")
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    vocab = model.get_output_embeddings().weight.shape[0]
    draft = _larger_vocabulary_draft(tmp_path / "draft", vocab)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the draft's weights loaded before the refusal"))
    with pytest.raises(ValueError, match=rf"the draft's vocabulary \({vocab + 1}\) is larger than the target's \({vocab}\)"):
        mmspec.pipeline("image-captioning", model=model, processor=processor, drafter=str(draft), device="cpu")


def test_caption_refuses_a_checkpoint_of_its_own_code_in_one_line(tmp_path, capsys, custom_code_lm, no_terminal):
    """The audit's: ``mmspec caption --model DIR`` of a checkpoint with its own code (an auto_map in
    config.json) asked transformers' [y/N] question on the terminal (the config was read with
    trust_remote_code=None), then refused in four lines naming only the Python argument; a draft
    model directory of its own code likewise (``spd:DIR`` / ``assistant:DIR`` asked too). Now the one
    line of ``mmspec generate`` naming --trust-remote-code, in the pipeline too (a drafter spec's says
    how to load it instead); with the flag a text LM of its own code is told it is
    no VLM in one line (was transformers' list of every image-text-to-text class)."""
    import mmspec
    from mmspec.hub import remote_code_refused

    image = tmp_path / "image.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image)
    refusal = f"mmspec: error: {remote_code_refused(custom_code_lm)}"
    for argv in (["--model", str(custom_code_lm)], ["--drafter", str(custom_code_lm)]):
        assert main(["caption", str(image), *argv, "--max-new-tokens", "2"]) == 2
        captured = capsys.readouterr()
        assert "[y/N]" not in captured.out + captured.err and captured.err.strip().splitlines()[-1] == refusal, captured
    for spec in ("spd", "assistant"):  # (a drafter spec's loader takes no flag: never the question, one line)
        assert main(["caption", str(image), "--drafter", f"{spec}:{custom_code_lm}", "--max-new-tokens", "2"]) == 2
        captured = capsys.readouterr()
        assert "[y/N]" not in captured.out + captured.err, captured
        assert captured.err.strip().splitlines()[-1].startswith(refusal.split(", which")[0]), captured
    assert main(["caption", str(image), "--model", str(custom_code_lm), "--trust-remote-code"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mmspec: error: {str(custom_code_lm)!r} is a mmspec_custom_lm checkpoint (CustomLM) of its own code (the auto_map of "
        "its config.json provides AutoConfig, AutoModelForCausalLM), not an image-text-to-text model (a VLM); a text model "
        f"goes through mmspec generate --model {custom_code_lm} --trust-remote-code")  # (was "is a checkpoint")
    with pytest.raises(ValueError) as raised:
        mmspec.pipeline("image-captioning", model=str(custom_code_lm))
    assert str(raised.value) == str(remote_code_refused(custom_code_lm))
