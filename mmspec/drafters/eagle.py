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
committed tokens arrive with every verification (``requires_target_hidden``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..adapters.hf import text_decoder
from ..core.cache import SequenceState, crop_cache
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.target import TargetOutput

HEAD_CONFIG = "eagle_config.json"
HEAD_WEIGHTS = "eagle_head.safetensors"


class EagleHead(nn.Module):
    """fc [2H -> H] + one decoder layer of the target's family + final norm.

    Args:
        text_config: the target decoder's config (its family, width, heads, rope); the head uses
            one layer of it and no vocabulary of its own.
    """

    def __init__(self, text_config) -> None:
        super().__init__()
        from transformers import AutoModel

        config = copy.deepcopy(text_config)
        config.num_hidden_layers = 1
        config.vocab_size = 1  # inputs arrive as embeddings; the target's embedding table is shared
        config.pad_token_id = None
        if hasattr(config, "layer_types") and config.layer_types:
            config.layer_types = config.layer_types[:1]
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.decoder = AutoModel.from_config(config)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, cache, position_ids: torch.Tensor) -> torch.Tensor:
        """features, token_embeds: [B, n, H]; position_ids: [B, n] -> predicted next features [B, n, H]."""
        inputs = self.fc(torch.cat([token_embeds, features], dim=-1))
        return self.decoder(inputs_embeds=inputs, past_key_values=cache, position_ids=position_ids, use_cache=cache is not None).last_hidden_state

    def save(self, directory: str | Path, **card) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(directory / HEAD_WEIGHTS))
        (directory / HEAD_CONFIG).write_text(json.dumps({"text_config": self.config.to_dict(), **card}, indent=1))

    @classmethod
    def load(cls, directory: str | Path, target_model: nn.Module) -> "EagleHead":
        """Load a head saved by :meth:`save` for ``target_model`` (checks the widths match)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / HEAD_CONFIG).is_file():
            raise FileNotFoundError(f"no EAGLE head in {directory} ({HEAD_CONFIG} missing); train one with `mmspec train drafter --method eagle`")
        target_config = text_decoder(target_model).config
        saved = json.loads((directory / HEAD_CONFIG).read_text())["text_config"]
        if saved["hidden_size"] != target_config.hidden_size:
            raise ValueError(f"the EAGLE head in {directory} has width {saved['hidden_size']}, the target {target_config.hidden_size}")
        head = cls(target_config)
        head.load_state_dict(load_file(str(directory / HEAD_WEIGHTS)))
        param = next(target_model.parameters())
        return head.to(device=param.device, dtype=param.dtype).eval()


@register_drafter("eagle")
class EagleDrafter(Drafter):
    """Chain drafting with an EAGLE head (K tokens per step).

    Args:
        target_model: the transformers target (its input embeddings and LM head are used).
        head: a trained :class:`EagleHead`.
        num_draft_tokens: K.
    """

    requires_target_hidden = True

    def __init__(self, target_model: nn.Module, head: EagleHead, num_draft_tokens: int = 5) -> None:
        super().__init__(num_draft_tokens)
        self.head = head
        self.embed = target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        self.cache = None
        self.fed = 0  # pairs (f_t, x_{t+1}) for t < fed are in the head's cache
        self.features: torch.Tensor | None = None  # target features of positions fed, fed + 1, ...

    @classmethod
    def from_spec(cls, target, arg: str | None, num_draft_tokens: int | None = None) -> "EagleDrafter":
        if not arg:
            raise ValueError('eagle needs a trained head: drafter="eagle:PATH" (train one with `mmspec train drafter --method eagle`)')
        return cls(target.model, EagleHead.load(arg, target.model), num_draft_tokens or 5)

    def start(self, context, state: SequenceState) -> None:
        from transformers import DynamicCache

        super().start(context, state)
        self.cache = DynamicCache()
        self.fed = 0
        self.features = None

    def on_verified(self, num_drafted: int, num_accepted: int, target_output: TargetOutput) -> None:
        """Keep the target features of the committed inputs (the prefill's whole prompt, or the
        pending token + the accepted drafts)."""
        new = target_output.hidden_states[:, : num_accepted + 1] if num_drafted or self.features is not None else target_output.hidden_states
        self.features = new if self.features is None else torch.cat([self.features, new], dim=1)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (features [1, n, H], next tokens [1, n]) at positions start.. -> predicted features [1, n, H]."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        return self.head(features, self.embed(tokens), self.cache, positions)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        length = state.tokens.shape[1]
        # Catch up on the committed pairs: features of positions fed .. length-2, tokens fed+1 .. length-1.
        pending = length - 1 - self.fed
        predicted = self._step(self.features[:, :pending], state.tokens[:, self.fed + 1 :], self.fed)[:, -1:]
        self.features = self.features[:, pending:]
        self.fed = length - 1
        self.forwards += 1
        tokens, probs = [], []
        for i in range(k):
            choice, q = self._pick(self.lm_head(predicted[:, -1]))
            tokens.append(choice.view(1, 1))
            probs.append(q)
            if i + 1 < k:
                predicted = self._step(predicted, tokens[-1], self.fed + 1 + i)
                self.forwards += 1
        crop_cache(self.cache, self.fed)  # the drafted pairs are not committed
        return Draft(tokens=torch.cat(tokens, dim=1), probs=torch.stack(probs, dim=1) if probs[0] is not None else None)

    def describe(self) -> dict:
        return {**super().describe(), "head_layers": 1}
