"""Text-to-speech methods, registered by name (the same names in the pipeline, ``mmspec tts``
and ``mmspec bench tts``): a drafter over the codec LM's flattened code stream
(:class:`~mmspec.adapters.audio.delay.DelayPatternTarget`) and the core's acceptance rule.

Lossless (greedy: the codes of plain decoding; sampling: its distribution):

- ``ar``: plain decoding: one model forward per step, its K codes drawn at once
  (:class:`~mmspec.drafters.steps.StepCompletionDrafter`: the rest of a step comes from the
  target's own known distributions, q = p, always accepted);
- ``spec``: speculative sampling with the small draft codec LM (``mmspec train tts --preset
  draft``), drafting whole steps after the current step's known codes
  (:class:`~mmspec.drafters.steps.StepAwareDrafter`);
- ``medusa``: Medusa heads on the codec LM's last hidden state (``mmspec train tts-drafter``),
  drafting a chain of whole steps after the current step's known codes, or a static token tree on
  a single-stream LM (:class:`~mmspec.drafters.steps.CodecMedusaDrafter`);
- ``eagle``: EAGLE's one-layer head on the codec LM's last hidden state and step inputs
  (``mmspec train tts-drafter --kind eagle``), the same chain step by step
  (:class:`~mmspec.drafters.steps.CodecEagleDrafter`; on a single-stream LM 6 codes, drafted in
  one C call where the head runs fused); ``eagle-tree``: the head grows Medusa's
  static tree instead on a single-stream LM, one head forward per depth;
- ``prompt-lookup``: n-gram lookup in the generated codes (training-free);
- ``sjd``: speculative Jacobi decoding over the code stream (training-free).

Tolerant (lossy), over the draft codec LM's chains unless said:

- ``spec-topk``: VADUSA's tolerance rule (a drafted code is accepted while it is among the
  target's ``top_k`` most likely codes at its position; no TV bound) over the draft LM's chains;
- ``eagle-topk``: the same rule over EAGLE's chain of the head's top-1 codes (drafted so under
  sampling too: the rule reads no q);
- ``vadusa``: the same rule over Medusa heads, as VADUSA does (its sparse tree does not fit the
  delay layout, which verifies chains only: the heads' top-1 chain);
- ``lantern``: LANTERN on audio codes, neighbours from the codec's codebook vectors (each
  codebook's k nearest codes), TV <= delta per code; ``medusa-lantern``: the same rule over the
  Medusa heads' chains (drafts that cost no model forward);
- ``pcg``: group acceptance in the manner of principled coarse-graining: overlapping groups of
  acoustically close codes (each code and its 3 nearest in the codec's codebook), speculative
  sampling on the group variable (exact over groups; a token-level bound in
  :mod:`mmspec.core.relaxed`).

Add one with a :class:`TTSMethod` subclass and :func:`register_method`; name one with its settings
in the one spec syntax of :mod:`mmspec.pipelines.methods` (``vadusa:top_k=5``, ``lantern:delta=0.2``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ...drafters import (CodecEagleDrafter, CodecMedusaDrafter, Drafter, JacobiDrafter, PromptLookupDrafter,
                        StepAwareDrafter, StepCompletionDrafter)
from ...drafters.steps import CODEC_TREE
from ..methods import Method, MethodRegistry, Setting, at_least

if TYPE_CHECKING:
    from .components import TTSComponents


#: every setting a method may read (a method reads ``num_draft_tokens`` and its rule's parameters)
SETTINGS: dict[str, Setting] = {
    "num_draft_tokens": Setting(int, "draft length in stream sub-tokens (default: the method's, a whole number of steps)",
                                at_least(1), "an integer >= 1"),
    "top_k": Setting(int, "accept a drafted code among the target's top k (VADUSA's tolerance)", rule="topk-tolerance"),
    "delta": Setting(float, "LANTERN's total-variation bound per code", rule="lantern"),
}

#: method name -> class
METHODS = MethodRegistry("text-to-speech method", example="vadusa:top_k=5")

#: class decorator: register ``cls`` under ``cls.name`` (a taken name is one ValueError line)
register_method = METHODS.register


class TTSMethod(Method):
    """A drafter (:meth:`build_drafter`) over the code stream verified by a rule (:attr:`rule`,
    None: exact): a :class:`~mmspec.pipelines.methods.Method` whose settings are
    ``num_draft_tokens`` and its rule's parameters (:attr:`rule_defaults`). A setting the method
    does not read is refused.

    Args:
        num_draft_tokens: draft length in stream sub-tokens (None: the method's default, a whole
            number of steps).
        **rule_settings: the rule's parameters (``top_k``, ``delta``), None meaning the default.
    """

    SETTINGS = SETTINGS
    registry = METHODS
    #: the rule's parameters this method sets (besides any table), with their defaults
    rule_defaults: ClassVar[dict[str, Any]] = {}
    #: default draft length in steps (K sub-tokens each)
    draft_steps: ClassVar[int] = 0
    #: default draft length in codes on a single-stream LM (K = 1, a VALL-E-style AR stage), where a
    #: step is one code; None: ``draft_steps``
    single_stream_tokens: ClassVar[int | None] = None
    #: the same where a wide verification is dear (:attr:`TTSComponents.verification_width` "narrow": a
    #: CPU without AMX tiles); None: ``single_stream_tokens`` everywhere
    narrow_stream_tokens: ClassVar[int | None] = None
    #: the same where it is "medium" (float32 on the 16-lane AVX-512 kernel); None: ``narrow_stream_tokens``
    medium_stream_tokens: ClassVar[int | None] = None

    #: whether the method drafts, so reads ``num_draft_tokens`` (False: plain decoding, which refuses it)
    drafts: ClassVar[bool] = True
    #: a head drafter (Medusa, EAGLE) drafts its heads' most likely codes under sampling too, for a
    #: rule that reads no draft distribution (VADUSA's top-1 chain)
    top1: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.defaults = {**({"num_draft_tokens": None} if cls.drafts else {}), **cls.rule_defaults}

    @property
    def num_draft_tokens(self) -> int | None:
        """The draft length asked for (None: the method's default, or a method that does not draft)."""
        return self.settings.get("num_draft_tokens")

    @property
    def rule_settings(self) -> dict[str, Any]:
        """The rule's parameters (its defaults updated by the given values)."""
        return {name: self.settings[name] for name in self.rule_defaults}

    def draft_length(self, components: "TTSComponents") -> int:
        """The draft length in stream sub-tokens: ``num_draft_tokens`` where given; on a
        single-stream LM the codes for the components' :attr:`~TTSComponents.verification_width`
        (``single_stream_tokens`` wide, ``medium_stream_tokens`` medium, ``narrow_stream_tokens``
        narrow, each falling back to the next wider where unset); else ``draft_steps`` whole steps."""
        k = components.target.num_codebooks
        if self.num_draft_tokens or k != 1 or not self.single_stream_tokens:
            return self.num_draft_tokens or self.draft_steps * k
        width = components.verification_width
        if width == "medium" and self.medium_stream_tokens:
            return self.medium_stream_tokens
        return self.narrow_stream_tokens if self.narrow_stream_tokens and width != "wide" else self.single_stream_tokens

    def build_drafter(self, components: "TTSComponents") -> Drafter | None:
        return None

    def check_components(self, components: "TTSComponents") -> None:
        """Raise ValueError when the model lacks a part the method needs (at pipeline construction):
        building the drafter loads (and caches) what it reads."""
        self.build_drafter(components)

    def rule_kwargs(self, components: "TTSComponents") -> dict[str, Any] | None:
        """The acceptance rule's parameters (None for the exact rules)."""
        return dict(self.rule_settings) if self.rule is not None else None

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "exact": self.exact, "num_draft_tokens": self.num_draft_tokens, **self.rule_settings}


def make_method(spec: str, **settings: Any) -> TTSMethod:
    """``"name[:key=value,...]"`` and settings -> the method (every setting checked), e.g.
    ``make_method("vadusa:top_k=5")`` (how ``mmspec bench tts --methods`` names a method with its
    settings) or ``make_method("lantern", delta=0.2)``."""
    return METHODS.make(spec, **settings)


@register_method
class AutoregressiveMethod(TTSMethod):
    name = "ar"
    description = "plain autoregressive decoding, a whole step per model forward (the baseline)"
    drafts = False

    def build_drafter(self, components):
        return StepCompletionDrafter()


@register_method
class DraftModelMethod(TTSMethod):
    name = "spec"
    description = "speculative sampling with the small draft codec LM (whole steps drafted)"
    draft_steps = 3

    def build_drafter(self, components):
        return StepAwareDrafter(components.draft_target(), num_draft_tokens=self.draft_length(components))


@register_method
class MedusaMethod(TTSMethod):
    name = "medusa"
    description = ("Medusa heads on the codec LM's last hidden state (a chain of whole steps; a static tree on a "
                   "single-stream LM; mmspec train tts-drafter)")

    def build_drafter(self, components):
        return CodecMedusaDrafter(components.medusa_heads(), num_draft_tokens=self.num_draft_tokens, top1=self.top1)


@register_method
class EagleMethod(TTSMethod):
    name = "eagle"
    description = ("EAGLE: a one-layer head on the codec LM's last hidden state and step inputs drafts whole steps "
                   "(a chain; mmspec train tts-drafter --kind eagle)")
    #: the single-stream tree the head grows (empty: the chain)
    tree_paths: ClassVar[list[tuple[int, ...]]] = []
    #: codes a chain drafts on a single stream, where it drafts in one C call: on the embedded
    #: VALL-E-style voice at temperature 1, 5 / 6 / 8 codes gave 1.82x / 1.85x / 1.84x against 1.68x
    #: for 3 (docs/benchmarks.md), and the open-domain voice on an AMX Xeon (60 validation sentences)
    #: 3 / 5 / 6 / 8 codes 1.66x / 1.72x / 1.81x / 1.76x; elsewhere the drafter's 3 steps
    single_stream_tokens = 6
    #: on a CPU without AMX tiles (a window of 7 costs ~2x one row there): on the open-domain voice,
    #: validation sentences, temperature 1, block verification, 3 / 4 codes gave 1.47x / 1.50x on a Zen 5
    #: core in bf16 but 1.22x / 1.15x on the same core run as an AVX2-only CPU in float32
    #: (docs/results/tts-open5-zen5-block-k-val2.md, tts-open5-avx2emu-block-k-val.md)
    narrow_stream_tokens = 3
    #: float32 on the 16-lane AVX-512 kernel (one AMX core run as a CPU without AMX or BF16, emulated; 40
    #: hand-written sentences, temperature 1, stop 81): 3 / 5 codes 1.72x / 1.84x (tau 2.57 / 3.00)
    medium_stream_tokens = 5

    def build_drafter(self, components):
        single = components.target.num_codebooks == 1 and not self.tree_paths
        return CodecEagleDrafter(components.eagle_head(), tree_paths=self.tree_paths, top1=self.top1,
                                 num_draft_tokens=self.draft_length(components) if single else self.num_draft_tokens)


@register_method
class EagleTreeMethod(EagleMethod):
    name = "eagle-tree"
    description = ("EAGLE's head growing Medusa's 9-node static tree on a single-stream LM, one head forward per depth "
                   "(the chain elsewhere)")
    tree_paths = CODEC_TREE


@register_method
class EagleTopKMethod(EagleMethod):
    name = "eagle-topk"
    description = ("EAGLE's top-1 chain under VADUSA's top-k tolerance (lossy: a drafted code counts while it is among "
                   "the target's top k)")
    rule = "topk-tolerance"
    rule_defaults = {"top_k": 5}
    top1 = True
    #: tuned on the open corpus' validation split (40 sentences, temperature 1, one AVX-512 BF16 core
    #: without AMX; docs/speech.md): 4 / 6 / 8 / 10 codes gave 1.51x / 1.53x / 1.48x / 1.40x (tau 4.19 /
    #: 5.02 / 5.58 / 5.97) and top-3 / 5 / 8 at 6 codes 1.37x / 1.53x / 1.63x, the last with WER 23.3 %
    #: against plain decoding's 19.2 % (top-5: 20.2 %; on 120 sentences top-2 / 3 / 5 gave WER 15.0 / 16.5 /
    #: 18.7 % against 15.1 %: the tolerance costs WER). Where a wide verification is cheap (AMX tiles,
    #: GPUs) 8 codes: on an AMX Xeon (60 validation sentences) 6 / 8 / 12 / 16 codes gave 2.45x / 2.53x /
    #: 2.59x / 2.34x (tau 5.72 / 6.60 / 8.10 / 9.01), 12 not taken for 2 % at more tolerated codes
    narrow_stream_tokens = 6
    single_stream_tokens = 8
    medium_stream_tokens = None  # (not EAGLE's 5: unmeasured, so its narrow 6)


@register_method
class PromptLookupMethod(TTSMethod):
    name = "prompt-lookup"
    description = "n-gram lookup in the generated codes (training-free)"
    draft_steps = 2

    def build_drafter(self, components):
        return PromptLookupDrafter(num_draft_tokens=self.draft_length(components))


@register_method
class JacobiMethod(TTSMethod):
    name = "sjd"
    description = "speculative Jacobi decoding over the code stream (training-free)"
    draft_steps = 2
    #: a window of 12 codes on the VALL-E-style voice: 2 / 3 / 4 / 6 / 8 / 12 / 16 gave 1.48x / 1.75x / 1.91x /
    #: 2.14x / 2.37x / 2.40x / 2.37x over plain decoding at temperature 1 (docs/benchmarks.md); on the
    #: open-domain voice on an AVX-512-BF16 core without AMX, 12 / 6 / 4 codes gave 0.96x / 1.11x / 1.14x
    #: (16 hand-written sentences, docs/speech.md), and with block verification on a Zen 5 core 4 / 5 / 6
    #: codes 1.43x / 1.48x / 1.41x (validation sentences; 4 / 5 1.46x / 1.50x on 120 x 2 more; run as an
    #: AVX2-only CPU in float32, 4 / 5 1.11x / 1.11x); on an AMX Xeon (60 validation sentences) 5 / 8 / 12 /
    #: 16 / 20 / 24 codes 1.64x / 1.85x / 1.91x / 1.63x / 1.64x / 1.50x (12 and the pending code: one 16-row tile)
    single_stream_tokens = 12
    narrow_stream_tokens = 5
    #: float32 on the 16-lane AVX-512 kernel (one AMX core run as a CPU without AMX or BF16, emulated; 40
    #: hand-written sentences, temperature 1, stop 81): 5 / 8 codes 1.85x / 2.05x (tau 2.56 / 3.20)
    medium_stream_tokens = 8
    #: redraft with the maximal coupling of consecutive iterates (:class:`~mmspec.drafters.jacobi.JacobiDrafter`)
    coupled: ClassVar[bool] = False

    def build_drafter(self, components):
        return JacobiDrafter(self.draft_length(components), coupled=self.coupled)


@register_method
class CoupledJacobiMethod(JacobiMethod):
    name = "sjd-coupled"
    description = ("SJD whose redrafts keep a code the next iterate still allows (the maximal coupling of consecutive "
                   "iterates, MC-SJD; exact and training-free)")
    #: its tau is higher where the window is wide: on the open-domain voice, one core of an AMX Xeon, 40
    #: hand-written sentences, temperature 1: 2.05x (tau 4.04) against `sjd`'s 1.99x (3.62); at 0.7 2.01x
    #: (3.92) against 1.97x (3.55); through the AVX-512-BF16 kernel (5 codes) 1.40x (2.58) against 1.45x
    #: (2.60) (stop 73). Since its redraft runs in one C call (stop 80) it is as fast as `sjd` or faster
    #: on every CPU kind measured (stop 81, temperature 0.7, the same 40 sentences: AMX 2.25x against
    #: 2.08x; run as AVX-512 fp32 1.85x / 1.82x, AVX-512-BF16 1.48x / 1.45x, AVX2 1.32x / 1.30x;
    #: docs/benchmarks.md), so `mmspec tts` and `mmspec serve` default to it
    coupled = True
    #: a wider window than `sjd`'s where a wide verification is cheap: its drafts stay put once the
    #: iterates agree, so a longer window keeps more of them. One AMX core, the 40 hand-written
    #: sentences at temperature 1 (stop 81): 10 / 12 / 15 / 20 codes 2.21x / 2.32x / 2.37x / 2.40x (tau
    #: 3.63 / 4.04 / 4.47 / 5.19), then 20 / 24 / 28 / 32 codes 2.45x / 2.48x / 2.50x / 2.25x (tau 5.19 /
    #: 5.75 / 6.22 / 6.83: 33 rows take a third 16-row tile); 24 (25 rows, two tiles) taken. The same
    #: core run as CPUs without AMX (emulated, temperature 1): float32 on the 16-lane AVX-512 kernel
    #: 5 / 6 / 8 / 10 codes 1.90x / 1.98x / 2.17x / 2.15x (tau 2.63 / 2.89 / 3.44 / 3.66), again 8 / 12 /
    #: 16 2.12x / 2.09x / 2.16x: 8 taken there; through the AVX-512-BF16 kernel 5 / 8 / 12 codes 1.49x /
    #: 1.46x / 1.42x and on AVX2 1.33x / 1.31x / 1.24x: `sjd`'s 8 and 5 kept there
    single_stream_tokens = 24


@register_method
class JacobiTopKMethod(JacobiMethod):
    name = "sjd-topk"
    description = "SJD's window under VADUSA's top-k tolerance (lossy: a drafted code counts while it is among the target's top k)"
    rule = "topk-tolerance"
    rule_defaults = {"top_k": 20}
    #: SJD's drafts are the target's own samples (at an earlier context), so a wide tolerance costs little
    #: WER: on the open-domain voice at temperature 1, one core of an AMX Xeon, 150 validation sentences x 2
    #: rounds (docs/speech.md), plain decoding WER 19.3 %; top-5 / 10 codes 2.29x at 18.8 %; top-10 / 31
    #: 3.06x at 20.1 %; top-16 / 24 3.26x at 19.1 %; top-16 / 31 3.35x at 20.1 %; top-20 / 24 3.37x at
    #: 19.5 % (speed only, 60 sentences, a quiet machine: top-8 / 10 / 12 / 16 / 20 at 24 codes 2.67x / 2.78x /
    #: 2.91x / 3.02x / 3.21x). Top-20 with 24 codes where a wide verification is cheap (AMX tiles, GPUs); 10
    #: codes elsewhere, where on the same core through the AVX-512-BF16 kernel top-16 at 8 / 10 / 12 / 16
    #: codes gave 1.76x / 1.80x / 1.79x / 1.81x and top-5 / 10 / 20 at 10 codes 1.54x / 1.73x / 1.84x
    single_stream_tokens = 24
    narrow_stream_tokens = 10
    #: float32 on the 16-lane AVX-512 kernel (emulated, as `sjd`'s): 10 / 16 codes 2.68x / 2.84x (tau
    #: 5.44 / 7.64), still short of the 24 codes whose WER was measured on AMX
    medium_stream_tokens = 16


@register_method
class TopKTolerantMethod(DraftModelMethod):
    name = "spec-topk"
    description = "the draft codec LM under VADUSA's top-k tolerance (lossy)"
    rule = "topk-tolerance"
    rule_defaults = {"top_k": 3}


@register_method
class LanternMethod(DraftModelMethod):
    name = "lantern"
    description = "the draft codec LM under LANTERN with the codec's code neighbours (lossy, TV <= delta per code)"
    rule = "lantern"
    rule_defaults = {"delta": 0.1}
    neighbours_k: ClassVar[int] = 8

    def rule_kwargs(self, components):
        return {**self.rule_settings, "neighbours": components.neighbours(self.neighbours_k)}


@register_method
class MedusaLanternMethod(LanternMethod):
    name = "medusa-lantern"
    description = "the Medusa heads' chains under LANTERN with the codec's code neighbours (lossy, TV <= delta per code)"

    def build_drafter(self, components):
        return MedusaMethod.build_drafter(self, components)


@register_method
class GroupMethod(LanternMethod):
    name = "pcg"
    description = "the draft codec LM under PCG group acceptance over groups of acoustically close codes (lossy)"
    rule = "group"
    rule_defaults = {}
    neighbours_k = 3


@register_method
class VadusaMethod(MedusaMethod):
    name = "vadusa"
    description = "VADUSA: Medusa heads under the top-k tolerance rule (lossy; a chain, as the delay layout takes no tree)"
    rule = "topk-tolerance"
    rule_defaults = {"top_k": 3}
    top1 = True
