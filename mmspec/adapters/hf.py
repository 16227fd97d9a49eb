"""Adapter: a transformers causal LM or VLM as a speculative-decoding target.

Supported: any decoder-only ``*ForCausalLM`` and the VLM families of :data:`VLM_FAMILIES`. A VLM's
pixels are encoded in the prefill only; later forwards feed token ids, whose embeddings the
language model looks up itself. All the adapter keeps is the model handle: the sequence lives in
a :class:`~mmspec.core.cache.SequenceState` created by :meth:`TransformersTarget.prefill`.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any

import torch
from torch import nn

from ..core.batch import BatchState
from ..core.cache import SequenceState, SlidingLayer, StaticKVCache, make_cache
from ..core.captured import DEFAULT_BUCKETS, StaticForward, check_buckets, fill_static_mask
from ..core.target import TargetOutput, select_hidden_states
from ..core.tree import TokenTree, tree_attention_mask, tree_position_ids
from ..modeling.hf_compat import cache_kwargs
from ..modeling.lean import lean_states, lean_supported
from .mrope import MROPE_FAMILIES, position_scheme
from .recurrent import (TREES_REFUSED, first_attention_layer, has_recurrent_layers, keep_layer_inputs, make_recurrent_cache,
                        wants_layer_inputs)

#: model_type -> human name. The families of :data:`~mmspec.adapters.mrope.MROPE_FAMILIES` (Qwen-VL)
#: take 3-D positions (their :mod:`~mmspec.adapters.mrope` position scheme); the others 1-D
#: positions equal to the token index. A family whose steps need more than token ids and positions
#: registers its :class:`FamilyHooks` (Mllama: :mod:`mmspec.adapters.mllama`).
VLM_FAMILIES = {
    "llava": "LLaVA-1.5 / Pixtral (LlavaForConditionalGeneration)",
    "llava_next": "LLaVA-NeXT (LlavaNextForConditionalGeneration)",
    "mistral3": "Mistral3 / Pixtral (Mistral3ForConditionalGeneration)",
    "idefics3": "Idefics3 (Idefics3ForConditionalGeneration)",
    "smolvlm": "SmolVLM (SmolVLMForConditionalGeneration)",
    "gemma3": "Gemma3 (Gemma3ForConditionalGeneration)",
    "gemma4": "Gemma 4 (Gemma4ForConditionalGeneration)",
    "llava_onevision": "LLaVA-OneVision (LlavaOnevisionForConditionalGeneration)",
    "internvl": "InternVL (InternVLForConditionalGeneration)",
    "mllama": "Llama-3.2-Vision (MllamaForConditionalGeneration)",
    **MROPE_FAMILIES,
    "lfm2_vl": "LFM2-VL (Lfm2VlForConditionalGeneration; short-conv recurrent layers, adapters/recurrent.py)",
}

#: model_type -> why mmspec cannot serve that multimodal family yet (its refusal names the reason;
#: other multimodal families outside :data:`VLM_FAMILIES` get a generic line). Empty at present.
UNSUPPORTED_FAMILIES: dict[str, str] = {}

PIXEL_INPUTS = ("pixel_values", "pixel_values_videos")


class FamilyHooks:
    """What a VLM family's sequence needs beyond token ids and positions; this base needs nothing.

    A family module subclasses it and registers it under its ``model_type`` (:func:`register_family`).
    """

    #: why the family's rows cannot share a batch (None: they can)
    batch_size_one_reason: str | None = None

    def check_inputs(self, model_inputs: dict[str, Any], input_ids: torch.Tensor) -> None:
        """Refuse a prompt the family cannot take (ValueError saying what to do), before any model work."""

    def make_cache(self, config, model_inputs: dict[str, Any], windows: bool = True):
        """The empty cache a prompt ``model_inputs`` is prefilled into (``windows=False``: sliding
        layers keep every position, for a batch's rows; :func:`~mmspec.core.cache.make_cache`)."""
        return make_cache(config, windows=windows)

    def step_inputs(self, cache, num_tokens: int) -> dict[str, Any]:
        """Inputs besides ids, positions and mask that a forward of ``num_tokens`` tokens after the
        prefill takes (as transformers' ``prepare_inputs_for_generation`` gives them)."""
        return {}

    def draft_inputs(self, cache, num_tokens: int) -> dict[str, Any]:
        """Inputs besides ids, positions and mask that a self-speculative draft's forward through the
        first layers of a batch's cache takes, so that each row drafts what it drafts alone (where a
        row alone takes none, a stacked batch may need some: Mllama's padded image tiles)."""
        return {}

    def extend_inputs(self, model_inputs: dict[str, Any], num_tokens: int) -> dict[str, Any]:
        """The family's per-token inputs other than [1, L] ones (those a caller extends itself)
        for the prompt ``model_inputs`` followed by ``num_tokens`` text tokens in one forward (a
        teacher-forced ``prompt + response``, as generate would have seen them); {}: none."""
        return {}


#: model_type -> the family's :class:`FamilyHooks` (the others get the base class's)
FAMILY_HOOKS: dict[str, FamilyHooks] = {}


def register_family(model_type: str):
    """Class decorator: register a :class:`FamilyHooks` subclass for ``model_type`` (one of :data:`VLM_FAMILIES`)."""
    def register(cls: type[FamilyHooks]) -> type[FamilyHooks]:
        if model_type not in VLM_FAMILIES:
            raise ValueError(f"{model_type!r} is not in VLM_FAMILIES; add it there first")
        FAMILY_HOOKS[model_type] = cls()
        return cls
    return register

#: the padded forward sizes a :class:`CapturedTransformersTarget` captures: up to 128, so that
#: EAGLE-2's largest tree (64 nodes) and its root fit
CAPTURED_BUCKETS = (*DEFAULT_BUCKETS, 128)

#: config fields of families whose logits are not a plain linear map of the last hidden state
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier_scale")


def _has_pixels(model_inputs: dict[str, Any]) -> bool:
    """Whether a prompt carries an image (one of :data:`PIXEL_INPUTS`, not None)."""
    return any(model_inputs.get(name) is not None for name in PIXEL_INPUTS)


def config_image_token_id(config) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def text_decoder(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers (``.layers``, ``.embed_tokens`` and a final norm, :func:`final_norm`)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for candidate in (decoder, getattr(decoder, "language_model", None), getattr(model, "model", None)):
        if candidate is not None and isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    raise ValueError(f"{type(model).__name__}: cannot find its text decoder layers")


#: the attribute names transformers' text decoders give their final norm, tried in order (LFM2's
#: decoder applies ``embedding_norm`` after its last layer; Phi's ``final_layernorm``)
FINAL_NORM_NAMES = ("norm", "embedding_norm", "final_layernorm", "final_norm")


def final_norm(decoder: nn.Module) -> nn.Module:
    """The norm a text decoder (:func:`text_decoder`, or a head's one-layer decoder) applies after
    its last layer: h_L -> norm(h_L), the states the LM head reads. Every drafter that needs it
    (EAGLE's fused check, Kangaroo's shallow states, the heads' training) asks here.

    Raises:
        ValueError: the decoder has none of :data:`FINAL_NORM_NAMES`.
    """
    for name in FINAL_NORM_NAMES:
        norm = getattr(decoder, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"{type(decoder).__name__}: cannot find its final norm (looked for {', '.join(FINAL_NORM_NAMES)}); "
                     "use a chain drafter without heads (prompt-lookup, layer-skip:N, a draft model)")


def truncated_decoder(decoder: nn.Module, num_layers: int, user: str = "layer-skip") -> nn.Module:
    """A view of ``decoder`` that runs only its first ``num_layers`` layers (then its final norm);
    ``user`` names the drafter in the error lines (N out of range; on a hybrid recurrent decoder, no
    attention layer among the first N, which a self-speculative draft needs to count the cached
    positions: refused here, as the drafter is built, not at its first draft).

    The view shares every parameter with ``decoder`` (no copy, no change to the original); only its
    layer list and config differ. A decoder whose per-layer input embeddings are packed over all its
    layers (Gemma 4's ``hidden_size_per_layer_input``: one [L * d] row per token, reshaped by
    ``num_hidden_layers``) keeps its layer count in the config; its forward runs the layers the list
    holds.
    """
    total = len(decoder.layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"{user} needs 1 <= N < {total} (the target has {total} layers), got N={num_layers}")
    first = first_attention_layer(decoder.config)  # (0 for a decoder without recurrent layers)
    if first is None or first >= num_layers:
        fix = (f"give N > {first}" if first is not None and first + 1 < total else
               f"{'its only attention layer is the last' if first is not None else 'the decoder has none'}, so no N "
               "works; use prompt-lookup or a draft model")
        raise ValueError(f"{user}: the first {num_layers} layers are all recurrent; a self-speculative draft needs "
                         f"an attention layer among them to count the cached positions: {fix}")
    view = copy.copy(decoder)
    view._modules = dict(decoder._modules)
    view._modules["layers"] = nn.ModuleList(list(decoder.layers)[:num_layers])
    config = copy.copy(decoder.config)
    if not getattr(config, "hidden_size_per_layer_input", 0):
        config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    view.config = config
    return view


#: the first prefill's checks (own_lm_head, lean_prefill) per model and :meth:`TransformersTarget._probe_key`:
#: ``mmspec.generate`` wraps a model in a new target on every call, whose first prefill would otherwise
#: run the prompt (and encode a VLM's image) twice again to repeat checks whose answers cannot change.
#: Weak keys: the table keeps no model alive.
_PROBED: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, tuple[bool, bool]]]" = weakref.WeakKeyDictionary()


class TransformersTarget:
    """A transformers model behind the core's :class:`~mmspec.core.target.Target` interface.

    Decoding steps and verifications (token ids after the prefill) of a model whose text decoder
    is a transformers ``LlamaModel`` with a plain LM head (SmolLM2, the embedded captioner, SmolVLM,
    LLaVA-1.5) run through :func:`~mmspec.modeling.lean.lean_states`: the model's own modules
    without transformers' per-call work (the embedded captioner's plain decoding 39.2 -> 35.9 ms a
    token, bf16, one core; docs/benchmarks.md), the same logits. Batched rows (2-D padding masks) and other
    families take the model's forward. ``lean = False`` opts out.

    Hybrid recurrent decoders (Qwen3.5's Gated DeltaNet, LFM2's short convolutions) keep their
    recurrent layers in :class:`~mmspec.adapters.recurrent.RecurrentLayer` cache layers that roll
    back with the KV cache; a verification over several tokens also keeps the layers' inputs for
    that (:mod:`mmspec.adapters.recurrent`). They decode chains, batches of rows included (each
    row's recurrent state rewound to its own accepted length).

    Args:
        model: a decoder-only causal LM or a VLM of :data:`VLM_FAMILIES`, in eval mode.
    Raises:
        ValueError: for encoder-decoder models and unsupported multimodal families.
    """

    lean = True

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        model_type = getattr(config, "model_type", "")
        if model_type in UNSUPPORTED_FAMILIES:
            raise ValueError(
                f"{type(model).__name__} is not supported yet: it {UNSUPPORTED_FAMILIES[model_type]}. "
                f"Supported VLM families: {', '.join(VLM_FAMILIES)}; or any decoder-only causal LM."
            )
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model; mmspec targets decoder-only models")
        if model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no LM head; pass a *ForCausalLM or *ForConditionalGeneration model")
        self.model = model
        self.is_vlm = model_type in VLM_FAMILIES
        if not self.is_vlm and config_image_token_id(config) is not None:
            raise ValueError(
                f"{type(model).__name__} ({model_type}) is a multimodal family mmspec does not support yet. "
                f"Supported VLM families: {', '.join(VLM_FAMILIES)}."
            )
        self.image_token_id = config_image_token_id(config) if self.is_vlm else None
        #: how the prompt's positions are laid out and where later positions start (M-RoPE for Qwen-VL)
        self.positions = position_scheme(config)
        #: placeholder token id -> the pixel input filling its slots (images; videos where the family takes them)
        self.placeholders = self.positions.placeholder_ids(config) if self.is_vlm else {}
        self.family = FAMILY_HOOKS.get(model_type, FamilyHooks())
        #: recurrent (linear-attention / convolution) layers: chains only (no token trees)
        self.recurrent = has_recurrent_layers(config)
        if self.recurrent:
            make_recurrent_cache(config, text_decoder(model))  # a mixer mmspec cannot roll back: refused here, once
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.own_lm_head: bool | None = None  # several-token forwards compute the LM head (_project); decided at the first prefill
        try:
            decoder = text_decoder(model) if self._plain_lm_head() else None
        except ValueError:  # no decoder layers where mmspec looks: the model's own forward
            decoder = None
        #: the Llama decoder that steps run through lean_states, or None (the model's own forward)
        self.lean_decoder = decoder if decoder is not None and lean_supported(decoder) else None
        #: prompts through lean_states too (:meth:`prompt_embeds` gave the embeddings the model's own
        #: forward feeds its decoder); decided at the first prefill, None before
        self.lean_prefill: bool | None = None if self.lean_decoder is not None else False
        known = _PROBED.get(model, {}).get(self._probe_key())
        if known is not None:  # an earlier target over this model made the first prefill's checks
            self.own_lm_head, self.lean_prefill = known

    def _probe_key(self) -> tuple:
        """What the first prefill's checks depend on besides the model: where and in what dtype it
        runs, whether its logits are a plain product, whether a lean decoder exists."""
        return self.device, self.model.dtype, self._plain_lm_head(), self.lean_decoder is not None

    def _plain_lm_head(self) -> bool:
        """True when the model's logits are its output embedding applied to the base model's last
        hidden state (no soft-capping or scaling, which some families add) and there is a base model."""
        configs = [self.model.config, getattr(self.model.config, "text_config", None)]
        transforms = any(getattr(c, name, None) not in (None, 1, 1.0) for c in configs if c is not None for name in LOGIT_TRANSFORMS)
        return not transforms and self.model.base_model is not self.model

    @staticmethod
    def _project(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """logits [B, n, V] = hidden [B, n, H] W^T (+ b), computed as (W hidden^T)^T.

        For a few rows this is the fast layout on CPUs: BLAS streams W [V, H] once in its stored
        order, while ``nn.Linear``'s hidden W^T takes a small-M GEMM path that costs about twice a
        one-row GEMV (measured here on a 49152 x 576 head: 1 row 8.3 ms; 2-8 rows 19-22 ms with
        F.linear, 5-9 ms this way). A head of another class (mmspec.optimize's few-row linear, a
        quantised layer) is called as it is."""
        if type(lm_head) is not nn.Linear:
            return lm_head(hidden)
        logits = torch.mm(lm_head.weight, hidden.flatten(0, 1).T).T.view(*hidden.shape[:2], -1)
        return logits if lm_head.bias is None else logits + lm_head.bias

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tree_refusal(self) -> str | None:
        """Why this model cannot verify token trees (one line saying what to use instead), or None.
        The loop asks before the prefill when the drafter drafts trees (``Drafter.drafts_trees``)."""
        return f"{type(self.model).__name__} {TREES_REFUSED}" if self.recurrent else None

    @property
    def batch_size_one_reason(self) -> str | None:
        """Why this model's rows cannot share a batch (its family's), or None."""
        return self.family.batch_size_one_reason

    def draft_inputs(self, cache, num_tokens: int) -> dict[str, Any]:
        """The family's :meth:`FamilyHooks.draft_inputs` (layer skip and Kangaroo over a batch)."""
        return self.family.draft_inputs(cache, num_tokens)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]

    def check_inputs(self, model_inputs: dict[str, Any]) -> torch.Tensor:
        """Validate a prompt and return its input_ids [1, L]. Raises ValueError that says what to do."""
        input_ids = model_inputs.get("input_ids")
        if input_ids is None:
            raise ValueError("pass the prompt as input_ids=... (LongTensor [1, L], e.g. from the model's tokenizer/processor)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError("input_ids must be an integer torch.Tensor of shape [1, L]")
        if input_ids.dim() == 1:
            raise ValueError("input_ids must be 2-D [batch, length]; add the batch dimension with input_ids[None]")
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"mmspec decodes one sequence at a time (batch size 1), got batch size {input_ids.shape[0]}; "
                "call it once per prompt"
            )
        if input_ids.shape[1] == 0:
            raise ValueError("the prompt is empty: input_ids has no tokens")
        mask = model_inputs.get("attention_mask")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("the prompt is padded (attention_mask has zeros); with batch size 1, pass it unpadded")
        if self.is_vlm:
            for token, pixels in self.placeholders.items():
                kind = "video" if "video" in pixels else "image"
                has_tokens, has_pixels = bool((input_ids == token).any()), model_inputs.get(pixels) is not None
                if has_tokens and not has_pixels:
                    raise ValueError(f"the prompt has {kind} tokens but no {pixels}; pass the processor's full output")
                if has_pixels and not has_tokens:
                    raise ValueError(
                        f"{pixels} were given but the prompt has no {kind} tokens; build the prompt with the "
                        f"model's processor (it inserts the {kind} tokens)"
                    )
            self.positions.check(self.model, input_ids, model_inputs)
            self.family.check_inputs(model_inputs, input_ids)
        elif _has_pixels(model_inputs):
            raise ValueError(f"{type(self.model).__name__} is a text-only model; it cannot take pixel_values")
        return input_ids

    def prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None = None) -> tuple[SequenceState, TargetOutput]:
        """The prompt through the model, its cache and the last position's logits [1, 1, V] (with
        ``hidden_layer``, that entry of the hidden states [1, L, H], or a tuple's entries concatenated
        [1, L, k H]). Where the decoder is a lean
        one and :meth:`prompt_embeds` reproduces the embeddings the model's forward gives its
        decoder (checked bitwise at the first prefill), the prompt runs through ``lean_states``
        as the steps do (a VLM's image features merged first): the fused layers instead of the
        model's modules, one logits row. Every prefill over a model takes the same path, the first
        included (it is run again that way, its image encoded twice; the checks' answers are kept
        per model, so a later target over it, as ``mmspec.generate`` makes on every call, runs the
        prompt once), so a seed gives the same output on every call."""
        return self._prefill(model_inputs, hidden_layer)

    def _prefill(self, model_inputs: dict[str, Any], hidden_layer: int | None, windows: bool = True
                 ) -> tuple[SequenceState, TargetOutput]:
        """:meth:`prefill`; ``windows=False`` keeps every position of sliding-window layers
        (:func:`~mmspec.core.cache.make_cache`), for a batch's rows."""
        input_ids = self.check_inputs(model_inputs).to(self.device)
        inputs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in model_inputs.items()}
        if self.lean_prefill:
            return self._lean_prefill(input_ids, self.prompt_embeds(input_ids, inputs), hidden_layer)
        cache = self._new_cache(inputs, windows)
        check_head, check_lean = self.own_lm_head is None, self.lean_prefill is None
        prompt_positions, offset = self.positions.prompt_positions(self.model, input_ids, inputs)
        if prompt_positions is not None:  # (1-D families: the model's default)
            inputs["position_ids"] = prompt_positions
        out = self.model(
            **inputs, **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1,
            output_hidden_states=hidden_layer is not None or check_head or check_lean,
        )
        if check_head:  # the multi-token path reproduces the model's own logits, or stays off
            self.own_lm_head = self._plain_lm_head() and torch.allclose(
                self._project(self.model.get_output_embeddings(), out.hidden_states[-1][:, -1:]).float(), out.logits[:, -1:].float(),
                rtol=1e-3, atol=1e-4)
        if check_lean:
            embeds = self.prompt_embeds(input_ids, inputs)
            self.lean_prefill = embeds is not None and torch.equal(embeds, out.hidden_states[0])
        _PROBED.setdefault(self.model, {})[self._probe_key()] = (self.own_lm_head, self.lean_prefill)
        if check_lean and self.lean_prefill:
            return self._lean_prefill(input_ids, embeds, hidden_layer)
        state = SequenceState(input_ids.long(), cache, prompt_length=input_ids.shape[1], position_offset=offset)
        return state, TargetOutput(out.logits[:, -1:], select_hidden_states(out.hidden_states, hidden_layer))

    def _new_cache(self, inputs: dict[str, Any], windows: bool = True):
        """An empty cache for one sequence: the family's (:meth:`FamilyHooks.make_cache`; ``windows=False``:
        sliding layers keep every position, for a batch's rows), or with rollback-able recurrent
        layers for a hybrid decoder."""
        if self.recurrent:
            return make_recurrent_cache(self.model.config, text_decoder(self.model))
        return self.family.make_cache(self.model.config, inputs, windows=windows)

    def prompt_embeds(self, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The decoder's input embeddings [1, L, H] of a prompt: its token embeddings, and for a VLM
        the image features scattered over the image tokens as transformers' VLM forwards do (the
        base model's ``get_image_features(..., return_dict=True).pooler_output`` and
        ``get_placeholder_mask``, given the prompt's inputs that ``get_image_features`` names);
        None for a VLM without that interface."""
        embeds = self.lean_decoder.embed_tokens(input_ids)
        if not _has_pixels(inputs):
            return embeds
        base = self.model.base_model
        features_of, mask_of = getattr(base, "get_image_features", None), getattr(base, "get_placeholder_mask", None)
        if features_of is None or mask_of is None:
            return None
        names = inspect.signature(features_of).parameters
        features = features_of(**{k: v for k, v in inputs.items() if k in names and k not in ("input_ids", "attention_mask")},
                               return_dict=True).pooler_output
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features), dim=0)
        features = features.to(embeds.device, embeds.dtype)
        return embeds.masked_scatter(mask_of(input_ids, inputs_embeds=embeds, image_features=features), features)

    def _lean_prefill(self, input_ids: torch.Tensor, embeds: torch.Tensor, hidden_layer: int | None
                      ) -> tuple[SequenceState, TargetOutput]:
        cache = make_cache(self.model.config)
        hidden, kept = lean_states(self.lean_decoder, embeds, cache, hidden_layer=hidden_layer)
        state = SequenceState(input_ids.long(), cache, prompt_length=input_ids.shape[1])
        return state, TargetOutput(self.model.get_output_embeddings()(hidden[:, -1:]), kept)

    def forward(
        self, state: SequenceState, tokens: torch.Tensor, hidden_layer: int | None = None, tree: TokenTree | None = None
    ) -> TargetOutput:
        """Append ``tokens`` [1, n] to the state's cache; logits [1, n, V].

        With ``tree`` (a TokenTree over exactly these n tokens) the inputs are a token tree rather
        than a chain: token i attends to the cache and to its tree ancestors and itself (a 4-D
        additive ``attention_mask`` [1, 1, n, cache + n]; :meth:`tree_masks` for sliding-window
        layers) at position cache + depth_i - 1. All n entries are appended to the cache;
        :meth:`SequenceState.commit` with the accepted path compacts them.
        """
        if tree is None:
            attention_mask, position_ids = None, state.position_ids(tokens.shape[1])
        else:
            if self.tree_refusal:  # (a tree from a drafter that does not declare drafts_trees)
                raise ValueError(self.tree_refusal)
            self._check_tree(tree, tokens.shape[1])
            attention_mask = self.tree_masks(state, tree)
            position_ids = tree_position_ids(tree, state.cache_length + state.position_offset, device=self.device)
        return self._run(tokens, state.cache, attention_mask, position_ids, hidden_layer)

    def split_items(self, rows: list[torch.Tensor], model_inputs: dict[str, Any]) -> dict[str, list[Any]]:
        """A batch's inputs indexed by image or video instead of by prompt, split per row (``rows``:
        each prompt's unpadded input_ids [1, L_b]): name -> one value per row, None where a row
        has none (:meth:`~mmspec.adapters.mrope.PositionScheme.split_items`; the Qwen-VL layout)."""
        return self.positions.split_items(self.model, rows, model_inputs)

    def prefill_rows(self, rows: list[dict[str, Any]], hidden_layer: int | None = None) -> tuple[BatchState, list[TargetOutput]]:
        """Prefill B prompts (each as :meth:`prefill` takes it) into one batch; each row's
        TargetOutput.

        Where the prompt goes through the lean decoder (``lean_prefill``) and every prompt has one
        length (a server's requests over one question and image size), the rows' embeddings
        (:meth:`prompt_embeds`, each image encoded as at batch 1) run through the decoder as one
        [B, L] forward: the same arithmetic per row as B batch-1 prefills (row-wise linears and
        attention; tests/test_batch_join.py compares the caches and logits bit for bit in fp32),
        with the weights read once. Otherwise one prompt at a time, caches stacked
        (:meth:`BatchState.prefill`)."""
        if self.lean_prefill is None and rows:  # the first prefill over this model decides the path
            state, out = self._prefill(rows[0], hidden_layer, windows=False)
            rest, outputs = self.prefill_rows(rows[1:], hidden_layer) if len(rows) > 1 else (None, [])
            first = BatchState.stack([state], self.device)
            if rest is not None:
                first.join(rest)
            first.ids = list(range(first.size))
            return first, [out, *outputs]
        ids = [self.check_inputs(r).to(self.device) for r in rows]
        if not (self.lean_prefill and len(rows) > 1 and len({i.shape[1] for i in ids}) == 1):
            states, outputs = zip(*(self._prefill(inputs, hidden_layer, windows=False) for inputs in rows))
            return BatchState.stack(states, self.device), list(outputs)
        inputs = [{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in r.items()} for r in rows]
        embeds = torch.cat([self.prompt_embeds(i, r) for i, r in zip(ids, inputs)])  # [B, L, H]
        cache = make_cache(self.model.config)
        hidden, kept = lean_states(self.lean_decoder, embeds, cache, hidden_layer=hidden_layer)
        head = self.model.get_output_embeddings()
        # the LM head row by row: one row is a matrix-vector product, as at batch 1 (a [B, H] product
        # may round differently)
        logits = torch.cat([head(hidden[b : b + 1, -1:]) for b in range(len(rows))])  # [B, 1, V]
        states = [SequenceState(i.long(), None, prompt_length=i.shape[1]) for i in ids]
        valid = torch.ones(len(rows), ids[0].shape[1], dtype=torch.bool, device=self.device)
        outputs = [TargetOutput(logits[b : b + 1], None if kept is None else kept[b : b + 1]) for b in range(len(rows))]
        return BatchState(states, cache, valid), outputs

    def forward_rows(self, state: BatchState, tokens: torch.Tensor, hidden_layer: int | None = None) -> TargetOutput:
        """Append ``tokens`` [B, n] to every row of a batch; logits [B, n, V] (hidden [B, n, H]).

        Rows see only their own valid cache slots (a 2-D attention mask) at their own positions;
        a model with sliding-window layers gets 4-D masks instead (:meth:`row_masks`).
        """
        n = tokens.shape[1]
        return self._run(tokens.to(self.device), state.cache, self.row_masks(state, n), state.position_ids(n), hidden_layer)

    def row_masks(self, state: BatchState, num_tokens: int):
        """The attention mask of a row forward of ``num_tokens`` inputs: the 2-D slot mask
        (``state.attention_mask``), or for a model with sliding-window layers additive 4-D masks
        [B, 1, n, C + n] over the rows' positions, since a row's valid slots have gaps (rejected
        drafts) and the window counts positions, not slots. With p(j) the position of slot j (its
        row's valid slots before it) and q(i) the position of input i:

            full[b, i, j]    = 0 if slot j is valid for row b and p(j) <= q(i), else min
            sliding[b, i, j] = full[b, i, j] where q(i) - p(j) < sliding_window, else min

        One mask (sliding) where every layer slides; ``{"full_attention": full,
        "sliding_attention": sliding}`` where both kinds are mixed, the mapping transformers'
        hybrid models take in place of the masks they would build."""
        flat = state.attention_mask(num_tokens)
        config = self.model.config.get_text_config()
        window, kinds = getattr(config, "sliding_window", None), set(getattr(config, "layer_types", None) or ["sliding_attention"])
        if window is None or "sliding_attention" not in kinds:
            return flat
        visible = flat.bool()  # [B, C + n]
        positions = visible.long().cumsum(dim=1) - 1  # the position of each valid slot, new inputs included
        queries = positions[:, -num_tokens:]  # [B, n]
        seen = visible[:, None, :] & (positions[:, None, :] <= queries[:, :, None])  # [B, n, C + n]
        in_window = seen & (queries[:, :, None] - positions[:, None, :] < window)
        dtype = self.model.dtype
        full, sliding = (torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)[:, None]
                         for m in (seen, in_window))
        return sliding if kinds == {"sliding_attention"} else {"full_attention": full, "sliding_attention": sliding}

    def _run(self, tokens: torch.Tensor, cache, attention_mask, position_ids: torch.Tensor, hidden_layer: int | None) -> TargetOutput:
        """One forward appending ``tokens`` [B, n] to ``cache``. One token: the model's own forward
        (what plain AR decoding runs). Several: the base model, then the LM head in the layout that
        is fast for few rows (_project), when the first prefill showed it gives the model's logits."""
        several = tokens.shape[1] > 1 and self.own_lm_head
        extra = self.family.step_inputs(cache, tokens.shape[1])
        keep_inputs = self.recurrent and tokens.shape[1] > 1 and wants_layer_inputs(cache)  # for a rollback inside it
        decoder = self.lean_decoder if self.lean and not extra else None
        if decoder is not None and lean_supported(decoder, attention_mask):
            hidden, kept = lean_states(decoder, decoder.embed_tokens(tokens), cache, position_ids, attention_mask, hidden_layer)
            head = self.model.get_output_embeddings()
            return TargetOutput(self._project(head, hidden) if several else head(hidden), kept)
        model = self.model.base_model if several else self.model
        out = model(
            input_ids=tokens,
            **cache_kwargs(model, cache),
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=hidden_layer is not None or keep_inputs,
            **extra,
        )
        if keep_inputs:
            keep_layer_inputs(cache, out.hidden_states)
        logits = self._project(self.model.get_output_embeddings(), out.last_hidden_state) if several else out.logits
        return TargetOutput(logits, select_hidden_states(out.hidden_states, hidden_layer))

    @staticmethod
    def _check_tree(tree: TokenTree, num_tokens: int) -> None:
        """A verification tree must be one tree over exactly the forward's inputs."""
        if tree.size != num_tokens or tree.tokens.dim() != 1:
            raise ValueError(f"tree has {tree.size} nodes (tokens {tuple(tree.tokens.shape)}) for {num_tokens} input tokens")

    def tree_masks(self, state: SequenceState, tree: TokenTree):
        """The attention mask of a tree forward after ``state``'s cache of c positions: the additive
        tree mask [1, 1, n, c + n] (:func:`~mmspec.core.tree.tree_attention_mask`), and for a model
        with sliding-window layers its window form over the keys those layers hand the model (the
        last v = min(c, window - 1) cached positions of a :class:`~mmspec.core.cache.SlidingLayer`,
        then the n nodes): node i at position P_i = c + depth_i - 1 sees key j at position p_j where
        the tree mask lets it and P_i - p_j < window. As :meth:`row_masks`: one mask where every
        layer slides, else ``{"full_attention": ..., "sliding_attention": ...}``."""
        prefix, dtype = state.cache_length, self.model.dtype
        full = tree_attention_mask(tree, prefix, dtype=dtype, device=self.device)
        config = self.model.config.get_text_config()
        window, kinds = getattr(config, "sliding_window", None), set(getattr(config, "layer_types", None) or ["sliding_attention"])
        if window is None or "sliding_attention" not in kinds:
            return full
        windowed = next((layer for layer in state.cache.layers if isinstance(layer, SlidingLayer)), None)
        visible = prefix if windowed is None else min(prefix, window - 1)
        nodes = prefix + tree.depth.to(self.device) - 1  # [n]
        keys = torch.cat([torch.arange(prefix - visible, prefix, device=self.device), nodes])
        seen = full[0, 0, :, prefix - visible :] == 0
        sliding = torch.zeros(seen.shape, dtype=dtype, device=self.device).masked_fill_(
            ~(seen & (nodes[:, None] - keys[None, :] < window)), torch.finfo(dtype).min)[None, None]
        return sliding if kinds == {"sliding_attention"} else {"full_attention": full, "sliding_attention": sliding}

    def text_only_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt a text-only draft sees (SPD): input_ids [1, L] without the image (and video) tokens."""
        if not self.placeholders:
            return input_ids
        keep = ~torch.isin(input_ids[0], torch.tensor(sorted(self.placeholders), device=input_ids.device))
        return input_ids[:, keep]


class CapturedTransformersTarget(TransformersTarget):
    """A :class:`TransformersTarget` whose forwards run captured (:mod:`mmspec.core.captured`): on
    CUDA one graph per padded forward size, replayed with one launch instead of a small model's
    hundreds of kernel launches and their Python (the embedded captioner's 30 layers: ~400 a token).

    The sequence lives in a :class:`~mmspec.core.cache.StaticKVCache` of ``max_length`` + the
    largest bucket slots that never moves: the prompt is written into it eagerly (through
    ``lean_states``, the image features merged as :meth:`TransformersTarget.prompt_embeds` does),
    and every later forward of n inputs (a chain, or a tree under its ancestor mask) is padded to the
    smallest bucket b >= n and run as
        logits, h_l = LMHead(lean_states(Embed(tokens), static cache, positions, mask)), layer l's states
    over the cache's full capacity, with a boolean mask that hides every slot past the sequence. One
    graph set per ``hidden_layer`` asked for (plain decoding: none; EAGLE: its feature layer), built
    at first use. On a CPU the same static buffers run eagerly (tests check the outputs there).

    Covered: a model whose decoder ``lean_states`` runs (a transformers Llama decoder, so SmolVLM,
    Idefics3, LLaVA over Llama, Llama LMs) with a plain LM head, one sequence at a time (a new
    prefill ends the previous sequence: the graphs own its buffers), no batches.

    Args:
        model: as :class:`TransformersTarget`'s, within what is covered.
        max_length: positions the static cache holds, prompt and generated tokens included (default:
            the model's ``max_position_embeddings``, at most 2048).
        buckets: the padded forward sizes that are captured, increasing (a verification over more
            inputs than the largest is refused; default :data:`CAPTURED_BUCKETS`).
    Raises:
        ValueError: a model outside what is covered, or bad sizes.
    """

    def __init__(self, model: nn.Module, max_length: int | None = None, buckets: tuple[int, ...] = CAPTURED_BUCKETS) -> None:
        super().__init__(model)
        if self.lean_decoder is None:
            raise ValueError(f"captured forwards need a Llama decoder with a plain LM head (mmspec's lean forward); "
                             f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) has none: drop cuda_graphs")
        positions = getattr(self.lean_decoder.config, "max_position_embeddings", None) or 2048
        self.max_length = min(positions, 2048) if max_length is None else int(max_length)
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2 positions, got {max_length}")
        check_buckets(buckets)
        self.buckets = tuple(buckets)
        self.lean_prefill = True  # every prompt goes into the static cache (:meth:`_lean_prefill`)
        self._cache: StaticKVCache | None = None
        self._static: dict[int | None, StaticForward] = {}  # hidden_layer -> its captured forward, built at first use

    @property
    def captured(self) -> bool:
        """Whether the forwards replay CUDA graphs (False on a CPU, where the static buffers run eagerly)."""
        return self.device.type == "cuda"

    def _static_cache(self) -> StaticKVCache:
        if self._cache is None:
            config, weight = self.lean_decoder.config, self.lean_decoder.embed_tokens.weight
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            shape = (1, config.num_key_value_heads, self.max_length + self.buckets[-1], head_dim)
            self._cache = StaticKVCache(config.num_hidden_layers, shape, weight.dtype, weight.device)
        return self._cache

    def _static_forward(self, hidden_layer: int | None) -> StaticForward:
        if hidden_layer not in self._static:
            decoder, head, cache, device = self.lean_decoder, self.model.get_output_embeddings(), self._static_cache(), self.device

            def inputs(b: int) -> dict[str, torch.Tensor]:
                return {"tokens": torch.zeros(1, b, dtype=torch.long, device=device),
                        "positions": torch.zeros(1, b, dtype=torch.long, device=device)}

            def forward(tokens, positions, mask):
                hidden, kept = lean_states(decoder, decoder.embed_tokens(tokens), cache, positions, mask, hidden_layer)
                logits = self._project(head, hidden) if tokens.shape[1] > 1 else head(hidden)
                return (logits,) if kept is None else (logits, kept)

            self._static[hidden_layer] = StaticForward(forward, inputs, cache, self.buckets, device)
        return self._static[hidden_layer]

    def check_inputs(self, model_inputs: dict[str, Any]) -> torch.Tensor:
        """:meth:`TransformersTarget.check_inputs`, and a prompt shorter than ``max_length``."""
        input_ids = super().check_inputs(model_inputs)
        if input_ids.shape[1] >= self.max_length:
            raise ValueError(f"the prompt has {input_ids.shape[1]} tokens and this captured target holds {self.max_length} "
                             "positions: pass a larger max_length")
        return input_ids

    def _lean_prefill(self, input_ids: torch.Tensor, embeds: torch.Tensor | None, hidden_layer: int | None
                      ) -> tuple[SequenceState, TargetOutput]:
        """The prompt into the static cache (eagerly, the cache's earlier sequence ended): every
        prefill of this target takes this path (``lean_prefill`` is set)."""
        if embeds is None:
            raise ValueError(f"{type(self.model).__name__} gives no image features mmspec can merge (get_image_features); "
                             "drop cuda_graphs")
        length = input_ids.shape[1]
        cache = self._static_cache()
        cache.slots = torch.arange(length, device=self.device)
        mask = torch.zeros(1, 1, length, cache.capacity, dtype=torch.bool, device=self.device)
        fill_static_mask(mask, 0, torch.ones(length, length, dtype=torch.bool, device=self.device).tril())
        hidden, kept = lean_states(self.lean_decoder, embeds, cache, cache.slots[None], mask, hidden_layer)
        cache.length = length
        state = SequenceState(input_ids.long(), cache, prompt_length=length)
        cache.owner = state  # the sequence that holds the static buffers now
        return state, TargetOutput(self.model.get_output_embeddings()(hidden[:, -1:]), kept)

    def forward(self, state: SequenceState, tokens: torch.Tensor, hidden_layer: int | None = None,
                tree: TokenTree | None = None) -> TargetOutput:
        """As :meth:`TransformersTarget.forward`, through the bucket's captured forward."""
        cache, n = state.cache, tokens.shape[1]
        if getattr(cache, "owner", None) is not state:
            raise ValueError("this captured target has started another sequence since; a captured target decodes "
                             "one sequence at a time")
        if state.cache_length + n > self.max_length:
            raise ValueError(f"position {state.cache_length + n - 1} is past this captured target's max_length "
                             f"{self.max_length}: pass a larger max_length or fewer max_new_tokens")
        if tree is None:
            positions, block = state.position_ids(n), None
        else:
            self._check_tree(tree, n)
            positions = tree_position_ids(tree, state.cache_length + state.position_offset, device=self.device)
            block = tree.ancestor_matrix().to(self.device)
        outputs = self._static_forward(hidden_layer)(n, block, tokens=tokens.to(self.device), positions=positions)
        return TargetOutput(outputs[0], outputs[1] if hidden_layer is not None else None)

    def prefill_rows(self, rows: list[dict[str, Any]], hidden_layer: int | None = None):
        raise ValueError("a captured target decodes one sequence at a time; use batch size 1 or drop cuda_graphs")

    def forward_rows(self, state: BatchState, tokens: torch.Tensor, hidden_layer: int | None = None):
        raise ValueError("a captured target decodes one sequence at a time; use batch size 1 or drop cuda_graphs")
