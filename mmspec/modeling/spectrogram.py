"""The log-mel spectrogram of a waveform (HiFi-GAN's convention).

Here, in the modeling layer, because a model needs it (:mod:`mmspec.modeling.mel_codec` encodes
audio to mel frames) and a model may not import from the adapters above it;
:mod:`mmspec.adapters.audio.codec` re-exports :func:`log_mel` under its old name.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=8)
def _mel_transform(rate: int, n_mels: int, n_fft: int, hop_length: int, f_max: float | None):
    import torchaudio

    # (float32 whatever the default dtype is at the first call: the transform is cached)
    return torchaudio.transforms.MelSpectrogram(sample_rate=rate, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels,
                                                f_max=f_max, power=1.0, norm="slaney", mel_scale="slaney").float()


def log_mel(waveform: torch.Tensor, rate: int, n_mels: int = 80, n_fft: int = 1024, hop_length: int = 256,
            f_max: float | None = None, floor: float = 1e-5) -> torch.Tensor:
    """Log-magnitude mel spectrogram (HiFi-GAN's convention, as the embedded voice's codec:
    magnitude STFT, Slaney mel filters, natural log of values clamped to ``floor``).

    Args:
        waveform: float [samples] or [channels, samples].
        rate: its sampling rate.
        f_max: the highest filter's edge (default rate / 2).
    Returns:
        float32 [n_mels, frames] for [samples], [channels, n_mels, frames] for [channels, samples];
        frames = samples // hop_length + 1 (centred frames).

    Centred frames pad each end by n_fft / 2 reflected samples, which needs more than n_fft / 2
    samples; a shorter clip (a sentence said very fast is one 512-sample codec frame) is first
    padded with zeros to n_fft / 2 + 1 samples, and its frames are the first samples // hop_length
    + 1 of that.
    """
    audio = torch.as_tensor(waveform).float()
    if audio.dim() not in (1, 2) or audio.shape[-1] == 0:
        raise ValueError(f"waveform must be a non-empty [samples] or [channels, samples], "
                         f"got shape {tuple(audio.shape)}")
    mel = _mel_transform(int(rate), n_mels, n_fft, hop_length, f_max).to(audio.device)
    samples, shortest = audio.shape[-1], n_fft // 2 + 1
    if samples >= shortest:
        return mel(audio).clamp_min(floor).log()
    padded = torch.nn.functional.pad(audio, (0, shortest - samples))
    return mel(padded)[..., : samples // hop_length + 1].clamp_min(floor).log()


@functools.cache
def _spectral_library():
    """The kernel library where :func:`griffin_lim`'s inner loops run in C (``kernels/spectral.c``:
    an x86-64 CPU with AVX2 + FMA where the kernels build), else None (PyTorch's operators)."""
    from .fast_linear import kernel_library

    return kernel_library()


@functools.cache
def _pghi_library():
    """A library where :func:`pghi_phase`'s integration runs in C (``kernels/portable/pghi.c``): the
    kernel library, else the portable one built alone (any CPU with a C compiler), else None (Python)."""
    from .fast_linear import KernelUnavailable, load_portable_kernel

    library = _spectral_library()
    if library is None:
        try:
            library = load_portable_kernel()
        except KernelUnavailable:
            return None
    return library


#: the Gaussian window whose phase-magnitude relation PGHI uses for a Hann window of length L has
#: variance parameter lambda = PGHI_HANN_GAMMA * L^2 (Prusa, Balazs and Sondergaard 2017, Table 1)
PGHI_HANN_GAMMA = 0.25645


def pghi_phase(magnitude: torch.Tensor, n_fft: int, hop_length: int, tolerance: float = 1e-3, band: float = 0.1
               ) -> torch.Tensor:
    """A phase for an STFT magnitude without iterations: Phase Gradient Heuristic Integration
    (Prusa, Balazs and Sondergaard, "A noniterative method for reconstruction of phase from STFT
    magnitude", 2017), in ``torch.stft``'s convention (each frame's time from its first sample, a
    periodic Hann window of n_fft). For a Gaussian window the log-magnitude s and the phase phi
    are tied (lambda = 0.25645 n_fft^2 for Hann, a = hop_length, M = n_fft, m the bin, n the frame):

        phi(m, n + 1) - phi(m, n) ~ a M / lambda * ds/dm + 2 pi a m / M,
        phi(m + 1, n) - phi(m, n) ~ -lambda / (a M) * ds/dn - pi

    (s = log max(|X|, 1e-12 max |X|), its differences central, one-sided at the edges; of the
    floors tried, 1e-30 to 1e-4, 1e-12 came closest after Griffin-Lim on the voice's spectra). The
    phase is integrated from the loudest coefficient outwards, loudest first (a bucket queue of
    ``band`` nats), by the trapezoid rule; each island of coefficients above ``tolerance`` times
    the largest starts at phase 0 from its loudest; quieter ones get phase 0. As Griffin-Lim's
    start it gives in 16 iterations the spectral convergence that 32 give from a random phase
    (docs/speech.md, "The codec's decode"). The integration runs in C (``kernels/portable/pghi.c``,
    plain C: on any CPU with a C compiler), else in Python (the same arithmetic: the steps in
    float32, their sums in double; the same phase, ~15x slower: on one core 1.1 ms a second of
    audio in C, 17-19 ms in Python, where Griffin-Lim's 16 iterations take ~3.5 ms).

    Args:
        magnitude: float [n_fft / 2 + 1, T], T >= 1.
    Returns:
        float32 [n_fft / 2 + 1, T] phases in radians (not wrapped).
    """
    bins, frames = magnitude.shape if magnitude.dim() == 2 else (0, 0)
    if bins != n_fft // 2 + 1 or frames < 1:
        raise ValueError(f"magnitude must be [{n_fft // 2 + 1}, T >= 1], got {tuple(magnitude.shape)}")
    if bins * frames >= 2**31:  # (the integration indexes coefficients with 32-bit integers)
        raise ValueError(f"a magnitude of {frames} frames is too long to integrate at once (13 hours at a 256-sample "
                         "hop); decode it in pieces")
    if not 0 < tolerance < 1 or not band > 0 or -math.log(tolerance) / band > 1e6:
        raise ValueError(f"tolerance must lie in (0, 1) and band be positive, with at most a million bands of "
                         f"log(1 / tolerance) / band, got {tolerance} and {band}")
    magnitude = magnitude.detach().cpu().float().contiguous()  # (an lstsq solution comes column-major)
    log = magnitude.clamp_min(max(1e-12 * float(magnitude.max()), torch.finfo(torch.float32).tiny)).log()
    top = float(log.max())
    bands = int(-math.log(tolerance) / band) + 1
    level = ((top - log) / band).floor().clamp_max(bands - 1).to(torch.int32)
    level[(magnitude <= 0) | (log < top + math.log(tolerance))] = -1
    lam = PGHI_HANN_GAMMA * n_fft ** 2
    along_bins = torch.gradient(log, dim=0)[0]
    along_frames = torch.gradient(log, dim=1)[0] if frames > 1 else torch.zeros_like(log)
    bin_index = torch.arange(bins, dtype=torch.float32)[:, None]
    step_t = (hop_length * n_fft / lam * along_bins + 2 * math.pi * hop_length / n_fft * bin_index).contiguous()
    step_f = (-lam / (n_fft * hop_length) * along_frames - math.pi).contiguous()
    phase = torch.zeros(bins, frames, dtype=torch.float64)
    library = _pghi_library()
    if library is None or library.pghi_integrate(phase.data_ptr(), level.data_ptr(), step_t.data_ptr(), step_f.data_ptr(),
                                                 bins, frames, bands):
        phase = _pghi_integrate(level, step_t, step_f, bands)
    return phase.float()


def _pghi_integrate(level: torch.Tensor, step_t: torch.Tensor, step_f: torch.Tensor, bands: int) -> torch.Tensor:
    """:func:`pghi_phase`'s integration in Python, step for step ``pghi_integrate`` of
    ``kernels/portable/pghi.c`` (its comment says how): levels int [bins, T] (-1: left at 0), the
    steps float32 [bins, T] -> phase float64 [bins, T]."""
    bins, frames = level.shape
    levels, along_t, along_f = level.flatten().tolist(), step_t.flatten().tolist(), step_f.flatten().tolist()
    phase, done = [0.0] * len(levels), [lv < 0 for lv in levels]
    seeds: list[list[int]] = [[] for _ in range(bands)]
    for i, lv in enumerate(levels):
        if lv >= 0:
            seeds[lv].append(i)
    frontier: list[list[int]] = [[] for _ in range(bands)]
    for seed in (i for band_seeds in seeds for i in band_seeds):
        if done[seed]:
            continue
        done[seed], current, size = True, levels[seed], 1
        frontier[current].append(seed)
        while size:
            while not frontier[current]:
                current += 1
            i = frontier[current].pop()
            size -= 1
            m, t, p = i // frames, i % frames, phase[i]
            for ok, j, step in ((t + 1 < frames, i + 1, along_t), (t > 0, i - 1, along_t),
                                (m + 1 < bins, i + frames, along_f), (m > 0, i - frames, along_f)):
                if ok and not done[j]:
                    phase[j] = p + (step[i] + step[j]) / 2 if j > i else p - (step[i] + step[j]) / 2
                    done[j] = True
                    frontier[levels[j]].append(j)
                    size += 1
                    current = min(current, levels[j])
    return torch.tensor(phase, dtype=torch.float64).view(bins, frames)


def griffin_lim(magnitude: torch.Tensor, n_fft: int, hop_length: int, n_iter: int = 32, momentum: float = 0.99,
                phase: torch.Tensor | None = None) -> torch.Tensor:
    """Audio whose STFT magnitude approximates ``magnitude``: fast Griffin-Lim (Perraudin, Balazs
    and Sondergaard, 2013), the algorithm and arithmetic of ``torchaudio.functional.griffinlim``
    (periodic Hann window of n_fft, centred frames, reflect padding, random initial phase) at ~2.7x
    its speed on a CPU core (a 3-second utterance: ~25 ms instead of ~67 ms for 32 iterations).

        x_n = ISTFT(S * P_n),   c_n = STFT(x_n),   t_n = c_n - m / (1 + m) * c_{n-1},
        P_{n+1} = t_n / (|t_n| + 1e-16),   output ISTFT(S * P_N),

    with P_0 = exp(i ``phase``) where given (:func:`pghi_phase` gives a good one), else ``torch.rand``
    complex (drawn from the global generator, as torchaudio draws it, so a caller seeds it the same
    way), and c_{-1} = 0.

    Why not torchaudio's: on a CPU its iterations spend more time outside the FFTs than in them
    (``torch.istft``'s overlap-add, complex ``abs`` and division, strided copies between the
    STFT's [F, T] layout and its frames). Here the frames stay frame-major [T, n_fft], the
    overlap-add is n_fft / hop_length shifted additions, the window envelope is divided once,
    and the phase update runs in place on the real and imaginary planes; where the C kernels
    build, the overlap-add, the forward STFT's reflected and windowed frames and the phase update
    are one pass each (``kernels/spectral.c``: an iteration over a 4.8-second utterance 0.90 ms
    instead of 1.55 on one core before the frames joined them).

    Args:
        magnitude: float [n_fft / 2 + 1, T] (T >= n_fft / hop_length + 1 frames).
        n_fft, hop_length: the STFT's; hop_length must divide n_fft.
        n_iter: the iterations; momentum m in [0, 1).
        phase: float [n_fft / 2 + 1, T], the start (default random).
    Returns:
        float [(T - 1) * hop_length] audio samples, what ``torch.istft(..., center=True)`` gives.
    """
    bins, frames = magnitude.shape if magnitude.dim() == 2 else (0, 0)
    if bins != n_fft // 2 + 1 or n_fft % hop_length or frames < n_fft // hop_length + 1:
        raise ValueError(f"magnitude must be [{n_fft // 2 + 1}, T >= {n_fft // hop_length + 1}] with hop_length dividing "
                         f"n_fft, got {tuple(magnitude.shape)} and hop_length {hop_length}")
    if phase is not None and phase.shape != magnitude.shape:
        raise ValueError(f"phase must have the magnitude's shape {tuple(magnitude.shape)}, got {tuple(phase.shape)}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
    overlap, pad, length = n_fft // hop_length, n_fft // 2, (frames - 1) * hop_length
    window = torch.hann_window(n_fft, dtype=magnitude.dtype, device=magnitude.device)
    envelope = torch.zeros(frames + overlap - 1, hop_length, dtype=magnitude.dtype, device=magnitude.device)
    squared = window.square().view(overlap, hop_length)
    for j in range(overlap):
        envelope[j : j + frames] += squared[j]
    inverse_envelope = envelope.view(-1)[pad : pad + length].reciprocal()
    summed = torch.empty_like(envelope)
    padded = magnitude.new_empty(length + 2 * pad)
    # the overlap-add, the forward STFT's reflected and windowed frames, and the phase update in C
    # where the kernels build (kernels/spectral.c: one pass each; the same operations, the overlap-add
    # summed in another order: ~1e-5 apart after 32 iterations), PyTorch's operators elsewhere
    library = _spectral_library() if magnitude.dtype == torch.float32 and magnitude.device.type == "cpu" else None

    def istft(spectrum: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # [T, bins] complex -> out [length]
        parts = torch.fft.irfft(spectrum, n=n_fft, dim=1)
        if library is not None:
            library.overlap_add(out.data_ptr(), parts.data_ptr(), window.data_ptr(), inverse_envelope.data_ptr(), frames,
                                n_fft, hop_length, pad, length)
            return out
        parts = parts.mul_(window).view(frames, overlap, hop_length)
        summed.zero_()
        for j in range(overlap):
            summed[j : j + frames] += parts[:, j]
        return torch.mul(summed.view(-1)[pad : pad + length], inverse_envelope, out=out)

    target = magnitude.T.contiguous()  # [T, bins]
    keep = momentum / (1 + momentum)
    if phase is None:
        spectrum = (magnitude * torch.rand(magnitude.shape, dtype=torch.complex64 if magnitude.dtype != torch.float64
                                           else torch.complex128, device=magnitude.device)).T.contiguous()
    else:
        # S e^{i phase} in the frames' layout [T, bins]: PyTorch's vectorised cos and sin (torch.polar
        # takes one scalar sincos per value; with its transpose 1.12 against 0.55 ms for 216 frames)
        turned = phase.T.to(magnitude)
        spectrum = torch.view_as_complex(torch.stack([target * turned.cos(), target * turned.sin()], dim=-1))
    previous = torch.zeros(frames, bins, 2, dtype=magnitude.dtype, device=magnitude.device)
    update = torch.empty_like(previous)
    scale = torch.empty_like(target)
    real, imag = update[..., 0], update[..., 1]
    windowed = magnitude.new_empty(frames, n_fft) if library is not None else None
    for _ in range(n_iter):
        audio = istft(spectrum, padded[pad : pad + length])
        if library is not None:  # the frames of the audio reflected at its ends, windowed, in one pass
            library.stft_frames(windowed.data_ptr(), audio.data_ptr(), window.data_ptr(), frames, n_fft, hop_length, pad,
                                length)
        else:
            padded[:pad] = audio[1 : pad + 1].flip(0)  # reflect padding, as torch.stft(center=True) pads
            padded[pad + length :] = audio[-pad - 1 : -1].flip(0)
            windowed = padded.unfold(0, n_fft, hop_length) * window
        rebuilt = torch.view_as_real(torch.fft.rfft(windowed, dim=1))
        if library is not None:
            library.griffin_lim_update(update.data_ptr(), rebuilt.data_ptr(), previous.data_ptr(), target.data_ptr(),
                                       target.numel(), keep)
        else:
            torch.add(rebuilt, previous, alpha=-keep, out=update)
            torch.mul(real, real, out=scale).addcmul_(imag, imag).sqrt_().add_(1e-16)
            torch.div(target, scale, out=scale)
            real.mul_(scale)
            imag.mul_(scale)
        previous = rebuilt
        spectrum = torch.view_as_complex(update)
    return istft(spectrum, magnitude.new_empty(length))
