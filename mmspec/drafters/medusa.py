"""Medusa (Cai et al., 2024) and Hydra (Ankner et al., 2024): extra decoding heads on the target's
last hidden state, drafting a static token tree verified in one target forward.

With f_t the target's last hidden state at the last verified position t (whose logits gave the
pending token x_{t+1}), head i = 1..M predicts x_{t+1+i}:

    Medusa:  h_i = f_t + SiLU(W_i f_t + b_i)                          p_i = softmax(LMHead(h_i))
    Hydra:   g_i = U_i [f_t; e(x_{t+1}); ...; e(x_{t+i})],  h_i = g_i + SiLU(W_i g_i + b_i)

Medusa heads see only f_t; Hydra heads also see the tokens drafted before them (their path in the
tree), which is what makes them sequentially dependent and more accurate. LMHead and e(.) are the
target's (shared). Trained on the target's own outputs: ``mmspec train drafter --method medusa|hydra``.
Drafts are deterministic top-k picks (q = 1 per node), so sampling stays exact. The heads are
:class:`mmspec.modeling.heads.DraftHeads`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..core.batch import BatchDrafting
from ..core.cache import SequenceState
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.target import TargetOutput
from ..core.tree import TokenTree
from ..modeling.heads import DraftHeads
from .shipped import shipped_drafter_dir
from .vocab import DraftLMHead, load_draft_vocabulary

#: a sparse static tree for 4 heads (Medusa-style: more children where the heads are confident):
#: path (a, b, ...) = a-th choice of head 1, then b-th choice of head 2, ...
DEFAULT_TREE = [
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0),
]


class _HeadsDrafter(BatchDrafting, Drafter):
    """Shared by Medusa and Hydra: a static tree of top-k head choices after the pending token."""

    spec_argument = "path"
    needs_transformers_target = True
    saved_layouts = ((DraftHeads.config_file,),)
    requires_target_hidden = True
    drafts_trees = True
    kind = "medusa"

    def __init__(self, target_model: nn.Module, heads: DraftHeads, tree_paths=None, draft_vocabulary: torch.Tensor | None = None) -> None:
        # the default tree is cut to the heads there are (heads trained with --num-heads < 4); a
        # given tree deeper than the heads is an error
        paths = [tuple(p) for p in tree_paths] if tree_paths else [tuple(p) for p in DEFAULT_TREE if len(p) <= heads.num_heads]
        depth = max(len(p) for p in paths)
        if depth > heads.num_heads:
            raise ValueError(f"the tree is {depth} deep but there are only {heads.num_heads} heads")
        super().__init__(depth)
        self.heads = heads
        self.embed = target_model.get_input_embeddings()
        self.lm_head = DraftLMHead(target_model.get_output_embeddings(), draft_vocabulary)
        # a draft vocabulary of fewer tokens than the tree's top-k (a head trained on a few short
        # answers) keeps the branches it can fill: a child index k needs k + 1 tokens to choose from
        # (the paths stay prefix-closed: a kept path's prefixes have no larger index)
        self.paths = [p for p in paths if max(p) < self.lm_head.weight.shape[0]]
        self.top_k = 1 + max(p[-1] for p in self.paths)
        self.feature: torch.Tensor | None = None

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None):
        path = arg or shipped_drafter_dir(target.model, cls.kind, DraftHeads.config_file)
        drafter = cls(target.model, DraftHeads.load(path, target.model, cls.kind), draft_vocabulary=load_draft_vocabulary(path))
        if num_draft_tokens:
            drafter.paths = [p for p in drafter.paths if len(p) <= num_draft_tokens]
        return drafter

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.feature = None

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Keep f at the last verified position: its logits gave the pending token."""
        self.feature = target_output.hidden_states[0, -1 if self.feature is None and not num_drafted else num_accepted]

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        paths = [p for p in self.paths if len(p) <= max_tokens]
        pending = state.tokens[0, -1]
        token_of: dict[tuple, torch.Tensor] = {}
        for depth in range(1, max(len(p) for p in paths) + 1):
            parents = sorted({p[:-1] for p in paths if len(p) == depth})
            if self.heads.kind == "hydra":
                prefixes = torch.stack([torch.stack([pending] + [token_of[q[:j]] for j in range(1, len(q) + 1)]) for q in parents])
                states = self.heads.head_state(depth - 1, self.feature.expand(len(parents), -1), self.embed(prefixes))
            else:
                states = self.heads.head_state(depth - 1, self.feature[None]).expand(len(parents), -1)
            self.forwards += 1
            choices = self.lm_head.tokens(torch.topk(self.lm_head(states), self.top_k, dim=-1).indices)  # [parents, k]
            for row, parent in enumerate(parents):
                for p in paths:
                    if len(p) == depth and p[:-1] == parent:
                        token_of[p] = choices[row, p[-1]]
        return Draft.from_tree(TokenTree.from_paths(paths, torch.stack([token_of[p] for p in paths])))

    def for_batch(self) -> "_HeadsDrafter":
        """The heads without a tree: the top-1 chain, one token per head (what batched rows verify)."""
        chain = copy.copy(self)
        chain.paths = [(0,) * depth for depth in range(1, max(len(p) for p in self.paths) + 1)]
        chain.top_k = 1
        return chain

    def describe(self) -> dict:
        return {**super().describe(), "tree": "static", "tree_nodes": len(self.paths), "heads": self.heads.num_heads,
                "draft_vocabulary": self.lm_head.size}


@register_drafter("medusa")
class MedusaDrafter(_HeadsDrafter):
    kind = "medusa"


@register_drafter("hydra")
class HydraDrafter(_HeadsDrafter):
    kind = "hydra"
