"""EAGLE / EAGLE-2 for image-token generators with classifier-free guidance.

The head is EAGLE's (:mod:`mmspec.drafters.eagle`): at image position i it reads the target's last
hidden state f_{i-1} (the codebook head's input; f_{-1} is the prompt's last position) and the
embedding of code x_i, and predicts f_i:

    f^_i = Norm(Block(W_fc [e(x_i); f_{i-1}]))        draft logits for x_{i+1} = Head_target(f^_i)

with one transformer block of LlamaGen's layout whose rotary embedding turns with the code's
(row, column) on the grid. e and Head_target are the generator's own (``embed_codes`` and
``code_logits`` of the :class:`~mmspec.adapters.image_gen.GuidedImageTarget`), never copied.

Guidance: the head runs on both rows of the guided target, the conditional features (after the
caption) and the unconditional ones (after the null caption), fed with the same codes, and drafts
from the guided logits u + g (c - u), the distribution the target verifies. Training
(``mmspec train image-drafter``) uses sequences the generator sampled itself with guidance, and
their features on both rows (:mod:`mmspec.train.image_drafter`).

``ImageEagleDrafter`` drafts a chain of K codes; ``ImageEagle2Drafter`` grows EAGLE-2's dynamic
tree (q = 1 per node), verified exactly or with LANTERN on trees
(:func:`mmspec.core.relaxed.tree_lantern_verify`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.cache import SequenceState
from ..core.sampling import cfg_combine
from ..modeling.llamagen import LlamaGenConfig, RMSNorm, TransformerBlock, chain_mask_after_cache, rope_table_2d
from ..core.drafter import register_drafter
from .eagle import Eagle2Drafter, EagleDrafter
from .vocab import DraftLMHead

CONFIG_FILE = "image_eagle_config.json"
WEIGHTS_FILE = "image_eagle_head.safetensors"


@dataclass
class ImageEagleConfig:
    """dim: the target's hidden size; grid: its (rows, columns) of codes."""

    dim: int
    n_head: int
    grid: tuple[int, int]
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def block_config(self) -> LlamaGenConfig:
        side = max(self.grid)
        return LlamaGenConfig(dim=self.dim, n_layer=1, n_head=self.n_head, vocab_size=1, cls_token_num=0, caption_dim=1,
                              block_size=side * side, rope_base=self.rope_base, norm_eps=self.norm_eps, rope_prefix="identity")


class ImageEagleHead(nn.Module):
    """fc [2D -> D] over [code embedding; target feature], one LlamaGen block, a norm."""

    def __init__(self, config: ImageEagleConfig) -> None:
        super().__init__()
        self.config = config
        block_config = config.block_config()
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=True)
        self.block = TransformerBlock(block_config, 0)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        rows, columns = config.grid
        side = max(rows, columns)
        cells = torch.arange(rows * columns)
        self.register_buffer("rope", rope_table_2d(block_config)[(cells // columns) * side + cells % columns], persistent=False)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features: [R, n, D]; token_embeds: [R or 1, n, D]; position_ids: [1, n] or [n] grid
        indices of the codes; attention_mask: None (causal after the cache) or additive
        [1, 1, n, cached + n] -> predicted features [R, n, D]."""
        x = self.fc(torch.cat([token_embeds.expand(features.shape[0], -1, -1), features], dim=-1))
        if attention_mask is None:
            attention_mask = chain_mask_after_cache(x.shape[1], cache.get_seq_length() if cache is not None else 0, x.device)
        return self.norm(self.block(x, self.rope[position_ids.reshape(-1)], cache, attention_mask))

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16, **card) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}, str(directory / WEIGHTS_FILE))
        (directory / WEIGHTS_FILE).chmod(0o644)  # safetensors writes owner-only files
        (directory / CONFIG_FILE).write_text(json.dumps({**asdict(self.config), **card}, indent=1))

    @classmethod
    def load(cls, directory: str | Path, target) -> "ImageEagleHead":
        """Load a head for ``target`` (a GuidedImageTarget); checks width and grid."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"no image EAGLE head in {directory} ({CONFIG_FILE} missing); "
                                    "train one with `mmspec train image-drafter`")
        saved = json.loads((directory / CONFIG_FILE).read_text())
        config = ImageEagleConfig(dim=saved["dim"], n_head=saved["n_head"], grid=tuple(saved["grid"]),
                                  rope_base=saved.get("rope_base", 10000.0), norm_eps=saved.get("norm_eps", 1e-5))
        width = target_width(target)
        if config.dim != width or config.grid != tuple(target.grid):
            raise ValueError(f"the image EAGLE head in {directory} is for width {config.dim} and grid {config.grid}; "
                             f"the target has width {width} and grid {tuple(target.grid)}")
        head = cls(config)
        head.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
        return head.to(device=target.device, dtype=target.dtype).eval()


def target_width(target) -> int:
    """The hidden size of a guided image target (the width of its code embeddings)."""
    probe = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    return int(target.embed_codes(probe).shape[-1])


class _CodeHead(DraftLMHead):
    """The target's codebook head as the drafters' LM head (the whole codebook; any module)."""

    def __init__(self, target) -> None:
        self.code_logits = target.code_logits
        self.vocab_size = target.vocab_size
        self.token_ids = None

    @property
    def size(self) -> int:
        return self.vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.code_logits(hidden)


class _GuidedDrafting:
    """What the image drafters change in EAGLE: the target's code embedding and codebook head, the
    head's cache starting at the first image position, drafting from the guided logits."""

    guidance_scale: float | None = None  # the generation's, set in start()

    @staticmethod
    def _target_parts(target, draft_vocabulary):
        if draft_vocabulary is not None:
            raise ValueError("image drafters draft over the whole codebook (no draft vocabulary)")
        return target.embed_codes, _CodeHead(target)

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.guidance_scale = getattr(state, "guidance_scale", None)
        self.fed = self.position_base = state.prompt_length - 1  # pair (f_prompt, x_0) is the head's position 0

    def _draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(predicted).float()  # [R, n, V]
        if self.guidance_scale is None or logits.shape[0] == 1:
            return logits[0]
        return cfg_combine(logits[0], logits[1], self.guidance_scale)

    @classmethod
    def _head(cls, target, arg: str | None) -> ImageEagleHead:
        if not arg:
            raise ValueError(f"no image EAGLE head for {type(target).__name__}; pass '{cls.name}:PATH' with one "
                             "trained by `mmspec train image-drafter`")
        return ImageEagleHead.load(arg, target)

    def describe(self) -> dict:
        return {**super().describe(), "guided_drafts": self.guidance_scale is not None}


@register_drafter("image-eagle")
class ImageEagleDrafter(_GuidedDrafting, EagleDrafter):
    """EAGLE chain drafts (K codes) for a :class:`~mmspec.adapters.image_gen.GuidedImageTarget`:
    ``ImageEagleDrafter(target, head, num_draft_tokens=4)``."""

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "ImageEagleDrafter":
        return cls(target, cls._head(target, arg), num_draft_tokens or 4)


@register_drafter("image-eagle2")
class ImageEagle2Drafter(_GuidedDrafting, Eagle2Drafter):
    """EAGLE-2 dynamic trees for a guided image target (see
    :class:`~mmspec.drafters.eagle.Eagle2Drafter`; ``num_nodes="auto"`` sizes them from the target's
    measured verification cost): ``ImageEagle2Drafter(target, head, depth=6, top_k=8)``."""

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "ImageEagle2Drafter":
        return cls(target, cls._head(target, arg), depth=num_draft_tokens or 6, max_nodes=48)
