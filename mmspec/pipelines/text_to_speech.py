"""Text-to-speech with codec-token LMs: ``mmspec.pipeline("text-to-speech", model=..., method=...)``.

A model directory (``model=None``: the embedded VALL-E-style voice in ``models/tts-valle``;
``model="delay"``: the delay-pattern one in ``models/tts``) holds ``tts.json``
(``codec``: the codec directory, relative; ``phonemizer``: the text front end of
:data:`mmspec.adapters.audio.phonemes.PHONEMIZERS`; ``draft``: the draft codec LM's directory or
null; ``medusa`` / ``eagle``: the Medusa heads' / EAGLE head's directory, optional; ``temperature``:
the model's default sampling temperature, 1 if absent, as a transformers generation config gives
one; ``nar``: a VALL-E-style voice's non-autoregressive stage, optional) and the codec LM
(:class:`~mmspec.modeling.codec_lm.CodecLM`). Text -> front-end ids -> the LM's code stream through
:func:`mmspec.generate` with the method's drafter (:mod:`~mmspec.pipelines.tts_methods`) -> codes
[K, F] -> the codec's waveform. A VALL-E-style voice's LM streams codebook 0 alone, and its NAR stage
(:class:`~mmspec.modeling.codec_nar.CodecNAR`) fills in codebooks 1 .. K-1 from it, deterministically,
so every method's output distribution is still plain decoding's.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..adapters.audio.delay import DelayPatternTarget
from ..adapters.audio.phonemes import make_phonemizer
from ..api import generate, generate_rows
from ..core.stats import DictAccess, SpecStats
from ..hub import dtype_name, models_dir, resolve_device, resolve_dtype
from ..modeling.codec_lm import CodecLM
from ..modeling.codec_nar import CodecNAR
from ..modeling.fast_linear import OptimizesOnLoad
from ..modeling.heads import DraftHeads, EagleHead
from ..modeling.mel_codec import MelRVQCodec
from .tts_methods import METHODS, TTSMethod, make_method

__all__ = ["METHODS", "TTSComponents", "TextToSpeechOutput", "TextToSpeechPipeline", "TextToSpeechStats"]

MANIFEST = "tts.json"
#: names of the embedded voices (``model=`` / ``--model``) -> their directory under models/
EMBEDDED_VOICES = {"valle": "tts-valle", "delay": "tts"}
DEFAULT_VOICE = "valle"  # the more intelligible one, and the one speculation speeds up (docs/benchmarks.md)


def _positive_number(value) -> bool:
    """A finite int or float > 0 (not a bool): what max_seconds, speed and a temperature must be."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


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
    from ..adapters.audio.codec import load_codec

    return load_codec(local if local.is_dir() else codec)


class TTSComponents(OptimizesOnLoad):
    """A TTS model's parts: the code-stream target, the codec (mmspec's mel codec or any codec of
    :mod:`mmspec.adapters.audio.codec`), the text front end, the draft model and Medusa heads, and
    a VALL-E-style voice's NAR stage (``nar``)."""

    def __init__(self, target: DelayPatternTarget, codec, phonemizer: str, draft_dir: Path | None,
                 device: torch.device, medusa_dir: Path | None = None, optimize: bool = False,
                 eagle_dir: Path | None = None, temperature: float = 1.0, nar: CodecNAR | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.target, self.codec, self.phonemizer_name, self.nar = target, codec, phonemizer, nar
        self.dtype = dtype  # the codec LMs' step models (and so their heads) and the NAR stage; front end, codec: float32
        self.temperature = temperature  # the model's default sampling temperature
        self.draft_dir, self.medusa_dir, self.eagle_dir, self.device = draft_dir, medusa_dir, eagle_dir, device
        self._draft: DelayPatternTarget | None = None
        self._medusa: DraftHeads | None = None
        self._eagle: EagleHead | None = None
        self.optimize, self.linears = optimize, "as loaded"  # which few-row kernel ran (mmspec.optimize)
        self.prepare(target.model)
        if nar is not None:
            self.prepare(nar)

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, device: str = "auto", optimize: bool = True,
                        dtype: str | torch.dtype = "auto") -> "TTSComponents":
        embedded = model is None or (isinstance(model, str) and model in EMBEDDED_VOICES and not Path(model).exists())
        directory = models_dir() / EMBEDDED_VOICES[model or DEFAULT_VOICE] if embedded else Path(model)
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            hint = (f"the embedded voice {directory.name} is not in this checkout (train it: docs/speech.md)" if embedded
                    else f"{directory} has no {MANIFEST}; is it an mmspec TTS model directory (or one of "
                    f"{', '.join(EMBEDDED_VOICES)})?")
            raise ValueError(hint)
        manifest = json.loads(manifest_path.read_text())
        temperature = manifest.get("temperature", 1.0)
        if not _positive_number(temperature):
            raise ValueError(f"{manifest_path}: \"temperature\" must be a positive number, got {temperature!r}")
        dev = resolve_device(device)
        dtype = resolve_dtype(dtype, dev)
        lm = CodecLM.from_pretrained(directory).to(dev).cast_steps(dtype)
        codec = load_tts_codec(directory, manifest.get("codec"))
        nar = load_nar_stage(directory, manifest.get("nar"), lm, dev, dtype)
        books = (nar or lm).config
        if (codec.num_codebooks, codec.codebook_size) != (books.num_codebooks, books.codebook_size):
            raise ValueError(f"the codec ({codec.num_codebooks} x {codec.codebook_size}) does not match the "
                             f"{'NAR stage' if nar else 'LM'}'s codebooks ({books.num_codebooks} x {books.codebook_size})")
        draft, medusa, eagle = manifest.get("draft"), manifest.get("medusa"), manifest.get("eagle")
        draft_dir = directory / draft if draft and (directory / draft / CodecLM.config_file).is_file() else None
        medusa_dir = directory / medusa if medusa and (directory / medusa / DraftHeads.config_file).is_file() else None
        eagle_dir = directory / eagle if eagle and (directory / eagle / EagleHead.config_file).is_file() else None
        return cls(DelayPatternTarget(lm), codec, manifest["phonemizer"], draft_dir, dev, medusa_dir, optimize, eagle_dir,
                   float(temperature), nar, dtype)

    def phonemes(self, text: str) -> torch.Tensor:
        """text -> [1, P] ids (one ValueError line for text the front end cannot say)."""
        ids = make_phonemizer(self.phonemizer_name)(text)
        vocab = self.target.model.config.text_vocab
        if int(ids.max()) >= vocab:
            raise ValueError(f"the text front end gave id {int(ids.max())}, beyond this model's {vocab}")
        return ids[None].to(self.device)

    def model_inputs(self, text: str, speed: float = 1.0) -> dict[str, torch.Tensor]:
        """text -> the codec LM's inputs: ``phoneme_ids`` [1, P] and, for an aligned model, the
        ``durations`` [1, P] its duration predictor gives at ``speed`` (shared with the draft)."""
        lm = self.target.model
        if speed != 1.0 and not lm.config.aligned:
            raise ValueError("speed needs an aligned codec LM (one with a duration predictor); this one sets its own pace")
        ids = self.phonemes(text)
        return {"phoneme_ids": ids, **({"durations": lm.predict_durations(ids, speed)} if lm.config.aligned else {})}

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
        from ..core.relaxed import neighbour_table

        target = self.target  # (a VALL-E-style voice streams codebook 0 alone)
        books = self.codec.codebook_embeddings()[: target.num_codebooks]  # [K, C, D]
        k = min(k, books.shape[1] - 1)
        width = target.codebook_size  # C codes (+ the end code) per codebook in the stream
        table = torch.arange(target.vocab_size)[:, None].repeat(1, k)
        for index, book in enumerate(books):
            start = index * width
            table[start : start + book.shape[0]] = neighbour_table(book, k) + start
        return table.to(self.device)

    def all_codes(self, tokens: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
        """A generation's new stream sub-tokens -> (the codec's codes [K, F], seconds the NAR stage
        took: 0 without one). A VALL-E-style voice's stream is codebook 0; its NAR stage fills in
        the rest from it and the alignment (``inputs``: the phoneme ids and durations it was given)."""
        codes = self.target.codes(tokens)
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


@dataclass
class TextToSpeechStats(DictAccess):
    """Speed of one call.

    Attributes:
        method: the method; config: its settings.
        frames: audio frames generated; seconds: audio seconds.
        target_forwards: verification steps + the prefill (plain decoding verifies every stream
            sub-token, but runs the codec LM once per step of K sub-tokens).
        tau: stream sub-tokens committed per verification step (plain decoding: 1).
        wall_time_s: the code generation's wall time, a VALL-E-style voice's NAR stage included
            (text front end and waveform decoding, the same for every method, not included).
        nar_time_s: of which the NAR stage (0 without one); ``generation["wall_time_s"]`` is the
            code stream's alone.
        real_time_factor: wall_time_s / seconds of audio.
        speedup: the baseline's wall time / wall_time_s, with ``compare_baseline``.
    """

    method: str
    config: dict[str, Any]
    frames: int = 0
    seconds: float = 0.0
    target_forwards: int = 0
    tau: float = 0.0
    wall_time_s: float = 0.0
    nar_time_s: float = 0.0
    real_time_factor: float = 0.0
    speedup: float | None = None
    baseline_wall_time_s: float | None = None
    generation: dict[str, Any] = field(default_factory=dict)


@dataclass
class TextToSpeechOutput(DictAccess):
    """audio: float32 [1, samples]; sampling_rate; codes [K, F]; stats; baseline_audio (with
    ``compare_baseline``)."""

    text: str
    audio: torch.Tensor
    sampling_rate: int
    codes: torch.Tensor
    stats: TextToSpeechStats
    baseline_audio: torch.Tensor | None = None
    baseline_codes: torch.Tensor | None = None


class TextToSpeechPipeline:
    """``mmspec.pipeline("text-to-speech", model=None, method="ar", device="auto")``.

    Args:
        model: a TTS model directory, or the name of an embedded voice: None or "valle" (the default,
            models/tts-valle: an LM over codebook 0 and a NAR stage for the rest), "delay" (models/tts:
            a delay-pattern codec LM over all 8 codebooks).
        method: a name of :data:`METHODS` or a :class:`TTSMethod`.
        num_draft_tokens: the method's draft length in stream sub-tokens (None: its default).
        optimize: few-row linears for the networks it loads (:func:`mmspec.optimize`;
            ``stats.config["linears"]`` says which kernel ran); False keeps them as loaded.
        dtype: the codec LMs' weights (the target's, the draft's, and so their heads'): "auto" (the
            default: bfloat16 where it is fast, a GPU or a CPU with AMX or AVX512-BF16, else
            float32; on the embedded voice bf16 reads as well as fp32, docs/benchmarks.md),
            "float32" or "bfloat16". The text front end, duration predictor, NAR stage and codec stay float32.
            ``stats.config["dtype"]`` says which; exact methods stay exact against plain decoding in
            the same dtype.
        **rule_settings: a tolerant method's rule parameters (``top_k`` for spec-topk, ``delta`` for
            lantern).
    """

    def __init__(self, model: str | Path | None = None, method: str | TTSMethod = "ar", device: str = "auto",
                 num_draft_tokens: int | None = None, optimize: bool = True, dtype: str | torch.dtype = "auto",
                 **rule_settings: Any) -> None:
        self.method = (method if isinstance(method, TTSMethod)
                       else make_method(method, num_draft_tokens=num_draft_tokens, **rule_settings))
        resolve_dtype(dtype)
        self.components = TTSComponents.from_pretrained(model, device, optimize, dtype)
        self.method.check_components(self.components)  # a missing draft is an error now, not at the first call

    @classmethod
    def check_arguments(cls, values: dict[str, Any]) -> None:
        """Check construction arguments (all of ``__init__``'s, bound) without loading anything
        (presets): the method and its settings, the device and dtype. Raises ValueError / TypeError."""
        if not isinstance(values["method"], TTSMethod):
            make_method(values["method"], num_draft_tokens=values["num_draft_tokens"], **values["rule_settings"])
        resolve_device(values["device"])
        resolve_dtype(values["dtype"])

    @property
    def sampling_rate(self) -> int:
        return self.components.codec.sampling_rate

    def _generate(self, method: TTSMethod, inputs: list[dict[str, torch.Tensor]], max_new_tokens: int, seed: int,
                  sampling: dict[str, Any], progress: Callable[[int], None] | None = None) -> list[tuple[torch.Tensor, SpecStats]]:
        """Each generation's new stream sub-tokens and stats: one generation, or a batch of them
        verified together (:func:`mmspec.api.generate_rows`; each row as its own generation)."""
        c = self.components
        settings = dict(drafter=method.build_drafter(c), max_new_tokens=max_new_tokens, seed=seed, acceptance=method.rule,
                        rule_kwargs=method.rule_kwargs(c), **sampling)
        k = c.target.num_codebooks
        if len(inputs) == 1:
            on_step = None if progress is None else (lambda generated: progress(generated // k))
            out = generate(c.target, on_step=on_step, **settings, **inputs[0])
            return [(out.sequences[0, k:], out.stats)]
        out = generate_rows(c.target, inputs, **settings)
        return [(out.sequences[b, k : k + s.new_tokens], s) for b, s in enumerate(out.row_stats)]

    def __call__(self, text: str | list[str], do_sample: bool = True, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, max_seconds: float = 20.0, speed: float = 1.0,
                 compare_baseline: bool = False, method: TTSMethod | None = None,
                 progress: Callable[[int], None] | None = None,
                 batch_size: int = 1) -> TextToSpeechOutput | list[TextToSpeechOutput]:
        """Say ``text``, or each text of a list (one output per text, in order). Sampling is the
        default, as codec LMs are used, at the model's temperature (``temperature=None``: its
        tts.json's, 0.7 for the embedded voice, as Bark samples; else 1). ``speed`` scales an aligned model's
        speaking rate (2.0: twice as fast). ``method`` overrides the pipeline's for this call (the
        benchmark runs every method on one model). ``progress`` is called with the steps (frames,
        roughly) generated so far by the method's run (batch size 1).

        ``batch_size``: texts of a list decoded together (:mod:`mmspec.core.batch`), each one
        verified as its own generation: the codes of the text said alone with the same ``seed``
        (every text gets it). A row's ``stats.wall_time_s`` runs from its batch's start until it
        finished; with ``compare_baseline``, plain decoding runs the same batches.

        Raises:
            ValueError: empty text, text the front end cannot say, a bad max_seconds, speed or batch_size.
        """
        method = method or self.method
        for name, value in (("max_seconds", max_seconds), ("speed", speed)):
            if not _positive_number(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise ValueError("no text given; pass a sentence or a list of them")
        c = self.components
        frames = int(max_seconds * c.codec.frame_rate)
        inputs = [c.model_inputs(t, speed) for t in texts]  # every text checked before decoding
        for ids in (i["phoneme_ids"] for i in inputs):
            if ids.shape[1] + frames + c.target.num_codebooks + 2 > c.target.model.config.max_positions:
                raise ValueError(f"text + {max_seconds} s exceed the model's {c.target.model.config.max_positions} "
                                 "positions; say a shorter sentence or lower max_seconds")
        budget = c.target.stream_length(frames) + 1
        temperature = c.temperature if temperature is None else temperature
        sampling = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        results = []
        for first in range(0, len(texts), batch_size):
            chunk = inputs[first : first + batch_size]
            baseline = None
            if compare_baseline:
                self._generate(make_method("ar"), chunk[:1], min(budget, 8 * c.target.num_codebooks), seed, sampling)  # warm-up
                baseline = self._generate(make_method("ar"), chunk, budget, seed, sampling)
            runs = self._generate(method, chunk, budget, seed, sampling, progress)
            for row, (tokens, stats) in enumerate(runs):
                results.append(self._output(method, texts[first + row], chunk[row], tokens, stats, baseline and baseline[row],
                                            sampling))
        return results[0] if isinstance(text, str) else results

    def _output(self, method: TTSMethod, text: str, inputs: dict[str, torch.Tensor], tokens: torch.Tensor, s: SpecStats,
                baseline: tuple[torch.Tensor, SpecStats] | None, sampling: dict) -> TextToSpeechOutput:
        """One generation (of ``inputs``)'s stream -> codes, waveform and stats (and the
        baseline's); ``sampling`` (do_sample, temperature, top_k, top_p as used) goes into the
        stats' config."""
        c = self.components
        codes, nar_s = c.all_codes(tokens, inputs)
        seconds = codes.shape[1] / c.codec.frame_rate
        used = {name: value for name, value in sampling.items() if value is not None}
        wall = s.wall_time_s + nar_s
        config = {**method.describe(), **s.config, **used, "linears": c.linears, "dtype": dtype_name(c.dtype)}
        stats = TextToSpeechStats(method=method.name, config=config,
                                  frames=codes.shape[1], seconds=seconds, target_forwards=s.target_forwards,
                                  tau=s.mean_accepted_length, wall_time_s=wall, nar_time_s=nar_s,
                                  real_time_factor=wall / max(seconds, 1e-9), generation=s.to_dict())
        result = TextToSpeechOutput(text=text, audio=c.waveform(codes), sampling_rate=self.sampling_rate, codes=codes,
                                    stats=stats)
        if baseline is not None:
            result.baseline_codes, baseline_nar_s = c.all_codes(baseline[0], inputs)
            stats.baseline_wall_time_s = baseline[1].wall_time_s + baseline_nar_s
            stats.speedup = stats.baseline_wall_time_s / wall
            result.baseline_audio = c.waveform(result.baseline_codes)
        return result
