"""Neural audio codecs (transformers' EnCodec, DAC, Mimi) behind one interface: waveform <-> codes.

A codec turns audio into K parallel streams of discrete codes (residual vector quantisation: K
codebooks of C codes, one code per codebook per frame) and back. Text-to-speech models predict
these codes; this module is what turns their output into sound, and a reference recording into
their training targets.

=========== ================================ ====================================================
family      what is chosen at construction   frames
=========== ================================ ====================================================
EnCodec     ``bandwidth`` (kbps, one of the  ``ceil(samples / hop)``; the 48 kHz model encodes
            config's ``target_bandwidths``;  overlapping 1 s chunks, each normalised by its
            default the largest: all         loudness: its chunks' codes are concatenated
            codebooks)                       (:class:`EncodecCodec`)
DAC         ``num_quantizers`` (default all) ``ceil(samples / hop)`` (the input is zero-padded
                                             to whole frames, as DAC's own preprocessing does)
Mimi        ``num_quantizers`` (default all; ``ceil(samples / frame_size)`` (12.5 Hz)
            Moshi uses 8)
=========== ================================ ====================================================

Every codec:

- :meth:`Codec.encode` waveform [channels, samples] or [samples] at any rate -> LongTensor
  [num_codebooks, frames] (resampled with ``torchaudio.functional.resample``, mixed to the codec's
  channel count);
- :meth:`Codec.decode` codes [num_codebooks, frames] -> float32 waveform [channels, samples] at
  :attr:`Codec.sampling_rate`;
- :meth:`Codec.codebook_embeddings` -> [num_codebooks, codebook_size, dim]: row c of codebook k is
  the vector code c adds to the decoder's input latent, which is the sum over the codebooks of
  their rows (distances between rows are what acoustic neighbour tables,
  :func:`mmspec.core.relaxed.neighbour_table`, are built from).

Encoding and decoding run in eval mode under ``torch.inference_mode()``; their results are
ordinary tensors on the model's device. Codecs are registered by name in :data:`CODECS`;
:func:`codec_for` wraps a loaded model, :func:`load_codec` loads one. :func:`read_wav`,
:func:`write_wav` (soundfile) and :func:`log_mel` (torchaudio) are the audio helpers around them.
"""

from __future__ import annotations

import io
import math
import numbers
import struct
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ...core.registry import class_registrar
from ...modeling.spectrogram import log_mel  # (re-exported: its home before mmspec.modeling.spectrogram)

# ---- registry ---------------------------------------------------------------------------------

#: codec name -> codec class (each wraps one transformers model class)
CODECS: dict[str, type[Codec]] = {}


#: class decorator: make ``cls`` the codec of models of ``cls.model_class`` (see :func:`codec_for`)
register_codec = class_registrar(CODECS, "codec", required=("name", "model_class"))


def supported_models() -> str:
    """The supported transformers classes, for messages: "EncodecModel (encodec), ..."."""
    return ", ".join(f"{cls.model_class} ({name})" for name, cls in CODECS.items())


def codec_for(model, **kwargs) -> Codec:
    """The codec of a loaded transformers codec model (keyword arguments go to its codec class:
    ``bandwidth`` for EnCodec, ``num_quantizers`` for DAC and Mimi).

    Raises:
        ValueError: for a model of no class in :data:`CODECS`.
    """
    for cls in CODECS.values():
        if cls.matches(model):
            return cls(model, **kwargs)
    raise ValueError(f"{type(model).__name__} is not a supported audio codec; supported: {supported_models()}")


def load_codec(path_or_hub_id: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               **kwargs) -> Codec:
    """Load a codec checkpoint (local directory or hub id) with transformers' ``AutoModel`` (no
    remote code) onto ``device`` and wrap it with :func:`codec_for` (``kwargs`` go there).

    ``dtype`` defaults to float32: the codecs are small, and half precision audibly degrades them.
    """
    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    from ...hub import cannot_load, check_model_path

    path = check_model_path(str(path_or_hub_id))
    try:  # (one line, not transformers' paragraph: a hub id not in the cache with HF_HUB_OFFLINE=1, a folder without config.json)
        model_type = AutoConfig.from_pretrained(path).model_type  # (the kind checked before the weights load)
    except OSError as error:
        raise cannot_load("codec", path_or_hub_id, error) from None
    if MODEL_MAPPING_NAMES.get(model_type) not in {cls.model_class for cls in CODECS.values()}:
        raise ValueError(f"{path_or_hub_id} is a {model_type!r} model, not a supported audio codec; supported: "
                         f"{supported_models()}")
    model = AutoModel.from_pretrained(path, dtype=dtype).to(device)
    return codec_for(model, **kwargs)


# ---- the interface ----------------------------------------------------------------------------


class Codec(ABC):
    """A neural audio codec: waveform <-> codes [num_codebooks, frames].

    A family provides ``_encode`` (audio [channels, samples] at :attr:`sampling_rate`, on the
    model's device and dtype -> codes [K, frames]), ``_decode`` (valid codes [K, frames] ->
    waveform [channels, samples]), :meth:`num_frames` and :meth:`codebook_embeddings`; this class
    validates, resamples and mixes inputs, and validates codes.

    Attributes:
        name: the registry name.
        model_class: the transformers class name the codec wraps.
        model: the wrapped model (in eval mode).
    """

    name: ClassVar[str]
    model_class: ClassVar[str]

    def __init__(self, model, *, sampling_rate: int, channels: int, num_codebooks: int, codebook_size: int,
                 frame_rate: float) -> None:
        self.model = model.eval()
        self._sampling_rate = int(sampling_rate)
        self._channels = int(channels)
        self._num_codebooks = int(num_codebooks)
        self._codebook_size = int(codebook_size)
        self._frame_rate = float(frame_rate)

    @classmethod
    def matches(cls, model) -> bool:
        """Whether ``model`` is an instance of :attr:`model_class`."""
        import transformers

        return isinstance(model, getattr(transformers, cls.model_class))

    # ---- properties -------------------------------------------------------------------------
    @property
    def sampling_rate(self) -> int:
        """Samples per second of the codec's audio (input after resampling, and output)."""
        return self._sampling_rate

    @property
    def channels(self) -> int:
        """Audio channels of the codec (1 mono, 2 stereo)."""
        return self._channels

    @property
    def num_codebooks(self) -> int:
        """K: codes per frame (one per codebook)."""
        return self._num_codebooks

    @property
    def codebook_size(self) -> int:
        """C: codes per codebook (valid codes are 0 .. C - 1)."""
        return self._codebook_size

    @property
    def frame_rate(self) -> float:
        """Frames per second (:meth:`num_frames` gives the exact count of a given input)."""
        return self._frame_rate

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.num_codebooks} codebooks x {self.codebook_size} codes, "
                f"{self.frame_rate:g} frames/s, {self.sampling_rate} Hz, {self.channels} channel(s))")

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, waveform: torch.Tensor, sampling_rate: int) -> torch.Tensor:
        """Waveform -> codes.

        Args:
            waveform: float [channels, samples] or [samples] (one clip, no batch dimension), at
                ``sampling_rate``; resampled to :attr:`sampling_rate` and mixed to :attr:`channels`
                (averaged to mono, or mono repeated).
            sampling_rate: its samples per second.
        Returns:
            LongTensor [num_codebooks, num_frames(samples at the codec's rate)] on the model's device.
        Raises:
            ValueError: for an empty, non-finite, non-float or wrongly shaped waveform, or a bad rate.
        """
        audio = self.prepare(waveform, sampling_rate)
        with torch.inference_mode():
            codes = self._encode(audio.to(device=self.device, dtype=self.dtype))
        return codes.long().clone()  # an ordinary tensor (inference tensors refuse in-place updates)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes -> waveform.

        Args:
            codes: integer [num_codebooks, frames], each in [0, codebook_size).
        Returns:
            float32 [channels, samples] at :attr:`sampling_rate` on the model's device (samples
            about frames * sampling_rate / frame_rate).
        Raises:
            ValueError: for codes of the wrong shape, dtype or number of codebooks, or out of range.
        """
        codes = self.check_codes(codes)
        with torch.inference_mode():
            audio = self._decode(codes)
        return audio.float().clone()

    @abstractmethod
    def num_frames(self, num_samples: int) -> int:
        """Frames :meth:`encode` gives for ``num_samples`` samples at :attr:`sampling_rate`."""

    @abstractmethod
    def codebook_embeddings(self) -> torch.Tensor:
        """float32 [num_codebooks, codebook_size, dim]: row c of codebook k is the vector code c adds
        to the decoder's input latent (after the quantizer's output projection, if any), so the
        latent of a frame is the sum over k of row codes[k] of codebook k."""

    @abstractmethod
    def _encode(self, audio: torch.Tensor) -> torch.Tensor:
        """audio [channels, samples] (codec rate, model device and dtype) -> codes [K, frames]."""

    @abstractmethod
    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        """valid codes [K, frames] (model device) -> waveform [channels, samples]."""

    # ---- validation -------------------------------------------------------------------------
    def prepare(self, waveform: torch.Tensor, sampling_rate: int) -> torch.Tensor:
        """Check a waveform and bring it to the codec's channels and rate: float32 [channels, samples]."""
        audio = torch.as_tensor(waveform)
        if not audio.is_floating_point():
            raise ValueError(f"waveform must be a float tensor with samples in [-1, 1], got {audio.dtype}; "
                             f"convert integer PCM first (e.g. int16 / 32768)")
        if audio.dim() not in (1, 2):
            raise ValueError(f"waveform must be [samples] or [channels, samples] (one clip, no batch dimension), "
                             f"got shape {tuple(audio.shape)}")
        if audio.numel() == 0:
            raise ValueError(f"waveform is empty (shape {tuple(audio.shape)}); pass at least one sample")
        if not bool(torch.isfinite(audio).all()):
            raise ValueError("waveform contains NaN or infinite samples; clean it (e.g. torch.nan_to_num) "
                             "before encoding")
        if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int) or sampling_rate <= 0:
            raise ValueError(f"sampling_rate must be a positive int (samples per second), got {sampling_rate!r}")
        audio = audio.float()
        if audio.dim() == 1:
            audio = audio[None]
        if audio.shape[0] != self.channels:
            audio = audio.mean(0, keepdim=True).expand(self.channels, -1)
        if sampling_rate != self.sampling_rate:
            import torchaudio

            audio = torchaudio.functional.resample(audio, sampling_rate, self.sampling_rate)
        return audio

    def check_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Check codes [num_codebooks, frames] for :meth:`decode`: LongTensor on the model's device."""
        codes = torch.as_tensor(codes)
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
        if codes.dim() != 2:
            raise ValueError(f"codes must be [codebooks, frames] (one clip, no batch dimension), got shape "
                             f"{tuple(codes.shape)}")
        if codes.shape[0] != self.num_codebooks:
            raise ValueError(f"codes have {codes.shape[0]} codebooks but this codec decodes {self.num_codebooks} "
                             f"({self!r}); pass [{self.num_codebooks}, frames]")
        if codes.shape[1] == 0:
            raise ValueError("codes have no frames; pass at least one frame")
        low, high = int(codes.min()), int(codes.max())
        if low < 0 or high >= self.codebook_size:
            raise ValueError(f"codes must lie in [0, {self.codebook_size}), got values from {low} to {high}; "
                             f"strip special tokens (pad, BOS, end) before decoding")
        return codes.long().to(self.device)


# ---- families ---------------------------------------------------------------------------------


@register_codec
class EncodecCodec(Codec):
    """transformers' ``EncodecModel`` (24 kHz mono, 32 kHz MusicGen, 48 kHz stereo).

    ``bandwidth`` (kbps) sets the codebooks: ``bandwidth * 1000 / (frame_rate * log2(C))``; it must
    be one of the config's ``target_bandwidths`` (default the largest: every codebook).

    Chunked models (``chunk_length_s``, the 48 kHz one) encode overlapping chunks of
    ``chunk_length`` samples every ``chunk_stride`` samples, ``ceil(chunk_length / hop)`` frames
    each (the last one shorter); their codes are concatenated along the frames, so
    :attr:`frame_rate` is the average rate and :meth:`decode` splits the frames back into chunks
    and overlap-adds them as the model does. The model needs every chunk but the last to be whole
    and the last to cover the overlap: the input is zero-padded to that (at most the overlap, 10 ms
    for the 48 kHz model), and a code stream whose last chunk is shorter (generated codes) is
    decoded with its last frame repeated, then cut to its own length.

    Normalising models (``normalize``, also the 48 kHz one) divide each chunk by its RMS before
    encoding: that loudness ("scale") is not part of the codes. :meth:`encode_with_scales` returns
    it, and :meth:`decode` takes it; without it every chunk is decoded at ``decode_scale`` (default
    0.1, about -20 dBFS RMS, a usual speech level).
    """

    name = "encodec"
    model_class = "EncodecModel"

    def __init__(self, model, bandwidth: float | None = None, decode_scale: float = 0.1) -> None:
        config = model.config
        bandwidths = list(config.target_bandwidths)
        bandwidth = max(bandwidths) if bandwidth is None else bandwidth
        if bandwidth not in bandwidths:
            raise ValueError(f"bandwidth {bandwidth!r} is not one of this EnCodec's target_bandwidths {bandwidths}")
        if not decode_scale > 0:
            raise ValueError(f"decode_scale must be > 0 (the RMS level of decoded chunks), got {decode_scale!r}")
        self.bandwidth = bandwidth
        self.decode_scale = float(decode_scale)
        self.hop = int(config.hop_length)
        self.chunk_length = config.chunk_length  # samples, or None (the whole input at once)
        self.chunk_stride = config.chunk_stride if config.chunk_length is not None else None
        if self.chunk_length is not None and self.chunk_stride is None:
            raise ValueError("this EnCodec config has chunk_length_s but no overlap; set config.overlap")
        if self.chunk_length is None:
            frame_rate = config.sampling_rate / self.hop
        else:
            frame_rate = self.frames_per_chunk * config.sampling_rate / self.chunk_stride
        super().__init__(model, sampling_rate=config.sampling_rate, channels=config.audio_channels,
                         num_codebooks=model.quantizer.get_num_quantizers_for_bandwidth(bandwidth),
                         codebook_size=config.codebook_size, frame_rate=frame_rate)

    @property
    def frames_per_chunk(self) -> int | None:
        """Frames of one full chunk (None for an unchunked model)."""
        return None if self.chunk_length is None else math.ceil(self.chunk_length / self.hop)

    @property
    def normalizes(self) -> bool:
        """Whether encoding divides each chunk by its loudness (which the codes then lack)."""
        return bool(self.model.config.normalize)

    @property
    def overlap(self) -> int:
        """Samples of a decoded chunk that the next one overlaps (0 for an unchunked model)."""
        return 0 if self.chunk_length is None else self.frames_per_chunk * self.hop - self.chunk_stride

    def padded_length(self, num_samples: int) -> int:
        """The input's length after padding its last chunk to cover the overlap."""
        last_start = (num_samples - 1) // self.chunk_stride * self.chunk_stride if self.chunk_length else 0
        return num_samples if last_start == 0 else max(num_samples, last_start + self.overlap)

    def num_frames(self, num_samples: int) -> int:
        if self.chunk_length is None:
            return math.ceil(num_samples / self.hop)
        num_samples = self.padded_length(num_samples)
        last_start = (num_samples - 1) // self.chunk_stride * self.chunk_stride
        whole_chunks = last_start // self.chunk_stride
        return whole_chunks * self.frames_per_chunk + math.ceil((num_samples - last_start) / self.hop)

    def num_chunks(self, num_frames: int) -> int:
        """Chunks a stream of ``num_frames`` frames splits into."""
        return 1 if self.chunk_length is None else math.ceil(num_frames / self.frames_per_chunk)

    def encode_with_scales(self, waveform: torch.Tensor,
                           sampling_rate: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`encode`, with the chunks' scales: (codes [K, frames], float32 [chunks] or None for a
        model that does not normalise). ``decode(codes, scales)`` restores the loudness."""
        audio = self.prepare(waveform, sampling_rate)
        with torch.inference_mode():
            codes, scales = self._encode_scaled(audio.to(device=self.device, dtype=self.dtype))
        return codes.long().clone(), None if scales is None else scales.float().clone()

    def decode(self, codes: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`Codec.decode`; ``scales`` [chunks] (from :meth:`encode_with_scales`) sets each
        chunk's loudness for a normalising model (default ``decode_scale`` for all)."""
        codes = self.check_codes(codes)
        scales = self._check_scales(scales, self.num_chunks(codes.shape[1]))
        with torch.inference_mode():
            audio = self._decode_scaled(codes, scales)
        return audio.float().clone()

    def _check_scales(self, scales, chunks: int) -> torch.Tensor | None:
        if scales is None:
            return torch.full((chunks,), self.decode_scale, device=self.device) if self.normalizes else None
        if not self.normalizes:
            raise ValueError("this EnCodec does not normalise its input, so its codes have no scales; pass scales=None")
        scales = torch.as_tensor(scales, dtype=torch.float32).reshape(-1)
        if scales.shape[0] != chunks or not bool((torch.isfinite(scales) & (scales > 0)).all()):
            raise ValueError(f"scales must be {chunks} positive finite values (one per chunk of the codes), "
                             f"got {tuple(scales.tolist())}")
        return scales.to(self.device)

    def _encode(self, audio):
        return self._encode_scaled(audio)[0]

    def _encode_scaled(self, audio):
        audio = F.pad(audio, (0, self.padded_length(audio.shape[1]) - audio.shape[1]))
        out = self.model.encode(audio[None], bandwidth=self.bandwidth, return_dict=True)
        chunks = out.audio_codes[:, 0]  # [chunks, K, frames per chunk]
        codes = torch.cat(list(chunks), dim=1)
        if out.last_frame_pad_length:
            codes = codes[:, : codes.shape[1] - out.last_frame_pad_length]
        scales = None if out.audio_scales[0] is None else torch.cat([s.reshape(1) for s in out.audio_scales])
        return codes, scales

    def _decode(self, codes):
        return self._decode_scaled(codes, self._check_scales(None, self.num_chunks(codes.shape[1])))

    def _decode_scaled(self, codes, scales):
        if self.chunk_length is None:
            chunks, samples = [codes], None
        else:
            chunks = list(codes.split(self.frames_per_chunk, dim=1))
            samples = (len(chunks) - 1) * self.chunk_stride + chunks[-1].shape[1] * self.hop
            if len(chunks) > 1:  # the last chunk must cover the overlap: repeat its last frame
                short = math.ceil(self.overlap / self.hop) - chunks[-1].shape[1]
                chunks[-1] = torch.cat([chunks[-1], chunks[-1][:, -1:].expand(-1, max(short, 0))], dim=1)
        length = chunks[0].shape[1]
        pad = length - chunks[-1].shape[1]
        stacked = torch.stack([F.pad(chunk, (0, length - chunk.shape[1])) for chunk in chunks])[:, None]
        audio_scales = [None] * len(chunks) if scales is None else [s.reshape(1, 1).to(self.dtype) for s in scales]
        audio = self.model.decode(stacked, audio_scales, last_frame_pad_length=pad, return_dict=True).audio_values
        return audio[0, :, :samples]

    def codebook_embeddings(self):
        with torch.no_grad():
            layers = self.model.quantizer.layers[: self.num_codebooks]
            return torch.stack([layer.codebook.embed for layer in layers]).float().clone()


@register_codec
class DacCodec(Codec):
    """transformers' ``DacModel`` (Descript Audio Codec, 16 / 24 / 44.1 kHz mono).

    ``num_quantizers`` keeps the first codebooks (default all ``n_codebooks``). The input is
    zero-padded to whole frames (DAC's own preprocessing), so ``frames = ceil(samples / hop)`` and
    decoding gives ``frames * hop`` samples. DAC looks codes up by cosine similarity in a small
    factorised space; :meth:`codebook_embeddings` gives them after the output projection (with its
    bias), the space the decoder sums them in.
    """

    name = "dac"
    model_class = "DacModel"

    def __init__(self, model, num_quantizers: int | None = None) -> None:
        config = model.config
        num_quantizers = config.n_codebooks if num_quantizers is None else num_quantizers
        if not 1 <= num_quantizers <= config.n_codebooks:
            raise ValueError(f"num_quantizers must be in 1..{config.n_codebooks} for this DAC, got {num_quantizers!r}")
        self.hop = int(config.hop_length)
        super().__init__(model, sampling_rate=config.sampling_rate, channels=1, num_codebooks=num_quantizers,
                         codebook_size=config.codebook_size, frame_rate=config.sampling_rate / self.hop)

    def num_frames(self, num_samples: int) -> int:
        return math.ceil(num_samples / self.hop)

    def _encode(self, audio):
        audio = F.pad(audio, (0, -audio.shape[1] % self.hop))
        return self.model.encode(audio[None], n_quantizers=self.num_codebooks, return_dict=True).audio_codes[0]

    def _decode(self, codes):
        return self.model.decode(audio_codes=codes[None], return_dict=True).audio_values.reshape(1, -1)

    def codebook_embeddings(self):
        with torch.no_grad():
            rows = [quantizer.out_proj(quantizer.codebook.weight.T[None])[0].T
                    for quantizer in self.model.quantizer.quantizers[: self.num_codebooks]]
            return torch.stack(rows).float().clone()


@register_codec
class MimiCodec(Codec):
    """transformers' ``MimiModel`` (Kyutai's 24 kHz, 12.5 frames/s codec of Moshi and Sesame CSM).

    ``num_quantizers`` keeps the first codebooks (default all; at least the semantic ones). Codebook
    0 .. ``num_semantic_quantizers`` - 1 are the semantic quantizer's, the rest the acoustic one's;
    each has its own output projection, which :meth:`codebook_embeddings` applies.
    """

    name = "mimi"
    model_class = "MimiModel"

    def __init__(self, model, num_quantizers: int | None = None) -> None:
        config = model.config
        num_quantizers = config.num_quantizers if num_quantizers is None else num_quantizers
        if not config.num_semantic_quantizers <= num_quantizers <= config.num_quantizers:
            raise ValueError(f"num_quantizers must be in {config.num_semantic_quantizers}..{config.num_quantizers} "
                             f"for this Mimi, got {num_quantizers!r}")
        super().__init__(model, sampling_rate=config.sampling_rate, channels=config.audio_channels,
                         num_codebooks=num_quantizers, codebook_size=config.codebook_size,
                         frame_rate=config.frame_rate)

    def num_frames(self, num_samples: int) -> int:
        return int(self.model.get_encoded_length(torch.tensor(num_samples)))

    def _encode(self, audio):
        return self.model.encode(audio[None], num_quantizers=self.num_codebooks, return_dict=True).audio_codes[0]

    def _decode(self, codes):
        return self.model.decode(codes[None], return_dict=True).audio_values[0]

    def codebook_embeddings(self):
        quantizer = self.model.quantizer
        semantic = quantizer.num_semantic_quantizers
        with torch.no_grad():
            rows = [self._projected(quantizer.semantic_residual_vector_quantizer, k) if k < semantic
                    else self._projected(quantizer.acoustic_residual_vector_quantizer, k - semantic)
                    for k in range(self.num_codebooks)]
            return torch.stack(rows).float().clone()

    @staticmethod
    def _projected(rvq, layer: int) -> torch.Tensor:
        embed = rvq.layers[layer].codebook.embed  # [C, codebook_dim]
        return embed if rvq.output_proj is None else rvq.output_proj(embed.T[None])[0].T


# ---- audio helpers ----------------------------------------------------------------------------


def read_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """Read an audio file (WAV, FLAC, OGG: whatever libsndfile reads) with soundfile.

    Returns:
        (float32 [channels, samples] in [-1, 1], sampling rate).

    Raises:
        FileNotFoundError: no such file (libsndfile's own error says only "System error").
    """
    import soundfile

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no audio file at {path}")
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)  # [samples, channels]
    return torch.from_numpy(data.T.copy()), int(rate)


def write_wav(path: str | Path, waveform: torch.Tensor, rate: int, subtype: str = "PCM_16") -> None:
    """Write float audio [channels, samples] or [samples] as a WAV file with soundfile.

    ``subtype`` "PCM_16" (default; samples are clipped to [-1, 1]) or "FLOAT" (exact float32), or
    any other soundfile WAV subtype. Parent directories are created. A path named for another
    format (``x.mp3``, ``x.flac``) is refused: WAV data under such a name was written silently.
    """
    import soundfile

    suffix = Path(path).suffix.lower()
    if suffix not in ("", ".wav", ".wave"):
        raise ValueError(f"write_wav writes WAV files; name the file .wav, not {suffix} (for FLAC or OGG: "
                         f"soundfile.write(path, audio.T.numpy(), rate))")

    audio = torch.as_tensor(waveform).detach().float().cpu()
    if audio.dim() == 1:
        audio = audio[None]
    if audio.dim() != 2 or audio.numel() == 0:
        raise ValueError(f"waveform must be a non-empty [samples] or [channels, samples], "
                         f"got shape {tuple(audio.shape)}")
    if not bool(torch.isfinite(audio).all()):
        raise ValueError("waveform contains NaN or infinite samples; clean it before writing")
    if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, numbers.Integral) or rate <= 0:
        raise ValueError(f"rate must be a positive int (samples per second), got {rate!r}")
    rate = int(rate)
    if subtype.upper().startswith("PCM"):
        audio = audio.clamp(-1.0, 1.0)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), audio.T.numpy(), rate, subtype=subtype, format="WAV")


def wav_header(rate: int, data_bytes: int | None, channels: int = 1) -> bytes:
    """The 44-byte header of a 16-bit PCM WAV of ``channels`` holding ``data_bytes`` bytes of
    samples (None: a stream of unknown length, both sizes 0xFFFFFFFF, which players reading a pipe accept)."""
    riff, data = (0xFFFFFFFF, 0xFFFFFFFF) if data_bytes is None else (36 + data_bytes, data_bytes)
    block = 2 * channels
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, rate, block * rate, block, 16) + b"data" + struct.pack("<I", data))


def pcm16(audio: torch.Tensor) -> bytes:
    """Float audio [channels, samples] or [samples] -> little-endian 16-bit PCM bytes, the channels
    interleaved frame by frame as a WAV holds them, converted exactly as :func:`write_wav` writes
    them (soundfile's PCM_16, clipped to [-1, 1]), so a stream or a server's answer holds the same
    samples as the file."""
    import soundfile

    raw = io.BytesIO()
    audio = torch.as_tensor(audio).detach().float().cpu()
    samples = (audio if audio.dim() == 1 else audio.T).reshape(-1).clamp(-1.0, 1.0).numpy()  # [frames x channels]
    soundfile.write(raw, samples, 8000, subtype="PCM_16", format="RAW", endian="LITTLE")  # (RAW: the samples alone)
    return raw.getvalue()
