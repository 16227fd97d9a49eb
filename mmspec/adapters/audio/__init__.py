"""Audio adapters for text-to-speech.

- :mod:`~mmspec.adapters.audio.codec`: neural audio codecs (transformers' EnCodec, DAC, Mimi) behind
  one :class:`Codec` interface (waveform <-> codes [codebooks, frames], codebook embeddings for
  acoustic neighbour tables), registered by name in :data:`CODECS`; WAV I/O and log-mel helpers.
- :mod:`~mmspec.adapters.audio.delay`: delay-pattern codec language models (MusicGen / Parler-TTS
  layout) as a core Target (import it from its module).
- :mod:`~mmspec.adapters.audio.normalize`: text normalisers (written -> spoken English: numbers,
  dates, money, abbreviations, URLs as words), registered by name in ``NORMALIZERS``, run before
  :mod:`~mmspec.adapters.audio.phonemes`' front ends (import them from their modules).
"""

from .codec import (
    CODECS,
    Codec,
    DacCodec,
    EncodecCodec,
    MimiCodec,
    codec_for,
    load_codec,
    log_mel,
    pcm16,
    read_wav,
    register_codec,
    wav_header,
    write_wav,
)

__all__ = ["CODECS", "Codec", "DacCodec", "EncodecCodec", "MimiCodec", "codec_for", "load_codec", "log_mel",
           "pcm16", "read_wav", "register_codec", "wav_header", "write_wav"]
