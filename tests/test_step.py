"""The decoding step both loops share (mmspec.core.step), checked on its own: the uniforms, the
first token after the prefill, the cut at a stop token / the budget, a verification's commit; and
the core's seams around it (the batch-drafting protocol, the target capabilities, the drafter
registry)."""

import pytest
import torch

import mmspec.drafters  # noqa: F401  (registers the drafters)
from mmspec.core.batch import BatchDrafting, propose_rows, row_drafter
from mmspec.core.draft import Draft
from mmspec.core.drafter import DRAFTERS, Drafter, register_drafter
from mmspec.core.rules import resolve_rule
from mmspec.core.sampling import SamplingConfig
from mmspec.core.stats import SpecStats
from mmspec.core.step import (StepResult, append_tokens, empty_draft, first_token, settle, truncate_at_stop, uniforms,
                              verify_chain)
from mmspec.core.target import (MultiStepTarget, TargetOutput, batch_size_one_reason, eos_token_ids, image_grid,
                                input_names, is_continuous, max_length, sees_images)
from mmspec.core.verify import Verification

GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(do_sample=True, temperature=1.0)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# truncate at stop ------------------------------------------------------------------------------

def test_truncate_keeps_the_first_stop_token_and_stops():
    kept, done = truncate_at_stop(torch.tensor([[4, 9, 2, 9]]), frozenset({9}), budget=10)
    assert kept.tolist() == [[4, 9]] and done


def test_truncate_cuts_at_the_budget_and_stops_when_it_is_spent():
    kept, done = truncate_at_stop(torch.tensor([[4, 5, 6]]), frozenset(), budget=2)
    assert kept.tolist() == [[4, 5]] and done
    kept, done = truncate_at_stop(torch.tensor([[4, 5, 6]]), frozenset(), budget=3)
    assert kept.tolist() == [[4, 5, 6]] and done  # exactly the budget: done


def test_truncate_goes_on_without_stop_token_within_the_budget():
    kept, done = truncate_at_stop(torch.tensor([[4, 5]]), frozenset({9}), budget=5)
    assert kept.tolist() == [[4, 5]] and not done


def test_a_stop_token_beyond_the_budget_is_not_seen():
    kept, done = truncate_at_stop(torch.tensor([[4, 5, 9]]), frozenset({9}), budget=2)
    assert kept.tolist() == [[4, 5]] and done


def test_continuous_tokens_have_no_stop_token_only_the_budget():
    tokens = torch.full((1, 3, 4), 9.0)  # every entry equals the "stop id": ignored
    kept, done = truncate_at_stop(tokens, frozenset({9}), budget=5)
    assert kept.shape == (1, 3, 4) and not done
    kept, done = truncate_at_stop(tokens, frozenset({9}), budget=2)
    assert torch.equal(kept, tokens[:, :2]) and done


# uniforms ------------------------------------------------------------------------------------

def test_uniforms_are_none_under_greedy_and_draw_nothing():
    generator = _generator()
    assert uniforms(generator, GREEDY, 3, torch.device("cpu")) is None
    assert torch.equal(torch.rand(4, generator=generator), torch.rand(4, generator=_generator()))


@pytest.mark.parametrize("n", [0, 1, 5])
def test_uniforms_are_n_plus_one_draws_of_the_generator(n):
    drawn = uniforms(_generator(3), SAMPLED, n, torch.device("cpu"))
    assert drawn.shape == (1, n + 1)
    assert torch.equal(drawn, torch.rand(1, n + 1, generator=_generator(3)))


# first token / verify / settle ------------------------------------------------------------------

def _logits(*rows: list[float]) -> TargetOutput:
    return TargetOutput(torch.tensor([rows]))


def test_first_token_is_the_argmax_under_greedy():
    rule = resolve_rule(None, GREEDY)
    step = first_token(rule, _logits([0.0, 3.0, 1.0]), torch.tensor([[7, 8]]), GREEDY, _generator(), frozenset(), 5)
    assert step.committed.tolist() == [[1]] and step.num_accepted == 0 and not step.done


def test_first_token_stops_at_a_stop_token_or_a_budget_of_one():
    rule = resolve_rule(None, GREEDY)
    prompt = torch.tensor([[7, 8]])
    assert first_token(rule, _logits([0.0, 3.0, 1.0]), prompt, GREEDY, _generator(), frozenset({1}), 5).done
    assert first_token(rule, _logits([0.0, 3.0, 1.0]), prompt, GREEDY, _generator(), frozenset(), 1).done


def test_first_token_under_sampling_draws_one_uniform():
    rule = resolve_rule(None, SAMPLED)
    generator = _generator(5)
    step = first_token(rule, _logits([0.0, 0.0, 0.0, 0.0]), torch.tensor([[7]]), SAMPLED, generator, frozenset(), 5)
    reference = _generator(5)
    u = torch.rand(1, 1, generator=reference)
    assert step.committed.shape == (1, 1) and step.committed.item() == int(u.item() * 4)  # uniform p: the u-quantile
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=reference))


def test_verify_chain_draws_k_plus_one_uniforms():
    rule = resolve_rule(None, SAMPLED)
    generator = _generator(2)
    draft = Draft(tokens=torch.tensor([[1, 2]]))
    verify_chain(rule, draft, _logits([0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [1.0, 1.0, 1.0]), SAMPLED, generator)
    reference = _generator(2)
    torch.rand(1, 3, generator=reference)
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=reference))


def test_verify_chain_greedy_accepts_the_argmax_prefix():
    rule = resolve_rule(None, GREEDY)
    draft = Draft(tokens=torch.tensor([[1, 0]]))
    verification = verify_chain(rule, draft, _logits([0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [1.0, 1.0, 1.0]), GREEDY, _generator())
    assert int(verification.num_accepted[0]) == 1 and verification.tokens[0, :2].tolist() == [1, 2]


def _verification(num_accepted: int, tokens: list[int]) -> Verification:
    return Verification(num_accepted=torch.tensor([num_accepted]), tokens=torch.tensor([tokens]))


def test_settle_commits_the_accepted_drafts_and_the_next_token():
    step = settle(_verification(2, [4, 5, 6, -1]), frozenset(), budget=10)
    assert step.committed.tolist() == [[4, 5, 6]] and step.num_accepted == 2 and step.length == 3 and not step.done


def test_settle_cuts_at_a_stop_token_and_at_the_budget():
    assert settle(_verification(2, [4, 9, 6, -1]), frozenset({9}), budget=10).committed.tolist() == [[4, 9]]
    step = settle(_verification(2, [4, 5, 6, -1]), frozenset(), budget=2)
    assert step.committed.tolist() == [[4, 5]] and step.done and step.num_accepted == 2


def test_step_record_counts_a_verification_step_but_not_the_first_token():
    stats = SpecStats(method="x")
    first = StepResult(_verification(0, [3]), torch.tensor([[3]]), 0, False)
    first.record(stats, None)
    assert stats.verify_steps == 0
    settle(_verification(1, [4, 5, -1]), frozenset(), budget=10).record(stats, 2)
    assert (stats.verify_steps, stats.drafted, stats.accepted, stats.committed_per_step) == (1, 2, 1, [2])
    # a stop token among the accepted drafts: the drafts after it are not counted as accepted (stop-78 test audit)
    stopped = SpecStats(method="x")
    settle(_verification(3, [4, 9, 6, 7]), frozenset({9}), budget=10).record(stopped, 3)
    assert (stopped.accepted, stopped.committed_per_step) == (2, [2])


def test_empty_draft_and_append_keep_the_row_layout():
    assert empty_draft(torch.zeros(1, 5, 3)).tokens.shape == (1, 0, 3)
    assert empty_draft(torch.tensor([[1, 2]])).length == 0
    joined = append_tokens(torch.tensor([[1, 2]]), torch.tensor([[3]], dtype=torch.int32))
    assert joined.tolist() == [[1, 2, 3]] and joined.dtype == torch.long


# the batch-drafting protocol ------------------------------------------------------------------

class _Plain(Drafter):
    """A drafter without the batch protocol: it proposes its row's last token."""

    def propose(self, state, max_tokens):
        return Draft(tokens=state.tokens[:, -1:])


class _Refusing(BatchDrafting, _Plain):
    batch_size_one_reason = "drafts trees"


class _Rows:
    def __init__(self, *tokens):
        self.rows = [type("Row", (), {"tokens": torch.tensor([t])})() for t in tokens]


def test_drafter_keeps_no_batch_api():
    assert not hasattr(Drafter, "for_batch") and not hasattr(Drafter, "propose_rows")


def test_a_plain_drafter_drafts_each_row_on_its_own():
    plain = _Plain()
    assert row_drafter(plain) is plain
    drafts = propose_rows([_Plain(), _Plain()], _Rows([1, 2], [3, 4]), [1, 0], [4, 4])
    assert [d.tokens.tolist() for d in drafts] == [[[4]], [[2]]]


def test_a_batch_drafter_that_cannot_draft_rows_says_why():
    with pytest.raises(ValueError, match="drafts trees, so it runs at batch size 1"):
        row_drafter(_Refusing())


# target capabilities ----------------------------------------------------------------------------

class _Bare:
    pass


class _Full:
    continuous = True
    input_names = ("caption",)
    eos_token_ids = (5, 6)
    max_length = 64
    batch_size_one_reason = "numbers positions by slot"
    grid = (4, 6)
    is_vlm = True

    def known_distributions(self, state):
        return torch.zeros(1)


def test_capabilities_default_for_a_target_without_them():
    bare = _Bare()
    assert (is_continuous(bare), input_names(bare), eos_token_ids(bare), max_length(bare), batch_size_one_reason(bare)) \
        == (False, None, [], None, None)
    assert (image_grid(bare), sees_images(bare), isinstance(bare, MultiStepTarget)) == (None, False, False)


def test_capabilities_read_from_a_target_that_declares_them():
    full = _Full()
    assert (is_continuous(full), input_names(full), eos_token_ids(full), max_length(full), batch_size_one_reason(full)) \
        == (True, ("caption",), [5, 6], 64, "numbers positions by slot")
    assert (image_grid(full), sees_images(full), isinstance(full, MultiStepTarget)) == ((4, 6), True, True)


# the drafter registry ---------------------------------------------------------------------------

def test_a_duplicate_drafter_name_is_refused():
    registered = DRAFTERS["prompt-lookup"]
    with pytest.raises(ValueError, match="a drafter named 'prompt-lookup' is already registered"):
        @register_drafter("prompt-lookup")
        class Again(_Plain):
            pass
    assert DRAFTERS["prompt-lookup"] is registered


def test_chain_stop_ends_a_chain_once_its_running_confidence_falls_below():
    """P_i = prod_{j <= i} c_j; the chain ends after the first draw with P_i < stop_below (kept);
    stop_below = 0 never ends it; a draw's confidence is q(token), or a greedy pick's top softmax."""
    from mmspec.core.draft import chain_stops, draft_confidence

    running, ended = 1.0, []
    for confidence in (0.9, 0.8, 0.5, 0.9):
        stop, running = chain_stops(running, confidence, 0.4)
        ended.append(stop)
    assert ended == [False, False, True, True] and running == pytest.approx(0.9 * 0.8 * 0.5 * 0.9)
    assert chain_stops(1.0, 0.01, 0.0) == (False, 1.0)
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    assert draft_confidence(logits, None, torch.tensor([1])) == pytest.approx(torch.softmax(logits, -1).max().item())
    q = torch.tensor([[0.1, 0.2, 0.7]])
    assert draft_confidence(logits, q, torch.tensor([0])) == pytest.approx(0.1)
