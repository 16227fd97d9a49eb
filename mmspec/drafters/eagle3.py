"""EAGLE-3 (Li et al., 2025): draft with a head fed by three target layers, over its own draft
vocabulary (the head: :class:`mmspec.modeling.eagle3.Eagle3Head`).

The drafting is EAGLE's (:mod:`mmspec.drafters.eagle`), with three differences:

- the target returns its ``hidden_states`` entries ``aux_layers`` (low / middle / high),
  concatenated ([R, n, 3 H]; ``target_hidden_layer`` is that tuple), which the head fuses by fc;
- the head's step output s is both the next step's feature and, through its own norm and LM head
  over N draft tokens, the draft logits (EAGLE's heads reuse the target's LM head);
- draft index j is target id ``j + d2t[j]``: a drafted token is mapped to its target id and a
  sampled draft's q [N] is spread onto the target's vocabulary, zero outside the draft vocabulary,
  so the target's speculative rule sees a distribution over its own ids and stays exact (the
  residual max(0, p - q) keeps the mass of the tokens the head cannot draft).

``drafter="eagle3:DIR"`` drafts chains of K tokens (on a CPU, with the head's projections few-row
C linears, in one C call a chain: :func:`mmspec.modeling.fused.eagle3_chain`);
``"eagle3-tree:DIR"`` grows EAGLE-2's dynamic
trees (top-k greedy trees, sampled children under sampling: :class:`~mmspec.drafters.eagle.Eagle2Drafter`;
the top-k growth in one C call there: :func:`mmspec.modeling.fused.eagle3_tree`).
DIR holds mmspec's layout (``mmspec train drafter --method eagle3``) or the vLLM / SGLang one
(``config.json`` + ``model.safetensors``; ``mmspec export drafter``, or a head trained elsewhere);
without DIR, the head shipped for an embedded model (``models/smolcap-eagle3``: the captioner's).
A head with the vision option (:class:`~mmspec.modeling.eagle3.VisionEagle3Head`, ``--vision-tokens
K``) drafts as EAGLE's vision-aware head does (:mod:`mmspec.drafters.eagle`), through the module
forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..core.cache import PreallocatedLayer
from ..core.drafter import register_drafter
from ..modeling.eagle3 import (CONFIG_FILE, ENGINE_ARCHITECTURES, ENGINE_CONFIG_FILE, ENGINE_WEIGHTS_FILE, Eagle3Head,
                               midlayer_parts)
from ..modeling.fused import (GrownTree, PlanStack, eagle3_chain, eagle3_tree, fused_enabled, int8_head, layer_plan,
                              linear_operand)
from .eagle import Eagle2Drafter, EagleDrafter
from .shipped import shipped_drafter_dir
from .tree_budget import forward_parameters
from .vocab import DraftLMHead, _Rows


class Eagle3LMHead(DraftLMHead):
    """The head's norm + LM head over its N draft tokens, read through :class:`DraftLMHead`'s
    interface: logits [..., N]; ``tokens`` maps indices to target ids (j + d2t[j]), ``full``
    spreads q [..., N] onto the V target ids (zero elsewhere)."""

    def __init__(self, head: Eagle3Head) -> None:
        self.vocab_size = head.config.vocab_size
        self.token_ids = head.token_ids
        self.weight, self.bias = head.lm_head.weight, None
        self.rows = _Rows(head.lm_head)
        self.head = head.lm_head
        self.norm = head.norm

    def __call__(self, hidden):
        """s [..., H] -> draft logits [..., N]."""
        return self.projection(self.norm(hidden))


class _Eagle3Parts:
    """What the EAGLE-3 drafters change in EAGLE's: the target states asked for, the LM head."""

    requires_target_hidden = True
    #: mmspec's layout, or an engine's (vLLM / SGLang / SpecForge: config.json + model.safetensors)
    saved_layouts = ((CONFIG_FILE,), (ENGINE_CONFIG_FILE, ENGINE_WEIGHTS_FILE))
    trained_by = "mmspec train drafter --method eagle3 --target PATH --data DATA"  # (or a vLLM / SGLang EAGLE-3 directory)

    @classmethod
    def holds_saved(cls, directory: Path) -> bool:
        """mmspec's layout, or an engine's whose config.json names an EAGLE-3 architecture (a plain
        causal LM's config.json + model.safetensors is a draft model, not a head). A config.json
        naming one without its weights, or one that is no JSON object beside model.safetensors,
        counts too: :meth:`Eagle3Head.load` then says what is wrong, where "it holds what spd reads"
        would send the user the wrong way."""
        if (directory / CONFIG_FILE).is_file():
            return True
        if not (directory / ENGINE_CONFIG_FILE).is_file():
            return False
        try:
            architectures = json.loads((directory / ENGINE_CONFIG_FILE).read_text()).get("architectures") or []
        except (ValueError, AttributeError):
            return (directory / ENGINE_WEIGHTS_FILE).is_file()
        return bool(set(architectures) & set(ENGINE_ARCHITECTURES.values()))

    @property
    def target_hidden_layer(self) -> tuple[int, ...]:
        """The target's ``hidden_states`` entries the head fuses (its ``aux_layers``)."""
        return tuple(self.head.config.aux_layers)

    def _target_parts(self, target_model: nn.Module, draft_vocabulary):
        """(the target's token embedding, the head's own draft LM head)."""
        return target_model.get_input_embeddings(), Eagle3LMHead(self._eagle3_head)

    def _fusable(self) -> bool:
        """Whether the head runs in one C call a draft (:func:`mmspec.modeling.fused.eagle3_chain`,
        :func:`~mmspec.modeling.fused.eagle3_tree`), checked once a generation: the fused kernels on,
        a plain head (a vision-aware one drafts through the module forward), its fc and LM head
        few-row linears without bias, a plain embedding table in the head's dtype."""
        head, table = self.head, getattr(self.embed, "weight", None)
        dtype = head.midlayer.input_layernorm.weight.dtype
        return (fused_enabled() and type(head) is Eagle3Head and type(self.embed) is nn.Embedding and table.dtype == dtype and table.is_contiguous()
                and head.fc.bias is None and linear_operand(head.fc, dtype) is not None
                and linear_operand(self.lm_head.projection, dtype) is not None)

    def _chain_plans(self):
        """The head layer's plan as a one-plan stack (:func:`layer_plan` with the mid layer's
        parts: its q / k / v read 2 D inputs), else None."""
        layer = self.head.midlayer
        dtype = layer.input_layernorm.weight.dtype
        plan = layer_plan(layer, midlayer_parts)
        if plan is None or plan.dtype != dtype or type(self.cache.layers[0]) is not PreallocatedLayer:
            return None
        plans = PlanStack([plan])
        self.chain_int8 = (int8_head(plans, layer, self.head.fc, self.lm_head.projection, parts_of=midlayer_parts)
                           if self.int8 else None)
        return plans

    def _rotary_rows(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, hd] of head positions start ... (:meth:`Eagle3Head.rotary`)."""
        return self.head.rotary(torch.arange(start, start + count), self.head.midlayer.input_layernorm.weight.dtype)

    def _head_operands(self) -> tuple:
        """The head's arguments of the C calls after the plan and its cache layer: Nh's weight,
        where Nh comes before the residual, the final norm's weight and eps, fc, the draft LM head."""
        head = self.head
        return (head.midlayer.hidden_norm.weight, head.config.norm_before_residual, head.norm.weight, head.norm.eps, head.fc,
                self.lm_head.projection)

    @classmethod
    def _load(cls, target, arg: str | None, spec: str) -> Eagle3Head:
        """The head in :meth:`head_path`."""
        return Eagle3Head.load(cls.head_path(target, arg, spec), target.model)

    @classmethod
    def head_path(cls, target, arg: str | None, spec: str = "eagle3"):
        """``arg`` (a head directory), or without one the head shipped for an embedded model
        (``models/smolcap-eagle3`` for the embedded captioner)."""
        return arg or shipped_drafter_dir(target.model, "eagle3", CONFIG_FILE, spec, train=cls.trained_by)


@register_drafter("eagle3")
class Eagle3Drafter(_Eagle3Parts, EagleDrafter):
    """EAGLE-3 chains: K tokens a step, greedy or sampled (q: the head's, over target ids).

    Args:
        target_model: the transformers target (its input embeddings are used).
        head: an :class:`Eagle3Head` for it.
        num_draft_tokens: K.
        stop_below, sampled_stop_below, greedy_draft_tokens, int8_head: as :class:`EagleDrafter`'s
            (the fused chain reads the head's int8 copy where ``int8_head``; default off).
    """

    #: the chain's default length: six tokens gave tau 4.44 against five's 3.87 on 22 test images of
    #: eleven groups at the same or better speed (1.54x / 1.53x greedy, 1.12x / 1.06x per token at
    #: temperature 1; one core of a Zen 4, docs/drafters.md); EAGLE's head stays at five
    default_length = 6

    def __init__(self, target_model: nn.Module, head: Eagle3Head, num_draft_tokens: int = default_length,
                 stop_below: float = 0.0, sampled_stop_below: float = 0.0, greedy_draft_tokens: int | None = None,
                 int8_head: bool | None = None) -> None:
        self._eagle3_head = head
        super().__init__(target_model, head, num_draft_tokens, int8_head=int8_head, captured_head=False, stop_below=stop_below,
                         sampled_stop_below=sampled_stop_below, greedy_draft_tokens=greedy_draft_tokens)

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "Eagle3Drafter":
        path = cls.head_path(target, arg)
        settings = cls.saved_settings(path, target, num_draft_tokens)
        return cls(target.model, Eagle3Head.load(path, target.model), settings.pop("num_draft_tokens", cls.default_length),
                   **settings)

    # ------------------------------------------------------------------ the fused chain (CPU)
    def _chain_call(self, plans, codes: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: int,
                    temperature: float, uniforms: torch.Tensor | None, probs: torch.Tensor | None) -> torch.Tensor:
        """The chain's C call (:func:`~mmspec.modeling.fused.eagle3_chain`: the pending pairs' target
        states fused by fc, then per token the final norm, the draft LM head, the pick and the next
        step over [N1(e); Nh(s)])."""
        return eagle3_chain(plans[0], self.cache.layers[0], *self._head_operands(), codes, features, self.embed.weight,
                            self.lm_head.token_ids, cos, sin, k, temperature, uniforms, probs, stop_below=self._chain_stop(),
                            int8=self.chain_int8)


@register_drafter("eagle3-tree")
class Eagle3TreeDrafter(_Eagle3Parts, Eagle2Drafter):
    """EAGLE-3 with EAGLE-2's dynamic trees (arguments as :class:`Eagle2Drafter`'s, less the
    draft vocabulary, which is the head's; ``int8_head`` defaults to off: on the embedded
    captioner's own families on an AMX core the int8 head's trees gave 3.27x (tau 5.60) against
    the bf16 head's 3.25x (5.70), docs/drafters.md)."""

    chain_class = Eagle3Drafter

    @staticmethod
    def int8_default() -> bool:
        """``int8_head=None``: off (measured no faster, above)."""
        return False

    def __init__(self, target_model: nn.Module, head: Eagle3Head, depth: int = 8, top_k: int | None = None,
                 num_nodes: int | str = "auto", max_nodes: int = 64, sampled_children: bool | None = None,
                 budget: str = "auto", int8_head: bool | None = None) -> None:
        self._eagle3_head = head
        super().__init__(target_model, head, depth=depth, top_k=top_k, num_nodes=num_nodes, max_nodes=max_nodes,
                         sampled_children=sampled_children, budget=budget, int8_head=int8_head, captured_head=False)
        # c_layer / C(1): the head's parameters (its own LM head included) over a target forward's
        self.relative_layer_cost = forward_parameters(head) / self._target_parameters(target_model)

    def _tree_call(self, plans, codes: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, depth: int,
                   expand_while) -> GrownTree:
        """The tree's C call (:func:`~mmspec.modeling.fused.eagle3_tree`: the pending pairs' target
        states fused by fc, then every layer's expansion over [N1(e); Nh(s)])."""
        return eagle3_tree(plans[0], self.cache.layers[0], *self._head_operands(), codes, features, self.embed.weight,
                           self.lm_head.token_ids, cos, sin, depth, self.top_k, expand_while=expand_while, int8=self.chain_int8)

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "Eagle3TreeDrafter":
        return cls(target.model, cls._load(target, arg, "eagle3-tree"), depth=num_draft_tokens or 8)
