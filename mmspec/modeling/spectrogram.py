"""The log-mel spectrogram of a waveform (HiFi-GAN's convention).

Here, in the modeling layer, because a model needs it (:mod:`mmspec.modeling.mel_codec` encodes
audio to mel frames) and a model may not import from the adapters above it;
:mod:`mmspec.adapters.audio.codec` re-exports :func:`log_mel` under its old name.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _mel_transform(rate: int, n_mels: int, n_fft: int, hop_length: int, f_max: float | None):
    import torchaudio

    return torchaudio.transforms.MelSpectrogram(sample_rate=rate, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels,
                                                f_max=f_max, power=1.0, norm="slaney", mel_scale="slaney")


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
