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

``ImageEagleDrafter`` drafts a chain of K codes (for a captured target, :mod:`mmspec.core.captured`,
through captured head forwards too: :class:`CapturedHeadChain`); ``ImageEagle2Drafter`` grows EAGLE-2's dynamic
tree (q = 1 per node), verified exactly or with LANTERN on trees
(:func:`mmspec.core.relaxed.tree_lantern_verify`). The head is
:class:`mmspec.modeling.heads.ImageEagleHead`.
"""

from __future__ import annotations

import torch

from ..core.cache import SequenceState, StaticKVCache
from ..core.captured import StaticForward
from ..core.drafter import register_drafter
from ..core.sampling import cfg_combine
from ..modeling.heads import ImageEagleHead, target_width
from .eagle import Eagle2Drafter, EagleDrafter
from .tree_budget import forward_parameters
from .vocab import DraftLMHead


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
    #: drafts only a text-to-image model's image tokens (not named for a text LM or a VLM)
    image_tokens_only = True
    saved_layouts = ((ImageEagleHead.config_file,),)
    needs_transformers_target = False

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

    @staticmethod
    def _target_parameters(target) -> int:
        """Parameters one guided target forward reads per token and row: its decoder stack (the
        whole generator where it names none) and its codebook head."""
        stack = getattr(target, "backbone", None)
        if stack is None:
            return forward_parameters(target.model)
        return forward_parameters(stack) + target.vocab_size * target_width(target)

    @classmethod
    def _load_head(cls, target, arg: str | None) -> ImageEagleHead:
        if not arg:
            raise ValueError(f"no image EAGLE head for {type(target).__name__}; pass '{cls.name}:PATH' with one "
                             "trained by `mmspec train image-drafter`")
        return ImageEagleHead.load(arg, target)

    def describe(self) -> dict:
        return {**super().describe(), "guided_drafts": self.guidance_scale is not None}


class CapturedHeadChain:
    """The image EAGLE head's chain forwards over static buffers: one CUDA graph per padded input
    size on a GPU (:class:`~mmspec.core.captured.StaticForward`; eager on a CPU, so the path is
    testable anywhere), as a captured target verifies. Its :class:`~mmspec.core.cache.StaticKVCache`
    is the drafter's head cache (``crop`` moves a length).

    Args:
        head: the :class:`ImageEagleHead`; embed: the target's code embedding.
        rows: the feature rows (2 under classifier-free guidance).
        buckets: the padded forward sizes (the target's).
    """

    def __init__(self, head: ImageEagleHead, embed, rows: int, buckets: tuple[int, ...], device: torch.device,
                 dtype: torch.dtype) -> None:
        block = head.config.block_config()
        capacity = head.config.grid[0] * head.config.grid[1] + buckets[-1]
        self.cache = StaticKVCache(1, (rows, block.kv_heads, capacity, block.head_dim), dtype, device)

        def inputs(b: int) -> dict[str, torch.Tensor]:
            return {"features": torch.zeros(rows, b, head.config.dim, dtype=dtype, device=device),
                    "codes": torch.zeros(1, b, dtype=torch.long, device=device),
                    "positions": torch.zeros(b, dtype=torch.long, device=device)}  # padded inputs at cell 0

        def forward(features, codes, positions, mask):
            return (head(features, embed(codes), self.cache, positions, mask),)

        self.forward = StaticForward(forward, inputs, self.cache, buckets, device)

    def __call__(self, features: torch.Tensor, codes: torch.Tensor, start: int) -> torch.Tensor:
        """Pairs (features [R, n, D], codes [1, n]) at head positions start .. start + n - 1,
        appended to the cache -> predicted features [R, n, D]."""
        n = codes.shape[1]
        positions = torch.arange(start, start + n, device=codes.device)
        return self.forward(n, features=features, codes=codes, positions=positions)[0]


@register_drafter("image-eagle")
class ImageEagleDrafter(_GuidedDrafting, EagleDrafter):
    """EAGLE chain drafts (K codes) for a :class:`~mmspec.adapters.image_gen.GuidedImageTarget`:
    ``ImageEagleDrafter(target, head, num_draft_tokens=4)``. For a captured target (``captured``:
    CUDA graphs) the head's forwards are captured too (:class:`CapturedHeadChain`, one per row
    count, built at first use)."""

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "ImageEagleDrafter":
        return cls(target, cls._load_head(target, arg), num_draft_tokens or 4)

    def _setup(self, *args) -> None:
        super()._setup(*args)
        self.chain: CapturedHeadChain | None = None  # the captured forwards in use (a captured target)
        self._chains: dict[int, CapturedHeadChain] = {}  # per feature rows

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.chain = None
        target = context.target
        if getattr(target, "captured", False):
            rows = state.cache.keys[0].shape[0]
            if rows not in self._chains:
                self._chains[rows] = CapturedHeadChain(self.head, self.embed, rows, target.buckets, target.device, target.dtype)
            self.chain = self._chains[rows]
            self.cache = self.chain.cache
            self.cache.length = 0

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        if self.chain is None:
            return super()._step(features, tokens, start)
        return self.chain(features, tokens, start - self.position_base)

    def describe(self) -> dict:
        return {**super().describe(), "captured_head": self.chain is not None}


@register_drafter("image-eagle2")
class ImageEagle2Drafter(_GuidedDrafting, Eagle2Drafter):
    """EAGLE-2 dynamic trees for a guided image target (see
    :class:`~mmspec.drafters.eagle.Eagle2Drafter`; ``num_nodes="auto"`` sizes them by a
    :class:`~mmspec.drafters.tree_budget.TreeBudgetPolicy`, deterministically when sampling): ``ImageEagle2Drafter(target, head, depth=6, top_k=8)``."""

    chain_class = ImageEagleDrafter
    cpu_top_k = 8  # (the image heads' settings were measured at 8 on CPUs)

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "ImageEagle2Drafter":
        return cls(target, cls._load_head(target, arg), depth=num_draft_tokens or 6, max_nodes=48)
