"""The embedded text-to-image model's frozen text encoder: the first layers of the real
SmolLM2-135M-Instruct (installed offline, see :mod:`mmspec.hub`), as LlamaGen uses a frozen T5.

``encode(captions)`` -> caption features [B, P, 576] for a LlamaGen-style generator with P caption
positions: a caption's token features are right-aligned and the positions before them hold the
generator's null caption (:meth:`LlamaGenModel.null_caption`), so no attention mask is needed and
the unconditional half of classifier-free guidance is the null caption everywhere.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class SmolTextEncoder(nn.Module):
    """Args:
        num_layers: decoder layers of SmolLM2 kept (the final norm is applied after them).
        dtype: weights' dtype ("auto": bf16 where it is fast, else fp32; see :func:`mmspec.hub.resolve_dtype`).
    """

    def __init__(self, num_layers: int = 8, dtype: torch.dtype | str = "auto") -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from ..hub import resolve_dtype, smollm2_checkpoint

        path = smollm2_checkpoint()
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a part of the pipeline's model: no "Loading weights" bar of its own
        try:
            lm = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
        finally:
            if shown:
                hf_logging.enable_progress_bar()
        self.decoder = lm.model
        self.decoder.layers = self.decoder.layers[:num_layers]
        self.decoder.config.num_hidden_layers = num_layers
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.num_layers = num_layers
        self.requires_grad_(False).eval()

    @property
    def feature_dim(self) -> int:
        return self.decoder.config.hidden_size

    @torch.no_grad()
    def encode(self, captions: list[str], null_caption: torch.Tensor, warn_cut: bool = True) -> torch.Tensor:
        """captions (B strings) + null caption [P, C] -> features [B, P, C] (float32).

        Captions longer than P tokens keep their first P tokens, with a UserWarning naming them
        (``warn_cut=False``: without it -- the training recipes, whose scene descriptions run to 92
        tokens, cut them knowingly; a warning per caption there told the user to shorten a prompt
        they never gave)."""
        if any(not isinstance(c, str) or not c.strip() for c in captions):
            raise ValueError("empty prompt: describe the image to generate, e.g. 'a red circle on a white background'")
        positions = null_caption.shape[0]
        ids = [self.tokenizer(c, add_special_tokens=False)["input_ids"] for c in captions]
        for i in ids:
            if warn_cut and len(i) > positions:
                kept = self.tokenizer.decode(i[:positions]).strip()
                tail = kept if len(kept) <= 60 else "..." + kept[-57:]
                warnings.warn(f"the prompt has {len(i)} tokens and the model reads the first {positions} (up to "
                              f"{tail!r}); shorten the prompt", UserWarning, stacklevel=3)  # (past no_grad)
        ids = [i[:positions] for i in ids]
        longest = max(len(i) for i in ids)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (longest - len(i)) + i for i in ids])
        attention = torch.tensor([[0] * (longest - len(i)) + [1] * len(i) for i in ids])
        device = next(self.decoder.parameters()).device
        hidden = self.decoder(input_ids=input_ids.to(device), attention_mask=attention.to(device)).last_hidden_state
        out = null_caption.float().to(device).unsqueeze(0).repeat(len(captions), 1, 1)
        for row, i in enumerate(ids):
            out[row, positions - len(i):] = hidden[row, longest - len(i):].float()
        return out
