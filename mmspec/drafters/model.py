"""An independent draft model (SpS; for a VLM target with a text-only draft, SPD).

The draft keeps its own KV cache. A text-only draft of a VLM target sees the prompt without its
image tokens (SPD, Gagrani et al. 2024); a VLM draft of the same family sees the image too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..adapters.hf import TransformersTarget
from ..core.batch import BatchDrafting, BatchState
from ..core.cache import SequenceState, SlidingLayer, crop_cache
from ..core.drafter import Draft, DraftContext, Drafter, register_drafter
from ..core.target import sees_images


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading positions where 1-D tensors a and b agree."""
    n = min(a.shape[0], b.shape[0])
    mismatch = torch.nonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.numel() else n


def config_vocab_size(directory: str | os.PathLike) -> int | None:
    """The vocabulary size a checkpoint directory's config.json declares (a VLM's ``text_config``'s,
    which sizes its LM head), read without loading anything; None where it does not say."""
    try:
        config = json.loads((Path(directory).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for part in (config.get("text_config"), config):
        size = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def check_draft_vocabulary(draft_vocab_size: int | None, target_vocab_size: int | None) -> None:
    """Refuse (one ValueError line) a draft whose vocabulary is larger than the target's: its
    tokens would not be the target's (a smaller one, the target's tokenizer with added tokens
    missing, is drafted from). Nothing where a size is unknown (None)."""
    if draft_vocab_size is not None and target_vocab_size is not None and draft_vocab_size > target_vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft_vocab_size}) is larger than the target's ({target_vocab_size}); "
                         "the draft must share the target's tokenizer")


@register_drafter("draft-model")
class ModelDrafter(BatchDrafting, Drafter):
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
        check_draft_vocabulary(self.draft.vocab_size, target.vocab_size)  # (a directory's: before it loads, by its config)
        families = [getattr(getattr(getattr(m, "model", None), "config", None), "model_type", None) for m in (target, self.draft)]
        if sees_images(target) and sees_images(self.draft) and families[0] != families[1]:
            raise ValueError(f"a draft model that sees images must be of the target's family ({families[0]}), got "
                             f"{families[1]}; use a text-only draft (SPD) sharing its tokenizer, or a VLM of its family")
        self.num_draft_tokens = self.initial_draft_tokens
        inputs = context.model_inputs
        if sees_images(target) and not sees_images(self.draft):
            ids = target.text_only_ids(inputs["input_ids"])  # SPD: no image tokens,
            inputs = {"input_ids": ids[:, ids[0] < self.draft.vocab_size]}  # nor the VLM's added ones (image framing)
        elif self.draft.vocab_size < target.vocab_size and "input_ids" in inputs:
            inputs = {**inputs, "input_ids": self._in_vocabulary(inputs["input_ids"])}
        self.state, _ = self.draft.prefill(inputs)  # the cache holds the whole draft prompt
        self.forwards = 1
        self.prompt = self.state.tokens
        self._vocab_pad = target.vocab_size - self.draft.vocab_size

    def _in_vocabulary(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with those the draft has no embedding for (ones the target's tokenizer added) read
        as token 0: the draft only proposes, so this changes its guesses, never the output."""
        return ids.masked_fill(ids >= self.draft.vocab_size, 0)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        return self.continue_after(state.new_tokens, min(self.num_draft_tokens, max_tokens))

    def _catch_up(self, generated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the draft's cache up to its prompt + the target's generated tokens [1, n]: keep the
        cached prefix that still agrees (rejected drafts fall away), feed the rest. -> (that
        sequence [1, L], the draft's logits after it [1, V])."""
        sequence = torch.cat([self.prompt, self._in_vocabulary(generated.to(self.prompt.device))], dim=1)
        keep = min(common_prefix_length(self.state.tokens[0], sequence[0]), sequence.shape[1] - 1)
        crop_cache(self.state.cache, keep)
        logits = self.draft.forward(self.state, sequence[:, keep:]).logits[:, -1]
        self.forwards += 1
        return sequence, logits

    def _draft(self, picked: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Draft:
        """The draft of the chosen tokens ([1] each) and their draft distributions (padded to the
        target's vocabulary)."""
        draft = Draft.chain([choice.view(1, 1) for choice, _ in picked], [q for _, q in picked])
        if draft.probs is not None and self._vocab_pad:
            draft.probs = torch.nn.functional.pad(draft.probs, (0, self._vocab_pad))
        return draft

    def continue_after(self, generated: torch.Tensor, k: int) -> Draft:
        """Draft ``k`` tokens after the target's generated tokens ``generated`` [1, n]."""
        sequence, logits = self._catch_up(generated)
        picked = []
        for i in range(k):
            picked.append(self._pick(logits))
            if i + 1 < k:
                logits = self.draft.forward(self.state, picked[-1][0].view(1, 1)).logits[:, -1]
                self.forwards += 1
        draft = self._draft(picked)
        self.state.tokens = torch.cat([sequence, draft.tokens[:, :-1]], dim=1)  # what the cache now holds
        return draft

    @classmethod
    def propose_rows(cls, drafters: list["ModelDrafter"], state, positions: list[int], budgets: list[int]) -> list[Draft]:
        """The rows of a batch draft together: each row catches its own draft cache up (ragged: one
        forward per row), then every further draft token is one forward of the draft model over all
        drafting rows, on a stacked copy of their caches (:class:`~mmspec.core.batch.BatchState`:
        a 2-D mask, each row at its own positions); each row picks with its own generator, as
        :meth:`propose` does, and its own cache keeps only the caught-up sequence (the next call
        feeds whatever of the draft was accepted). Drafts of other targets (a codec LM, an image
        generator) and drafts with sliding-window layers (their windowed caches do not stack) go
        row by row."""
        if type(drafters[0]).propose is not ModelDrafter.propose or not all(
                type(d.draft) is TransformersTarget for d in drafters) or any(
                isinstance(layer, SlidingLayer) for layer in drafters[0].state.cache.layers):
            return super().propose_rows(drafters, state, positions, budgets)
        lengths = [min(d.num_draft_tokens, budget) for d, budget in zip(drafters, budgets)]
        caught = [d._catch_up(state.rows[p].new_tokens) for d, p in zip(drafters, positions)]
        for d, (sequence, _) in zip(drafters, caught):
            d.state.tokens = sequence
        logits = torch.cat([row_logits for _, row_logits in caught])  # [rows, V]
        batch = BatchState.stack([d.state for d in drafters], drafters[0].draft.device)
        picked: list[list] = [[] for _ in drafters]
        for i in range(max(lengths)):
            for j, d in enumerate(drafters):
                if i < lengths[j]:
                    picked[j].append(d._pick(logits[j : j + 1]))
            if not any(i + 1 < k for k in lengths):
                break
            chosen = torch.stack([rows[min(i, len(rows) - 1)][0].view(1) for rows in picked])  # [rows, 1]
            logits = drafters[0].draft.forward_rows(batch, chosen).logits[:, -1]
            batch.commit([c.view(1, 1) for c in chosen])
            for j, d in enumerate(drafters):
                d.forwards += i + 1 < lengths[j]
        return [d._draft(rows) for d, rows in zip(drafters, picked)]

    def on_verified(self, num_drafted: int, num_accepted: int, target_output) -> None:
        if self.schedule == "heuristic" and num_drafted:
            self.num_draft_tokens = self.num_draft_tokens + 2 if num_accepted == num_drafted else max(1, self.num_draft_tokens - 1)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "draft_model": type(self.draft.model).__name__,
            "schedule": self.schedule,
            "sees_image": sees_images(self.draft),
        }


@register_drafter("spd")
class SpdDrafter(ModelDrafter):
    """SPD by name: ``"spd:PATH"`` loads the text-only draft model in PATH (a transformers causal
    LM with the target's tokenizer); ``"spd"`` loads the one shipped for mmspec's embedded
    captioner (``models/smolcap-draft``, trained by ``mmspec train caption-draft``)."""

    spec_argument = "path"
    needs_transformers_target = True
    saved_layouts = (("config.json",),)  # a transformers causal LM
    trained_by = "mmspec train caption-draft"

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "SpdDrafter":
        from pathlib import Path

        from transformers import AutoModelForCausalLM

        from .shipped import check_drafter_dir, shipped_drafter_dir

        if arg:
            check_drafter_dir(cls.name, arg)
            path = Path(arg).expanduser()
        else:
            path = shipped_drafter_dir(target.model, "draft", "config.json", spec="spd", train=cls.trained_by,
                                       instead="a small transformers causal LM sharing the target's tokenizer "
                                               "(a text-only draft; its directory alone as the drafter works too)")
        from ..hub import damaged_weights, is_remote_code_refusal, remote_code_refused, weights_unreadable

        param = next(target.model.parameters())
        try:  # (False, not None: transformers would ask [y/N] on the terminal about a draft of its own code)
            draft = AutoModelForCausalLM.from_pretrained(path, dtype=param.dtype, trust_remote_code=False)
            draft = draft.to(param.device).eval()
        except weights_unreadable() as error:
            raise damaged_weights(path, error) from None
        except ValueError as error:
            if is_remote_code_refusal(error):
                raise remote_code_refused(arg, "give the directory alone as the drafter, not spd:PATH, with "
                                               "--trust-remote-code (in Python: load the model with trust_remote_code=True "
                                               "and pass it as the drafter)") from None
            raise
        return cls(draft, num_draft_tokens or 4)
