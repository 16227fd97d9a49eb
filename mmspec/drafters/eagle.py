"""EAGLE (Li et al., 2024): draft at the feature level with one decoder layer over the target's
own features.

At position t the head reads the target's last hidden state f_t ([H], the input of the LM head)
and the embedding of the token that follows it, e(x_{t+1}), and predicts the next feature:

    f^_{t+1} = Norm(Layer(W_fc [e(x_{t+1}); f_t]))        logits_{t+2} = LMHead_target(f^_{t+1})

Drafting continues on the head's own predictions (f^ replaces f). The token embedding and the LM
head are the target's (shared, never copied); only W_fc, one decoder layer of the target's family
and a norm are trained (``mmspec train drafter --method eagle``). Training loss (the paper's):
SmoothL1(f^, f) + 0.1 * CE(LMHead(f^), x).

The head keeps its own KV cache over the committed (feature, token) pairs; features of the
committed tokens arrive with every verification (``requires_target_hidden``). The head is
:class:`mmspec.modeling.heads.EagleHead`; EAGLE-2's automatic tree size is
:mod:`mmspec.drafters.tree_budget`.

A head trained with the vision option (:class:`~mmspec.modeling.heads.VisionEagleHead`, ViSpec's
recipe; ``mmspec train drafter --vision-tokens K``) loads through the same specs (``eagle:DIR``,
``eagle2:DIR``): at the prefill the drafter takes the target's features at the prompt's image
tokens, writes their k compressed tokens into the head's cache first (the committed pairs follow at
positions k, k+1, ...) and adds the global image feature to every head input. It drafts through
the module forward (not the fused or captured steps, which cover the plain head); the target's
verification is unchanged, so decoding stays exact.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from ..adapters.hf import config_image_token_id, final_norm, text_decoder
from ..core.batch import BatchDrafting
from ..core.cost import PathCalibration
from ..core.cache import SequenceState, StaticKVCache, crop_cache, make_cache, stack_caches
from ..core.draft import chain_stops, draft_confidence
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.target import TargetOutput
from ..core.sampling import logits_to_probs
from ..core.tree import TokenTree, dynamic_tree, expansion_mask, sampled_dynamic_tree
from ..hub import dtype_name
from ..modeling.fused import (GrownTree, chain_draws, chain_samples, fused_plans, head_chain, head_tree, int8_amx, int8_head,
                             linear_operand)
from ..modeling.heads import EagleHead, VisionContext
from ..modeling.lean import lean_supported, rotary
from .captured_chain import CapturedEagle2Tree, CapturedEagleChain, CapturedHeadStep
from .shipped import chain_settings, check_stop_below, shipped_drafter_dir
from .tree_budget import BUDGETS, TreeBudgetPolicy, budget_class, forward_parameters
from .vocab import DraftLMHead, load_draft_vocabulary


@register_drafter("eagle")
class EagleDrafter(BatchDrafting, Drafter):
    """Chain drafting with an EAGLE head (K tokens per step).

    Args:
        target_model: the transformers target (its input embeddings and LM head are used).
        head: a trained :class:`EagleHead`.
        num_draft_tokens: K.
        draft_vocabulary: LongTensor [N] of token ids to draft from (:mod:`mmspec.drafters.vocab`;
            shipped next to the head), or None for the whole vocabulary.
        int8_head: the fused calls (chain, EAGLE-2's tree) read the head's layer and ``fc`` as int8
            weights (:func:`mmspec.modeling.fused.int8_head`): half the bytes, and on AMX-INT8 tiles
            rows nearly free. The drafts are the int8 head's (its q where they are sampled), so
            decoding stays exact. None (default): :meth:`int8_default` (EAGLE's chain, one row a
            step: off, measured no faster on the captioner; EAGLE-2's trees: where the int8
            kernel sums by AMX-INT8, :func:`mmspec.modeling.fused.int8_amx`).
        captured_head: run each drafting step as one captured graph
            (:class:`~mmspec.drafters.captured_chain.CapturedEagleChain`; EAGLE-2's greedy trees:
            ``CapturedEagle2Tree``). None (default): where the
            target verifies from a static KV cache on a GPU (a ``CapturedTransformersTarget``);
            True: over any target and device (a CPU runs the static buffers eagerly), refused for a
            head it does not cover.
        stop_below: a dynamic draft length for greedy chains: the chain ends after the first draft
            whose running confidence prod_j q_j(x_j) falls below it
            (:func:`mmspec.core.draft.chain_stops`); 0 (default) drafts K every step. A captured
            step drafts K.
        sampled_stop_below: the same for sampled chains (q: the draws' distributions). Kept apart
            because a sampled draw's q foretells its acceptance less well (on the captioner the
            stop measured no faster there: docs/drafters.md).
        greedy_draft_tokens: K for greedy chains (default ``num_draft_tokens``): with a stop they
            can afford to draft further.
            ``from_spec`` reads these and K from the head's ``chain_settings.json`` where it has one
            (:func:`~mmspec.drafters.shipped.chain_settings`).
    """

    spec_argument = "path"
    needs_transformers_target = True
    saved_layouts = ((EagleHead.config_file,),)
    requires_target_hidden = True

    def __init__(self, target_model: nn.Module, head: EagleHead, num_draft_tokens: int = 5,
                 draft_vocabulary: torch.Tensor | None = None, int8_head: bool | None = None,
                 captured_head: bool | None = None, stop_below: float = 0.0, sampled_stop_below: float = 0.0,
                 greedy_draft_tokens: int | None = None) -> None:
        self._setup(head, *self._target_parts(target_model, draft_vocabulary), num_draft_tokens, int8_head)
        self.captured_head = captured_head
        self.stop_below = check_stop_below(stop_below, "stop_below")
        self.sampled_stop_below = check_stop_below(sampled_stop_below, "sampled_stop_below")
        if greedy_draft_tokens is not None and (isinstance(greedy_draft_tokens, bool) or not isinstance(greedy_draft_tokens, int)
                                                or greedy_draft_tokens < 1):
            raise ValueError(f"greedy_draft_tokens={greedy_draft_tokens!r}: give an integer >= 1, or None for num_draft_tokens")
        self.greedy_draft_tokens = greedy_draft_tokens
        self.image_token_id = self._image_token(head, target_model)

    @staticmethod
    def _image_token(head: EagleHead, target_model: nn.Module) -> int | None:
        """The id of the target's image tokens, which a vision-aware head reads (None for a plain
        head); a vision-aware head over a target without image tokens is refused here."""
        if not getattr(head, "vision_tokens", 0):  # (EAGLE's VisionEagleHead, EAGLE-3's VisionEagle3Head)
            return None
        token = config_image_token_id(target_model.config)
        if token is None:
            raise ValueError(f"this EAGLE head was trained with the vision option (vision_tokens={head.vision_tokens}) and "
                             f"reads a VLM's image tokens; {type(target_model).__name__} has none: use a head trained "
                             "without --vision-tokens")
        return token

    def _setup(self, head: EagleHead, embed: nn.Module, lm_head: DraftLMHead, num_draft_tokens: int,
               int8: bool | None = None) -> None:
        Drafter.__init__(self, num_draft_tokens)
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.int8 = self.int8_default() if int8 is None else int8
        self.chain_int8 = None  # the int8 copy the fused calls read (where self.int8)
        self.cache = None
        self.image_token_id: int | None = None  # (a vision-aware head: see __init__)
        self.vision: VisionContext | None = None  # this generation's image context (a vision-aware head, an image in the prompt)
        self.image_positions: torch.Tensor | None = None  # the prompt's image-token positions [m]
        self.fed = 0  # pairs (f_t, x_{t+1}) for position_base <= t < fed are in the head's cache
        self.position_base = 0  # the sequence position of the head's first pair (its cache entry 0)
        self.features: torch.Tensor | None = None  # target features [R, n, H] of positions fed, fed + 1, ...
        self.captured_head: bool | None = None  # (see the class's Args; __init__ sets it)
        self._captured_steps: dict[tuple, CapturedHeadStep] = {}  # (kind, shape, sampling, capacity) -> its captured step
        self.captured_step: CapturedHeadStep | None = None  # the captured step this generation drafts with, if any
        self.stop_below = self.sampled_stop_below = 0.0  # a chain's confidence stops (see the class's Args)
        self.greedy_draft_tokens: int | None = None

    @staticmethod
    def int8_default() -> bool:
        """``int8_head=None``: a chain feeds one row a step, which int8 does not make cheaper on
        the captioner (tau 4.27 -> 4.18, the same speed): bf16."""
        return False

    @classmethod
    def head_path(cls, target, arg: str | None):
        """The head directory a spec names: ``arg``, or the one shipped for an embedded model."""
        return arg or shipped_drafter_dir(target.model, "eagle", EagleHead.config_file)

    @staticmethod
    def saved_settings(path, target, num_draft_tokens: int | None) -> dict:
        """The keyword arguments the head's ``chain_settings.json`` in ``path`` gives for ``target``'s
        dtype (:func:`~mmspec.drafters.shipped.chain_settings`; a given ``num_draft_tokens`` sets K)."""
        return chain_settings(path, num_draft_tokens, dtype_name(target.model.dtype))

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "EagleDrafter":
        path = cls.head_path(target, arg)
        settings = cls.saved_settings(path, target, num_draft_tokens)
        return cls(target.model, EagleHead.load(path, target.model), settings.pop("num_draft_tokens", 5),
                   load_draft_vocabulary(path), **settings)

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.cache = make_cache(None)  # preallocated layers: in-place appends, fused head layers
        self.fed = 0
        self.position_base = 0
        self.features = None
        self.vision = None
        self.image_positions = None
        if self.image_token_id is not None:
            self.image_positions = torch.nonzero(state.tokens[0, : state.prompt_length] == self.image_token_id).flatten()
        self.chain_plans = False  # the fused chain's head plans (None: it does not run; False: not checked yet)
        self.captured_step = self._choose_captured(state)
        if self.captured_step is not None:
            self.captured_step.cache.length = 0

    def _choose_captured(self, state: SequenceState) -> CapturedHeadStep | None:
        """This generation's captured drafting step (:attr:`captured_head`; built at first use
        for each shape, sampling and capacity: :meth:`_capture`), or None."""
        wanted, static = self.captured_head, isinstance(state.cache, StaticKVCache)
        head = self.head
        covered = (type(head) is EagleHead and head.lean and lean_supported(head.decoder)
                   and type(self)._draft_logits is EagleDrafter._draft_logits and self._captures())
        if wanted is None:
            wanted = covered and static and state.cache.keys[0].is_cuda
        if not wanted:
            return None
        if not covered:
            raise ValueError(f"captured_head covers EAGLE's chain and EAGLE-2's greedy trees over a text EagleHead, not "
                             f"{type(self).__name__} with {type(head).__name__} here; pass captured_head=None or False")
        capacity = state.cache.capacity if static else min(getattr(head.decoder.config, "max_position_embeddings", None) or 2048, 2048)
        key, build = self._capture(capacity)
        if key not in self._captured_steps:
            self._captured_steps[key] = build()
        return self._captured_steps[key]

    def _captures(self) -> bool:
        """Whether this drafter's steps, as configured for this generation, can run captured."""
        return type(self).propose is EagleDrafter.propose

    def _capture(self, capacity: int):
        """(the key, a builder) of the captured step this generation needs."""
        key = ("chain", self.num_draft_tokens, self.context.sampling, capacity)
        return key, lambda: CapturedEagleChain(self.head, self.embed, self.lm_head, self.num_draft_tokens, self.context.sampling,
                                               capacity)

    @staticmethod
    def _target_parts(target_model: nn.Module, draft_vocabulary: torch.Tensor | None):
        """(the target's token embedding, its LM head restricted to the draft vocabulary)."""
        return target_model.get_input_embeddings(), DraftLMHead(target_model.get_output_embeddings(), draft_vocabulary)

    @property
    def head_cache_length(self) -> int:
        return self.fed - self.position_base

    def _draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Predicted features [R, n, H] -> draft logits [n, N] (R = 1 here; the image drafter
        combines its guidance rows)."""
        return self.lm_head(predicted[0])

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Keep the target features of the committed inputs (the prefill's whole prompt, or the
        pending token + the accepted drafts)."""
        new = target_output.hidden_states[:, : num_accepted + 1] if num_drafted or self.features is not None else target_output.hidden_states
        if self.features is None and self.image_positions is not None and len(self.image_positions):
            self._start_vision(new)
        self.features = new if self.features is None else torch.cat([self.features, new], dim=1)

    def _start_vision(self, prompt_features: torch.Tensor) -> None:
        """A vision-aware head, at the prefill (prompt_features [R, L, H]): the adaptor over the
        features at the image tokens gives this generation's :class:`VisionContext`; its prefix
        takes the head cache's first k entries, so the committed pair t sits at position k + t
        (``position_base = -k``)."""
        head = self.head  # (a VisionEagleHead or a VisionEagle3Head)
        image = prompt_features[:, self.image_positions.to(prompt_features.device)]
        self.vision = head.vision_context(image.to(head.fc.weight.dtype))
        head.write_prefix(self.vision, self.cache)
        self.position_base = -head.vision_tokens
        self.forwards += 1

    def _head(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One head forward over its cache (with this generation's image context, if any)."""
        if self.vision is None:
            return self.head(features, token_embeds, self.cache, position_ids, attention_mask)
        return self.head(features, token_embeds, self.cache, position_ids, attention_mask, vision=self.vision)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (features [R, n, H], next tokens [1, n]) at positions start.. -> predicted features [R, n, H]."""
        start -= self.position_base
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        return self._head(features, self.embed(tokens), positions)

    def _catch_up(self, state: SequenceState) -> torch.Tensor:
        """Feed the committed pairs not yet in the head's cache (features of positions fed .. L-2,
        tokens fed+1 .. L-1) -> the predicted feature after the last committed token [R, 1, H]."""
        length = state.tokens.shape[1]
        pending = length - 1 - self.fed
        predicted = self._step(self.features[:, :pending], state.tokens[:, self.fed + 1 :], self.fed)[:, -1:]
        self.features = self.features[:, pending:]
        self.fed = length - 1
        self.forwards += 1
        return predicted

    def _fusable(self) -> bool:
        """Whether the head can run fused (checked once a generation): a Llama EagleHead drafting
        over one feature row (this class's draft logits), ``fc`` and the draft LM head few-row
        linears, a plain embedding table in the head's dtype."""
        head = self.head
        if type(head) is not EagleHead or type(self)._draft_logits is not EagleDrafter._draft_logits:
            return False  # (an image head: its own layer, guided logits)
        decoder, table = head.decoder, getattr(self.embed, "weight", None)
        dtype = final_norm(decoder).weight.dtype
        return not (not head.lean or type(self.embed) is not nn.Embedding or table.dtype != dtype or not table.is_contiguous()
                    or not lean_supported(decoder, None) or len(decoder.layers) != 1 or linear_operand(head.fc, dtype) is None
                    or linear_operand(self.lm_head.projection, dtype) is None)

    def _chain_plans(self):
        """The head layer's fused plans (the head :meth:`_fusable`, checked by the caller, and its
        cache's layer made), else None."""
        decoder = self.head.decoder
        plans = fused_plans(decoder.layers, self.cache, 1, decoder.norm.weight.dtype, self.embed.weight.device)
        self.chain_int8 = int8_head(plans, decoder.layers[0], self.head.fc, self.lm_head.projection) if plans is not None and self.int8 else None
        return plans

    def _fused_chain(self, state: SequenceState, k: int) -> Draft | None:
        """:meth:`propose`'s chain in one C call (:func:`mmspec.modeling.fused.head_chain`: the
        committed pairs the head has not seen, then per token the draft LM head, the pick and the
        next head forward) where it runs (:meth:`_chain_plans`, greedy or temperature-only
        sampling): the loop's tokens from the same generator, q within float rounding; else None."""
        if not chain_samples(self.context.sampling):
            return None
        fused = self._fused_inputs(state, k - 1)
        if fused is None:
            return None
        plans, pending, cos, sin = fused
        temperature, uniforms, probs = chain_draws(self.context.sampling, self.context.generator, k, self.lm_head.size)
        codes = self._chain_call(plans, state.tokens[0, self.fed + 1 :].contiguous(), self.features[0, :pending].contiguous(),
                                 cos, sin, k, temperature, uniforms, probs)
        self._fed_pairs(state, pending)
        self.forwards += len(codes)
        return Draft(tokens=self.lm_head.tokens(codes)[None],
                     probs=None if probs is None else self.lm_head.full(probs[: len(codes)])[None])

    def _chain_call(self, plans, codes: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: int,
                    temperature: float, uniforms: torch.Tensor | None, probs: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_fused_chain`'s C call over the pending pairs (codes [n0], features [n0, .]) -> the
        k drafted indices [k] (:func:`~mmspec.modeling.fused.head_chain`)."""
        decoder = self.head.decoder
        return head_chain(plans, self.cache.layers[0], decoder.norm.weight, decoder.norm.variance_epsilon, self.head.fc,
                          self.lm_head.projection, codes, features, self.embed.weight, None, 0, cos, sin, k, temperature,
                          uniforms, probs, ids=self.lm_head.token_ids, int8=self.chain_int8, stop_below=self._chain_stop())

    def _fused_inputs(self, state: SequenceState, ahead: int, rows: int = 1):
        """(the head's plans, the pending pairs n0, rotary rows cos / sin [n0 + ahead, hd] from the
        first pending position) for a fused C call (:meth:`_fused_chain`, EAGLE-2's tree) where it
        runs (:meth:`_chain_plans`, CPU, one feature row, n0 and ``rows`` within the plans' rows),
        else None."""
        pending = state.tokens.shape[1] - 1 - self.fed
        if self.chain_plans is False and not self._fusable():
            self.chain_plans = None
        if (pending > 1 and self.chain_plans is not None and state.tokens.device.type == "cpu"
                and (not getattr(self.cache, "layers", None) or (self.chain_plans and pending > self.chain_plans[0].max_rows))):
            # the first step (the head's cache layer is made by its first forward) or too many pairs:
            # all but the last pair through the head's module forward, the last one in the fused call
            self._step(self.features[:, : pending - 1], state.tokens[:, self.fed + 1 : self.fed + pending], self.fed)
            self.features, self.fed, pending = self.features[:, pending - 1 :], self.fed + pending - 1, 1
            self.forwards += 1
        if self.chain_plans is False and getattr(self.cache, "layers", None):
            self.chain_plans = self._chain_plans()
        plans = self.chain_plans or None
        if (plans is None or not 1 <= pending <= plans[0].max_rows or rows > plans[0].max_rows or not plans.fresh()
                or self.features.shape[0] != 1 or self.features.dtype != plans[0].dtype or state.tokens.device.type != "cpu"):
            return None
        cos, sin = self._rotary_rows(self.fed - self.position_base, pending + ahead)
        return plans, pending, cos, sin

    def _rotary_rows(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's rotary rows cos, sin [count, hd] of the head positions start ..."""
        cos, sin = rotary(self.head.decoder, self.features[:, :1].expand(1, count, -1), start, None)  # (rows: their count)
        return cos[0], sin[0]

    def _fed_pairs(self, state: SequenceState, pending: int) -> None:
        """Record that a fused call fed the ``pending`` committed pairs into the head's cache."""
        self.features = self.features[:, pending:]
        self.fed = state.tokens.shape[1] - 1

    def _propose_captured(self, state: SequenceState, k: int) -> Draft:
        """:meth:`propose` through the captured step (:attr:`captured_step`): it drafts K tokens, the first k kept."""
        pending = state.tokens.shape[1] - 1 - self.fed
        sampling = self.context.sampling
        uniforms = None
        if sampling.do_sample:
            generator = self.context.generator
            uniforms = torch.rand(self.num_draft_tokens, dtype=torch.float32, generator=generator, device=generator.device)
        codes, probs = self.captured_step(self.features[:, :pending], state.tokens[:, self.fed + 1 :], self.head_cache_length, uniforms)
        self._fed_pairs(state, pending)
        self.forwards += self.num_draft_tokens
        return Draft(tokens=self.lm_head.tokens(codes[:k])[None], probs=None if probs is None else self.lm_head.full(probs[:k])[None])

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self._chain_length(), max_tokens)
        if self.captured_step is not None:
            return self._propose_captured(state, k)
        fused = self._fused_chain(state, k)
        if fused is not None:
            return fused
        predicted = self._catch_up(state)
        tokens, probs, running, stop_below = [], [], 1.0, self._chain_stop()
        for i in range(k):
            logits = self._draft_logits(predicted[:, -1:])
            choice, q = self.lm_head.pick(self, logits)
            tokens.append(choice.view(1, 1))
            probs.append(q)
            stop, running = chain_stops(running, draft_confidence(logits, q, choice) if stop_below else 1.0, stop_below)
            if stop:
                self._skip_draws(k - i - 1)
                break
            if i + 1 < k:
                predicted = self._step(predicted, tokens[-1], self.fed + i)  # pair (f^_t, x_{t+1}) at position t
                self.forwards += 1
        crop_cache(self.cache, self.head_cache_length)  # the drafted pairs are not committed
        return Draft.chain(tokens, probs)

    def _chain_stop(self) -> float:
        """This generation's confidence stop: ``sampled_stop_below`` when it samples, else ``stop_below``."""
        return self.sampled_stop_below if self.context.sampling.do_sample else self.stop_below

    def _chain_length(self) -> int:
        """This generation's K: ``greedy_draft_tokens`` (where set) for greedy chains, else ``num_draft_tokens``."""
        return self.num_draft_tokens if self.context.sampling.do_sample or not self.greedy_draft_tokens else self.greedy_draft_tokens

    def _skip_draws(self, count: int) -> None:
        """A chain stopped ``count`` draws early: take the uniforms those draws would have (one
        each, as the fused chain takes all K at once), so the generator runs on as it would have."""
        generator = self.context.generator
        if count > 0 and self.context.sampling.do_sample:
            torch.rand(count, dtype=torch.float32, generator=generator, device=generator.device)

    @classmethod
    def propose_rows(cls, drafters: list["EagleDrafter"], state, positions: list[int], budgets: list[int]) -> list[Draft]:
        """The rows of a batch draft together: each row feeds its committed pairs to its own head
        cache (:meth:`_catch_up`, ragged), then every further draft token is one head forward over
        all drafting rows, on a stacked copy of their head caches (a 2-D mask over its slots, each
        row at its own positions), and one draft LM head over them; each row picks with its own
        generator, as :meth:`propose` does. Image heads (their own attention) and vision-aware heads
        (each row its own image context) go row by row."""
        if not isinstance(drafters[0].head, EagleHead) or getattr(drafters[0].head, "vision_tokens", 0):
            return super().propose_rows(drafters, state, positions, budgets)
        lengths = [min(d._chain_length(), budget) for d, budget in zip(drafters, budgets)]
        running = [1.0] * len(drafters)  # each row's confidence stop (:func:`chain_stops`)
        predicted = torch.cat([d._catch_up(state.rows[p]) for d, p in zip(drafters, positions)])  # [n, 1, H]
        first = drafters[0]
        cache, valid = stack_caches([d.cache for d in drafters])
        valid = valid.to(predicted.device)
        starts = torch.tensor([[d.fed - d.position_base] for d in drafters], device=predicted.device)
        picked: list[list] = [[] for _ in drafters]
        drafting = list(range(len(drafters)))
        tokens = torch.zeros(len(drafters), 1, dtype=torch.long, device=predicted.device)
        for i in range(max(lengths)):
            drafting = [j for j in drafting if i < lengths[j]]
            logits = first._draft_logits(predicted[drafting, -1:].transpose(0, 1))  # [drafting rows, N]
            for row, j in enumerate(drafting):
                drafter = drafters[j]
                choice, q = drafter.lm_head.pick(drafter, logits[row : row + 1])
                picked[j].append((choice.view(1, 1), q))
                tokens[j, 0] = choice[0]
                stop_below = drafter._chain_stop()
                if stop_below:
                    stop, running[j] = chain_stops(running[j], draft_confidence(logits[row : row + 1], q, choice), stop_below)
                    if stop:
                        drafter._skip_draws(lengths[j] - i - 1)
                        lengths[j] = i + 1
            if not any(i + 1 < lengths[j] for j in drafting):
                break
            mask = torch.cat([valid, valid.new_ones(len(drafters), i + 1)], dim=1).long()
            predicted = first.head(predicted, first.embed(tokens), cache, starts + i, mask)
            for j in drafting:
                drafters[j].forwards += i + 1 < lengths[j]
        return [Draft.chain(*zip(*rows)) for rows in picked]

    def describe(self) -> dict:
        fused = getattr(self, "chain_plans", None) not in (None, False)  # (known once a step was drafted)
        vision = {"vision_tokens": self.head.vision_tokens} if getattr(self.head, "vision_tokens", 0) else {}
        return {**super().describe(), "head_layers": 1, "draft_vocabulary": self.lm_head.size, **vision,
                **({"captured_head": True} if getattr(self, "captured_step", None) is not None else {}),
                **{name: value for name, value in (("stop_below", self.stop_below), ("sampled_stop_below", self.sampled_stop_below),
                                                   ("greedy_draft_tokens", self.greedy_draft_tokens)) if value},
                **({"fused_head": True, "head_int8": self.chain_int8 is not None} if fused else {})}


@register_drafter("eagle2")
class Eagle2Drafter(EagleDrafter):
    """EAGLE-2 (Li et al., 2024): the EAGLE head grows a context-aware dynamic tree.

    Expand the ``top_k`` most confident nodes per layer (``top_k=None``, the default: 4 for greedy
    trees on a CPU target, else 8; :attr:`cpu_top_k`) for ``depth`` layers (confidence = product
    of the head's probabilities along the path), keep the ``num_nodes`` best of all candidates
    (:func:`mmspec.core.tree.dynamic_tree`), verify the tree in one target forward. The tree is
    deterministic (q = 1 per node), so sampling stays exact with the multi-draft rule.

    Under sampling (``sampled_children=None`` follows the generation's ``do_sample``) a top-k
    child x is accepted with probability p(x) only, so the children are instead drawn from the
    head's q at the generation's temperature / top-k / top-p, without replacement, and accepted
    with sum min(p, q) (:func:`mmspec.core.tree.sampled_dynamic_tree`: the slots' values are fixed
    before their tokens are drawn and nothing drawn is dropped, which keeps the rule exact).

    ``num_nodes="auto"`` (hardware-aware): grow up to ``max_nodes`` candidates, ``depth`` layers at
    most, and let a :class:`~mmspec.drafters.tree_budget.TreeBudgetPolicy` decide how deep each
    tree grows and which nodes are verified, maximising the expected tokens per unit of cost,
    (1 + sum of the kept nodes' calibrated V) / (C(n + 1) + drafting time), with C the target's
    verification cost. ``budget`` names where C, the cost of a tree layer and the drafting time
    come from (:mod:`mmspec.drafters.tree_budget`): ``"timed"`` (measured on this device, the
    layers timed as they run), ``"nominal"`` (a deterministic cost model), or ``"auto"``: nominal
    when the tree can change the output (sampling, or a lossy rule such as LANTERN), so that a seed
    reproduces it, timed for exact greedy decoding.
    The stats report the budget and the mean tree size and depth chosen.

    Over a target that verifies through CUDA graphs (``captured_head``, as :class:`EagleDrafter`'s)
    a greedy tree grows in one graph replay (:class:`~mmspec.drafters.captured_chain.CapturedEagle2Tree`):
    every layer (a graph cannot stop early), then the rerank as above.

    Each expansion runs the head once over the layer's frontier nodes: node i reads the head's
    predicted feature at its parent and its own token, and attends to the committed pairs and its
    tree ancestors (a 4-D mask over the head's cache).
    """

    drafts_trees = True

    #: K of the chain form a batch row drafts with, and its class (:meth:`for_batch`)
    batch_chain_tokens = 5
    chain_class: ClassVar[type] = EagleDrafter
    #: ``top_k=None``: the branching of greedy (top-k) trees on a CPU target, and elsewhere. On CPUs
    #: a tree layer's rows cost arithmetic and 4 measured faster than 8 (the embedded captioner,
    #: greedy: an AVX2 core 2.22-2.25x against 2.11x on validation items, Zen 1 1.41x against
    #: 1.37x, AMX the same tau at 4 to 10; docs/benchmarks.md); sampled trees and GPUs keep 8
    cpu_top_k: ClassVar[int] = 4
    default_top_k: ClassVar[int] = 8

    def __init__(self, target_model: nn.Module, head: EagleHead, depth: int = 8, top_k: int | None = None,
                 num_nodes: int | str = "auto", max_nodes: int = 64, draft_vocabulary: torch.Tensor | None = None,
                 sampled_children: bool | None = None, budget: str = "auto", int8_head: bool | None = None,
                 captured_head: bool | None = None) -> None:
        super().__init__(target_model, head, num_draft_tokens=depth, draft_vocabulary=draft_vocabulary, int8_head=int8_head,
                         captured_head=captured_head)
        if num_nodes != "auto" and not (isinstance(num_nodes, int) and num_nodes >= 1):
            raise ValueError(f"num_nodes must be a positive int or 'auto', got {num_nodes!r}")
        if budget != "auto" and budget not in BUDGETS:
            raise ValueError(f"unknown tree budget {budget!r}; use 'auto' or one of {sorted(BUDGETS)}")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"top_k must be a positive int or None (chosen by device), got {top_k!r}")
        self.top_k_option = top_k
        self.depth, self.top_k, self.num_nodes, self.max_nodes = depth, top_k or self.default_top_k, num_nodes, max_nodes
        self.sampled_children = sampled_children
        self.budget = budget
        # c_layer / C(1) for the nominal budget: the parameters one tree layer reads (head + draft
        # LM head) over those of one target forward
        width = head.fc.out_features
        per_layer = forward_parameters(head) - (forward_parameters(head.vision) if getattr(head, "vision_tokens", 0) else 0)  # (the adaptor runs once a generation)
        self.relative_layer_cost = (per_layer + self.lm_head.size * width) / self._target_parameters(target_model)
        self.policy: TreeBudgetPolicy | None = None  # num_nodes="auto": this generation's size policy
        self.carry_calibration = True  # (see start)
        self.carried_calibrations: dict[tuple, PathCalibration] = {}  # (target model, depth, top_k) -> its calibration
        self.chosen_nodes: list[int] = []
        self.drafted_depths: list[int] = []

    @staticmethod
    def int8_default() -> bool:
        """``int8_head=None``: a tree layer feeds up to ``top_k`` rows, nearly free on AMX-INT8 tiles
        (the captioner's 8 rows a layer 0.52 -> 0.35 ms): int8 where :func:`int8_amx`."""
        return int8_amx()

    def for_batch(self) -> EagleDrafter:
        """Its chain form for a batch row: EAGLE (``chain_class``) with the same head,
        ``batch_chain_tokens`` per step (trees need batch size 1)."""
        chain = self.chain_class.__new__(self.chain_class)
        chain._setup(self.head, self.embed, self.lm_head, self.batch_chain_tokens, self.int8)
        chain.image_token_id = self.image_token_id
        return chain

    @staticmethod
    def _target_parameters(target_model: nn.Module) -> int:
        """Parameters one target forward reads per token: its decoder stack and LM head."""
        return forward_parameters(text_decoder(target_model)) + target_model.get_output_embeddings().weight.numel()

    def start(self, context, state: SequenceState) -> None:
        if self.top_k_option is None:  # (before the captured step is chosen: its shape)
            cpu_greedy = context.target.device.type == "cpu" and not self._samples_children(context)
            self.top_k = self.cpu_top_k if cpu_greedy else self.default_top_k
        super().start(context, state)
        self.chosen_nodes, self.drafted_depths = [], []
        self.policy = None
        if self.num_nodes == "auto":
            budget = budget_class(self.budget, context.output_follows_draft).for_generation(context, self.relative_layer_cost, state)
            self.policy = TreeBudgetPolicy(budget, self.depth, self._calibration(context))

    def _calibration(self, context) -> PathCalibration | None:
        """The confidences' calibration this generation's top-k trees start from: where the tree
        cannot change the output (exact greedy decoding), the one the drafter's earlier generations
        of the same target and tree shape left, so that a caption's first steps do not trust the head's
        confidences afresh; else None (a new one: a seed reproduces a sampled output)."""
        if not self.carry_calibration or context.output_follows_draft or self._samples_children(context):
            return None
        key = (id(getattr(context.target, "model", context.target)), self.depth, self.top_k)
        return self.carried_calibrations.setdefault(key, PathCalibration(self.depth))

    def _captures(self) -> bool:
        return type(self).propose is Eagle2Drafter.propose and not self._samples_children()

    def _capture(self, capacity: int):
        key = ("tree", self.depth, self.top_k, capacity)
        return key, lambda: CapturedEagle2Tree(self.head, self.embed, self.lm_head, self.depth, self.top_k, capacity)

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        super().on_verified(num_drafted, num_accepted, target_output)
        if self.policy is not None and self.drafted_depths:
            self.policy.on_verified(self.drafted_depths[-1], num_drafted, num_accepted)

    def _samples_children(self, context=None) -> bool:
        """Whether this generation's trees are sampled: ``sampled_children``, else ``do_sample`` (of
        ``context``, default the drafter's)."""
        if self.sampled_children is not None:
            return self.sampled_children
        context = context or self.context
        return context is not None and context.sampling.do_sample

    def on_tree_verified(self, path: torch.Tensor, tree_output: TargetOutput) -> None:
        if self.policy is not None:
            self.policy.on_tree_verified(path)

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "Eagle2Drafter":
        path = arg or shipped_drafter_dir(target.model, "eagle", EagleHead.config_file, "eagle2")
        return cls(target.model, EagleHead.load(path, target.model), depth=num_draft_tokens or 8,
                   draft_vocabulary=load_draft_vocabulary(path))

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        """Grow this step's draft tree after the committed sequence and return it for one verification.

        The head first catches up on the committed pairs (f_t, x_{t+1}) it has not seen, giving the
        predicted feature f^ after the last token; the root's children come from its draft
        distribution, and every expansion runs the head once over the frontier nodes. A node's
        cumulative confidence is V = prod of the draft probabilities along its path.

        - top-k trees: ``dynamic_tree`` keeps the ``top_k`` most probable children of the ``top_k``
          most confident frontier nodes per layer; the ``num_nodes`` best (or, with
          ``num_nodes="auto"``, those the :class:`TreeBudgetPolicy` keeps) are verified;
        - sampled trees: ``sampled_dynamic_tree`` draws each node's children from q (Gumbel-top-m
          with ``context.generator``) into slots opened before the draw (the policy plans the
          first-child chain's depth and opens siblings by their value).

        Args:
            state: the target's sequence, tokens [1, L] (the head's cache covers the committed
                pairs up to ``self.fed``).
            max_tokens: the tree may be at most this deep.
        Returns:
            A tree draft (``Draft.from_tree``): tokens [1, N] (target vocabulary ids), parents [N],
            depths, and for sampled trees the node distributions q [1, N, V]; empty when no node
            pays.
        """
        policy = self.policy
        if policy is not None:
            policy.begin_step()
        depth = min(self.depth, max_tokens)
        sampling, sampled = self.context.sampling, self._samples_children()
        size = self.max_nodes if policy is not None else self.num_nodes
        if not sampled:
            grown = self._captured_tree(state, depth) if self.captured_step is not None else self._fused_tree(state, depth, policy)
            if grown is not None:
                return self._settled(grown.best(size), policy, sampled, state)
        root_feature = self._catch_up(state)
        fed_nodes: list[int] = []  # candidate indices in the head cache after the committed pairs
        outputs: dict[int, torch.Tensor] = {}  # candidate -> predicted feature [H]

        def draft_probs(predicted: torch.Tensor) -> torch.Tensor:
            logits = self._draft_logits(predicted)
            return logits_to_probs(logits, sampling) if sampled else torch.softmax(logits.float(), dim=-1)

        def child_probs(candidates: TokenTree, nodes: torch.Tensor) -> torch.Tensor:
            nodes = nodes.tolist()
            parents = candidates.parents[nodes].tolist()
            features = torch.stack([root_feature[:, 0] if p < 0 else outputs[p] for p in parents], dim=1)
            tokens = self.lm_head.tokens(candidates.tokens[nodes].to(state.tokens.device))[None]
            depths = candidates.depth[nodes].to(tokens.device)
            committed = self.head_cache_length
            mask = expansion_mask(candidates.ancestor_rows(nodes, fed_nodes), committed, root_feature.dtype, tokens.device)
            predicted = self._head(features, self.embed(tokens), (committed + depths - 1)[None], attention_mask=mask)
            self.forwards += 1
            fed_nodes.extend(nodes)
            for node, feature in zip(nodes, predicted.unbind(1)):
                outputs[node] = feature  # [R, H]
            return draft_probs(predicted)

        root_probs = draft_probs(root_feature)[0]
        expand_while = policy.expand_while(sampled) if policy is not None else None
        if not sampled:
            tree = dynamic_tree(root_probs, child_probs, depth=depth, top_k=self.top_k, num_nodes=size,
                                expand_while=expand_while)
        else:
            open_slot = None
            if policy is not None:
                depth = policy.chain_depth(depth)
                open_slot = policy.sibling_rule(depth)
            tree = sampled_dynamic_tree(root_probs, child_probs, depth=depth, top_k=self.top_k, num_nodes=size,
                                        generator=self.context.generator, open_slot=open_slot, expand_while=expand_while)
        crop_cache(self.cache, self.head_cache_length)
        return self._settled(tree, policy, sampled, state)

    def _captured_tree(self, state: SequenceState, depth: int) -> TokenTree:
        """The top-k tree's growth as one graph replay (:class:`CapturedEagle2Tree`: every layer,
        no early stop), its layers below ``depth`` dropped, as candidates before the rerank."""
        pending = state.tokens.shape[1] - 1 - self.fed
        codes, parents, scores = self.captured_step.grow(self.features[:, :pending], state.tokens[:, self.fed + 1 :],
                                                          self.head_cache_length)
        self._fed_pairs(state, pending)
        self.forwards += self.depth
        tree = TokenTree(codes, parents.cpu(), scores=scores)
        return tree if depth >= self.depth else tree.select(torch.nonzero(tree.depth <= depth).flatten())

    def _fused_tree(self, state: SequenceState, depth: int, policy: TreeBudgetPolicy | None) -> TokenTree | None:
        """The top-k tree's growth in one C call (:meth:`_tree_call`: the committed pairs the head
        has not seen, then every layer's expansion) where it runs
        (:meth:`_fused_inputs`), as candidates before the rerank; else None."""
        fused = self._fused_inputs(state, depth - 1, self.top_k)
        if fused is None:
            return None
        plans, pending, cos, sin = fused
        grown = self._tree_call(plans, state.tokens[0, self.fed + 1 :].contiguous(), self.features[0, :pending].contiguous(),
                                cos, sin, depth, policy.expand_while(False) if policy is not None else None)
        self._fed_pairs(state, pending)
        self.forwards += grown.layers
        return TokenTree(grown.tokens, grown.parents, scores=grown.scores)

    def _tree_call(self, plans, codes: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, depth: int,
                   expand_while) -> GrownTree:
        """:meth:`_fused_tree`'s C call over the pending pairs (codes [n0], features [n0, .])
        (:func:`~mmspec.modeling.fused.head_tree`)."""
        decoder = self.head.decoder
        return head_tree(plans, self.cache.layers[0], decoder.norm.weight, decoder.norm.variance_epsilon, self.head.fc,
                         self.lm_head.projection, codes, features, self.embed.weight, cos, sin, depth, self.top_k,
                         expand_while=expand_while, ids=self.lm_head.token_ids, int8=self.chain_int8)

    def _settled(self, tree: TokenTree, policy: TreeBudgetPolicy | None, sampled: bool, state: SequenceState) -> Draft:
        """The grown tree (draft vocabulary codes) as this step's draft: target ids, and the nodes
        the policy keeps."""
        self.drafted_depths.append(tree.max_depth)
        tree = dataclasses.replace(tree, tokens=self.lm_head.tokens(tree.tokens.to(state.tokens.device)),  # draft indices -> ids
                                   probs=None if tree.probs is None else self.lm_head.full(tree.probs))
        if policy is not None:
            tree = policy.settle(tree, sampled)
        self.chosen_nodes.append(tree.size)
        if tree.size == 0:
            return Draft(tokens=state.tokens.new_empty((1, 0)))
        return Draft.from_tree(tree)

    def describe(self) -> dict:
        chosen = {"mean_tree_nodes": round(sum(self.chosen_nodes) / len(self.chosen_nodes), 1),
                  "mean_depth_drafted": round(sum(self.drafted_depths) / len(self.drafted_depths), 1)} if self.chosen_nodes else {}
        budget = self.policy.describe() if self.policy is not None else {}
        return {**super().describe(), "tree": "dynamic, sampled children" if self._samples_children() else "dynamic", "depth": self.depth, "top_k": self.top_k,
                "num_nodes": self.num_nodes, **budget, **chosen}
