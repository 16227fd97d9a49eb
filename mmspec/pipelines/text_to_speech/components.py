"""The parts of a text-to-speech model, loaded once: :class:`TTSComponents`.

A model directory (``model=None``: the embedded VALL-E-style voice in ``models/tts-valle``;
``model="delay"``: the delay-pattern one in ``models/tts``) holds ``tts.json``
(``codec``: the codec directory, relative; ``phonemizer``: the text front end of
:data:`mmspec.adapters.audio.phonemes.PHONEMIZERS`; ``normalizer``: the text normaliser run before
it, of :data:`mmspec.adapters.audio.normalize.NORMALIZERS`, "english" if absent; ``draft``: the draft codec LM's directory or
null; ``medusa`` / ``eagle``: the Medusa heads' / EAGLE head's directory, optional; ``temperature``:
the model's default sampling temperature, 1 if absent, as a transformers generation config gives
one; ``nar``: a VALL-E-style voice's non-autoregressive stage, optional) and the codec LM
(:class:`~mmspec.modeling.codec_lm.CodecLM`).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch

from ...adapters.audio.delay import DelayPatternTarget
from ...adapters.audio.normalize import NormalizedText, make_normalizer
from ...adapters.audio.phonemes import EMPTY_TEXT, PHONEMIZERS, make_phonemizer
from ...hub import models_dir, no_models_note, resolve_device, resolve_dtype
from ...modeling.codec_lm import CodecLM
from ...modeling.codec_nar import CodecNAR
from ...modeling.fast_linear import OptimizesOnLoad
from ...modeling.fused import read_as_int8
from ...modeling.heads import DraftHeads, EagleHead
from ...modeling.mel_codec import MelRVQCodec


MANIFEST = "tts.json"
#: names of the embedded voices (``model=`` / ``--model``) -> their directory under models/
EMBEDDED_VOICES = {"valle": "tts-valle", "delay": "tts"}
DEFAULT_VOICE = "valle"  # the more intelligible one, and the one speculation speeds up (docs/benchmarks.md)


#: the fastest speaking rate ``speed`` may ask of an aligned voice. The embedded voice's duration
#: predictor gives about one frame (23 ms) per phoneme id at speed 1; at 4 three quarters of an
#: ordinary sentence's ids already get no frame ("There are seven blue squares.": 46 of 61, 15
#: frames), and at 50 the sentence is one frame of noise (issue 44)
MAX_SPEED = 4.0


def _positive_number(value) -> bool:
    """A finite int or float > 0 (not a bool): what max_seconds, speed and a temperature must be."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_speed(speed, name: str = "speed") -> None:
    """``speed`` must be a positive number at most :data:`MAX_SPEED` (``name``: how the caller
    spells it, "--speed" on the command line). Raises ValueError in one line."""
    if not _positive_number(speed):
        raise ValueError(f"{name} must be a positive number, got {speed!r}")
    if speed > MAX_SPEED:
        raise ValueError(f"{name} must be at most {MAX_SPEED:g} (a speaking rate: 2 is twice as fast), got {speed!r}; "
                         "faster, most phonemes get no audio frame")


def check_int8(int8: bool, device: str | torch.device = "cpu", optimize: bool = True) -> None:
    """Refuse ``int8=True`` (:func:`mmspec.modeling.fused.read_as_int8`) where it cannot run: it
    needs the fused C layers, so the CPU and ``optimize``.

    Raises:
        TypeError: ``int8`` is not a bool.
        ValueError: ``int8`` on another device or without ``optimize``.
    """
    if not isinstance(int8, bool):
        raise TypeError(f"int8 is True or False, got {int8!r}")
    if int8 and (resolve_device(device).type != "cpu" or not optimize):
        raise ValueError("int8 weights run on the CPU's fused C layers: use device cpu and optimize=True, or leave int8 off")


def voice_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The codec LMs' dtype: "auto", float32 or bfloat16 (:func:`~mmspec.hub.resolve_dtype`);
    another (float16, whose sums no kernel here keeps) is one ValueError line."""
    resolved = resolve_dtype(dtype, device)
    if resolved not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the voice runs in float32 or bfloat16: use dtype auto, float32 or bfloat16, got {dtype}")
    return resolved


def is_embedded_voice(model: str | Path | None) -> bool:
    """Whether ``model`` names an embedded voice: None (the default) or a name of
    :data:`EMBEDDED_VOICES` (a path of that name outranks it)."""
    return model is None or (isinstance(model, str) and model in EMBEDDED_VOICES and not Path(model).exists())


def voice_directory(model: str | Path | None) -> Path:
    """A voice (None: the default; an embedded voice's name, or a model directory) -> its directory."""
    return models_dir() / EMBEDDED_VOICES[model or DEFAULT_VOICE] if is_embedded_voice(model) else Path(model)


def read_manifest(model: str | Path | None) -> tuple[Path, dict]:
    """A voice (None: the default; an embedded voice's name, or a model directory) -> (its
    directory, its ``tts.json`` with ``"normalizer"`` filled in: "english" where it names none),
    the normaliser's name checked: what is known before any weights load. Raises ValueError (one
    line) for a directory without ``tts.json`` or an unknown normaliser."""
    embedded, directory = is_embedded_voice(model), voice_directory(model)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        hint = ((no_models_note() or f"the embedded voice {directory.name} is not in this checkout (train it: docs/speech.md)")
                if embedded
                else f"{directory} has no {MANIFEST}; is it an mmspec TTS model directory (or one of "
                f"{', '.join(EMBEDDED_VOICES)})?")
        raise ValueError(hint)
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as error:  # (JSON's errors, a file not UTF-8)
        raise ValueError(f"{manifest_path} is not valid JSON ({error}); see docs/speech.md for its fields") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_path} must hold a JSON object of the voice's parts (codec, phonemizer, ...), "
                         f"got {type(manifest).__name__}; see docs/speech.md")
    if "phonemizer" not in manifest:
        raise ValueError(f"{manifest_path} names no phonemizer; add \"phonemizer\": one of {', '.join(sorted(PHONEMIZERS))}")
    if manifest["phonemizer"] not in PHONEMIZERS:
        raise ValueError(f"{manifest_path} names phonemizer {manifest['phonemizer']!r}, which mmspec does not have; use one "
                         f"of {', '.join(sorted(PHONEMIZERS))}")
    manifest.setdefault("normalizer", "english")
    make_normalizer(manifest["normalizer"])  # an unknown name is refused before the weights load
    return directory, manifest


def spoken_text(text: str, normalizer: str = "english") -> NormalizedText:
    """Written text -> what the voice says (the normaliser ``normalizer``: numbers, dates, symbols
    as words; what no voice can say dropped and named). Raises ValueError (one line) for empty
    text, or text with nothing left to say: ``"日本 😀"`` names what it dropped."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(EMPTY_TEXT)
    spoken = make_normalizer(normalizer)(text)
    if not re.search(r"[A-Za-z0-9]", spoken.text):
        cannot = f": {spoken.describe_dropped()} cannot be spoken" if spoken.dropped else ""
        raise ValueError(f"the text has nothing this voice can say{cannot}; pass English words")
    return spoken


def load_nar_stage(directory: Path, nar: str | None, lm: CodecLM, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> CodecNAR | None:
    """A VALL-E-style voice's NAR stage (tts.json ``nar``, a directory relative to the voice) in
    ``dtype`` (the codec LM's: one pass over every frame, 11.8 -> 6.9 ms for 150 frames in bf16 on
    one AMX core), or None; its LM must stream codebook 0 alone and be aligned (the stage reads the
    durations)."""
    if not nar:
        return None
    if lm.config.num_codebooks != 1 or not lm.config.aligned:
        raise ValueError(f"{directory / MANIFEST} names a NAR stage, but its codec LM is not an aligned LM over codebook 0 "
                         "alone (mmspec train tts --codebooks 1)")
    stage = CodecNAR.from_pretrained(directory / nar).to(device, dtype)
    if stage.config.codebook_size != lm.config.codebook_size:
        raise ValueError(f"the NAR stage's codebooks have {stage.config.codebook_size} codes, the LM's {lm.config.codebook_size}")
    return stage


def load_tts_codec(directory: Path, codec: str | None):
    """A model directory's codec: ``codec`` (tts.json) is a directory relative to it holding
    mmspec's mel codec or a transformers EnCodec / DAC / Mimi checkpoint
    (:func:`mmspec.adapters.audio.codec.load_codec`), or a hub id of one."""
    if not codec:
        raise ValueError(f"{directory / MANIFEST} names no codec; add \"codec\": a codec directory or hub id")
    local = directory / codec
    if (local / MelRVQCodec.config_file).is_file():
        return MelRVQCodec.from_pretrained(local)
    from ...adapters.audio.codec import load_codec

    return load_codec(local if local.is_dir() else codec)


class TTSComponents(OptimizesOnLoad):
    """A TTS model's parts: the code-stream target, the codec (mmspec's mel codec or any codec of
    :mod:`mmspec.adapters.audio.codec`), the text front end, the draft model and Medusa heads, and
    a VALL-E-style voice's NAR stage (``nar``)."""

    def __init__(self, target: DelayPatternTarget, codec, phonemizer: str, draft_dir: Path | None,
                 device: torch.device, medusa_dir: Path | None = None, optimize: bool = False,
                 eagle_dir: Path | None = None, temperature: float = 1.0, nar: CodecNAR | None = None,
                 dtype: torch.dtype = torch.float32, normalizer: str = "english", int8: bool = False) -> None:
        self.target, self.codec, self.phonemizer_name, self.nar = target, codec, phonemizer, nar
        self.normalizer_name = normalizer
        self.dtype = dtype  # the codec LMs' step models (and so their heads) and the NAR stage; front end, codec: float32
        self.temperature = temperature  # the model's default sampling temperature
        self.draft_dir, self.medusa_dir, self.eagle_dir, self.device = draft_dir, medusa_dir, eagle_dir, device
        self._draft: DelayPatternTarget | None = None
        self._medusa: DraftHeads | None = None
        self._eagle: EagleHead | None = None
        self.optimize, self.linears = optimize, "as loaded"  # which few-row kernel ran (mmspec.optimize)
        self.prepare(target.model)
        self.int8 = int8  # the AR stage's decoder projections and the NAR stage's linears read as int8
        if int8:
            read_as_int8(target.model.backbone.layers)
        if nar is not None:
            self.prepare(nar)
            if int8:
                nar.read_as_int8()

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, device: str = "auto", optimize: bool = True,
                        dtype: str | torch.dtype = "auto", int8: bool = False) -> "TTSComponents":
        directory, manifest = read_manifest(model)
        manifest_path = directory / MANIFEST
        temperature = manifest.get("temperature", 1.0)
        normalizer = manifest["normalizer"]
        if not _positive_number(temperature):
            raise ValueError(f"{manifest_path}: \"temperature\" must be a positive number, got {temperature!r}")
        dev = resolve_device(device)
        dtype = voice_dtype(dtype, dev)
        check_int8(int8, dev, optimize)
        make_phonemizer(manifest["phonemizer"])  # (its packages before the weights load: not at the first call, a
        if normalizer == "english":  # server's request, after --preload said the task was loaded)
            from ...hub import require_modules

            require_modules(("num2words",), "the English text normaliser (numbers, dates, amounts)", "pip install 'mmspec[speech]'")
        codec = load_tts_codec(directory, manifest.get("codec"))  # (the small part first: a wrong entry refused sooner)
        lm = CodecLM.from_pretrained(directory).to(dev).cast_steps(dtype)
        nar = load_nar_stage(directory, manifest.get("nar"), lm, dev, dtype)
        books = (nar or lm).config
        if (codec.num_codebooks, codec.codebook_size) != (books.num_codebooks, books.codebook_size):
            stage = ("" if nar is not None or books.num_codebooks >= codec.num_codebooks else
                     f"; an AR stage of {books.num_codebooks} codebook(s) says the rest through a NAR stage, which "
                     f"{manifest_path} does not name (\"nar\"): train one with mmspec train tts-nar --voice {directory}, "
                     "or link a trained one there")
            raise ValueError(f"the codec ({codec.num_codebooks} x {codec.codebook_size}) does not match the "
                             f"{'NAR stage' if nar else 'LM'}'s codebooks ({books.num_codebooks} x {books.codebook_size}){stage}")
        draft, medusa, eagle = manifest.get("draft"), manifest.get("medusa"), manifest.get("eagle")
        draft_dir = directory / draft if draft and (directory / draft / CodecLM.config_file).is_file() else None
        medusa_dir = directory / medusa if medusa and (directory / medusa / DraftHeads.config_file).is_file() else None
        eagle_dir = directory / eagle if eagle and (directory / eagle / EagleHead.config_file).is_file() else None
        return cls(DelayPatternTarget(lm), codec, manifest["phonemizer"], draft_dir, dev, medusa_dir, optimize, eagle_dir,
                   float(temperature), nar, dtype, normalizer, int8)

    def normalize(self, text: str) -> NormalizedText:
        """:func:`spoken_text` under this voice's normaliser."""
        return spoken_text(text, self.normalizer_name)

    def phonemes(self, text: str) -> torch.Tensor:
        """text (normalised: :meth:`normalize`) -> [1, P] ids (one ValueError line for text the
        front end cannot say). Line breaks are said as spaces (the pipeline splits at them first)."""
        ids = make_phonemizer(self.phonemizer_name)(" ".join(text.split()))
        vocab = self.target.model.config.text_vocab
        if int(ids.max()) >= vocab:
            raise ValueError(f"the text front end gave id {int(ids.max())}, beyond this model's {vocab}")
        return ids[None].to(self.device)

    def model_inputs(self, text: str, speed: float = 1.0, ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """text -> the codec LM's inputs: ``phoneme_ids`` [1, P] (``ids`` where already made) and,
        for an aligned model, the ``durations`` [1, P] its duration predictor gives at ``speed``
        (shared with the draft)."""
        lm = self.target.model
        if speed != 1.0 and not lm.config.aligned:
            raise ValueError("speed needs an aligned codec LM (one with a duration predictor); this one sets its own pace")
        ids = self.phonemes(text) if ids is None else ids
        if not lm.config.aligned:
            return {"phoneme_ids": ids}
        durations = lm.predict_durations(ids, speed)
        if int(durations.sum()) < 1:
            raise ValueError(f"at speed {speed:g} the text {text!r} gets no audio frame; lower speed or say more")
        return {"phoneme_ids": ids, "durations": durations}

    @property
    def max_positions(self) -> int:
        """The codec LM's context: phoneme ids + separator + audio steps."""
        return self.target.model.config.max_positions

    def frames_needed(self, inputs: dict[str, torch.Tensor], frames: int) -> int:
        """The audio frames a generation of ``inputs`` makes under a budget of ``frames``: an
        aligned model's durations' total F (known before decoding) if smaller, else the budget
        (an unaligned model ends itself, at the budget at the latest)."""
        if "durations" in inputs:
            return min(int(inputs["durations"].sum()), frames)
        return frames

    def cut_short(self, inputs: dict[str, torch.Tensor], codes: torch.Tensor, frames: int) -> bool:
        """Whether a generation of ``inputs`` that gave ``codes`` [K, F] was cut by the budget of
        ``frames`` rather than ending by itself: an aligned model's durations ask for more frames,
        or an unaligned one reached the budget without its end code."""
        if "durations" in inputs:
            return int(inputs["durations"].sum()) > frames
        return codes.shape[1] >= frames

    def positions_needed(self, inputs: dict[str, torch.Tensor], frames: int) -> int:
        """The codec LM positions a generation of ``inputs`` under a budget of ``frames`` can fill:
        P phoneme ids + :meth:`frames_needed` + K + 2 (the separator, the begin step, the delays and
        the end step)."""
        return inputs["phoneme_ids"].shape[1] + self.frames_needed(inputs, frames) + self.target.num_codebooks + 2

    def draft_target(self) -> DelayPatternTarget:
        if self.draft_dir is None:
            raise ValueError("this model has no draft codec LM (tts.json 'draft'); train one with mmspec train tts "
                             "--preset draft, or use method='prompt-lookup' or 'sjd'")
        if self._draft is None:
            self._draft = DelayPatternTarget(CodecLM.from_pretrained(self.draft_dir).to(self.device).cast_steps(self.dtype))
            self.prepare(self._draft.model)
        return self._draft

    def medusa_heads(self) -> DraftHeads:
        if self.medusa_dir is None:
            raise ValueError("this model has no Medusa heads (tts.json 'medusa'); train them with mmspec train tts-drafter, "
                             "or use method='spec'")
        if self._medusa is None:
            self._medusa = DraftHeads.load(self.medusa_dir, self.target.model, "medusa")
            self.prepare(self._medusa)
        return self._medusa

    def eagle_head(self) -> EagleHead:
        if self.eagle_dir is None:
            raise ValueError("this model has no EAGLE head (tts.json 'eagle'); train one with mmspec train tts-drafter "
                             "--kind eagle, or use method='medusa'")
        if self._eagle is None:
            self._eagle = EagleHead.load(self.eagle_dir, self.target.model.backbone).eval()
            self.prepare(self._eagle)
        return self._eagle

    def neighbours(self, k: int) -> torch.Tensor:
        """A codebook neighbour table over the stream's ids, LongTensor [V, k]: each code's k nearest
        codes of its own codebook (the codec's centroids, L2); the end code, pad and stop ids are
        their own neighbours (never relaxed). k is at most C - 1."""
        from ...core.relaxed import neighbour_table

        target = self.target  # (a VALL-E-style voice streams codebook 0 alone)
        books = self.codec.codebook_embeddings()[: target.num_codebooks]  # [K, C, D]
        k = min(k, books.shape[1] - 1)
        width = target.codebook_size  # C codes (+ the end code) per codebook in the stream
        table = torch.arange(target.vocab_size)[:, None].repeat(1, k)
        for index, book in enumerate(books):
            start = index * width
            table[start : start + book.shape[0]] = neighbour_table(book, k) + start
        return table.to(self.device)

    def all_codes(self, tokens: torch.Tensor, inputs: dict[str, torch.Tensor], frames: int
                  ) -> tuple[torch.Tensor, float]:
        """A generation's new stream sub-tokens -> (the codec's codes [K, F], F <= ``frames``, the
        budget; seconds the NAR stage took: 0 without one). A VALL-E-style voice's stream is
        codebook 0; its NAR stage fills in the rest from it and the alignment (``inputs``: the
        phoneme ids and durations it was given)."""
        codes = self.target.codes(tokens)[:, :frames]  # (the budget's last steps may hold a frame or two more)
        if self.nar is None:
            return codes, 0.0
        start = time.perf_counter()
        codes = self.nar.complete(codes[0], inputs["phoneme_ids"][0], inputs["durations"][0])
        return codes, time.perf_counter() - start

    def waveform(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [K, F] -> float32 audio [channels, samples] (mmspec's mel codec is mono and gives
        [samples]; the transformers codecs give [channels, samples])."""
        audio = self.codec.decode(codes.to(getattr(self.codec, "device", "cpu"))).float().cpu()
        return audio if audio.dim() == 2 else audio[None]


