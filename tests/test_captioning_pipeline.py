"""The image-captioning pipeline on tiny saved checkpoints of every VLM family, and image inputs."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_checkpoints import CHECKPOINT_FAMILIES, cached_tiny_checkpoint, save_tiny_draft

import mmspec
from mmspec.pipelines import CaptionOutput, ImageCaptioningPipeline
from mmspec.pipelines.captioning import DRAFTERS_FILE
from mmspec.pipelines.images import MAX_SIDE, load_image

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def photo():
    """A 40x60 (HxW) random RGB image: not square, so resizing and aspect ratio are exercised."""
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    return cached_tiny_checkpoint("smolvlm", tmp_path_factory)


@pytest.fixture(scope="module")
def smolvlm(smolvlm_dir):
    return mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32")


def reference_caption(captioner: ImageCaptioningPipeline, image, prompt: str = "Describe the image.") -> str:
    """transformers' own greedy generate() on the pipeline's inputs."""
    inputs = captioner.preprocess(image, prompt)
    out = captioner.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return captioner.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


# -- every family ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", CHECKPOINT_FAMILIES)
def test_family_checkpoint_greedy_equals_baseline_and_transformers(family, tmp_path_factory, tmp_path, photo, capsys):
    """A checkpoint saved with save_pretrained plus its processor: the pipeline's caption equals its
    baseline's and transformers' generate; ``mmspec caption --model DIR`` gives the same caption."""
    from mmspec.cli import main

    directory = cached_tiny_checkpoint(family, tmp_path_factory)
    captioner = mmspec.pipeline("image-captioning", model=directory, dtype="fp32")
    assert captioner.model.dtype == torch.float32 and captioner.chosen_drafter == "prompt-lookup"
    r = captioner(photo, max_new_tokens=NEW_TOKENS, compare_baseline=True)
    assert isinstance(r, CaptionOutput)
    assert r.identical_to_baseline is True and r.text == r.baseline_text
    assert r.stats.speedup > 0 and r.stats.new_tokens == NEW_TOKENS
    assert r.stats.config["drafter"] == "prompt-lookup" and r.baseline_stats.method == "ar"
    assert r.text == reference_caption(captioner, photo)
    assert r["text"] == r.text and r["stats"] is r.stats
    encoded = json.loads(json.dumps(r.to_dict()))
    assert encoded["stats"]["speedup"] == r.stats.speedup and "mean_accepted_length" in encoded["stats"]
    photo.save(tmp_path / "photo.png")
    capsys.readouterr()
    code = main(["caption", str(tmp_path / "photo.png"), "--model", str(directory), "--dtype", "fp32",
                 "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["text"] == r.text


def test_without_baseline_fields_are_none(smolvlm, photo):
    r = smolvlm(photo, max_new_tokens=4)
    assert r.baseline_text is None and r.baseline_stats is None and r.identical_to_baseline is None
    assert r.stats.speedup is None and r.prompt == "Describe the image."
    assert json.loads(json.dumps(r.to_dict()))["baseline_stats"] is None


def test_list_in_list_out_in_order(smolvlm, photo, tmp_path):
    path = tmp_path / "photo.png"
    photo.save(path)
    gray = np.asarray(photo.convert("L"))
    results = smolvlm([photo, path, gray], max_new_tokens=4)
    assert isinstance(results, list) and len(results) == 3
    assert results[0].text == results[1].text  # the PNG holds the same pixels
    assert results[2].text == smolvlm(gray, max_new_tokens=4).text


@pytest.mark.parametrize("family", ["smolvlm", "llava"])
def test_batches_give_the_batch_one_captions(family, tmp_path_factory, photo):
    """batch_size=3 over 4 images of different sizes (prompts of different lengths): the captions,
    greedy and seeded-sampled, are those of batch size 1; the baseline runs batched too."""
    captioner = mmspec.pipeline("image-captioning", model=cached_tiny_checkpoint(family, tmp_path_factory), dtype="fp32")
    rng = np.random.default_rng(1)
    images = [photo, rng.integers(0, 256, (64, 32, 3), dtype=np.uint8), photo.rotate(90, expand=True),
              rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)]
    for options in ({}, {"do_sample": True, "seed": 4}):
        one = captioner(images, max_new_tokens=NEW_TOKENS, **options)
        batched = captioner(images, max_new_tokens=NEW_TOKENS, batch_size=3, compare_baseline=True, **options)
        assert [r.text for r in batched] == [r.text for r in one]
        assert [r.stats.new_tokens for r in batched] == [r.stats.new_tokens for r in one]
        assert [r.stats.config["batch_size"] for r in batched] == [3, 3, 3, 1]
        assert all(r.identical_to_baseline for r in batched) or options
        assert all(r.stats.speedup > 0 for r in batched)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        captioner(images, batch_size=0)


def test_prompt_default_and_override(smolvlm_dir, photo):
    captioner = mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", prompt="What is this?")
    assert captioner(photo, max_new_tokens=2).prompt == "What is this?"
    assert captioner(photo, prompt="Count the dots.", max_new_tokens=2).prompt == "Count the dots."


def test_seeded_sampling_is_reproducible(smolvlm, photo):
    kwargs = dict(max_new_tokens=6, do_sample=True, temperature=1.5, seed=3)
    assert smolvlm(photo, **kwargs).text == smolvlm(photo, **kwargs).text


@pytest.mark.parametrize("drafter", ["ar", "layer-skip:1", "prompt-lookup:3"])
def test_explicit_drafters_are_lossless(smolvlm_dir, photo, drafter):
    captioner = mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", drafter=drafter)
    r = captioner(photo, max_new_tokens=NEW_TOKENS, compare_baseline=True)
    assert r.identical_to_baseline and r.stats.config["drafter"] == drafter and r.stats.config["drafter_choice"] == "given"


def test_loaded_model_and_text_only_draft_model(smolvlm, smolvlm_dir, tmp_path, photo):
    draft_dir = save_tiny_draft(tmp_path / "draft", vocab_size=len(smolvlm.tokenizer))
    captioner = ImageCaptioningPipeline(smolvlm.model, processor=smolvlm.processor, drafter=str(draft_dir))
    assert captioner.chosen_drafter.startswith("draft model") and captioner.model_dir == smolvlm_dir
    r = captioner(photo, max_new_tokens=NEW_TOKENS, compare_baseline=True)
    assert r.identical_to_baseline and r.stats.draft_forwards > 0


# -- drafter="auto" ----------------------------------------------------------------------------------
def checkpoint_with_drafters(source, tmp_path, entries):
    target = tmp_path / "checkpoint"
    shutil.copytree(source, target)
    (target / DRAFTERS_FILE).write_text(json.dumps(entries))
    return target


@pytest.mark.parametrize("speedups, expected", [((1.4, 1.1), "layer-skip:1"), ((0.9, 1.1), "prompt-lookup")])
def test_auto_picks_the_fastest_entry(smolvlm_dir, tmp_path, photo, speedups, expected):
    entries = [{"drafter": "layer-skip:1", "speedup": speedups[0]}, {"drafter": "prompt-lookup", "speedup": speedups[1]}]
    captioner = mmspec.pipeline("image-captioning", model=checkpoint_with_drafters(smolvlm_dir, tmp_path, entries), dtype="fp32")
    assert captioner.chosen_drafter == expected and DRAFTERS_FILE in captioner.drafter_reason
    r = captioner(photo, max_new_tokens=4)
    assert r.stats.config["drafter"] == expected and f"{max(speedups):.2f}x" in r.stats.config["drafter_choice"]


def test_auto_loads_a_draft_model_relative_to_the_checkpoint(smolvlm, smolvlm_dir, tmp_path, photo):
    entries = [{"drafter": "prompt-lookup", "speedup": 1.1}, {"drafter": "spd-draft", "speedup": 1.8, "num_draft_tokens": 3}]
    checkpoint = checkpoint_with_drafters(smolvlm_dir, tmp_path, entries)
    save_tiny_draft(checkpoint / "spd-draft", vocab_size=len(smolvlm.tokenizer))
    captioner = mmspec.pipeline("image-captioning", model=checkpoint, dtype="fp32")
    assert captioner.chosen_drafter == f"draft model {checkpoint / 'spd-draft'}"
    r = captioner(photo, max_new_tokens=NEW_TOKENS, compare_baseline=True)
    assert r.identical_to_baseline and r.stats.config["num_draft_tokens"] == 3


def test_auto_without_file_is_prompt_lookup(smolvlm):
    assert smolvlm.chosen_drafter == "prompt-lookup" and "no mmspec_drafters.json" in smolvlm.drafter_reason


@pytest.mark.parametrize("measured_on, graphs", [("cpu", False), ("NVIDIA H100 80GB HBM3", False), ("NVIDIA H100 80GB HBM3", True)])
def test_auto_says_when_its_file_measured_another_device(tmp_path, measured_on, graphs):
    from mmspec.pipelines.captioning import choose_auto_drafter, choose_batch_drafter, choose_sampling_drafter

    machine = {"cpu": "AMD EPYC", "device": measured_on, "threads": 1, "dtype": "float32"}
    (tmp_path / DRAFTERS_FILE).write_text(json.dumps({
        "machine": machine, "benchmark": {"cuda_graphs": graphs}, "sampled_temperature": 1.0,
        "drafters": [{"drafter": "eagle", "speedup": 1.5, "sampled_speedup_per_token": 1.2}],
        "batches": [{"batch_size": 4, "drafter": "ar", "speedup": 1.0}]}))
    measured = ("cpu" if measured_on == "cpu" else "cuda", graphs)
    for runs_on in [("cpu", False), ("cuda", False), ("cuda", True)]:
        reasons = [choose_auto_drafter(tmp_path, runs_on)[1], choose_sampling_drafter(tmp_path, runs_on)[2]]
        if runs_on == measured:
            assert not any("measured on cpu" in r or "measured on cuda" in r for r in reasons)
            continue
        way = measured[0] + (" with CUDA graphs" if graphs else "")
        here = runs_on[0] + (" with CUDA graphs" if runs_on[1] else "")
        flags = f"--device {runs_on[0]}" + (" --cuda-graphs" if runs_on[1] else "")
        for reason in reasons:
            assert reason.endswith(f"; measured on {way}, not on this pipeline's {here}: `mmspec bench caption {flags} "
                                   "--write-drafters-file` measures it there")
        assert choose_auto_drafter(tmp_path, runs_on)[0]["drafter"] == "eagle"  # the file's choice, said to be from elsewhere
    if measured_on == "cpu":  # (the batch table: a CPU's, read on a GPU)
        assert choose_batch_drafter(tmp_path, 4, ("cuda", False))[2].endswith(
            "not on this pipeline's cuda: `mmspec bench caption --device cuda --write-drafters-file` measures it there")


@pytest.mark.parametrize("content", ["not json", "[]", '[{"drafter": "prompt-lookup"}]', '{"drafter": "ar"}'])
def test_invalid_drafters_file_is_a_clear_error(smolvlm_dir, tmp_path, content):
    checkpoint = checkpoint_with_drafters(smolvlm_dir, tmp_path, [])
    (checkpoint / DRAFTERS_FILE).write_text(content)
    with pytest.raises(ValueError, match=DRAFTERS_FILE):
        mmspec.pipeline("image-captioning", model=checkpoint, dtype="fp32")


# -- errors --------------------------------------------------------------------------------------------
def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match="known tasks: image-captioning, text-to-image, text-to-speech"):
        mmspec.pipeline("image-segmentation")


def test_unknown_drafter(smolvlm_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown drafter 'medusa-9'.*'layer-skip'"):
        mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", drafter="medusa-9")
    with pytest.raises(FileNotFoundError, match="draft model directory not found"):
        mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", drafter=str(tmp_path / "draft"))


@pytest.mark.parametrize("drafter, instead", [
    ("spd", "pass drafter='spd:PATH' with a small transformers causal LM sharing the target's tokenizer"),
    ("eagle2", r"pass drafter='eagle2:PATH' with one trained for this model \(`mmspec train drafter --method eagle`\)")])
def test_a_trained_drafter_by_name_on_a_users_model_says_what_to_pass(smolvlm_dir, drafter, instead):
    """By name, a trained drafter exists only for mmspec's embedded models: "spd" on a user's
    checkpoint pointed at `mmspec train caption-draft`, which trains the embedded captioner's draft
    only, and every line repeated itself ("no trained draft drafter ... (a trained draft drafter not found)")."""
    with pytest.raises(ValueError, match=f"^no trained {drafter} drafter ships for SmolVLMForConditionalGeneration "
                                         rf"\(mmspec ships them for its embedded models only\); {instead}") as error:
        mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", drafter=drafter)
    assert "caption-draft" not in str(error.value) and "not found" not in str(error.value)


@pytest.mark.parametrize("spec, line", [
    ("eagle:models/smolcap-eagle", "the eagle head in models/smolcap-eagle has width 576, the target 32: it was"),
    ("eagle3:models/smolcap-eagle3", "the EAGLE-3 head in models/smolcap-eagle3 has width 576 .* the target's is 32: it was"),
    ("medusa:models/smolcap-medusa", "the heads in models/smolcap-medusa have width 576, the target 32: they were")])
def test_a_head_trained_for_another_model_says_what_to_do(smolvlm_dir, monkeypatch, spec, line):
    """The embedded captioner's heads on a user's checkpoint: the line named the widths only."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    method = spec.split(":")[0]
    with pytest.raises(ValueError, match=f"^{line} trained for another model; train one for this model with "
                                         f"`mmspec train drafter --method {method} --target PATH --data DATA`$"):
        mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", drafter=spec)


@pytest.mark.parametrize("flag, value", [("trust_remote_code", "False"), ("cuda_graphs", "no"), ("optimize", 1)])
def test_construction_flags_take_true_or_false_only(smolvlm_dir, flag, value):
    """trust_remote_code="False" (a string) was taken as True, so the checkpoint's own code would run."""
    with pytest.raises(ValueError, match=f"^{flag} must be True or False, got {value!r}"):
        mmspec.pipeline("image-captioning", model=smolvlm_dir, **{flag: value})


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(smolvlm, smolvlm_dir, photo, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        smolvlm(photo, prompt=prompt)
    with pytest.raises(ValueError, match="prompt is empty"):
        mmspec.pipeline("image-captioning", model=smolvlm_dir, prompt=prompt)


def test_missing_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        mmspec.pipeline("image-captioning", model=tmp_path / "nope")


def test_text_only_model_is_refused(tmp_path, smolvlm):
    from transformers import AutoModelForCausalLM

    language_model = AutoModelForCausalLM.from_pretrained(save_tiny_draft(tmp_path / "lm", len(smolvlm.tokenizer)))
    with pytest.raises(ValueError, match="text-only model"):
        ImageCaptioningPipeline(language_model, processor=smolvlm.processor)


def test_image_errors_reach_the_caller(smolvlm, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.png"):
        smolvlm(tmp_path / "missing.png")
    fake = tmp_path / "notes.png"
    fake.write_text("this is text, not pixels")
    with pytest.raises(ValueError, match="notes.png is not an image file"):
        smolvlm(fake)



def test_a_list_is_checked_whole_before_any_caption(smolvlm, photo, tmp_path):
    """A bad item late in a list (stop 78 audit: 8 captions made, then the error, all of them lost)
    is refused before decoding, named by its place; an empty list is refused as t2i / tts do."""
    done = []
    for bad, kind, match in ((tmp_path / "scnes.png", FileNotFoundError, "image 3 of 3: image file not found"),
                             (np.zeros((3, 8, 8)), ValueError, r"image 3 of 3: .*channels first"),
                             (5, TypeError, "image 3 of 3: expected a PIL.Image")):
        with pytest.raises(kind, match=match):
            smolvlm([photo, photo, bad], progress=done.append)
    assert done == []
    with pytest.raises(ValueError, match="no images given"):
        smolvlm([])


def test_numpy_scalars_are_the_python_values(smolvlm, photo):
    """seed=np.int64 failed in torch's generator ("an integer is required"); np.bool_ was refused
    as "must be True or False, got np.True_ (bool)"; batch_size=np.int64 refused."""
    plain = smolvlm([photo, photo], seed=3, do_sample=True, max_new_tokens=8)
    numpy = smolvlm([photo, photo], seed=np.int64(3), do_sample=np.bool_(True), max_new_tokens=np.int64(8),
                    batch_size=np.int64(2), temperature=np.float32(1.0))
    assert [o.text for o in numpy] == [o.text for o in plain]
    assert type(numpy[0].stats.config["seed"]) is int


def test_a_pipeline_is_not_copied_or_pickled(smolvlm):
    import copy
    import pickle

    for copying in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="holds loaded models and kernels and cannot be pickled or copied"):
            copying(smolvlm)


# -- image inputs ------------------------------------------------------------------------------------
def rgb(image):
    out = load_image(image)
    assert out.mode == "RGB"
    return np.asarray(out)


@pytest.mark.parametrize(
    "image, expected",
    [
        (Image.new("RGB", (3, 2), (10, 20, 30)), (10, 20, 30)),
        (Image.new("RGBA", (3, 2), (255, 0, 0, 0)), (255, 255, 255)),  # transparent -> white
        (Image.new("RGBA", (3, 2), (0, 0, 0, 255)), (0, 0, 0)),
        (Image.new("LA", (3, 2), (0, 0)), (255, 255, 255)),
        (Image.new("La", (3, 2), (0, 0)), (255, 255, 255)),  # premultiplied (a ValueError before)
        (Image.new("RGBa", (3, 2), (0, 0, 0, 255)), (0, 0, 0)),
        (Image.new("CMYK", (3, 2), (0, 255, 255, 0)), (255, 0, 0)),
        (Image.new("L", (3, 2), 77), (77, 77, 77)),
        (Image.new("1", (3, 2), 1), (255, 255, 255)),
        (Image.new("I;16", (3, 2), 65535), (255, 255, 255)),
        (Image.new("I;16", (3, 2), 32896), (128, 128, 128)),  # scaled, not clipped to 255
        (Image.new("I", (3, 2), 40000), (156, 156, 156)),
        (Image.new("F", (3, 2), 0.5), (128, 128, 128)),
        (np.full((2, 3, 3), 200, np.uint8), (200, 200, 200)),
        (np.full((2, 3, 3), 65535, np.uint16), (255, 255, 255)),
        (np.full((2, 3), 1000, np.uint16), (4, 4, 4)),
        (np.full((2, 3, 3), 0.5, np.float32), (128, 128, 128)),
        (np.full((2, 3), 0.25, np.float64), (64, 64, 64)),
        (np.full((2, 3, 1), 9, np.uint8), (9, 9, 9)),
        (np.full((2, 3), True), (255, 255, 255)),
    ],
    ids=lambda v: getattr(v, "mode", None) or (f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else None),
)
def test_image_kinds_become_rgb(image, expected):
    pixels = rgb(image)
    assert pixels.shape == (2, 3, 3)
    assert (pixels == np.array(expected, np.uint8)).all(), pixels[0, 0]


def test_an_animation_says_its_first_frame_is_used_and_a_text_chunk_bomb_names_its_file(tmp_path):
    """The stop-77 audit: a GIF's first frame was captioned without a word; a PNG whose text chunk
    inflates past PIL's limit was PIL's bare message, no file named."""
    from PIL import Image, PngImagePlugin

    from mmspec.pipelines.images import load_image

    frames = [Image.new("RGB", (8, 8), colour) for colour in ("black", "white")]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:])
    with pytest.warns(UserWarning, match=r"a.gif holds 2 frames \(an animation or a multi-page file\); its first is used"):
        assert load_image(tmp_path / "a.gif").getpixel((0, 0)) == (0, 0, 0)
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * (PngImagePlugin.MAX_TEXT_CHUNK + 1), zip=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "bomb.png", pnginfo=info)
    with pytest.raises(ValueError, match=r"bomb.png is not an image file mmspec can read \(Decompressed data too large"):
        load_image(tmp_path / "bomb.png")


def test_numpy_rgba_is_composited_on_white():
    pixels = np.zeros((2, 3, 4), np.uint8)
    pixels[..., 0] = 255
    pixels[0, :, 3] = 255  # top row opaque red, bottom row transparent
    out = rgb(pixels)
    assert (out[0] == (255, 0, 0)).all() and (out[1] == (255, 255, 255)).all()


def test_palette_with_transparency():
    image = Image.new("P", (3, 2), 0)
    image.putpalette([0, 0, 255, 0, 255, 0] + [0] * 762)
    image.putpixel((0, 0), 1)
    image.info["transparency"] = 0
    out = rgb(image)
    assert tuple(out[0, 0]) == (0, 255, 0) and tuple(out[1, 1]) == (255, 255, 255)


def test_sixteen_bit_png_keeps_its_tones(tmp_path):
    ramp = (np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000)
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    assert Image.open(tmp_path / "ramp.png").mode == "I;16"
    out = rgb(tmp_path / "ramp.png")[..., 0]
    assert (out == np.rint(ramp / 257)).all() and len(np.unique(out)) == 12


@pytest.mark.parametrize("suffix", ["png", "jpg"])
def test_paths_str_and_pathlike(tmp_path, suffix):
    image = Image.new("RGB", (8, 6), (200, 100, 50))
    path = tmp_path / f"x.{suffix}"
    image.save(path)
    for given in (path, str(path)):
        out = rgb(given)
        assert out.shape == (6, 8, 3) and np.abs(out.astype(int) - (200, 100, 50)).max() <= 3


def test_exif_rotated_jpeg_equals_manual_rotation(tmp_path):
    rng = np.random.default_rng(1)
    stored = Image.fromarray(rng.integers(0, 256, (16, 32, 3), dtype=np.uint8))  # 32 wide, 16 high
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = tmp_path / "phone.jpg"
    stored.save(path, exif=exif, quality=95)
    decoded = Image.open(path)
    manual = np.asarray(decoded.convert("RGB").transpose(Image.Transpose.ROTATE_270))
    out = rgb(path)
    assert out.shape == (32, 16, 3) and (out == manual).all()
    assert (rgb(Image.open(path)) == manual).all()  # a PIL image is turned upright too


@pytest.mark.parametrize(
    "array, message",
    [
        (np.zeros((3, 8, 8), np.uint8), "channels first"),
        (np.zeros((8, 8, 2), np.uint8), "must be"),
        (np.zeros((2, 2, 2, 3), np.uint8), "must be"),
        (np.full((4, 4), 1.5, np.float32), r"values in \[0, 1\]"),
        (np.full((4, 4), np.nan, np.float32), "NaN"),
        (np.zeros((4, 4), np.int64), "unsupported dtype int64"),
        (np.zeros((0, 4), np.uint8), "empty"),
    ],
)
def test_bad_arrays(array, message):
    with pytest.raises(ValueError, match=message):
        load_image(array)


def test_missing_and_non_image_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="image file not found: .*absent.jpg"):
        load_image(tmp_path / "absent.jpg")
    fake = tmp_path / "fake.png"
    fake.write_text("hello")
    with pytest.raises(ValueError, match=r"fake.png is not an image file \("):
        load_image(fake)
    with pytest.raises(ValueError, match="is a directory"):
        load_image(tmp_path)
    with pytest.raises(ValueError, match="the image path is empty; give an image file"):
        load_image("")  # (not ". is a directory")
    with pytest.raises(TypeError, match="PIL.Image, a path or a numpy array"):
        load_image(42)
    # a local file's URL is its path (the stop-74 audit: "file:///a.png" was looked up as "file:/a.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "a b.png")
    assert load_image(f"file://{tmp_path}/a%20b.png").size == (8, 8)
    with pytest.raises(ValueError, match="names another host's file"):
        load_image("file://server/a.png")
    # any URL scheme, in any case, and data URLs: refused (they were looked up as files); "~" expanded
    for url in ("HTTP://example.com/x.png", "ftp://host/x.png", "s3://bucket/x.png", "data:image/png;base64,AAAA"):
        with pytest.raises(ValueError, match="is a URL; mmspec reads no URLs"):
            load_image(url)
    assert load_image(f"FILE://{tmp_path}/a%20b.png").size == (8, 8)
    home = Path(os.path.expanduser("~"))
    with pytest.raises(FileNotFoundError, match=f"image file not found: {home}/absent-mmspec.png"):
        load_image("~/absent-mmspec.png")


@pytest.mark.parametrize("image, hint", [
    (torch.zeros(3, 8, 8), r"tensor.permute\(1, 2, 0\).numpy\(\)"), (b"\x89PNG", r"PIL.Image.open\(io.BytesIO\(data\)\)"),
    ((i for i in range(2)), "pass a list of images"), (np.zeros((2, 8, 8, 3), np.uint8), r"pass a list of \[H, W, C\] arrays"),
])
def test_other_kinds_say_how_to_make_an_image(image, hint):
    with pytest.raises((TypeError, ValueError), match=hint):
        load_image(image)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="cut.png is not an image file"):
        load_image(path)


def test_too_large_images(tmp_path):
    wide = tmp_path / "wide.png"
    Image.new("1", (MAX_SIDE + 1, 1)).save(wide)
    with pytest.raises(ValueError, match=r"wide.png is too large: 16385x1 pixels"):
        load_image(wide)
    with pytest.raises(ValueError, match="too large.*megapixels"):
        load_image(Image.new("1", (8200, 8200)))  # 67 megapixels, 8 MB in mode "1"


@pytest.mark.parametrize("family", ["llava", "smolvlm", "gemma3", "mistral3"])
def test_prompt_mentioning_image_tokens_still_captions_the_one_image(family, tmp_path_factory, photo):
    """A literal ``<image>`` (or the family's own image token) in the prompt made the processor look
    for a second image, so every caption failed; now the text is escaped and the image captioned."""
    captioner = mmspec.pipeline("image-captioning", model=cached_tiny_checkpoint(family, tmp_path_factory), dtype="fp32")
    image_token = captioner.target.image_token_id
    expected = int((captioner.preprocess(photo, "What is it?")["input_ids"] == image_token).sum())
    for token in ["<image>", *captioner.image_tokens]:
        prompt = f"What is in the {token}? Answer about {token}."
        inputs = captioner.preprocess(photo, prompt)
        assert int((inputs["input_ids"] == image_token).sum()) == expected
        r = captioner(photo, prompt=prompt, max_new_tokens=2)
        assert r.prompt == prompt and r.stats.new_tokens == 2


def test_linears_are_optimized_at_load_unless_opted_out(smolvlm, smolvlm_dir, photo):
    from mmspec.modeling.fast_linear import FewRowLinear

    kernel = smolvlm.optimization.kernel
    assert kernel in ("c", "transposed") and smolvlm.optimization.replaced > 0
    assert any(isinstance(m, FewRowLinear) for m in smolvlm.model.modules())
    assert smolvlm(photo, max_new_tokens=4).stats.config["linears"] == smolvlm.optimization.label
    plain = mmspec.pipeline("image-captioning", model=smolvlm_dir, dtype="fp32", optimize=False)
    assert plain.optimization is None and not any(isinstance(m, FewRowLinear) for m in plain.model.modules())
    assert plain(photo, max_new_tokens=4).stats.config["linears"] == "as loaded"
