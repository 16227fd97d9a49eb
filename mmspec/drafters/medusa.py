"""Medusa (Cai et al., 2024) and Hydra (Ankner et al., 2024): extra decoding heads on the target's
last hidden state, drafting a static token tree verified in one target forward.

With f_t the target's last hidden state at the last verified position t (whose logits gave the
pending token x_{t+1}), head i = 1..M predicts x_{t+1+i}:

    Medusa:  h_i = f_t + SiLU(W_i f_t + b_i)                          p_i = softmax(LMHead(h_i))
    Hydra:   g_i = U_i [f_t; e(x_{t+1}); ...; e(x_{t+i})],  h_i = g_i + SiLU(W_i g_i + b_i)

Medusa heads see only f_t; Hydra heads also see the tokens drafted before them (their path in the
tree), which is what makes them sequentially dependent and more accurate. LMHead and e(.) are the
target's (shared). Trained on the target's own outputs: ``mmspec train drafter --method medusa|hydra``.
Drafts are deterministic top-k picks (q = 1 per node), so sampling stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..core.cache import SequenceState
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.target import TargetOutput
from ..core.tree import TokenTree
from .shipped import shipped_drafter_dir
from .vocab import DraftLMHead, load_draft_vocabulary

HEADS_CONFIG = "heads_config.json"
HEADS_WEIGHTS = "heads.safetensors"

#: a sparse static tree for 4 heads (Medusa-style: more children where the heads are confident):
#: path (a, b, ...) = a-th choice of head 1, then b-th choice of head 2, ...
DEFAULT_TREE = [
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0),
]


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # a head starts as the identity: LMHead(f) = the target's next token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class DraftHeads(nn.Module):
    """M Medusa (``kind="medusa"``) or Hydra (``kind="hydra"``) heads of width H."""

    def __init__(self, hidden_size: int, num_heads: int = 4, kind: str = "medusa") -> None:
        super().__init__()
        if kind not in ("medusa", "hydra"):
            raise ValueError(f"kind must be 'medusa' or 'hydra', got {kind!r}")
        self.hidden_size, self.num_heads, self.kind = hidden_size, num_heads, kind
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        if kind == "hydra":
            # input: [f; e(x_{t+1}); ...; e(x_{t+i})]; starts as "look at f only"
            self.inputs = nn.ModuleList(nn.Linear((i + 2) * hidden_size, hidden_size, bias=False) for i in range(num_heads))
            for projection in self.inputs:
                with torch.no_grad():
                    projection.weight.zero_()
                    projection.weight[:, :hidden_size] = torch.eye(hidden_size)

    def head_state(self, i: int, features: torch.Tensor, prefix_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Head i (0-based, predicts x_{t+2+i}) on features [..., H] and, for Hydra, the embeddings of
        x_{t+1} .. x_{t+1+i} as prefix_embeds [..., i+1, H] -> [..., H] (apply the LM head next)."""
        if self.kind == "hydra":
            features = self.inputs[i](torch.cat([features, prefix_embeds.flatten(-2)], dim=-1))
        return self.blocks[i](features)

    def save(self, directory: str | Path, **card) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(directory / HEADS_WEIGHTS))
        config = {"kind": self.kind, "hidden_size": self.hidden_size, "num_heads": self.num_heads}
        (directory / HEADS_CONFIG).write_text(json.dumps({**config, **card}, indent=1))

    @classmethod
    def load(cls, directory: str | Path, target_model: nn.Module, kind: str) -> "DraftHeads":
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / HEADS_CONFIG).is_file():
            raise FileNotFoundError(f"no {kind} heads in {directory} ({HEADS_CONFIG} missing); train them with `mmspec train drafter --method {kind}`")
        config = json.loads((directory / HEADS_CONFIG).read_text())
        if config["kind"] != kind:
            raise ValueError(f"{directory} holds {config['kind']} heads, not {kind}")
        width = target_model.get_output_embeddings().weight.shape[1]
        if config["hidden_size"] != width:
            raise ValueError(f"the heads in {directory} have width {config['hidden_size']}, the target {width}")
        heads = cls(config["hidden_size"], config["num_heads"], kind)
        heads.load_state_dict(load_file(str(directory / HEADS_WEIGHTS)))
        param = next(target_model.parameters())
        return heads.to(device=param.device, dtype=param.dtype).eval()


class _HeadsDrafter(Drafter):
    """Shared by Medusa and Hydra: a static tree of top-k head choices after the pending token."""

    requires_target_hidden = True
    kind = "medusa"

    def __init__(self, target_model: nn.Module, heads: DraftHeads, tree_paths=None, draft_vocabulary: torch.Tensor | None = None) -> None:
        paths = [tuple(p) for p in (tree_paths or DEFAULT_TREE)]
        depth = max(len(p) for p in paths)
        if depth > heads.num_heads:
            raise ValueError(f"the tree is {depth} deep but there are only {heads.num_heads} heads")
        super().__init__(depth)
        self.heads = heads
        self.paths = paths
        self.embed = target_model.get_input_embeddings()
        self.lm_head = DraftLMHead(target_model.get_output_embeddings(), draft_vocabulary)
        self.top_k = 1 + max(p[-1] for p in paths)
        self.feature: torch.Tensor | None = None

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None):
        path = arg or shipped_drafter_dir(target.model, cls.kind, HEADS_CONFIG)
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

    def describe(self) -> dict:
        return {**super().describe(), "tree": "static", "tree_nodes": len(self.paths), "heads": self.heads.num_heads,
                "draft_vocabulary": self.lm_head.size}


@register_drafter("medusa")
class MedusaDrafter(_HeadsDrafter):
    kind = "medusa"


@register_drafter("hydra")
class HydraDrafter(_HeadsDrafter):
    kind = "hydra"
