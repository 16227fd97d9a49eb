"""One decoding step, shared by the batch-1 loop (:func:`mmspec.core.loop.speculative_decode`) and
batched decoding (:func:`mmspec.core.batch.batched_decode`).

A generation is: prefill -> :func:`first_token` -> (draft -> :func:`verify_chain` or
:func:`verify_tree` -> :func:`settle` -> commit)*. The loops differ in how they prefill, run the
target and keep the cache (one sequence, or rows sharing one forward); what a row does with its
target output is here, once:

- the uniforms a verification consumes (:func:`uniforms`): n + 1 for a draft of n tokens, drawn
  from the row's generator in the same order whatever the batch, none under greedy decoding;
- the rule's verdict on the draft, cut at the first stop token or the token budget
  (:func:`truncate_at_stop`, :func:`settle`), and the tokens appended to the row
  (:func:`append_tokens`);
- the drafter's start after the prefill and the statistics' last figures
  (:func:`start_drafter`, :func:`finish_stats`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection

import torch

from .cache import SequenceState
from .draft import Draft
from .drafter import DraftContext, Drafter
from .rules import AcceptanceRule
from .sampling import SamplingConfig
from .stats import SpecStats
from .target import Target, TargetOutput
from .verify import TreeVerification, Verification


def uniforms(generator: torch.Generator, sampling: SamplingConfig, n: int, device: torch.device) -> torch.Tensor | None:
    """[1, n + 1] U(0, 1) for a draft of n tokens / tree nodes (one per draft, one for the corrected or
    bonus token), drawn on the generator's device and moved to ``device``; None under greedy
    decoding, which draws nothing."""
    if not sampling.do_sample:
        return None
    return torch.rand(1, n + 1, dtype=torch.float32, generator=generator, device=generator.device).to(device)


def truncate_at_stop(new_tokens: torch.Tensor, eos_token_ids: Collection[int], budget: int) -> tuple[torch.Tensor, bool]:
    """Cut a step's tokens [1, n] (or continuous tokens [1, n, D], which have no stop token) at the
    first stop token (kept, as transformers does) and at the token budget.

    Returns:
        The kept tokens [1, m] (m <= min(n, budget)) and whether the generation is done (a stop
        token was kept, or the budget is spent).
    """
    kept = new_tokens[:, :budget]
    if eos_token_ids and kept.dim() == 2:
        for i, token in enumerate(kept[0].tolist()):
            if token in eos_token_ids:
                return kept[:, : i + 1], True
    return kept, new_tokens.shape[1] >= budget


def empty_draft(tokens: torch.Tensor) -> Draft:
    """The draft of a plain AR step for a row whose tokens are ``tokens`` [1, L] (or [1, L, D]):
    no tokens, [1, 0] (or [1, 0, D]) of the row's dtype."""
    return Draft(tokens=tokens[:, :0])


def append_tokens(tokens: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
    """A row's tokens [1, L] (or [1, L, D]) followed by ``new_tokens`` [1, m] (or [1, m, D]), in the
    row's dtype and device: [1, L + m]."""
    return torch.cat([tokens, new_tokens.to(tokens)], dim=1)


@dataclass(frozen=True)
class StepResult:
    """What one verification leaves to commit.

    Attributes:
        verification: the rule's verdict (tokens [1, K + 1], padded after the committed ones).
        committed: the tokens to append, [1, m] (continuous: [1, m, D]); 1 <= m <= num_accepted + 1.
        num_accepted: drafted tokens (tree nodes) the rule accepted.
        done: whether the generation stops after these tokens (a stop token or the budget).
    """

    verification: Verification
    committed: torch.Tensor
    num_accepted: int
    done: bool

    @property
    def length(self) -> int:
        """Tokens committed (m)."""
        return self.committed.shape[1]

    def record(self, stats: SpecStats, positions: int | None) -> None:
        """Add the step to ``stats``: what the verification reports, and, for a verification of
        ``positions`` drafted positions (a tree's depth), the step's acceptance (None: the token
        after the prefill, which is no verification step). Accepted drafts count as far as the step
        kept them: a stop token or the budget inside the accepted drafts leaves the rest uncounted."""
        self.verification.record(stats)
        if positions is not None:
            stats.record_step(positions, min(self.num_accepted, self.length), self.length)


def settle(verification: Verification, eos_token_ids: Collection[int], budget: int) -> StepResult:
    """The tokens a verification commits (its accepted drafts and the next token), cut at the first
    stop token and at ``budget`` tokens, exactly where AR decoding would have stopped."""
    num_accepted = int(verification.num_accepted[0])
    committed, done = truncate_at_stop(verification.tokens[:, : num_accepted + 1], eos_token_ids, budget)
    return StepResult(verification, committed, num_accepted, done)


def verify_chain(rule: AcceptanceRule, draft: Draft, output: TargetOutput, sampling: SamplingConfig,
                 generator: torch.Generator) -> Verification:
    """The rule's verdict on a linear draft of k tokens (k may be 0) from the target's output over
    [pending token, d_1 .. d_k] (logits [1, k + 1, V], or a continuous output), with k + 1 uniforms
    from ``generator``."""
    return rule.verify_output(draft, output, sampling, uniforms(generator, sampling, draft.length, output.device), generator)


def first_token(rule: AcceptanceRule, output: TargetOutput, tokens: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator, eos_token_ids: Collection[int], max_new_tokens: int) -> StepResult:
    """The token after the prompt: the rule over an empty draft and the prefill's last output
    ([1, 1, V]), drawing one uniform when sampling.

    Args:
        tokens: the row's prompt tokens [1, L] (or [1, L, D]), for the empty draft's shape.
        max_new_tokens: the generation's budget (>= 1), so ``done`` says whether one token is all.
    Returns:
        The step: ``committed`` [1, 1] (or [1, 1, D]), num_accepted 0.
    """
    verification = verify_chain(rule, empty_draft(tokens), output, sampling, generator)
    committed = verification.tokens[:, :1]
    _, done = truncate_at_stop(committed, eos_token_ids, max_new_tokens)
    return StepResult(verification, committed, 0, done)


def verify_tree(
    rule: AcceptanceRule,
    target: Target,
    state: SequenceState,
    draft: Draft,
    sampling: SamplingConfig,
    generator: torch.Generator,
    hidden_layer: int | None,
) -> tuple[TreeVerification, TargetOutput, TargetOutput]:
    """Verify a tree draft of N nodes: one target forward over [pending, node_0 .. node_{N-1}] with
    the tree attention mask, then the rule's tree form. Draws N + 1 uniforms like a linear draft of
    N tokens (a chain-shaped tree consumes the same numbers and gives the same tokens).

    Returns:
        The verification (path [1, N], num_accepted [1]), the target output restricted to
        [pending, accepted path] (logits [1, num_accepted + 1, V]), and the whole output
        [root, node_0 .. node_{N-1}] (logits [1, N + 1, V]).
    """
    tree = draft.tree
    rooted = tree.prepend_root(state.tokens[0, -1])
    out = target.forward(state, rooted.tokens.to(state.tokens.device).unsqueeze(0), hidden_layer=hidden_layer, tree=rooted)
    verification = rule.verify_tree(tree, out.logits, sampling, uniforms(generator, sampling, tree.size, out.logits.device))
    rows = torch.cat([verification.path.new_zeros(1), verification.path[0, : int(verification.num_accepted[0])] + 1])
    hidden = None if out.hidden_states is None else out.hidden_states[:, rows]
    return verification, TargetOutput(out.logits[:, rows], hidden), out


def start_drafter(drafter: Drafter, context: DraftContext, state: SequenceState, prefill_output: TargetOutput,
                  stats: SpecStats) -> None:
    """Start a row's drafter after the prefill and the first token (``state.tokens`` holds it): its
    settings into ``stats.config``, and, for a feature drafter, the prefill's hidden states as a
    verification of nothing."""
    drafter.start(context, state)
    stats.config.update(drafter.describe())
    if drafter.requires_target_hidden:
        drafter.on_verified(0, 0, prefill_output)


def finish_stats(stats: SpecStats, drafter: Drafter | None, new_tokens: int, started: float) -> None:
    """A row's last figures: its new tokens, its drafter's forwards and the settings it chose while
    generating, and the wall time since ``started`` (a ``time.perf_counter()``)."""
    stats.new_tokens = new_tokens
    stats.draft_forwards = drafter.forwards if drafter is not None else 0
    if drafter is not None:
        stats.config.update(drafter.describe())
    stats.wall_time_s = time.perf_counter() - started
