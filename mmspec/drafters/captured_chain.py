"""EAGLE's whole drafting step captured: one CUDA graph per padded count of committed pairs.

An EAGLE drafting step (:class:`~mmspec.drafters.eagle.EagleDrafter`) feeds the head the n
committed pairs it has not seen (1 .. K + 1 after a verification), then K times projects the
predicted feature through the draft LM head, picks a token and runs the head once more over it.
Eagerly on a GPU that is K + 1 one-layer forwards of ~30 kernel launches each, plus the picks:
bound by launches and Python, not by arithmetic. Here the step is one graph replay of

    f^ = Head(F, e(X))[n - 1]                       the pairs at head slots s .. s + n - 1
    for i < K:  x_i = pick(LMHead_draft(f^), u_i)    argmax, or inversion of q's CDF at u_i
                f^ = Head(f^, e(x_i))                at slot s + n + i

where every slot, position (the head's positions are its cache slots) and mask (causal over the
slots: slot j is seen by the input at slot p iff j <= p) is derived on the device from (s, n), so
the host copies in only the pairs, (s, n) and the uniforms u [K]. The inputs are padded to a bucket
b >= n; the b - n padded rows write slots s + n .. s + b - 1, which the chain's own writes then
replace before any real input can see them. The head's KV cache is a
:class:`~mmspec.core.cache.StaticKVCache` whose length is the committed pairs: the drafted pairs are
never committed, so nothing is rolled back. On a CPU the same buffers run eagerly
(:class:`~mmspec.core.captured.GraphRunner`), which is how the tests check the path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.cache import StaticKVCache
from ..core.captured import DEFAULT_BUCKETS, GraphRunner
from ..core.sampling import SamplingConfig, logits_to_probs, sample_from_probs
from ..core.verify import exact_argmax
from ..modeling.heads import EagleHead
from .vocab import DraftLMHead


class CapturedEagleChain:
    """EAGLE's drafting step (catch-up + K picks) over static buffers, one graph per bucket.

    Args:
        head: the :class:`EagleHead` (one Llama decoder layer, one feature row).
        embed: the target's token embedding; lm_head: the draft LM head.
        num_draft_tokens: K, drafted by every call.
        sampling: the generation's settings (greedy picks, or ``logits_to_probs`` + a uniform each).
        capacity: head positions a sequence may reach (the committed pairs plus the K drafted).
        buckets: the padded counts of committed pairs; those up to the first >= K + 1 are kept (a
            longer catch-up, the prompt's, runs its leading pairs eagerly first).
    """

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: DraftLMHead, num_draft_tokens: int, sampling: SamplingConfig,
                 capacity: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        k = num_draft_tokens
        limit = next((b for b in buckets if b >= k + 1), buckets[-1])
        self.buckets = tuple(b for b in buckets if b <= limit)
        self.head, self.embed, self.lm_head, self.k, self.sampling = head, embed, lm_head, k, sampling
        self.capacity = capacity
        config = head.decoder.config
        weight = head.fc.weight
        device, dtype, width = weight.device, weight.dtype, config.hidden_size
        head_dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
        shape = (1, config.num_key_value_heads, capacity + self.buckets[-1] + k, head_dim)
        self.cache = StaticKVCache(1, shape, dtype, device)
        self.slot_ids = torch.arange(self.cache.capacity, device=device)

        def buffers(b: int) -> dict[str, torch.Tensor]:
            return {"features": torch.zeros(1, b, width, dtype=dtype, device=device),
                    "tokens": torch.zeros(1, b, dtype=torch.long, device=device),
                    "where": torch.tensor([0, 1], device=device),  # (s, n)
                    "uniforms": torch.zeros(k, device=device)}

        self.runner = GraphRunner(self._chain, buffers, self.buckets, device)

    def _feed(self, features: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Pairs (features [1, m, H], tokens [1, m]) written at head ``slots`` [m] (their positions
        too), each attending to every slot up to its own -> predicted features [1, m, H]."""
        self.cache.slots = slots
        mask = (self.slot_ids[None] <= slots[:, None])[None, None]  # [1, 1, m, capacity]
        return self.head(features, self.embed(tokens), self.cache, slots[None], attention_mask=mask)

    def _pick(self, logits: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [1, N] -> (draft index [1], q [1, N] when sampling)."""
        if not self.sampling.do_sample:
            return exact_argmax(logits), None
        probs = logits_to_probs(logits, self.sampling)
        return sample_from_probs(probs, uniform), probs

    def _chain(self, features: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor, uniforms: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
        """The captured step over one bucket's buffers -> (draft indices [K], and q [K, N] when sampling)."""
        start, count = where[0], where[1]
        rows = torch.arange(tokens.shape[1], device=tokens.device)
        predicted = self._feed(features, tokens, start + rows).index_select(1, where[1:] - 1)  # f^ after the last pair
        codes, probs = [], []
        for i in range(self.k):
            code, q = self._pick(self.lm_head(predicted[0]), uniforms[i : i + 1])
            codes.append(code)
            probs.append(q)
            if i + 1 < self.k:
                predicted = self._feed(predicted, self.lm_head.tokens(code)[None], (start + count + i).view(1))
        return (torch.cat(codes),) if probs[0] is None else (torch.cat(codes), torch.cat(probs))

    @torch.no_grad()
    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, start: int, uniforms: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed the pairs (features [1, n, H], next tokens [1, n]) at head slots start .. start + n - 1
        (committed: the cache's length becomes start + n) and draft K tokens after them ->
        (draft indices [K], q [K, N] or None). ``uniforms`` [K]: the picks' numbers when sampling.

        Raises:
            ValueError: a sequence longer than ``capacity``.
        """
        n = tokens.shape[1]
        if start + n + self.k > self.capacity:
            raise ValueError(f"the captured EAGLE chain holds {self.capacity} head positions and this step needs "
                             f"{start + n + self.k}; raise the captured target's max_length")
        largest = self.buckets[-1]
        if n > largest:  # (the prompt's pairs: all but the last bucket's worth eagerly)
            m = n - largest
            self._feed(features[:, :m], tokens[:, :m], torch.arange(start, start + m, device=tokens.device))
            features, tokens, start, n = features[:, m:], tokens[:, m:], start + m, largest
        b = self.runner.bucket(n)
        buffers = self.runner.buffers[b]
        for name, value in (("features", features), ("tokens", tokens)):
            buffers[name].zero_()
            buffers[name][:, :n].copy_(value)
        buffers["where"].copy_(torch.tensor([start, n]))
        if uniforms is not None:
            buffers["uniforms"].copy_(uniforms)
        outputs = self.runner.run(b)
        self.cache.length = start + n
        return outputs[0].clone(), outputs[1].clone() if len(outputs) > 1 else None
