"""EAGLE's drafting step and EAGLE-2's greedy tree captured: one CUDA graph per padded count of
committed pairs.

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

EAGLE-2's greedy tree (:class:`CapturedEagle2Tree`) is the same catch-up followed by all of
``dynamic_tree``'s expansions: each feeds the frontier's top_k nodes at consecutive slots after the
committed ones, under a mask of the committed slots, the node's fed ancestors (an ancestry matrix
grown on the device) and itself.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.cache import StaticKVCache
from ..core.captured import DEFAULT_BUCKETS, GraphRunner
from ..core.sampling import SamplingConfig, logits_to_probs, sample_from_probs
from ..core.tree import top_log
from ..core.verify import exact_argmax
from ..modeling.heads import EagleHead
from .vocab import DraftLMHead


class CapturedHeadStep:
    """What EAGLE's captured chain and EAGLE-2's captured tree share: the head's StaticKVCache
    (its length = the committed pairs), the committed pairs' catch-up padded to a bucket, and one
    graph per bucket (:class:`~mmspec.core.captured.GraphRunner`) over the buffers
    ``features`` [1, b, H], ``tokens`` [1, b] and ``where`` = (s, n), plus a subclass's own
    (:meth:`_buffers`). A subclass defines :meth:`_step` (the captured function) over them.

    Args:
        head: the :class:`EagleHead` (one Llama decoder layer, one feature row).
        embed: the target's token embedding; lm_head: the draft LM head.
        drafted: head slots a step writes after the committed pairs (a chain's K, a tree's fed nodes).
        capacity: head positions a sequence may reach (the committed pairs plus the drafted).
        buckets: the padded counts of committed pairs; those up to the first >= ``most_pending``
            are kept (a longer catch-up, the prompt's, runs its leading pairs eagerly first).
    """

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: DraftLMHead, drafted: int, capacity: int,
                 buckets: tuple[int, ...], most_pending: int) -> None:
        limit = next((b for b in buckets if b >= most_pending), buckets[-1])
        self.buckets = tuple(b for b in buckets if b <= limit)
        self.head, self.embed, self.lm_head, self.drafted, self.capacity = head, embed, lm_head, drafted, capacity
        config = head.decoder.config
        weight = head.fc.weight
        self.device, self.dtype, self.width = weight.device, weight.dtype, config.hidden_size
        head_dim = getattr(config, "head_dim", None) or self.width // config.num_attention_heads
        shape = (1, config.num_key_value_heads, capacity + self.buckets[-1] + drafted, head_dim)
        self.cache = StaticKVCache(1, shape, self.dtype, self.device)
        self.slot_ids = torch.arange(self.cache.capacity, device=self.device)
        self.runner = GraphRunner(self._step, self._buffers, self.buckets, self.device)

    def _buffers(self, b: int) -> dict[str, torch.Tensor]:
        """Bucket b's static inputs: the committed pairs, padded, and (s, n)."""
        return {"features": torch.zeros(1, b, self.width, dtype=self.dtype, device=self.device),
                "tokens": torch.zeros(1, b, dtype=torch.long, device=self.device),
                "where": torch.tensor([0, 1], device=self.device)}

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor, **extra: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _feed(self, features: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Pairs (features [1, m, H], tokens [1, m]) written at head ``slots`` [m] (their positions
        too), each attending to every slot up to its own -> predicted features [1, m, H]."""
        self.cache.slots = slots
        mask = (self.slot_ids[None] <= slots[:, None])[None, None]  # [1, 1, m, capacity]
        return self.head(features, self.embed(tokens), self.cache, slots[None], attention_mask=mask)

    def _catch_up(self, features: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """The bucket's committed pairs fed at slots s .. -> the feature predicted after the last
        real one, f^ [1, 1, H] (the padded rows' writes are overwritten before anything reads them)."""
        rows = torch.arange(tokens.shape[1], device=tokens.device)
        return self._feed(features, tokens, where[0] + rows).index_select(1, where[1:] - 1)

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, start: int, **extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The committed pairs (and ``extra`` buffers' contents) into their bucket's buffers, then
        its replay -> copies of its outputs; the cache's length becomes start + n.

        Raises:
            ValueError: a sequence longer than ``capacity``.
        """
        n = tokens.shape[1]
        if start + n + self.drafted > self.capacity:
            raise ValueError(f"the captured EAGLE step holds {self.capacity} head positions and this step needs "
                             f"{start + n + self.drafted}; raise the captured target's max_length")
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
        for name, value in extra.items():
            buffers[name].copy_(value)
        outputs = self.runner.run(b)
        self.cache.length = start + n
        return tuple(output.clone() for output in outputs)


class CapturedEagleChain(CapturedHeadStep):
    """EAGLE's drafting step (catch-up + K picks) over static buffers, one graph per bucket.

    Args:
        num_draft_tokens: K, drafted by every call.
        sampling: the generation's settings (greedy picks, or ``logits_to_probs`` + a uniform each,
            from the bucket's ``uniforms`` [K] buffer).
        most_pending: committed pairs after a verification, at most (default K + 1).
        the rest: as :class:`CapturedHeadStep`'s.
    """

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: DraftLMHead, num_draft_tokens: int, sampling: SamplingConfig,
                 capacity: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS, most_pending: int | None = None) -> None:
        self.k, self.sampling = num_draft_tokens, sampling
        super().__init__(head, embed, lm_head, num_draft_tokens, capacity, buckets,
                         num_draft_tokens + 1 if most_pending is None else most_pending)

    def _buffers(self, b: int) -> dict[str, torch.Tensor]:
        return {**super()._buffers(b), "uniforms": torch.zeros(self.k, dtype=torch.float32, device=self.device)}

    def _pick(self, logits: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [1, N] -> (draft index [1], q [1, N] when sampling)."""
        if not self.sampling.do_sample:
            return exact_argmax(logits), None
        probs = logits_to_probs(logits, self.sampling)
        return sample_from_probs(probs, uniform), probs

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor, uniforms: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
        """The captured step over one bucket's buffers -> (draft indices [K], and q [K, N] when sampling)."""
        predicted = self._catch_up(features, tokens, where)  # f^ after the last pair
        after = where[0] + where[1]  # the first slot after the committed pairs
        codes, probs = [], []
        for i in range(self.k):
            code, q = self._pick(self.lm_head(predicted[0]), uniforms[i : i + 1])
            codes.append(code)
            probs.append(q)
            if i + 1 < self.k:
                predicted = self._feed(predicted, self.lm_head.tokens(code)[None], (after + i).view(1))
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
        outputs = self._run(features, tokens, start, **({} if uniforms is None else {"uniforms": uniforms}))
        return outputs[0], outputs[1] if len(outputs) > 1 else None


class CapturedEagle2Tree(CapturedHeadStep):
    """EAGLE-2's greedy (top-k) tree grown in one graph replay per step, as
    :func:`~mmspec.core.tree.dynamic_tree` grows it without an early stop: after the catch-up
    (:class:`CapturedHeadStep`'s), the root's top_k tokens are layer 1, and each of the
    ``depth - 1`` expansions feeds the top_k frontier nodes of the last layer to the head (node j
    at slot b + (e - 1) top_k + j, b = s + n, position b + depth - 1, seeing the committed slots,
    its fed ancestors and itself), takes each one's top_k children by log q (a stable sort, as
    ``dynamic_tree``), scores them log V = log V(parent) + log q, and keeps the top_k of those as
    the next frontier (in creation order). The host reads the candidates (tokens [C], parents [C],
    log V [C], C = top_k + (depth - 1) top_k^2) and reranks them.

    Args:
        depth, top_k: the tree's layers and branching (fixed: a graph has static shapes).
        the rest: as :class:`CapturedHeadStep`'s.
    """

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head: DraftLMHead, depth: int, top_k: int, capacity: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.depth, self.top_k = depth, min(top_k, lm_head.size)  # (a draft vocabulary smaller than top_k: all of it)
        fed = (depth - 1) * self.top_k  # nodes fed to the head: they take the slots a chain's drafts would
        super().__init__(head, embed, lm_head, fed, capacity, buckets, most_pending=depth + 1)

    def _top_log(self, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted features [1, m, H] -> the top_k (log q [m, top_k], draft indices [m, top_k])
        of each row, as ``dynamic_tree`` ranks them (:func:`~mmspec.core.tree.top_log`)."""
        return top_log(torch.softmax(self.lm_head(predicted[0]).float(), dim=-1), self.top_k)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The captured growth over one bucket's buffers -> (draft indices [C], parents [C], log V [C])."""
        k, device = self.top_k, tokens.device
        base = where[0] + where[1]  # the first slot after the committed pairs
        root = self._catch_up(features, tokens, where)  # [1, 1, H]
        scores, codes = self._top_log(root)  # layer 1: [1, k] each
        all_codes, all_scores = [codes[0]], [scores[0]]
        all_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        frontier, frontier_scores = torch.arange(k, device=device), scores[0]  # candidate indices, log V
        parent_features = root.expand(1, k, -1)  # each frontier node's parent's predicted feature
        parent_rows = torch.zeros(k, dtype=torch.long, device=device)  # ... and its row of the fed ancestry
        fed = self.slot_ids.new_zeros(k, 0, dtype=torch.bool)  # [k, fed so far]: fed node j is an ancestor
        total = k
        for e in range(1, self.depth):
            slots = base + (e - 1) * k + torch.arange(k, device=device)
            seen = torch.cat([fed.index_select(0, parent_rows), torch.eye(k, dtype=torch.bool, device=device)], dim=1)
            column = self.slot_ids - base  # slot -> its fed node (inside 0 .. e k - 1)
            inside = (column >= 0) & (column < seen.shape[1])
            mask = (self.slot_ids < base) | seen.gather(1, column.clamp(0, seen.shape[1] - 1)[None].expand(k, -1)) & inside
            self.cache.slots = slots
            node_codes = torch.cat(all_codes).index_select(0, frontier)
            predicted = self.head(parent_features, self.embed(self.lm_head.tokens(node_codes))[None], self.cache,
                                  (base + e - 1).view(1, 1).expand(1, k), attention_mask=mask[None, None])
            child_log, child_codes = self._top_log(predicted)  # [k, k]
            child_scores = (frontier_scores[:, None] + child_log).flatten()
            all_codes.append(child_codes.flatten())
            all_parents.append(frontier.repeat_interleave(k))
            all_scores.append(child_scores)
            best = torch.sort(torch.argsort(-child_scores, stable=True)[:k]).values  # the next frontier, in creation order
            frontier, frontier_scores = total + best, child_scores.index_select(0, best)
            parent_features, parent_rows = predicted.index_select(1, best // k), best // k
            fed = seen
            total += k * k
        return torch.cat(all_codes), torch.cat(all_parents), torch.cat(all_scores)

    @torch.no_grad()
    def grow(self, features: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed the committed pairs (as :meth:`CapturedEagleChain.__call__`) and grow the tree ->
        (draft indices [C], parents [C], log V [C])."""
        return self._run(features, tokens, start)
