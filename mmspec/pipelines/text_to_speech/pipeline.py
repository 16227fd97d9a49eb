"""Text-to-speech with codec-token LMs: ``mmspec.pipeline("text-to-speech", model=..., method=...)``.

Text -> the normaliser's words (:mod:`mmspec.adapters.audio.normalize`) -> front-end ids -> the
LM's code stream through :func:`mmspec.generate` with the method's drafter
(:mod:`~mmspec.pipelines.text_to_speech.methods`) -> codes [K, F] -> the codec's waveform (the
model's parts: :mod:`~mmspec.pipelines.text_to_speech.components`). A VALL-E-style voice's LM
streams codebook 0 alone, and its NAR stage (:class:`~mmspec.modeling.codec_nar.CodecNAR`) fills
in codebooks 1 .. K-1 from it, deterministically, so every method's output distribution is still
plain decoding's. :meth:`TextToSpeechPipeline.stream` yields a text's audio sentence by sentence as
each is ready.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ...adapters.audio.normalize import NormalizedText
from ...api import generate, generate_rows
from ...core.batch import batch_stats
from ...core.stats import DictAccess, SpecStats
from ...hub import dtype_name, resolve_device
from ..base import Pipeline, ProgressCallback, register_pipeline
from .components import MAX_SPEED, TTSComponents, _positive_number, check_int8, check_speed, voice_dtype
from .methods import METHODS, TTSMethod, make_method

__all__ = ["MAX_SPEED", "METHODS", "PAUSE_SECONDS", "SPLITS", "TTSComponents", "TextToSpeechChunk", "TextToSpeechOutput",
           "TextToSpeechPipeline", "TextToSpeechStats"]


#: silence between the pieces of a text said as several generations (its sentences)
PAUSE_SECONDS = 0.3
#: how a text is cut into generations: "auto" (whole where it fits the context, else sentences,
#: else clauses) or "sentences" (every sentence alone, a sentence too long alone by its clauses)
SPLITS = ("auto", "sentences")


def split_sentences(text: str) -> list[str]:
    """``text`` -> its sentences: split where white space follows . ! ? or an ellipsis (or one of
    them and a closing quote or bracket), and at line breaks; empty pieces dropped. "$49.99" and
    "3/4/2025." stay whole (no space after the inner periods)."""
    return [piece.strip() for piece in re.split(r"(?<=[.!?\u2026])\s+|(?<=[.!?\u2026][\"')\]])\s+|\n+", text)
            if piece and piece.strip()]


def split_words(piece: str) -> tuple[str, str]:
    """A piece of two or more words -> its halves (by words), for a clause too long alone."""
    words = piece.split()
    return " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])


def split_clauses(sentence: str) -> list[str]:
    """A sentence -> its clauses: split after , ; : followed by white space."""
    return [piece.strip() for piece in re.split(r"(?<=[,;:])\s+", sentence) if piece and piece.strip()]


def sampling_options(components, do_sample: bool, temperature: float | None, top_k: int | None,
                     top_p: float | None) -> dict[str, Any]:
    """A call's sampling arguments for :func:`mmspec.generate`: an unset temperature is the voice's
    own when sampling and 1 (none) when greedy; one given with greedy decoding goes on to be
    refused there."""
    if temperature is None:
        temperature = components.temperature if do_sample else 1.0
    return {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}


def _summed(stats: list[SpecStats]) -> SpecStats:
    """One generation's stats, or the sum of a split text's generations (their wall times and
    target forwards added, tau over all their steps)."""
    if len(stats) == 1:
        return stats[0]
    return batch_stats(stats, sum(s.wall_time_s for s in stats), sum(s.target_forwards for s in stats))


@dataclass
class TextToSpeechStats(DictAccess):
    """Speed of one call.

    Attributes:
        method: the method; config: its settings.
        frames: audio frames generated; seconds: the speech's seconds (frames / frame rate; the
            pauses :meth:`__call__` puts between a long text's pieces are not counted).
        target_forwards: verification steps + the prefill (plain decoding verifies every stream
            sub-token, but runs the codec LM once per step of K sub-tokens).
        tau: stream sub-tokens committed per verification step: plain decoding's is 1 on a
            one-codebook stream (the VALL-E-style AR stage) and K on a delay-pattern model's, whose
            every step commits one code of each of its K codebooks (compare methods by speedup).
        wall_time_s: the code generation's wall time, a VALL-E-style voice's NAR stage included
            (text front end and waveform decoding, the same for every method, not included).
        nar_time_s: of which the NAR stage (0 without one); ``generation["wall_time_s"]`` is the
            code stream's alone.
        real_time_factor: wall_time_s / seconds (of speech).
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
    ``compare_baseline``); pieces: the texts said as separate generations, normalised (the text
    itself, or its sentences / clauses where it did not fit the context at once or ``split`` asked
    for sentences: their codes back to back, their audio joined by :data:`PAUSE_SECONDS` of
    silence); normalized: the whole text as the normaliser gave it; dropped: what it removed
    because no voice can say it (runs of emoji, other scripts:
    :class:`~mmspec.adapters.audio.normalize.NormalizedText`); truncated: whether ``max_seconds``
    cut a piece's speech short (the audio then stops mid-text; raise ``max_seconds`` to hear it all).
    :meth:`to_dict` is JSON-serialisable (the audio's samples and the codes as nested lists)."""

    text: str
    audio: torch.Tensor
    sampling_rate: int
    codes: torch.Tensor
    stats: TextToSpeechStats
    baseline_audio: torch.Tensor | None = None
    baseline_codes: torch.Tensor | None = None
    pieces: list[str] = field(default_factory=list)
    normalized: str = ""
    dropped: tuple[str, ...] = ()
    truncated: bool = False


@dataclass
class TextToSpeechChunk(DictAccess):
    """One piece of a streamed text (:meth:`TextToSpeechPipeline.stream`), yielded once it is ready.

    Attributes:
        index: the piece's place (0, 1, ...); total: how many pieces the text has, as known when
            this chunk was made (its sentences; a later sentence cut into clauses adds its parts
            when the stream reaches it).
        text: the piece (a normalised sentence or clause).
        audio: float32 [1, samples]: the piece's speech, after :data:`PAUSE_SECONDS` of silence on
            every chunk but the first, so the chunks played back to back are
            ``tts(text, split=...).audio`` with the same settings and split.
        sampling_rate: Hz.
        codes: the piece's codes [K, F].
        stats: the piece's :class:`TextToSpeechStats`.
        elapsed_s: seconds from the ``stream`` call (its checks and front end included) until this
            chunk was ready; the first chunk's is the time to first audio (time the caller spends
            between chunks is included too).
        dropped: what the normaliser removed from the whole text (on every chunk).
        truncated: whether ``max_seconds`` cut this piece's speech short.
    """

    index: int
    total: int
    text: str
    audio: torch.Tensor
    sampling_rate: int
    codes: torch.Tensor
    stats: TextToSpeechStats
    elapsed_s: float
    dropped: tuple[str, ...] = ()
    truncated: bool = False


@register_pipeline
class TextToSpeechPipeline(Pipeline):
    """``mmspec.pipeline("text-to-speech", model=None, method="sjd-coupled", device="auto")``.

    Args:
        model: a TTS model directory, or the name of an embedded voice: None or "valle" (the default,
            models/tts-valle: an LM over codebook 0 and a NAR stage for the rest), "delay" (models/tts:
            a delay-pattern codec LM over all 8 codebooks).
        method: a spec of :data:`METHODS` in the one syntax, ``name[:key=value,...]``
            ("vadusa:top_k=5"), or a :class:`TTSMethod`. The default is exact coupled SJD, as
            ``mmspec tts`` and ``mmspec serve`` use (training-free: every voice has it); "ar" is
            plain decoding.
        num_draft_tokens: the method's draft length in stream sub-tokens (None: its default).
        optimize: few-row linears for the networks it loads (:func:`mmspec.optimize`;
            ``stats.config["linears"]`` says which kernel ran); False keeps them as loaded.
        dtype: the codec LMs' weights (the target's, the draft's, and so their heads'): "auto" (the
            default: bfloat16 where it is fast, a GPU or a CPU with AMX or AVX512-BF16, else
            float32; on the embedded voice bf16 reads as well as fp32, docs/benchmarks.md),
            "float32" or "bfloat16". The text front end, duration predictor, NAR stage and codec stay float32.
            ``stats.config["dtype"]`` says which; exact methods stay exact against plain decoding in
            the same dtype.
        int8: read the AR stage's decoder projections and the NAR stage's linears as int8 weights
            (CPU, ``optimize``; the int8 kernel: AVX512-VNNI, AMX-INT8 or AVX2), activations in
            ``dtype``: another, quantised model, faster on CPUs without AMX (docs/speech.md, "int8
            weights"); every method, plain decoding included, decodes that model, so exact methods
            stay exact against plain decoding with ``int8=True``. ``stats.config["int8"]`` says which.
        **rule_settings: a tolerant method's rule parameters (``top_k`` for spec-topk, ``delta`` for
            lantern).
    """

    task = "text-to-speech"
    methods = METHODS

    def __init__(self, model: str | Path | None = None, method: str | TTSMethod = "sjd-coupled", device: str = "auto",
                 num_draft_tokens: int | None = None, optimize: bool = True, dtype: str | torch.dtype = "auto",
                 int8: bool = False, **rule_settings: Any) -> None:
        self.method = self.make_method(method, num_draft_tokens=num_draft_tokens, **rule_settings)
        voice_dtype(dtype)
        check_int8(int8, device, optimize)
        self.components = TTSComponents.from_pretrained(model, device, optimize, dtype, int8)
        self.method.check_components(self.components)  # a missing draft is an error now, not at the first call

    @classmethod
    def check_arguments(cls, values: dict[str, Any]) -> None:
        """Check construction arguments (all of ``__init__``'s, bound) without loading anything
        (presets): the method and its settings, the device and dtype. Raises ValueError / TypeError."""
        if not isinstance(values["method"], TTSMethod):
            make_method(values["method"], num_draft_tokens=values["num_draft_tokens"], **values["rule_settings"])
        resolve_device(values["device"])
        voice_dtype(values["dtype"])
        check_int8(values["int8"], values["device"], values["optimize"])

    @property
    def sampling_rate(self) -> int:
        return self.components.codec.sampling_rate

    def _frames(self, max_seconds: float) -> int:
        """The codec frames ``max_seconds`` allows; at least one (else one ValueError line, before decoding)."""
        rate = self.components.codec.frame_rate
        if max_seconds > 86400:  # (1e308 s overflowed int(): a traceback after the voice loaded)
            raise ValueError(f"max_seconds={max_seconds:g} is more than a day; give at most 86400 s (a generation's "
                             "budget: a long text is said piece by piece)")
        frames = int(max_seconds * rate)
        if frames < 1:
            raise ValueError(f"max_seconds={max_seconds:g} is shorter than one codec frame; give at least {1 / rate:.4g} s "
                             f"(this codec makes {rate:g} frames a second)")
        return frames

    @property
    def channels(self) -> int:
        """The audio's channels (1 for mmspec's mel codec; a stereo EnCodec's 2): ``audio`` is [channels, samples]."""
        return int(getattr(self.components.codec, "channels", 1))

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
                 top_p: float | None = None, seed: int | None = 0, max_seconds: float = 20.0, speed: float = 1.0,
                 compare_baseline: bool = False, method: TTSMethod | str | None = None,
                 progress: bool | ProgressCallback | None = None,
                 batch_size: int = 1, split: str = "auto") -> TextToSpeechOutput | list[TextToSpeechOutput]:
        """Say ``text``, or each text of a list (one output per text, in order). Sampling is the
        default, as codec LMs are used, at the model's temperature (``temperature=None``: its
        tts.json's, 0.7 for the embedded voice, as Bark samples; else 1). ``speed`` scales an aligned model's
        speaking rate (2.0: twice as fast; at most :data:`~.components.MAX_SPEED`). ``method`` (a TTSMethod or a spec) overrides the
        pipeline's for this call (the benchmark runs every method on one model). ``progress`` is
        called with the steps (frames, roughly) generated so far by the method's run (batch size
        1); True shows a terminal bar of frames. ``seed`` seeds every generation (``None``: a fresh
        random seed, as in every pipeline).

        The text is normalised first (the model's normaliser, "english" by default: numbers,
        dates, times, money, units, abbreviations, initialisms, URLs as words; emoji and other
        scripts dropped and listed in ``output.dropped``), then cut into generations.

        ``max_seconds`` caps each generation's audio. A text whose phoneme ids and audio frames do
        not fit the codec LM's context together (an aligned voice's frames are its predicted
        durations' total, known before decoding, when under the cap; an unaligned voice's, the cap)
        is said as separate generations: its sentences, and a sentence that does not fit alone, its
        clauses (split after , ; :), and a clause that does not fit alone, the halves of its words,
        each with ``seed``; their audio is joined with a :data:`PAUSE_SECONDS` pause
        (``output.pieces`` lists them). A single word that does not fit alone is refused before
        anything is decoded. ``split="sentences"`` says every sentence alone
        (the pieces :meth:`stream` yields; with it, joined, the same audio bitwise).

        ``batch_size``: generations (texts, or the pieces of a split text) decoded together
        (:mod:`mmspec.core.batch`), each verified as its own generation: the codes of the text said
        alone with the same ``seed`` (every text gets it), bitwise; on a CPU with the C kernels in
        bf16 too (each batch row is computed alone by the few-row kernels and the batch-invariant
        attention; not where a row's draft is wider than the kernels' rows, nor on CUDA). A row's
        ``stats.wall_time_s`` runs from its batch's start until it finished; with
        ``compare_baseline``, plain decoding runs the same batches.

        Raises:
            ValueError: empty text, text with nothing sayable left (naming what was dropped), a
                word too long for the context even alone, a bad max_seconds, speed, batch_size or split.
        """
        # (max_seconds, speed, split and batch_size are checked before the call: check_task_values)
        method = self.make_method(method) if method is not None else self.method
        texts = self.strings(text, "text")
        if not texts:
            raise ValueError("no text given; pass a sentence or a list of them")
        c = self.components
        frames = self._frames(max_seconds)
        # every text checked and split before decoding: (text index, piece, its inputs)
        spoken, pieces = [], []
        for index, t in enumerate(texts):
            with self.naming_item(index + 1, len(texts), "text"):
                normalized, cut = self._pieces(t, speed, frames, split)
            spoken.append(normalized)
            pieces += [(index, piece, inputs) for piece, inputs in cut]
        budget = c.target.stream_length(frames) + 1
        sampling = sampling_options(c, do_sample, temperature, top_k, top_p)
        runs: list[tuple[torch.Tensor, SpecStats]] = []
        baselines: list[tuple[torch.Tensor, SpecStats] | None] = []
        plain = self.make_method("ar")
        report, close = self.progress_reporter(progress, sum(c.frames_needed(i, frames) for _, _, i in pieces), "frame")
        done = 0
        try:
            for _, chunk in self.chunks([inputs for _, _, inputs in pieces], batch_size):
                shifted = None if report is None else (lambda steps, before=done: report(before + steps))
                method_runs, baseline = self.with_baseline(
                    lambda: self._generate(method, chunk, budget, seed, sampling, shifted),
                    (lambda: self._generate(plain, chunk, budget, seed, sampling)) if compare_baseline else None,
                    warm_up=lambda: self._generate(plain, chunk[:1], min(budget, 8 * c.target.num_codebooks), seed, sampling),
                    key=plain.name)
                runs.extend(method_runs)
                baselines.extend(baseline if baseline is not None else [None] * len(chunk))
                done += sum(c.frames_needed(inputs, frames) for inputs in chunk)
        finally:
            close()
        results = []
        for index, t in enumerate(texts):
            mine = [p for p, (owner, _, _) in enumerate(pieces) if owner == index]
            result = self._output(method, t, [pieces[p][1] for p in mine], [pieces[p][2] for p in mine],
                                  [runs[p] for p in mine], [baselines[p] for p in mine], sampling, frames)
            result.normalized, result.dropped = spoken[index].text, spoken[index].dropped
            results.append(result)
        return results[0] if isinstance(text, str) else results

    @classmethod
    def check_task_values(cls, values: dict[str, Any]) -> None:
        """max_seconds, speed and split of a call (:meth:`Pipeline.check_call_values`)."""
        if not _positive_number(values["max_seconds"]):
            raise ValueError(f"max_seconds must be a positive number, got {values['max_seconds']!r}")
        check_speed(values["speed"])
        cls.check_split(values["split"])
        if values["method"] is not None and not isinstance(values["method"], TTSMethod):
            cls.make_method(values["method"])

    @staticmethod
    def check_split(split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")

    def stream(self, text: str, do_sample: bool = True, temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = 0, max_seconds: float = 20.0, speed: float = 1.0,
               method: TTSMethod | str | None = None, split: str = "sentences") -> Iterator[TextToSpeechChunk]:
        """Say ``text`` piece by piece, yielding each piece's audio as soon as it is ready
        (:class:`TextToSpeechChunk`: a float32 [1, samples] tensor, its sampling rate, the piece's
        text and stats). The settings are :meth:`__call__`'s; ``split="sentences"`` (the default)
        makes every sentence a piece, so the first audio comes after the first sentence.

        With the same arguments, the chunks' audio joined is ``tts(text, split=split).audio``
        bitwise, and their codes ``.codes``: each piece is generated alone with ``seed``, as
        ``__call__`` does with ``batch_size=1``.

        The text is checked, normalised, cut into sentences and run through the front end here,
        before the first chunk is asked for: text with nothing to say or characters the front end
        cannot say raise ValueError at the call. A sentence's durations, and its cut into clauses
        where it does not fit the context alone, are made when the stream reaches it, so a long
        text's first audio does not wait for every sentence's (~2 ms each); a single word too long
        for the context even alone raises ValueError there. ``total`` counts the pieces known so far:
        the sentences, and a later sentence's clauses once the stream reaches them.

        Example:
            >>> for chunk in tts.stream("Hello there. How are you today?"):
            ...     play(chunk.audio, chunk.sampling_rate)
        """
        start = time.perf_counter()
        method = self.make_method(method) if method is not None else self.method
        c = self.components
        frames = self._frames(max_seconds)
        normalized, whole, sentences = self._sentences(text, speed, frames, split)
        budget = c.target.stream_length(frames) + 1
        sampling = sampling_options(c, do_sample, temperature, top_k, top_p)

        def fitted() -> Iterator[tuple[int, str, dict[str, torch.Tensor]]]:  # (each piece, with the count known then)
            if whole is not None:
                yield 1, *whole
                return
            total = len(sentences)
            for sentence, ids in sentences:
                pieces = self._fit(sentence, ids, speed, frames)
                total += len(pieces) - 1
                for piece, inputs in pieces:
                    yield total, piece, inputs

        def chunks() -> Iterator[TextToSpeechChunk]:
            pause = None
            for index, (total, piece, inputs) in enumerate(fitted()):
                run = self._generate(method, [inputs], budget, seed, sampling)[0]
                out = self._output(method, piece, [piece], [inputs], [run], [None], sampling, frames)
                audio = out.audio
                if index:
                    if pause is None:
                        pause = audio.new_zeros(audio.shape[0], round(PAUSE_SECONDS * self.sampling_rate))
                    audio = torch.cat([pause, audio], dim=-1)
                yield TextToSpeechChunk(index=index, total=total, text=piece, audio=audio,
                                        sampling_rate=self.sampling_rate, codes=out.codes, stats=out.stats,
                                        elapsed_s=time.perf_counter() - start, dropped=normalized.dropped,
                                        truncated=out.truncated)

        return chunks()

    def _pieces(self, text: str, speed: float, frames: int, split: str = "auto"
                ) -> tuple[NormalizedText, list[tuple[str, dict[str, torch.Tensor]]]]:
        """``text`` normalised, and as the generations that say it, each (its text, its inputs)
        fitting the codec LM's context under a budget of ``frames``: the whole text where it fits
        (``split="auto"``), else its sentences, a sentence that does not fit alone its clauses, and
        a clause that does not fit alone the halves of its words (again while a half does not fit).
        Raises ValueError (one line) for text with nothing to say, or a word that does not fit alone."""
        normalized, whole, sentences = self._sentences(text, speed, frames, split)
        if whole is not None:
            return normalized, [whole]
        return normalized, [piece for sentence, ids in sentences for piece in self._fit(sentence, ids, speed, frames)]

    def _sentences(self, text: str, speed: float, frames: int, split: str
                   ) -> tuple[NormalizedText, tuple[str, dict[str, torch.Tensor]] | None, list[tuple[str, torch.Tensor]]]:
        """``text`` normalised, and either the whole of it as one generation (its text, its
        inputs: ``split="auto"`` where it fits) or its sentences, each with its phoneme ids [1, P]
        (the front end run over every sentence: one ValueError line for what it cannot say),
        to be fitted by :meth:`_fit`."""
        c = self.components
        normalized = c.normalize(text)
        text = normalized.text
        sentences = split_sentences(text)
        if split == "auto" or len(sentences) == 1:
            ids = c.phonemes(text)  # (a text whose phonemes alone pass the context: no durations run over it all)
            if ids.shape[1] + c.target.num_codebooks + 2 < c.max_positions:
                whole = c.model_inputs(text, speed, ids)
                if c.positions_needed(whole, frames) <= c.max_positions:
                    return normalized, (" ".join(text.split()), whole), []
        if not c.target.model.config.aligned and frames >= c.max_positions:  # (no split can help)
            raise ValueError(f"max_seconds asks for {frames} audio frames a generation, more than this model's "
                             f"{c.max_positions} positions hold (it has no durations to end sooner); lower max_seconds "
                             f"(--max-seconds) below {c.max_positions / c.codec.frame_rate:.2f} s")
        return normalized, None, [(sentence, c.phonemes(sentence)) for sentence in sentences]

    def _fit(self, piece: str, ids: torch.Tensor | None, speed: float, frames: int, split_into=split_clauses
             ) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """``piece`` (its phoneme ids [1, P] where made) as the generations that say it: itself
        where it fits the context under ``frames``, else its parts (``split_into``: a sentence's
        clauses; else, or where that gives one, the halves of its words), each fitted again.
        Raises ValueError (one line) for a word that does not fit alone."""
        c = self.components
        inputs = c.model_inputs(piece, speed, ids)
        if c.positions_needed(inputs, frames) <= c.max_positions:
            return [(piece, inputs)]
        parts = split_into(piece) if split_into is not None else []
        if len(parts) < 2 and len(piece.split()) > 1:
            parts = split_words(piece)
        if len(parts) > 1:
            return [fitted for part in parts for fitted in self._fit(part, None, speed, frames, None)]
        shown = piece if len(piece) <= 60 else piece[:57] + "..."
        count = inputs["phoneme_ids"].shape[1]
        hint = ("" if count >= c.max_positions else ", or say it faster (speed, --speed) or lower max_seconds "
                "(--max-seconds)" if "durations" in inputs else ", or lower max_seconds (--max-seconds)")
        raise ValueError(f"{shown!r} is too long for the model's {c.max_positions} positions even alone ({count} "
                         f"phoneme ids + {c.frames_needed(inputs, frames)} audio frames); shorten it{hint}")

    def _output(self, method: TTSMethod, text: str, pieces: list[str], inputs: list[dict[str, torch.Tensor]],
                runs: list[tuple[torch.Tensor, SpecStats]], baselines: list[tuple[torch.Tensor, SpecStats] | None],
                sampling: dict, frames: int) -> TextToSpeechOutput:
        """One text's generations (one per piece: ``inputs[i]`` gave ``runs[i]``, the new stream
        and its stats, and ``baselines[i]``) -> codes, waveform and stats (and the baseline's).
        Several pieces: codes back to back [K, sum F_i], their waveforms joined by a
        :data:`PAUSE_SECONDS` silence, stats summed (:func:`~mmspec.core.batch.batch_stats`).
        ``sampling`` (do_sample, temperature, top_k, top_p as used) goes into the stats' config;
        ``frames`` is each piece's budget (``max_seconds``)."""
        c = self.components
        codes, nar_s = zip(*(c.all_codes(tokens, i, frames) for (tokens, _), i in zip(runs, inputs)))
        audio = self._join([c.waveform(piece) for piece in codes])
        generation = _summed([s for _, s in runs])
        used = {name: value for name, value in sampling.items() if value is not None}
        wall = generation.wall_time_s + sum(nar_s)
        seconds = sum(piece.shape[1] for piece in codes) / c.codec.frame_rate  # (the pauses between pieces: not made)
        config = {**method.describe(), **generation.config, **used, **self.run_config()}
        stats = TextToSpeechStats(method=method.name, config=config, frames=sum(piece.shape[1] for piece in codes),
                                  seconds=seconds, target_forwards=generation.target_forwards,
                                  tau=generation.mean_accepted_length, wall_time_s=wall, nar_time_s=sum(nar_s),
                                  real_time_factor=wall / max(seconds, 1e-9), generation=generation.to_dict())
        result = TextToSpeechOutput(text=text, audio=audio, sampling_rate=self.sampling_rate, codes=torch.cat(codes, dim=1),
                                    stats=stats, pieces=list(pieces),
                                    truncated=any(c.cut_short(i, piece, frames) for i, piece in zip(inputs, codes)))
        if baselines[0] is not None:
            base_codes, base_nar_s = zip(*(c.all_codes(tokens, i, frames) for (tokens, _), i in zip(baselines, inputs)))
            result.baseline_codes = torch.cat(base_codes, dim=1)
            stats.baseline_wall_time_s = _summed([s for _, s in baselines]).wall_time_s + sum(base_nar_s)
            stats.speedup = stats.baseline_wall_time_s / wall
            result.baseline_audio = self._join([c.waveform(piece) for piece in base_codes])
        return result

    def _join(self, waveforms: list[torch.Tensor]) -> torch.Tensor:
        """Waveforms [channels, samples_i] -> one, a :data:`PAUSE_SECONDS` silence between each two."""
        if len(waveforms) == 1:
            return waveforms[0]
        pause = waveforms[0].new_zeros(waveforms[0].shape[0], round(PAUSE_SECONDS * self.sampling_rate))
        joined = [waveforms[0]]
        for waveform in waveforms[1:]:
            joined += [pause, waveform]
        return torch.cat(joined, dim=-1)

    def run_config(self) -> dict[str, Any]:
        """The linears' kernel and the codec LMs' dtype (every result's stats.config)."""
        return {"linears": self.components.linears, "dtype": dtype_name(self.components.dtype), "int8": self.components.int8}
