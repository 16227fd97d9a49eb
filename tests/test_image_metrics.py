"""The text-to-image quality metrics (mmspec.metrics) and the metric model's recipe (mmspec train clip)."""

import argparse

import numpy as np
import pytest
import torch

pytest.importorskip("open_clip")

from mmspec.metrics import MetricCLIP, frechet_clip_distance, frechet_distance, load_metric_clip, prompt_score
from mmspec.metrics.image_quality import CompactTokenizer, clip_config, frechet_distance_from_statistics, prompt_scores

TINY = dict(image_size=32, patch_size=8, vision_width=32, vision_layers=1, context_length=32, text_width=32,
            text_layers=1, head_width=16, embed_dim=16)


def tiny_metric(texts=("a red circle on a white background", "a blue square")):
    torch.manual_seed(0)
    ids = CompactTokenizer.vocabulary(list(texts), TINY["context_length"])
    return MetricCLIP(clip_config(ids, **TINY), ids)


def test_frechet_distance_identical_sets_is_zero():
    features = np.random.default_rng(0).normal(size=(200, 8))
    assert frechet_distance(features, features) == pytest.approx(0.0, abs=1e-8)
    assert frechet_distance(torch.tensor(features), features.copy()) == pytest.approx(0.0, abs=1e-8)


def test_frechet_distance_closed_form_for_gaussians():
    mu_a, mu_b = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.5])
    var_a, var_b = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    expected = ((mu_a - mu_b) ** 2).sum() + ((np.sqrt(var_a) - np.sqrt(var_b)) ** 2).sum()  # diagonal: 7.25 + 5
    assert frechet_distance_from_statistics(mu_a, np.diag(var_a), mu_b, np.diag(var_b)) == pytest.approx(expected, rel=1e-10)
    # full covariances: against scipy's sqrtm
    scipy_linalg = pytest.importorskip("scipy.linalg")
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    sigma_a, sigma_b = a @ a.T + 0.1 * np.eye(5), b @ b.T + 0.1 * np.eye(5)
    reference = ((mu_a[:1] - mu_b[:1]) ** 2).sum() + np.trace(sigma_a + sigma_b - 2 * scipy_linalg.sqrtm(sigma_a @ sigma_b).real)
    mu5_a, mu5_b = np.r_[mu_a[:1], np.zeros(4)], np.r_[mu_b[:1], np.zeros(4)]
    assert frechet_distance_from_statistics(mu5_a, sigma_a, mu5_b, sigma_b) == pytest.approx(reference, rel=1e-8)
    # from samples: the estimate approaches the closed form
    samples_a = rng.normal(size=(20000, 3)) * np.sqrt(var_a) + mu_a
    samples_b = rng.normal(size=(20000, 3)) * np.sqrt(var_b) + mu_b
    assert frechet_distance(samples_a, samples_b) == pytest.approx(expected, rel=0.03)


def test_frechet_distance_is_symmetric_and_stable_for_singular_covariances():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(300, 6)), rng.normal(size=(300, 6)) * 2 + 0.5
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-9)
    few_a, few_b = rng.normal(size=(4, 16)), rng.normal(size=(5, 16))  # rank-deficient covariances
    distance = frechet_distance(few_a, few_b)
    assert np.isfinite(distance) and distance >= 0
    assert distance == pytest.approx(frechet_distance(few_b, few_a), rel=1e-6)


def test_prompt_score_and_features_on_a_tiny_random_model():
    from PIL import Image

    metric = tiny_metric()
    images = torch.randint(0, 256, (3, 3, 48, 48), dtype=torch.uint8)
    prompts = ["a red circle", "a blue square", "a purple zebra!"]  # unknown words -> the unknown token
    features = metric.image_features(images)
    assert features.shape == (3, 16) and torch.allclose(features.norm(dim=-1), torch.ones(3), atol=1e-5)
    # uint8, float [-1, 1] and PIL inputs agree
    as_float = metric.image_features(images.float() / 127.5 - 1)
    as_pil = metric.image_features([Image.fromarray(x.permute(1, 2, 0).numpy()) for x in images.view(3, 3, 48, 48)])
    assert torch.allclose(features, as_float, atol=1e-5) and as_pil.shape == (3, 16)
    text = metric.text_features(prompts)
    tokens = metric.tokenizer(prompts)
    assert text.shape == (3, 16) and int((tokens == 1).sum()) > 0
    with torch.no_grad():  # the length-bucketed text encoder equals open_clip's own
        assert torch.allclose(metric.encode_text(tokens), metric.model.encode_text(tokens), atol=1e-5)
    scores = prompt_scores(images, prompts, model=metric)
    assert scores.shape == (3,) and bool((scores >= 0).all()) and bool((scores <= 100).all())
    assert prompt_score(images, prompts, model=metric) == pytest.approx(float(scores.mean()))
    assert frechet_clip_distance(images, images, model=metric) == pytest.approx(0.0, abs=1e-6)


def test_clip_recipe_trains_saves_and_loads(tmp_path, monkeypatch):
    from mmspec.train import clip

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    parser = argparse.ArgumentParser()
    clip.add_arguments(parser)
    out = tmp_path / "t2i-clip"
    args = parser.parse_args(["--out", str(out), "--steps", "2", "--batch-size", "4", "--images", "8",
                              "--val-images", "6", "--eval-pairs", "6", "--save-every", "1", "--vision-width", "32",
                              "--vision-layers", "1", "--text-width", "32", "--text-layers", "1", "--head-width", "16",
                              "--embed-dim", "16", "--image-size", "32", "--warmup", "1"])
    assert clip.run(args) == 0
    import json

    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["step"] == 2 and 0 <= evaluation["top1"] <= evaluation["top5"] <= 1
    assert (out / "model.safetensors").exists() and json.loads((out / "training.json").read_text())["step"] == 2
    metric = load_metric_clip(out)
    assert metric.model.text_projection.dtype == torch.float32
    score = prompt_score(torch.zeros(2, 3, 64, 64, dtype=torch.uint8), ["a red circle", "a blue square"], model=metric)
    assert 0 <= score <= 100
    # rerunning with more steps resumes from the checkpoint
    args.steps = 3
    assert clip.run(args) == 0
    assert json.loads((out / "eval.json").read_text())["step"] == 3
