"""The embedded default captioner (models/smolcap + the installed SmolLM2) through the pipeline.

fp32 so that greedy speculative decoding must reproduce plain decoding token for token (in bf16 a
near-tie can be broken differently by a multi-token forward; docs/usage.md)."""

from pathlib import Path

import pytest
import torch

import mmspec

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


@pytest.fixture(scope="module")
def pipe():
    return mmspec.pipeline("image-captioning", model=None, drafter="prompt-lookup", device="cpu", dtype=torch.float32)


TRAINED = ["spd", "kangaroo", "medusa", "hydra", "eagle", "eagle2", "eagle3", "eagle3-tree"]  # shipped in models/smolcap-*


@pytest.mark.parametrize("drafter", ["prompt-lookup", *TRAINED])
def test_embedded_captioner_greedy_is_lossless(pipe, drafter):
    pipe.drafter, pipe.chosen_drafter, pipe.drafter_reason = pipe.resolve_drafter(drafter)
    out = pipe(SAMPLES / "scenes.png", prompt="Explain what this image shows in detail.", max_new_tokens=40, compare_baseline=True)
    assert out.text and out.text == out.baseline_text
    assert out.stats.new_tokens > 5 and out.stats.speedup > 0
    assert out.stats.config["drafter"] == drafter
    if drafter in TRAINED:  # the shipped drafter is the one trained for this captioner: it gets accepted
        assert out.stats.mean_accepted_length > 1.5


def test_the_embedded_captioners_folder_is_the_embedded_captioner():
    """model="models/smolcap" (the folder README names) loads what model=None loads."""
    from mmspec.modeling.captioner import default_captioner_dir

    named = mmspec.pipeline("image-captioning", model=str(default_captioner_dir()), drafter="ar", dtype=torch.float32)
    default = mmspec.pipeline("image-captioning", drafter="ar", dtype=torch.float32)
    assert named(SAMPLES / "photo.png", max_new_tokens=8).text == default(SAMPLES / "photo.png", max_new_tokens=8).text


def test_readme_sample_gets_a_correct_caption(pipe):
    """The README's main job captions samples/photo.png (a fundus photograph of a retina)."""
    pipe.drafter, pipe.chosen_drafter, pipe.drafter_reason = pipe.resolve_drafter("eagle2")
    out = pipe(SAMPLES / "photo.png", prompt="Give a detailed description of this picture.", max_new_tokens=64, compare_baseline=True)
    assert "retina" in out.text and out.text == out.baseline_text


def test_embedded_captioner_answers_text_questions_without_an_image(pipe):
    from mmspec.modeling.captioner import load_default_captioner

    model, processor = load_default_captioner(dtype=torch.float32)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    inputs = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], return_tensors="pt")
    out = mmspec.generate(model, max_new_tokens=16, **inputs)
    assert "Paris" in processor.tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:])


def test_threads_calling_one_pipeline_get_their_own_captions():
    """Four threads captioning through one pipeline (EAGLE-3, the default drafter, whose state the
    calls share) get the captions of four calls one after another; unguarded they got wrong
    captions and a ValueError from the fused chain (PIPELINE_LOCK)."""
    import threading

    pipe = mmspec.pipeline("image-captioning", model=None, drafter="eagle3", device="cpu")
    images = [SAMPLES / name for name in ("photo.png", "charts.png", "text.png", "scenes.png")]
    alone = [pipe(image, max_new_tokens=16).text for image in images]
    together: list = [None] * len(images)

    def caption(i):
        together[i] = pipe(images[i], max_new_tokens=16).text

    threads = [threading.Thread(target=caption, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone and len(set(alone)) > 1


def test_a_captioner_trained_into_another_folder_loads_as_the_embedded_one(pipe, tmp_path):
    """The stop-78 audit: `mmspec train captioner --out runs/smolcap-v3` wrote a folder that only
    loaded copied into models/smolcap ("Unrecognized processing class")."""
    from mmspec.modeling.captioner import WEIGHTS_FILE, default_captioner_dir

    (tmp_path / WEIGHTS_FILE).symlink_to(default_captioner_dir() / WEIGHTS_FILE)
    other = mmspec.pipeline("image-captioning", model=tmp_path, drafter="prompt-lookup", device="cpu", dtype=torch.float32)
    image = SAMPLES / "photo.png"
    assert other(image, max_new_tokens=12).text == pipe(image, max_new_tokens=12).text
