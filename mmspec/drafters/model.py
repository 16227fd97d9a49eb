"""An independent draft model (SpS; for a VLM target with a text-only draft, SPD).

The draft keeps its own KV cache. A text-only draft of a VLM target sees the prompt without its
image tokens (SPD, Gagrani et al. 2024); a VLM draft of the same family sees the image too.
"""

from __future__ import annotations

import torch

from ..adapters.hf import TransformersTarget
from ..core.cache import SequenceState, crop_cache
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading positions where 1-D tensors a and b agree."""
    n = min(a.shape[0], b.shape[0])
    mismatch = torch.nonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.numel() else n


@register_drafter("draft-model")
class ModelDrafter(Drafter):
    """Draft with a smaller model that shares the target's tokenizer.

    Args:
        model: the draft model (causal LM, or a VLM of a supported family), or a ready
            :class:`~mmspec.core.target.Target` (e.g. a small image-token generator, which is
            prefilled with the target's own model inputs).
        num_draft_tokens: K (initial K for the "heuristic" schedule).
        schedule: "constant", or "heuristic" (K += 2 after a fully accepted draft, K -= 1 otherwise,
            as transformers' assisted generation does).
    """

    def __init__(self, model: torch.nn.Module, num_draft_tokens: int = 4, schedule: str = "constant") -> None:
        super().__init__(num_draft_tokens)
        if schedule not in ("constant", "heuristic"):
            raise ValueError(f"schedule must be 'constant' or 'heuristic', got {schedule!r}")
        self.draft = TransformersTarget(model) if isinstance(model, torch.nn.Module) else model
        self.schedule = schedule
        self.initial_draft_tokens = num_draft_tokens
        self.state: SequenceState | None = None
        self.prompt: torch.Tensor | None = None

    def start(self, context: DraftContext, target_state: SequenceState) -> None:
        super().start(context, target_state)
        target = context.target
        if self.draft.vocab_size > target.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({self.draft.vocab_size}) is larger than the target's "
                f"({target.vocab_size}); the draft must share the target's tokenizer"
            )
        self.num_draft_tokens = self.initial_draft_tokens
        inputs = context.model_inputs
        if getattr(target, "is_vlm", False) and not getattr(self.draft, "is_vlm", False):
            inputs = {"input_ids": target.text_only_ids(inputs["input_ids"])}  # SPD: no image tokens
        self.state, _ = self.draft.prefill(inputs)  # the cache holds the whole draft prompt
        self.forwards = 1
        self.prompt = self.state.tokens
        self._vocab_pad = target.vocab_size - self.draft.vocab_size

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        return self.continue_after(state.new_tokens, min(self.num_draft_tokens, max_tokens))

    def continue_after(self, generated: torch.Tensor, k: int) -> Draft:
        """Draft ``k`` tokens after the target's generated tokens ``generated`` [1, n]."""
        # What the draft must condition on: its own prompt + everything generated so far.
        sequence = torch.cat([self.prompt, generated.to(self.prompt.device)], dim=1)
        # Keep the cached prefix that still agrees (rejected drafts fall away); feed the rest.
        keep = min(common_prefix_length(self.state.tokens[0], sequence[0]), sequence.shape[1] - 1)
        crop_cache(self.state.cache, keep)
        feed = sequence[:, keep:]
        tokens, probs = [], []
        for _ in range(k):
            logits = self.draft.forward(self.state, feed).logits[:, -1]
            self.forwards += 1
            choice, q = self._pick(logits)
            feed = choice.view(1, 1)
            tokens.append(feed)
            probs.append(q)
        drafted = torch.cat(tokens, dim=1)
        self.state.tokens = torch.cat([sequence, drafted[:, :-1]], dim=1)  # what the cache now holds
        if probs[0] is None:
            return Draft(tokens=drafted)
        q = torch.stack(probs, dim=1)
        if self._vocab_pad:
            q = torch.nn.functional.pad(q, (0, self._vocab_pad))
        return Draft(tokens=drafted, probs=q)

    def on_verified(self, num_drafted: int, num_accepted: int, target_output) -> None:
        if self.schedule == "heuristic" and num_drafted:
            self.num_draft_tokens = self.num_draft_tokens + 2 if num_accepted == num_drafted else max(1, self.num_draft_tokens - 1)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "draft_model": type(self.draft.model).__name__,
            "schedule": self.schedule,
            "sees_image": getattr(self.draft, "is_vlm", False),
        }


@register_drafter("spd")
class SpdDrafter(ModelDrafter):
    """SPD by name: ``"spd:PATH"`` loads the text-only draft model in PATH (a transformers causal
    LM with the target's tokenizer); ``"spd"`` loads the one shipped for mmspec's embedded
    captioner (``models/smolcap-draft``, trained by ``mmspec train caption-draft``)."""

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "SpdDrafter":
        from pathlib import Path

        from transformers import AutoModelForCausalLM

        from .shipped import shipped_drafter_dir

        train = "mmspec train caption-draft"
        if arg:
            path = Path(arg).expanduser()
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"SPD draft model not found at {arg}; train it with `{train}` or pass spd:PATH of a causal LM")
        else:
            path = shipped_drafter_dir(target.model, "draft", "config.json", spec="spd", train=train)
        param = next(target.model.parameters())
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=param.dtype).to(param.device).eval()
        return cls(draft, num_draft_tokens or 4)
