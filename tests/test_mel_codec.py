"""The embedded voice's codec: residual k-means over stacked log-mel frames, Griffin-Lim decoding."""

import dataclasses
import math

import pytest
import torch

from mmspec.modeling.mel_codec import MelCodecConfig, MelRVQCodec, _kmeans, with_decoding
from mmspec.modeling import spectrogram
from mmspec.modeling.spectrogram import griffin_lim, pghi_phase


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
    assert torch.equal(codec.decode(codes), waveform)  # Griffin-Lim's start is the same each time
    codec.save(tmp_path)
    again = MelRVQCodec.from_pretrained(tmp_path)
    assert torch.equal(again.encode(audio), codes)


def test_the_magnitude_is_torchaudios_inverse_mel_scale():
    """The pseudo-inverse made once gives what torchaudio's InverseMelScale solves for on each call
    (the minimum-norm least-squares solution), within float32 rounding, for the default codec's
    filters and another setting's; a wrong filter bank (mel_scale="htk") is far off."""
    import torchaudio

    for config in (MelCodecConfig(), MelCodecConfig(n_mels=40, f_max=6000.0, n_fft=512, hop_length=128)):
        codec = MelRVQCodec(config)
        vectors = torch.randn(30, config.dim, generator=torch.Generator().manual_seed(0))
        mel = vectors.reshape(-1, config.n_mels).T.exp()
        theirs = torchaudio.transforms.InverseMelScale(n_stft=config.n_fft // 2 + 1, n_mels=config.n_mels,
                                                      sample_rate=config.sample_rate, f_max=config.f_max,
                                                      norm="slaney", mel_scale="slaney")(mel)
        ours = codec.magnitude(vectors)
        assert ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
        htk = torchaudio.transforms.InverseMelScale(n_stft=config.n_fft // 2 + 1, n_mels=config.n_mels,
                                                   sample_rate=config.sample_rate, f_max=config.f_max, norm="slaney",
                                                   mel_scale="htk")(mel)
        assert not torch.allclose(ours, htk, rtol=1e-2, atol=1e-2 * float(theirs.abs().max()))


def test_short_and_empty_code_sequences_decode():
    codec = MelRVQCodec(MelCodecConfig(num_codebooks=2, codebook_size=4, griffin_lim_iters=2))
    assert codec.decode(torch.zeros(2, 0, dtype=torch.long)).shape == (0,)
    assert codec.decode(torch.zeros(2, 1, dtype=torch.long)).shape == (512,)


@pytest.fixture(params=["c", "torch"])
def kernels(request, monkeypatch):
    """Run the caller with the C kernels (skipped where they do not build) or with PyTorch's operators."""
    if request.param == "c":
        if spectrogram._spectral_library() is None:
            pytest.skip("the C kernels do not build here")
    else:
        monkeypatch.setattr(spectrogram, "_spectral_library", lambda: None)
    return request.param


@pytest.mark.parametrize("n_fft, hop, frames, momentum", [(1024, 256, 60, 0.99), (512, 128, 5, 0.0), (256, 128, 40, 0.5),
                                                         (512, 128, 7, 0.5)])
def test_griffin_lim_is_torchaudios(n_fft, hop, frames, momentum, kernels):
    """The fast Griffin-Lim computes torchaudio's (same window, padding, momentum and random start
    from the global generator) within float rounding, on a magnitude no signal has exactly: with
    the C phase update (kernels/spectral.c) and without."""
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


@pytest.mark.parametrize("n_fft, hop, frames", [(1024, 256, 216), (512, 128, 5), (256, 128, 40), (512, 128, 7)])
def test_the_c_stft_frames_are_pytorchs_reflected_windowed_frames(n_fft, hop, frames):
    """kernels/spectral.c's stft_frames gives bit for bit what Griffin-Lim's PyTorch path computes:
    the audio reflected at both ends as torch.stft(center=True) pads it, framed, times the window
    (the shortest audio Griffin-Lim takes, n_fft / hop + 1 frames, included)."""
    library = spectrogram._spectral_library()
    if library is None:
        pytest.skip("the C kernels do not build here")
    length, pad = (frames - 1) * hop, n_fft // 2
    audio = torch.randn(length, generator=torch.Generator().manual_seed(frames))
    window = torch.hann_window(n_fft)
    padded = torch.nn.functional.pad(audio[None, None], (pad, pad), mode="reflect")[0, 0]
    expected = padded.unfold(0, n_fft, hop) * window
    got = torch.full((frames, n_fft), float("nan"))
    library.stft_frames(got.data_ptr(), audio.data_ptr(), window.data_ptr(), frames, n_fft, hop, pad, length)
    assert torch.equal(got, expected)


def test_griffin_lim_starts_from_the_given_phase(kernels):
    """With a phase and no iterations, the output is the inverse STFT of |S| e^{i phase} (torch.polar
    and torch.istft), whatever the phase's dtype: the start built from cos and sin in the frames'
    layout is that spectrum; a transposed start (the bins' layout read as frames) is far off."""
    magnitude = torch.rand(513, 40, generator=torch.Generator().manual_seed(4)) ** 2
    phase = torch.rand(513, 40, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 40 - 20
    expected = torch.istft(torch.polar(magnitude, phase.float()), 1024, 256, window=torch.hann_window(1024), center=True)
    for given in (phase, phase.float()):
        got = griffin_lim(magnitude, 1024, 256, n_iter=0, phase=given)
        assert got.shape == expected.shape and (got - expected).abs().max() < 1e-5 * expected.abs().max()
    flipped = torch.istft(torch.polar(magnitude, phase.flip(1).float()), 1024, 256, window=torch.hann_window(1024),
                          center=True)
    assert (flipped - expected).abs().max() > 0.1 * expected.abs().max()


def test_griffin_lim_refuses_bad_shapes():
    with pytest.raises(ValueError, match="magnitude must be"):
        griffin_lim(torch.rand(500, 10), 1024, 256)
    with pytest.raises(ValueError, match="magnitude must be"):
        griffin_lim(torch.rand(513, 3), 1024, 256)
    with pytest.raises(ValueError, match="magnitude must be"):
        griffin_lim(torch.rand(513), 1024, 256)
    with pytest.raises(ValueError, match="momentum"):
        griffin_lim(torch.rand(513, 10), 1024, 256, momentum=1.0)


def test_the_c_phase_update_is_the_formula_in_every_lane():
    """kernels/spectral.c's griffin_lim_update against its formula, t = rebuilt - keep previous,
    t target / (|t| + 1e-16), for 1 .. 11 values: the vector loop's four at a time and its tail."""
    library = spectrogram._spectral_library()
    if library is None:
        pytest.skip("the C kernels do not build here")
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 12):
        rebuilt, previous = torch.randn(n, 2, generator=gen), torch.randn(n, 2, generator=gen)
        target, update = torch.rand(n, generator=gen), torch.empty(n, 2)
        library.griffin_lim_update(update.data_ptr(), rebuilt.data_ptr(), previous.data_ptr(), target.data_ptr(), n, 0.4)
        t = torch.view_as_complex(rebuilt - 0.4 * previous)
        assert torch.allclose(torch.view_as_complex(update), t * target / (t.abs() + 1e-16), rtol=1e-6, atol=1e-7), n


def harmonic_speech(seconds=1.5, rate=22050):
    """A voiced sound with a gliding pitch, twelve harmonics and a syllable-rate envelope."""
    t = torch.arange(int(seconds * rate)) / rate
    phase = 2 * math.pi * torch.cumsum((140 + 40 * torch.sin(2 * math.pi * 1.3 * t)) / rate, 0)
    voiced = sum(torch.sin(k * phase) / k for k in range(1, 13))
    return 0.2 * voiced * (0.55 + 0.45 * torch.sin(2 * math.pi * 3 * t))


def stft_magnitude(audio, n_fft=1024, hop=256):
    return torch.stft(audio, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True).abs()


def spectral_convergence(audio, magnitude):
    return float((stft_magnitude(audio) - magnitude).norm() / magnitude.norm())


def test_pghi_phase_advances_by_the_tones_frequency():
    """Across frames a steady tone's phase turns by 2 pi f hop at the bins that carry it (what the
    magnitude's slope across bins tells PGHI), whichever bin the tone falls between."""
    rate, hop = 22050, 256
    for frequency in (440.0, 1001.3):
        t = torch.arange(rate) / rate
        magnitude = stft_magnitude(torch.sin(2 * math.pi * frequency * t))
        phase = pghi_phase(magnitude, 1024, hop)
        peak = int(magnitude[:, 20].argmax())
        for m in (peak - 1, peak, peak + 1):
            step = phase[m, 21:60] - phase[m, 20:59]
            expected = 2 * math.pi * frequency * hop / rate
            assert torch.allclose(torch.remainder(step - expected + math.pi, 2 * math.pi) - math.pi,
                                  torch.zeros(39), atol=0.05)


def test_pghi_phase_turns_across_bins_as_a_clicks_phase_does():
    """Across bins a click's phase turns by the slope its time sets (what the magnitude's slope
    across frames tells PGHI): PGHI's bin-to-bin steps match the STFT's own where the click is loud."""
    audio = torch.zeros(22050)
    audio[5000] = 1.0
    spectrum = torch.stft(audio, 1024, 256, window=torch.hann_window(1024), return_complex=True)
    magnitude = spectrum.abs()
    phase = pghi_phase(magnitude, 1024, 256)
    loud = magnitude[1:] > 0.1 * magnitude.max()  # (pairs of neighbouring bins, both loud)
    loud &= magnitude[:-1] > 0.1 * magnitude.max()
    error = torch.remainder((phase[1:] - phase[:-1]) - (spectrum[1:].angle() - spectrum[:-1].angle()) + math.pi,
                            2 * math.pi) - math.pi
    assert loud.sum() > 500 and error[loud].abs().median() < 0.4


def test_pghi_starts_griffin_lim_where_a_random_phase_needs_twice_the_iterations(kernels):
    """On a voiced sound's magnitude: PGHI's phase alone is far closer than a random one, and 16
    iterations from it come as close as 32 from a random start (the embedded voice's codec
    decodes so; docs/speech.md has the measurements on speech)."""
    magnitude = stft_magnitude(harmonic_speech())
    phase = pghi_phase(magnitude, 1024, 256)
    torch.manual_seed(0)
    random_start = spectral_convergence(griffin_lim(magnitude, 1024, 256, n_iter=0), magnitude)
    pghi_start = spectral_convergence(griffin_lim(magnitude, 1024, 256, n_iter=0, phase=phase), magnitude)
    assert pghi_start < 0.5 * random_start
    torch.manual_seed(0)
    random_32 = spectral_convergence(griffin_lim(magnitude, 1024, 256, n_iter=32), magnitude)
    assert spectral_convergence(griffin_lim(magnitude, 1024, 256, n_iter=16, phase=phase), magnitude) <= random_32


def test_pghi_in_c_and_in_python_give_the_same_phase(monkeypatch):
    """kernels/spectral.c's integration is the Python loop's step for step, in the same double
    arithmetic (the same islands, the same order, the same sums): bit for bit, on a magnitude with
    many islands below the tolerance (a column-major one, as an lstsq solution is)."""
    if spectrogram._pghi_library() is None:
        pytest.skip("the C kernels do not build here")
    magnitude = stft_magnitude(harmonic_speech(0.6))
    magnitude = magnitude * (torch.rand(magnitude.shape, generator=torch.Generator().manual_seed(0)) > 0.2)
    magnitude = magnitude.T.contiguous().T  # (column-major)
    in_c = pghi_phase(magnitude, 1024, 256, tolerance=1e-2)
    monkeypatch.setattr(spectrogram, "_pghi_library", lambda: None)
    in_python = pghi_phase(magnitude, 1024, 256, tolerance=1e-2)
    assert torch.equal(in_c, in_python) and in_c.abs().max() > 10  # (phases integrated far, not left at 0)
    assert in_c[magnitude < 1e-2 * magnitude.max()].abs().max() == 0  # quieter than the tolerance: 0


def test_pghi_builds_alone_where_the_kernel_library_cannot(monkeypatch, tmp_path):
    """On a CPU without the kernel library (no AVX2, not x86) the integration's plain C builds alone
    (kernels/portable/pghi.c) and gives the Python loop's phase; without a C compiler, the Python loop."""
    import shutil

    from mmspec.modeling import fast_linear

    if not (shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("no C compiler here")
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(fast_linear, "_PORTABLE", None)
    monkeypatch.setattr(spectrogram, "_spectral_library", lambda: None)  # (as without AVX2)
    find_library = spectrogram._pghi_library.__wrapped__  # (not cached)
    portable = find_library()
    assert portable is not None and "portable-" in portable._name and str(tmp_path) in portable._name
    magnitude = stft_magnitude(harmonic_speech(0.4))
    monkeypatch.setattr(spectrogram, "_pghi_library", lambda: portable)
    in_c = pghi_phase(magnitude, 1024, 256)
    monkeypatch.setattr(spectrogram, "_pghi_library", lambda: None)
    assert torch.equal(in_c, pghi_phase(magnitude, 1024, 256)) and in_c.abs().max() > 10
    monkeypatch.setattr(fast_linear, "_PORTABLE", None)
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "empty"))  # (nothing built there yet)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert find_library() is None  # (no compiler: Python)


def test_pghi_and_griffin_lim_refuse_bad_inputs():
    with pytest.raises(ValueError, match="magnitude must be"):
        pghi_phase(torch.rand(500, 10), 1024, 256)
    with pytest.raises(ValueError, match="tolerance"):
        pghi_phase(torch.rand(513, 10), 1024, 256, tolerance=0)
    with pytest.raises(ValueError, match="phase must have"):
        griffin_lim(torch.rand(513, 10), 1024, 256, phase=torch.zeros(513, 9))
    with pytest.raises(ValueError, match="a million bands"):
        pghi_phase(torch.rand(513, 10), 1024, 256, band=1e-9)
    assert torch.equal(pghi_phase(torch.zeros(513, 6), 1024, 256), torch.zeros(513, 6))  # silence: nothing to integrate
    quiet = torch.rand(513, 12, generator=torch.Generator().manual_seed(0)) ** 4
    quiet[quiet < 0.05] = 0
    quiet *= 1e-34  # (1e-12 of its largest value underflows float32)
    assert torch.isfinite(griffin_lim(quiet, 1024, 256, 4, phase=pghi_phase(quiet, 1024, 256))).all()


def test_codec_settings_are_checked_and_the_random_start_still_decodes():
    with pytest.raises(ValueError, match="griffin_lim_start must be one of pghi, random"):
        MelRVQCodec(MelCodecConfig(griffin_lim_start="zero"))
    with pytest.raises(ValueError, match="griffin_lim_iters"):
        MelRVQCodec(MelCodecConfig(griffin_lim_iters=-1))
    codec = MelRVQCodec(MelCodecConfig(num_codebooks=2, codebook_size=4))
    codec.config = dataclasses.replace(codec.config, griffin_lim_start="PGHI")  # (set after construction: refused too)
    with pytest.raises(ValueError, match="griffin_lim_start must be one of"):
        codec.decode(torch.zeros(2, 8, dtype=torch.long))
    codes = torch.randint(0, 4, (2, 30), generator=torch.Generator().manual_seed(0))
    for start in ("pghi", "random"):
        codec = MelRVQCodec(MelCodecConfig(num_codebooks=2, codebook_size=4, griffin_lim_iters=3, griffin_lim_start=start))
        codec.codebooks.normal_(generator=torch.Generator().manual_seed(1))
        audio = codec.decode(codes)
        assert audio.shape == (30 * 512,) and torch.isfinite(audio).all() and torch.equal(codec.decode(codes), audio)



def test_a_decode_setting_reads_start_and_iterations_and_is_checked():
    """with_decoding (the scripts' START:ITERATIONS): the codec's settings replaced, each checked."""
    changed = with_decoding(MelCodecConfig(), "random:32")
    assert (changed.griffin_lim_start, changed.griffin_lim_iters) == ("random", 32) and changed.n_fft == MelCodecConfig().n_fft
    for bad, message in (("pghi", "START:ITERATIONS"), ("pghi:-1", "START:ITERATIONS"), ("zero:4", "griffin_lim_start")):
        with pytest.raises(ValueError, match=message):
            with_decoding(MelCodecConfig(), bad)
