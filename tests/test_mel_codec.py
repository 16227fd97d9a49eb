"""The embedded voice's codec: residual k-means over stacked log-mel frames, Griffin-Lim decoding."""

import math

import pytest
import torch

from mmspec.modeling.mel_codec import MelCodecConfig, MelRVQCodec, _kmeans
from mmspec.modeling.spectrogram import griffin_lim


def tones(seconds=2.0, rate=22050):
    t = torch.arange(int(seconds * rate)) / rate
    pitch = 200 + 300 * t / seconds  # a rising tone with a harmonic
    phase = 2 * math.pi * torch.cumsum(pitch / rate, 0)
    return 0.3 * torch.sin(phase) + 0.1 * torch.sin(2 * phase)


def test_kmeans_finds_separated_clusters():
    gen = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    points = torch.cat([c + 0.1 * torch.randn(50, 2, generator=gen) for c in centres])
    found = _kmeans(points, 3, 10, torch.Generator().manual_seed(1))
    assert torch.cdist(found, centres).min(0).values.max() < 0.1


def test_fit_encode_decode_and_reload(tmp_path):
    codec = MelRVQCodec(MelCodecConfig(num_codebooks=3, codebook_size=16, griffin_lim_iters=4))
    audio = tones()
    vectors = codec.features(audio)
    assert vectors.shape[1] == 160 and vectors.shape[0] == (audio.shape[0] // 256 + 1) // 2
    errors = codec.fit(vectors, iterations=10)
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.5 * float(vectors.var(0).mean())
    codes = codec.encode(audio)
    assert codes.shape == (3, vectors.shape[0]) and int(codes.max()) < 16
    assert torch.allclose(codec.dequantise(codes), codec.dequantise(codec.quantise(codec.dequantise(codes))), atol=1e-4)
    waveform = codec.decode(codes)
    assert waveform.shape == (codes.shape[1] * 2 * 256,) and torch.isfinite(waveform).all()
    assert torch.equal(codec.decode(codes), waveform)  # Griffin-Lim's random start is seeded
    codec.save(tmp_path)
    again = MelRVQCodec.from_pretrained(tmp_path)
    assert torch.equal(again.encode(audio), codes)


def test_short_and_empty_code_sequences_decode():
    codec = MelRVQCodec(MelCodecConfig(num_codebooks=2, codebook_size=4, griffin_lim_iters=2))
    assert codec.decode(torch.zeros(2, 0, dtype=torch.long)).shape == (0,)
    assert codec.decode(torch.zeros(2, 1, dtype=torch.long)).shape == (512,)


@pytest.mark.parametrize("n_fft, hop, frames, momentum", [(1024, 256, 60, 0.99), (512, 128, 5, 0.0), (256, 128, 40, 0.5)])
def test_griffin_lim_is_torchaudios(n_fft, hop, frames, momentum):
    """The fast Griffin-Lim computes torchaudio's (same window, padding, momentum and random start
    from the global generator) within float rounding, on a magnitude no signal has exactly."""
    import torchaudio

    magnitude = torch.rand(n_fft // 2 + 1, frames, generator=torch.Generator().manual_seed(1)) ** 4
    torch.manual_seed(0)
    expected = torchaudio.functional.griffinlim(magnitude, torch.hann_window(n_fft), n_fft, hop, n_fft, 1.0, 16,
                                                momentum, None, True)
    torch.manual_seed(0)
    got = griffin_lim(magnitude, n_fft, hop, n_iter=16, momentum=momentum)
    assert got.shape == expected.shape == ((frames - 1) * hop,)
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
    # a real signal's magnitude comes back as a signal with (nearly) that magnitude
    audio = tones(1.0)
    spec = torch.stft(audio, 1024, 256, window=torch.hann_window(1024), return_complex=True).abs()
    torch.manual_seed(0)
    rebuilt = torch.stft(griffin_lim(spec, 1024, 256), 1024, 256, window=torch.hann_window(1024), return_complex=True).abs()
    assert ((rebuilt - spec).norm() / spec.norm()) < 0.15  # (random phases: 0.82; 4 iterations: 0.23)


def test_griffin_lim_refuses_bad_shapes():
    with pytest.raises(ValueError, match="magnitude must be"):
        griffin_lim(torch.rand(500, 10), 1024, 256)
    with pytest.raises(ValueError, match="magnitude must be"):
        griffin_lim(torch.rand(513, 3), 1024, 256)
    with pytest.raises(ValueError, match="magnitude must be"):
        griffin_lim(torch.rand(513), 1024, 256)
    with pytest.raises(ValueError, match="momentum"):
        griffin_lim(torch.rand(513, 10), 1024, 256, momentum=1.0)
