"""The embedded voice's codec: residual k-means over stacked log-mel frames, Griffin-Lim decoding."""

import math

import torch

from mmspec.modeling.mel_codec import MelCodecConfig, MelRVQCodec, _kmeans


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
