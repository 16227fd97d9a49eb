"""Text-to-speech with codec-token LMs: ``mmspec.pipeline("text-to-speech", model=..., method=...)``.

Text -> front-end ids -> the LM's code stream through :func:`mmspec.generate` with the method's
drafter (:mod:`~mmspec.pipelines.text_to_speech.methods`) -> codes [K, F] -> the codec's waveform
(the model's parts: :mod:`~mmspec.pipelines.text_to_speech.components`). A VALL-E-style voice's LM
streams codebook 0 alone, and its NAR stage (:class:`~mmspec.modeling.codec_nar.CodecNAR`) fills
in codebooks 1 .. K-1 from it, deterministically, so every method's output distribution is still
plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ...api import generate, generate_rows
from ...core.stats import DictAccess, SpecStats
from ...hub import dtype_name, resolve_device, resolve_dtype
from ..base import Pipeline, ProgressCallback, register_pipeline
from .components import TTSComponents, _positive_number
from .methods import METHODS, TTSMethod, make_method

__all__ = ["METHODS", "TTSComponents", "TextToSpeechOutput", "TextToSpeechPipeline", "TextToSpeechStats"]


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


@register_pipeline
class TextToSpeechPipeline(Pipeline):
    """``mmspec.pipeline("text-to-speech", model=None, method="ar", device="auto")``.

    Args:
        model: a TTS model directory, or the name of an embedded voice: None or "valle" (the default,
            models/tts-valle: an LM over codebook 0 and a NAR stage for the rest), "delay" (models/tts:
            a delay-pattern codec LM over all 8 codebooks).
        method: a spec of :data:`METHODS` in the one syntax, ``name[:key=value,...]``
            ("vadusa:top_k=5"), or a :class:`TTSMethod`.
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

    task = "text-to-speech"
    methods = METHODS

    def __init__(self, model: str | Path | None = None, method: str | TTSMethod = "ar", device: str = "auto",
                 num_draft_tokens: int | None = None, optimize: bool = True, dtype: str | torch.dtype = "auto",
                 **rule_settings: Any) -> None:
        self.method = self.make_method(method, num_draft_tokens=num_draft_tokens, **rule_settings)
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
                 compare_baseline: bool = False, method: TTSMethod | str | None = None,
                 progress: bool | ProgressCallback | None = None,
                 batch_size: int = 1) -> TextToSpeechOutput | list[TextToSpeechOutput]:
        """Say ``text``, or each text of a list (one output per text, in order). Sampling is the
        default, as codec LMs are used, at the model's temperature (``temperature=None``: its
        tts.json's, 0.7 for the embedded voice, as Bark samples; else 1). ``speed`` scales an aligned model's
        speaking rate (2.0: twice as fast). ``method`` (a TTSMethod or a spec) overrides the
        pipeline's for this call (the benchmark runs every method on one model). ``progress`` is
        called with the steps (frames, roughly) generated so far by the method's run (batch size
        1); True shows a terminal bar of frames.

        ``batch_size``: texts of a list decoded together (:mod:`mmspec.core.batch`), each one
        verified as its own generation: the codes of the text said alone with the same ``seed``
        (every text gets it). A row's ``stats.wall_time_s`` runs from its batch's start until it
        finished; with ``compare_baseline``, plain decoding runs the same batches.

        Raises:
            ValueError: empty text, text the front end cannot say, a bad max_seconds, speed or batch_size.
        """
        method = self.make_method(method) if method is not None else self.method
        for name, value in (("max_seconds", max_seconds), ("speed", speed)):
            if not _positive_number(value):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.check_batch_size(batch_size)
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
        plain = self.make_method("ar")
        report, close = self.progress_reporter(progress, frames, "frame")
        try:
            for first, chunk in self.chunks(inputs, batch_size):
                runs, baseline = self.with_baseline(
                    lambda: self._generate(method, chunk, budget, seed, sampling, report),
                    (lambda: self._generate(plain, chunk, budget, seed, sampling)) if compare_baseline else None,
                    warm_up=lambda: self._generate(plain, chunk[:1], min(budget, 8 * c.target.num_codebooks), seed, sampling),
                    key=plain.name)
                for row, (tokens, stats) in enumerate(runs):
                    results.append(self._output(method, texts[first + row], chunk[row], tokens, stats,
                                                baseline and baseline[row], sampling))
        finally:
            close()
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
        config = {**method.describe(), **s.config, **used, **self.run_config()}
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

    def run_config(self) -> dict[str, Any]:
        """The linears' kernel and the codec LMs' dtype (every result's stats.config)."""
        return {"linears": self.components.linears, "dtype": dtype_name(self.components.dtype)}
