"""Drafting from the target's own known distributions, for targets whose steps emit several tokens
from one forward (the delay-pattern codec LMs of :mod:`mmspec.adapters.audio.delay`).

:class:`StepCompletionDrafter` proposes the rest of the current step, drawn from the target's
distributions there (argmax under greedy decoding), which the target already computed: with
q = p every rule accepts them (speculative sampling: min(1, p/q) = 1), so a generation is plain
decoding that runs the model once per step and commits a whole step per loop iteration, instead
of one loop iteration per codebook. It is the ``ar`` method of the text-to-speech pipeline.

:class:`StepAwareDrafter` is a draft model's drafter that does the same first: after a rejection
inside a step, the rest of that step is known to the target (q = p, always accepted), so only the
following steps come from the draft model (which would otherwise guess the known codes and lose
some of them).
"""

from __future__ import annotations

import torch

from ..core.batch import BatchDrafting
from ..core.cache import SequenceState, crop_cache, make_cache
from ..core.drafter import Draft, Drafter, register_drafter
from ..core.sampling import SamplingConfig
from ..core.target import MultiStepTarget
from ..core.tree import TokenTree, expansion_mask
from ..modeling.fused import chain_draws, chain_samples, fused_plans, head_chain, int8_fast, int8_head, linear_operand
from ..modeling.lean import lean_supported, rotary
from .model import ModelDrafter


def _needs_steps(context) -> None:
    if not isinstance(context.target, MultiStepTarget):
        raise ValueError(f"this drafter needs a multi-token-step target (a delay-pattern codec LM), "
                         f"not {type(context.target).__name__}")


@register_drafter("step-completion")
class StepCompletionDrafter(BatchDrafting, Drafter):
    """Needs a target with ``known_distributions(state) -> logits [n, V]``."""

    name = "step-completion"

    def __init__(self) -> None:
        super().__init__(num_draft_tokens=1)

    def start(self, context, state: SequenceState) -> None:
        _needs_steps(context)
        super().start(context, state)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        tokens, probs = self._pick(self.context.target.known_distributions(state)[:max_tokens])
        return Draft(tokens=tokens[None], probs=None if probs is None else probs[None])


@register_drafter("step-aware")
class StepAwareDrafter(ModelDrafter):
    """A draft codec LM's drafter (arguments of :class:`~mmspec.drafters.model.ModelDrafter`):
    the current step's known codes first (q = p), then the draft model's, ``num_draft_tokens`` in all."""

    def start(self, context, state: SequenceState) -> None:
        _needs_steps(context)
        super().start(context, state)

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        k = min(self.num_draft_tokens, max_tokens)
        known, known_q = self._pick(self.context.target.known_distributions(state)[:k])
        if known.shape[0] == k:
            return Draft(tokens=known[None], probs=None if known_q is None else known_q[None])
        more = self.continue_after(torch.cat([state.new_tokens, known[None].to(state.new_tokens.device)], dim=1),
                                   k - known.shape[0])
        tokens = torch.cat([known[None].to(more.tokens.device), more.tokens], dim=1)
        if more.probs is None:
            return Draft(tokens=tokens)
        return Draft(tokens=tokens, probs=torch.cat([known_q[None].to(more.probs), more.probs], dim=1))


class _CodecHeadDrafter(BatchDrafting, Drafter):
    """A drafter of whole steps through a codec LM's own K output heads (one linear,
    ``get_output_embeddings``: the embedded :class:`~mmspec.modeling.codec_lm.CodecLM`): the rest
    of the pending token's step a from the target's known distributions (q = p), then steps
    a + 1, a + 2, ... from the subclass's head (:meth:`_steps`), codebook by codebook; drawn from
    the head's distributions under sampling (q = theirs: exact), their argmax under greedy
    decoding: a chain, since the delay layout verifies no token trees. A subclass with static token
    trees (``tree_paths``) drafts them where the target verifies trees (a single-stream LM, batch
    size 1; ``self.paths`` is the tree in use, None for the chain).

    Args:
        num_draft_tokens: draft length in stream sub-tokens (None: the rest of the step, then
            ``draft_steps`` whole steps).
        tree_paths: the single-stream tree's paths (empty: chains only); those deeper than
            ``max_depth`` are dropped.
        top1: draft the head's most likely codes under sampling too (VADUSA's top-1 chain): for
            a lossy rule that reads no draft distribution (the top-k tolerance), whose acceptance
            a sampled draft lowers. Under an exact rule the picks are point masses (q = one-hot),
            which keeps it exact.
    """

    requires_target_hidden = True
    #: what the target must be, said when it is not (formatted with the head's ``width``)
    needs = "a codec LM whose heads are one linear of width {width} (the embedded CodecLM)"

    def __init__(self, width: int, num_draft_tokens: int | None, draft_steps: int, tree_paths=(),
                 max_depth: int | None = None, top1: bool = False) -> None:
        super().__init__(num_draft_tokens or 1)
        self.width, self.fixed_length, self.draft_steps, self.top1 = width, num_draft_tokens, draft_steps, top1
        self.tree_paths = [tuple(p) for p in tree_paths if max_depth is None or len(p) <= max_depth]
        self.paths: list[tuple[int, ...]] | None = None

    def _fits(self, target) -> bool:
        return True

    def start(self, context, state: SequenceState) -> None:
        _needs_steps(context)
        output = getattr(context.target.model, "get_output_embeddings", lambda: None)()
        if output is None or output.in_features != self.width or not self._fits(context.target):
            raise ValueError(self.needs.format(width=self.width))
        super().start(context, state)
        self.output = output
        k = context.target.num_codebooks
        self.num_draft_tokens = self.fixed_length or k - 1 + self.draft_steps * k
        self.paths = self.tree_paths if getattr(context.target, "supports_trees", False) and self.tree_paths else None

    def for_batch(self) -> "_CodecHeadDrafter":
        """The chain form (batched rows verify no trees); call it on a copy."""
        chain = super().for_batch()
        chain.tree_paths = []
        return chain

    def describe(self) -> dict:
        tree = {"tree": "chain"} if self.paths is None else {"tree": "static", "tree_nodes": len(self.paths)}
        return {**super().describe(), **tree, **({"draws": "top-1"} if self.top1 else {})}

    @property
    def head_sampling(self) -> SamplingConfig:
        """How the head's own codes are drawn: the generation's sampling, or greedy with ``top1``."""
        return SamplingConfig(do_sample=False) if self.top1 else self.context.sampling

    def _steps(self, state: SequenceState, known: torch.Tensor, more: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """At least ``more`` codes of the steps after the pending token's (completed by ``known``)
        where the head gives them: codes [m] and the distributions [m, V] they were drawn from
        (None: argmax); the draft keeps the first ``more``."""
        raise NotImplementedError

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        limit = min(self.num_draft_tokens, max_tokens)
        known, known_q = self._pick(self.context.target.known_distributions(state)[:limit])
        more = limit - known.shape[0]
        if more <= 0:
            return Draft(tokens=known[None], probs=None if known_q is None else known_q[None])
        tokens, probs = self._steps(state, known, more)
        if not known.shape[0]:  # (a step starts here: the head's codes alone)
            return Draft(tokens=tokens[None, :more].to(known.device), probs=None if probs is None else probs[None, :more])
        tokens = torch.cat([known, tokens[:more].to(known.device)])[None]
        if known_q is None:
            return Draft(tokens=tokens, probs=None)
        if probs is None:  # (top-1 picks after sampled known codes: point masses)
            probs = torch.nn.functional.one_hot(tokens[0, known.shape[0]:], known_q.shape[-1]).to(known_q)
        return Draft(tokens=tokens, probs=torch.cat([known_q, probs[:more].to(known_q)])[None])


#: Medusa's sparse tree for a single-stream codec LM (9 nodes for 4 heads; path (a, b, ...) = head
#: 0's a-th choice, then head 1's b-th, ...): on the VALL-E-style voice (temperature 1, one core) it
#: beat trees of 4, 6, 12 and 17 nodes side by side (docs/benchmarks.md): a tiny LM's forward grows
#: with its rows, so nodes that are rarely accepted cost more than they bring
CODEC_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


@register_drafter("codec-medusa")
class CodecMedusaDrafter(_CodecHeadDrafter):
    """Medusa heads (:class:`~mmspec.modeling.heads.DraftHeads`, kind "medusa") on a delay-pattern
    codec LM (:class:`_CodecHeadDrafter`).

    With f the target's last hidden state at the last verified position (the state whose heads
    gave step a, the pending token's step), Medusa head i = 0..M-1 gives step a + 1 + i:
    logits_i = Heads(f + SiLU(W_i f + b_i)) [K, C + 1].

    On a single-stream LM (K = 1, a VALL-E-style voice's AR stage, where the target verifies token
    trees) the draft is Medusa's sparse static tree: path (a, b, ...) takes head 0's a-th most
    likely code, then head 1's b-th, ... (``tree_paths``, default :data:`CODEC_TREE` and, for more
    than 4 heads, the top-1 chain on to the last head; cut to the heads' depth and to
    ``num_draft_tokens``); its nodes are deterministic picks (q = 1), which the speculative rule's
    multi-draft form keeps exact. Several codebooks do not
    fit a tree (a node would carry a partial step), so there the draft is the chain of the heads'
    own draws (the top-1 path under greedy decoding).
    """

    needs = "codec Medusa heads need a codec LM whose heads are one linear of width {width} (the embedded CodecLM)"

    def __init__(self, heads, num_draft_tokens: int | None = None, tree_paths=None, top1: bool = False) -> None:
        limit = min(heads.num_heads, num_draft_tokens or heads.num_heads)
        paths = tree_paths or CODEC_TREE + [(0,) * d for d in range(5, limit + 1)]
        super().__init__(heads.hidden_size, num_draft_tokens, heads.num_heads, paths, limit, top1)
        self.heads = heads
        self.feature: torch.Tensor | None = None

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.feature = None

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        if self.paths is None:
            return super().propose(state, max_tokens)
        paths = [p for p in self.paths if len(p) <= max_tokens]
        depth = max(len(p) for p in paths)
        states = torch.stack([self.heads.head_state(i, self.feature) for i in range(depth)])
        self.forwards += 1
        guesses = self.output(states).view(depth, 1, -1)  # steps a + 1 .. a + depth (K = 1: a = length - 1)
        top = self.context.target.draft_logits(state, state.length, guesses).topk(1 + max(p[-1] for p in paths), dim=-1)
        tokens = torch.stack([top.indices[len(p) - 1, p[-1]] for p in paths])
        return Draft.from_tree(TokenTree.from_paths(paths, tokens))

    def on_verified(self, num_drafted: int, num_accepted: int, target_output) -> None:
        self.feature = target_output.hidden_states[0, -1 if self.feature is None and not num_drafted else num_accepted]

    def _steps(self, state, known, more):
        k = self.context.target.num_codebooks
        steps = min(-(-more // k), self.heads.num_heads)  # whole steps still wanted, at most one per head
        states = torch.stack([self.heads.head_state(i, self.feature) for i in range(steps)])
        self.forwards += 1
        guesses = self.output(states).view(steps, k, -1)
        first = (state.length - 1) // k + 1  # the step after the pending token's
        return self._pick(self.context.target.draft_logits(state, first, guesses)[:more], self.head_sampling)

    def describe(self) -> dict:
        return {**super().describe(), "heads": self.heads.num_heads}


@register_drafter("codec-eagle")
class CodecEagleDrafter(_CodecHeadDrafter):
    """EAGLE (Li et al., 2024) on a delay-pattern codec LM whose step model also gives its step
    inputs (:class:`_CodecHeadDrafter`; the embedded :class:`~mmspec.modeling.codec_lm.CodecLM`).

    The head works a step at a time: with f_{t-1} the target's last hidden state after step t - 1
    and E_t the LM's input for step t (its K codes' embeddings and alignment),
    f^_t = Head(W_fc [E_t; f_{t-1}]) (one decoder layer, :class:`~mmspec.modeling.heads.EagleHead`),
    and Heads(f^_t) [K, C] is step t + 1. After the pending token's step a (completed by the known
    codes), step a + 1 + i comes from f^_{a+i}, fed back with the drafted step's input. The head
    keeps a cache of the committed steps' pairs (E_t, f_{t-1}), read from the target's step cache
    (``step_hidden``).

    On a single-stream LM (K = 1, where the target verifies token trees) it can draft a static
    tree instead (``tree_paths``, e.g. :data:`CODEC_TREE`; path (a, b, ...) = the a-th most likely
    code of the head's first step, then the b-th of the step the head predicts after that code, ...).
    The head runs once per tree depth over that depth's nodes that have children: node p reads
    f^ of its parent (f^_a at the root) and its own code's input, at its step's position, and
    attends to the committed pairs and its ancestors (a 4-D mask over the head's cache), as
    EAGLE-2 expands its tree. The nodes are deterministic picks (q = 1), which the speculative
    rule's multi-draft form keeps exact. In batches, and with several codebooks, it drafts the chain.
    The chain is the default: on the embedded VALL-E-style voice the 9-node tree raised tau from
    2.90 to 3.04 but cost more than that (1.13x against the chain's 1.43x, docs/benchmarks.md).

    Args:
        head: the trained :class:`~mmspec.modeling.heads.EagleHead` (width D of the codec LM).
        num_draft_tokens, draft_steps: as :class:`_CodecHeadDrafter`'s.
        tree_paths: the single-stream tree (empty: the chain).
        int8_head: the fused chain reads the head's layer, ``fc`` and the output linear as int8
            weights (:func:`mmspec.modeling.fused.int8_head`: 1.2 MB instead of 2.5 on the embedded
            voice, so that they stay in the L2 cache across a chain's codes); the draws' q are the
            int8 head's, so decoding stays exact. None (default): where the CPU has AVX512-VNNI.
        top1: the chain of the head's most likely codes under sampling too (:class:`_CodecHeadDrafter`).
    """

    needs = ("a codec EAGLE head needs a codec LM whose heads are one linear of width {width} and that gives its "
             "step inputs (the embedded CodecLM)")

    def __init__(self, head, num_draft_tokens: int | None = None, draft_steps: int = 3, tree_paths=(),
                 int8_head: bool | None = None, top1: bool = False) -> None:
        super().__init__(head.config.hidden_size, num_draft_tokens, draft_steps, tree_paths, num_draft_tokens, top1)
        self.head = head
        self.int8 = int8_fast() if int8_head is None else int8_head
        self.chain_int8 = None  # the int8 copy the fused chain reads (where self.int8)

    def _fits(self, target) -> bool:
        return hasattr(target.steps, "step_inputs")

    def start(self, context, state: SequenceState) -> None:
        super().start(context, state)
        self.cache, self.fed = make_cache(self.head.config), 1  # pairs of steps 1 .. fed - 1 cached
        self.chain_plans = False  # the fused chain's head plans (None: it does not run; False: not checked yet)
        self.code_table: torch.Tensor | None = None  # its code inputs [C, D] (a one-codebook LM)
        self.chain_rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # its rotary rows of positions 0 .. [P, hd]

    def _step_inputs(self, state: SequenceState, stream: torch.Tensor, first: int) -> torch.Tensor:
        """Stream ids [n * K] of steps first .. first + n - 1 -> the LM's inputs [1, n, D]."""
        target = self.context.target
        steps = target.model_ids(stream.view(-1, target.num_codebooks), first_step=first)
        return target.steps.step_inputs(steps[None], [first], [state.cache.conditioning])[0]

    def _run(self, features: torch.Tensor, inputs: torch.Tensor, first: int, mask: torch.Tensor | None = None,
             same_step: bool = False) -> torch.Tensor:
        """Pairs (inputs [1, n, D], features [1, n, D]) at steps first .. first + n - 1 (all at step
        ``first`` with ``same_step``: tree siblings) -> f^ [1, n, D]."""
        n = inputs.shape[1]
        positions = (torch.full((n,), first) if same_step else torch.arange(first, first + n)).to(inputs.device)[None]
        self.forwards += 1
        return self.head(features, inputs, self.cache, positions, mask)

    def _feed_root(self, state: SequenceState, stream: torch.Tensor, a: int) -> torch.Tensor:
        """One head forward over the committed steps' pairs it has not seen and the pending step a's
        (stream ids ``stream`` hold step a's codes) -> f^_a [1, 1, D]. The cache keeps the
        committed pairs (up to step a - 1) and, until the caller crops it, step a's."""
        hidden, k = state.cache.step_hidden, self.context.target.num_codebooks  # hidden[t] = f_{t-1}
        first = self.fed
        out = self._run(torch.stack(hidden[first : a + 1])[None], self._step_inputs(state, stream[first * k : (a + 1) * k], first),
                        first)
        self.fed = a
        return out[:, -1:]

    def _chain_plans(self):
        """The head layer's fused plans where :meth:`_fused_steps` runs (checked once a generation:
        one codebook, the head a fused Llama layer, ``fc`` and the output head few-row linears), else None."""
        target, decoder = self.context.target, self.head.decoder
        dtype = decoder.norm.weight.dtype
        if (target.num_codebooks != 1 or not hasattr(target.steps, "code_inputs") or not self.head.lean
                or not lean_supported(decoder, None) or len(decoder.layers) != 1 or linear_operand(self.head.fc, dtype) is None
                or linear_operand(self.output, dtype) is None):
            return None
        ids = target.model_ids(torch.arange(self.output.out_features)[:, None].to(self.output.weight.device), first_step=1)
        self.code_table = target.steps.code_inputs(ids[:, 0]).contiguous()  # (steps >= 1 map codes alike)
        plans = fused_plans(decoder.layers, self.cache, 1, dtype, self.output.weight.device)
        self.chain_int8 = int8_head(plans, decoder.layers[0], self.head.fc, self.output) if plans is not None and self.int8 else None
        return plans

    def _fused_steps(self, state: SequenceState, stream: torch.Tensor, a: int, steps: int):
        """:meth:`_steps`' chain in one C call (:func:`mmspec.modeling.fused.head_chain`: the root's
        pairs, then per code the output head, the draw and the next head forward) where it runs
        (:meth:`_chain_plans`, greedy or temperature-only sampling, every drafted position free):
        the same codes and q as the loop (the same kernels and draws; the softmax in C, so q within
        float rounding) -> (codes [steps], q [steps, V] or None), or None."""
        if self.chain_plans is False:
            self.chain_plans = self._chain_plans()
        plans, sampling, target = self.chain_plans, self.head_sampling, self.context.target
        first = self.fed
        codes, n0 = stream[first : a + 1], a - first + 1
        if (plans is None or n0 > plans[0].max_rows or not plans.fresh() or not chain_samples(sampling)
                or any(state.cache.position(index) != "free" for index in range(a + 1, a + 1 + steps))):
            return None
        low, high = torch.aminmax(codes)
        if int(low) < 0 or int(high) >= self.code_table.shape[0]:  # (a stream id that is no code)
            return None
        decoder, rows = self.head.decoder, n0 + steps - 1
        align = target.steps.alignment_table(state.cache.conditioning)
        if self.chain_rotary is None or self.chain_rotary[0].shape[0] < first + rows:  # (rotary's table rows, kept: ~10 us a call)
            cos, sin = rotary(decoder, self.code_table[None, :1].expand(1, max(2 * (first + rows), 256), -1), 0, None)
            self.chain_rotary = cos[0], sin[0]
        cos, sin = (table[first : first + rows] for table in self.chain_rotary)
        temperature, uniforms, probs = chain_draws(sampling, self.context.generator, steps, target.vocab_size)
        codes = head_chain(plans, self.cache.layers[0], decoder.norm.weight, decoder.norm.variance_epsilon, self.head.fc,
                           self.output, codes.contiguous(), torch.stack(state.cache.step_hidden[first : a + 1]), self.code_table,
                           None if align is None else align.contiguous(), first, cos, sin, steps, temperature, uniforms, probs,
                           keep=n0 - 1, int8=self.chain_int8)  # step a's pair is not committed yet
        self.fed = a
        self.forwards += steps
        return codes, probs

    def _steps(self, state, known, more):
        target, k = self.context.target, self.context.target.num_codebooks
        steps = -(-more // k)  # whole steps: each is fed back whole
        a = (state.length - 1) // k  # the pending token's step, completed by the known codes
        stream = torch.cat([state.tokens[0], known.to(state.tokens.device)]) if known.shape[0] else state.tokens[0]
        fused = self._fused_steps(state, stream, a, steps)
        if fused is not None:
            return fused
        feature = self._feed_root(state, stream, a)
        committed = self.cache.get_seq_length() - 1  # step a's pair is not committed yet
        tokens, probs = [], []
        for i in range(steps):
            if i:
                feature = self._run(feature, self._step_inputs(state, step, a + i), a + i)
            guesses = self.output(feature[0]).view(1, k, -1)
            step, q = self._pick(target.draft_logits(state, a + 1 + i, guesses), self.head_sampling)
            tokens.append(step)
            probs.append(q)
        crop_cache(self.cache, committed)  # the drafted steps are not committed
        return torch.cat(tokens), None if probs[0] is None else torch.cat(probs)

    def _node_inputs(self, state: SequenceState, codes: torch.Tensor, step: int) -> torch.Tensor:
        """Codes [m] of m tree nodes, all at ``step`` (K = 1) -> the LM's inputs [1, m, D]."""
        target = self.context.target
        ids = target.model_ids(codes.view(-1, 1), first_step=step)  # K = 1: ids depend on the step only at step 0
        index = torch.full((1, codes.shape[0]), step, device=ids.device)
        return target.steps.step_inputs(ids[None], [step], [state.cache.conditioning], step_index=index)[0]

    def _children(self, state, step: int, features: torch.Tensor, width: int) -> torch.Tensor:
        """f^ [m, D] of m nodes -> the ``width`` most likely codes of each one's next step [m, width]."""
        guesses = self.output(features)  # [m, C] (K = 1)
        logits = torch.stack([self.context.target.draft_logits(state, step, g.view(1, 1, -1))[0] for g in guesses])
        return logits.topk(width, dim=-1).indices

    def propose(self, state: SequenceState, max_tokens: int) -> Draft:
        if self.paths is None:
            return super().propose(state, max_tokens)
        paths = [p for p in self.paths if len(p) <= max_tokens]
        a = state.length - 1  # K = 1: the pending token is step a
        root = self._feed_root(state, state.tokens[0], a)
        committed = self.cache.get_seq_length() - 1
        width = 1 + max(p[-1] for p in paths)
        features = {(): root[0, 0]}  # f^ after feeding each node (the root: f^_a)
        codes = {(i,): c for i, c in enumerate(self._children(state, a + 1, root[0], width)[0])}
        index = {p: i for i, p in enumerate(paths)}
        ancestors = torch.tensor([[p[: len(q)] == q for q in paths] for p in paths])  # [i, j]: paths[j] is a prefix of paths[i]
        fed: list[int] = []  # the tree nodes in the head's cache, in order
        base = self.cache.get_seq_length()  # the committed pairs and the root's
        for depth in range(1, max(len(p) for p in paths)):
            frontier = [p for p in paths if len(p) == depth and any(len(q) == depth + 1 and q[:depth] == p for q in paths)]
            if not frontier:
                break
            nodes = [index[p] for p in frontier]
            mask = expansion_mask(ancestors[nodes][:, fed], base, root.dtype, root.device)
            inputs = self._node_inputs(state, torch.stack([codes[p] for p in frontier]), a + depth)
            out = self._run(torch.stack([features[p[:-1]] for p in frontier])[None], inputs, a + depth, mask, same_step=True)
            children = self._children(state, a + depth + 1, out[0], width)
            for j, p in enumerate(frontier):
                features[p] = out[0, j]
                codes.update({p + (i,): children[j, i] for i in range(width)})
            fed += nodes
        crop_cache(self.cache, committed)  # the drafted nodes are not committed
        return Draft.from_tree(TokenTree.from_paths(paths, torch.stack([codes[p] for p in paths])))

    def describe(self) -> dict:
        fused = getattr(self, "chain_plans", None) not in (None, False)  # (known once a chain was drafted)
        chain = {"fused_chain": True, "chain_int8": self.chain_int8 is not None} if fused and self.paths is None else {}
        return {**super().describe(), "head_layers": 1, **chain}
