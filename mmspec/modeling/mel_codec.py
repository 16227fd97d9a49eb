"""The embedded voice's codec: log-mel frames quantised by residual k-means, decoded by
Griffin-Lim.

Encoding: 22,050 Hz audio -> 80-bin log-mel spectrogram (n_fft 1024, hop 256: 86.1 frames/s) ->
``stack`` consecutive frames concatenated into one vector x (stack 2: 43.1 vectors/s, 160 values)
-> residual vector quantisation with ``num_codebooks`` stages of ``codebook_size`` centroids:

    r_0 = x,   c_k = argmin_j || r_k - e_{k,j} ||^2,   r_{k+1} = r_k - e_{k, c_k},

so x is approximated by sum_k e_{k, c_k}. The codebooks are fitted by k-means on each stage's
residuals (:meth:`MelRVQCodec.fit`), in seconds on minutes of speech. Decoding sums the
centroids, unstacks the mel frames and inverts them through the mel filters' pseudo-inverse (what
torchaudio's ``InverseMelScale`` solves for; the same filters) and fast Griffin-Lim
(:func:`~mmspec.modeling.spectrogram.griffin_lim`, torchaudio's algorithm, faster on a CPU),
started from the phase that phase gradient heuristic integration gives
(:func:`~mmspec.modeling.spectrogram.pghi_phase`: 16 iterations from it reach the spectral
convergence of 32 from a random phase). Griffin-Lim's phase estimate sounds phasey, but the
speech stays as intelligible to a recogniser as the source (docs/speech.md has the measured WER).

Saved as ``mel_codec.json`` + ``mel_codec.safetensors`` (the centroids [K, C, D]).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .spectrogram import griffin_lim, log_mel, pghi_phase
from .persistence import DataclassModel


#: how :class:`MelRVQCodec` starts Griffin-Lim (:attr:`MelCodecConfig.griffin_lim_start`)
GRIFFIN_LIM_STARTS = ("pghi", "random")


def check_decoding(config: "MelCodecConfig") -> None:
    """Refuse Griffin-Lim settings the decode cannot run, in one line each."""
    if config.griffin_lim_start not in GRIFFIN_LIM_STARTS:
        raise ValueError(f"griffin_lim_start must be one of {', '.join(GRIFFIN_LIM_STARTS)}, "
                         f"got {config.griffin_lim_start!r}")
    if not isinstance(config.griffin_lim_iters, int) or config.griffin_lim_iters < 0:
        raise ValueError(f"griffin_lim_iters must be a whole number >= 0, got {config.griffin_lim_iters!r}")


def with_decoding(config: "MelCodecConfig", setting: str) -> "MelCodecConfig":
    """``config`` with Griffin-Lim's start and iterations from ``"START:ITERATIONS"`` (e.g.
    ``"random:32"``, what every codec decoded with before stop 79), checked (:func:`check_decoding`)."""
    start, _, iterations = setting.partition(":")
    if not iterations.isdigit():
        raise ValueError(f"a decode setting is START:ITERATIONS, e.g. pghi:16 or random:32; got {setting!r}")
    changed = replace(config, griffin_lim_start=start, griffin_lim_iters=int(iterations))
    check_decoding(changed)
    return changed


@dataclass
class MelCodecConfig:
    sample_rate: int = 22050
    n_fft: int = 1024
    hop_length: int = 256
    n_mels: int = 80
    f_max: float = 8000.0
    stack: int = 2
    num_codebooks: int = 8
    codebook_size: int = 256
    griffin_lim_iters: int = 16
    #: Griffin-Lim's start: "pghi" (:func:`~mmspec.modeling.spectrogram.pghi_phase`; 16 iterations
    #: from it match 32 from a random phase) or "random" (torchaudio's, what every codec started
    #: from before stop 79; a codec saved then, without this field, now starts from "pghi")
    griffin_lim_start: str = "pghi"
    log_floor: float = 1e-5

    @property
    def dim(self) -> int:
        return self.n_mels * self.stack

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / (self.hop_length * self.stack)


class MelRVQCodec(DataclassModel, nn.Module):
    """Residual k-means over stacked log-mel frames (module doc).

    Buffers: ``codebooks`` [K, C, D], D = n_mels * stack.
    """

    config_class = MelCodecConfig
    config_file = "mel_codec.json"
    weights_file = "mel_codec.safetensors"
    kind = "mel codec"
    save_dtype = torch.float16  # centroids of log-mel values: fp16 keeps them to ~1e-3 relative
    load_dtype = torch.float32

    def __init__(self, config: MelCodecConfig) -> None:
        check_decoding(config)
        super().__init__(config)
        self.register_buffer("codebooks", torch.zeros(config.num_codebooks, config.codebook_size, config.dim))
        self._derived: dict[str, torch.Tensor] = {}  # made from the config on first use; not parameters (a plain dict)

    # ---- features ----------------------------------------------------------------------------
    def _inverse_mel(self) -> torch.Tensor:
        """The mel filters' pseudo-inverse, float32 [n_fft / 2 + 1, n_mels], made on first use: what
        torchaudio's ``InverseMelScale`` (the same filters as :func:`~mmspec.modeling.spectrogram.log_mel`)
        solves for on every call. Its least squares over the 80 x 513 system A = F^T (F the filters,
        [n_fft / 2 + 1, n_mels], of full rank) give the minimum-norm solution pinv(A) mel; the
        pseudo-inverse made once in float64 gives it as one product (within ~1e-6 of the solver's
        answer, relative; 0.08 instead of 0.64 ms for 250 frames on one core)."""
        if "inverse_mel" not in self._derived:
            import torchaudio

            c = self.config
            filters = torchaudio.functional.melscale_fbanks(c.n_fft // 2 + 1, 0.0, c.f_max, c.n_mels, c.sample_rate,
                                                           norm="slaney", mel_scale="slaney")
            self._derived["inverse_mel"] = torch.linalg.pinv(filters.T.double()).float()
        return self._derived["inverse_mel"]

    def features(self, audio: torch.Tensor) -> torch.Tensor:
        """Mono audio [samples] (float, at ``sample_rate``) -> stacked log-mel vectors [T, D]."""
        c = self.config
        mel = log_mel(audio, c.sample_rate, c.n_mels, c.n_fft, c.hop_length, c.f_max, c.log_floor)  # [n_mels, frames]
        frames = mel.shape[1] // self.config.stack * self.config.stack
        return mel[:, :frames].T.reshape(-1, self.config.dim)

    def magnitude(self, vectors: torch.Tensor) -> torch.Tensor:
        """Stacked log-mel vectors [T, D] (T >= 1) -> the STFT magnitude Griffin-Lim is asked for,
        [n_fft / 2 + 1, max(T * stack, n_fft / hop_length + 1)] (a short clip padded with quiet frames:
        Griffin-Lim's padding needs a few)."""
        c = self.config
        mel = vectors.reshape(-1, c.n_mels).T.exp()  # [n_mels, frames]
        short = max(0, c.n_fft // c.hop_length + 1 - mel.shape[1])
        mel = torch.nn.functional.pad(mel, (0, short), value=c.log_floor)
        return (self._inverse_mel() @ mel.float()).clamp_min(0)

    def waveform(self, vectors: torch.Tensor) -> torch.Tensor:
        """Stacked log-mel vectors [T, D] -> audio [T * stack * hop_length samples] (Griffin-Lim)."""
        c = self.config
        frames = vectors.shape[0] * c.stack
        if frames == 0:
            return torch.zeros(0)
        check_decoding(c)  # (again: a config may be replaced after construction)
        magnitude = self.magnitude(vectors)
        if c.griffin_lim_start == "pghi":
            audio = griffin_lim(magnitude, c.n_fft, c.hop_length, c.griffin_lim_iters,
                                phase=pghi_phase(magnitude, c.n_fft, c.hop_length))
        else:
            with torch.random.fork_rng():
                torch.manual_seed(0)  # a random start: the same codes give the same audio
                audio = griffin_lim(magnitude, c.n_fft, c.hop_length, c.griffin_lim_iters)
        audio = audio[: frames * c.hop_length]  # (the inverse STFT gives (frames - 1) * hop samples)
        return torch.nn.functional.pad(audio, (0, frames * c.hop_length - audio.shape[0]))

    # ---- quantisation ------------------------------------------------------------------------
    def quantise(self, vectors: torch.Tensor) -> torch.Tensor:
        """Vectors [T, D] -> codes LongTensor [K, T] (greedy residual assignment)."""
        residual = vectors.float()
        codes = []
        for book in self.codebooks:
            index = torch.cdist(residual, book).argmin(-1)
            codes.append(index)
            residual = residual - book[index]
        return torch.stack(codes)

    def dequantise(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [K, T] -> vectors [T, D] (the sum of the stages' centroids)."""
        return sum(book[index] for book, index in zip(self.codebooks, codes))

    def encode(self, audio: torch.Tensor, sampling_rate: int | None = None) -> torch.Tensor:
        """Mono audio [samples] at ``sampling_rate`` (default: the codec's ``sample_rate``, else
        resampled to it, as :meth:`mmspec.adapters.audio.codec.Codec.encode` takes it) -> codes [K, T]."""
        if sampling_rate is not None and sampling_rate != self.config.sample_rate:
            import torchaudio

            audio = torchaudio.functional.resample(audio.float(), sampling_rate, self.config.sample_rate)
        return self.quantise(self.features(audio))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [K, T] -> audio [samples]."""
        return self.waveform(self.dequantise(codes))

    # the read side of mmspec.adapters.audio.codec.Codec, so pipelines take either
    @property
    def sampling_rate(self) -> int:
        return self.config.sample_rate

    @property
    def frame_rate(self) -> float:
        return self.config.frame_rate

    @property
    def num_codebooks(self) -> int:
        return self.config.num_codebooks

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    def codebook_embeddings(self) -> torch.Tensor:
        """[K, C, D] the centroids (a frame's vector is the sum of its K codes' rows)."""
        return self.codebooks.float()

    @torch.no_grad()
    def fit(self, vectors: torch.Tensor, iterations: int = 25, seed: int = 0) -> list[float]:
        """Fit every stage by k-means (k-means++ seeding) on the previous stages' residuals of
        ``vectors`` [N, D]; returns the mean squared residual after each stage."""
        gen = torch.Generator().manual_seed(seed)
        residual = vectors.float()
        errors = []
        for stage in range(self.config.num_codebooks):
            centroids = _kmeans(residual, self.config.codebook_size, iterations, gen)
            self.codebooks[stage] = centroids
            residual = residual - centroids[torch.cdist(residual, centroids).argmin(-1)]
            errors.append(float(residual.pow(2).mean()))
        return errors


def _kmeans(x: torch.Tensor, k: int, iterations: int, gen: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means on x [N, D] with k-means++ seeding; empty clusters are re-seeded on the
    points farthest from their centroid. Returns centroids [k, D]."""
    n = x.shape[0]
    centroids = x[torch.randint(n, (1,), generator=gen)]
    closest = torch.cdist(x, centroids).squeeze(1).pow(2)
    for _ in range(1, k):
        pick = torch.multinomial(closest / closest.sum(), 1, generator=gen)
        centroids = torch.cat([centroids, x[pick]])
        closest = torch.minimum(closest, (x - x[pick]).pow(2).sum(-1))
    for _ in range(iterations):
        distance = torch.cdist(x, centroids)
        assign = distance.argmin(-1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).unsqueeze(1)
        empty = counts.squeeze(1) == 0
        centroids = torch.where(empty.unsqueeze(1), centroids, sums / counts.clamp_min(1))
        if bool(empty.any()):
            far = distance.gather(1, assign[:, None]).squeeze(1).topk(int(empty.sum())).indices
            centroids[empty] = x[far]
    return centroids
