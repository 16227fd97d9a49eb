"""The one logits -> probabilities transform, checked against transformers' logits processors."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from mmspec.core.sampling import SamplingConfig, cfg_combine, logits_to_probs, sample_from_probs


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 10, 0.5)])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = logits_to_probs(logits, SamplingConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, expected.softmax(-1))


def test_greedy_is_point_mass():
    logits = torch.tensor([[0.1, 3.0, -1.0]])
    assert logits_to_probs(logits, SamplingConfig()).tolist() == [[0.0, 1.0, 0.0]]


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="guidance_scale"):
        SamplingConfig(guidance_scale=0.5)


@pytest.mark.parametrize("settings", [
    {"do_sample": True, "temperature": float("inf")}, {"temperature": float("inf")}, {"temperature": float("nan")},
    {"do_sample": True, "temperature": "hot"}, {"temperature": True}, {"top_k": 2.5}, {"top_k": "5"},
    {"top_p": float("nan")}, {"guidance_scale": float("inf")},
])
def test_non_finite_or_non_numeric_settings_are_one_value_error(settings):
    """Every task builds its sampling here, so an infinite temperature (noise for t2i, a crash in the
    TTS NAR stage before) or a string is refused once, in one line naming the setting."""
    (name,) = [key for key in settings if key != "do_sample"]
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingConfig(**settings)


def test_cfg_combine():
    c, u = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    assert cfg_combine(c, u, 3.0).tolist() == [4.0, -2.0]


def test_inverse_cdf_sampling_distribution():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    draws = sample_from_probs(p.expand(u.shape[0], 4), u)
    freq = torch.bincount(draws, minlength=4).double() / u.shape[0]
    assert freq[1] == 0
    assert (freq - p.double()).abs().max() < 0.005
    # edge uniforms never pick a zero-weight token or run past the vocabulary
    edge = sample_from_probs(torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]), torch.tensor([0.0, 0.9999999]))
    assert edge.tolist() == [1, 1]
