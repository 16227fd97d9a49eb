"""Frequency-ranked draft vocabulary: the restricted LM head and its bookkeeping."""

import torch
from torch import nn

from mmspec.drafters.vocab import DraftLMHead, coverage, frequent_tokens, load_draft_vocabulary, save_draft_vocabulary


def test_restricted_head_matches_the_full_head_on_its_rows():
    torch.manual_seed(0)
    lm_head = nn.Linear(8, 20, bias=False)
    ids = torch.tensor([5, 0, 17, 3])
    head = DraftLMHead(lm_head, ids)
    hidden = torch.randn(3, 8)
    assert head.size == 4 and torch.allclose(head(hidden), lm_head(hidden)[:, ids])
    assert torch.equal(head.tokens(torch.tensor([[1, 2]])), torch.tensor([[0, 17]]))
    probs = torch.softmax(head(hidden), -1)
    full = head.full(probs)
    assert full.shape == (3, 20) and torch.allclose(full.sum(-1), torch.ones(3))
    assert torch.equal(full[:, ids], probs) and full[:, [1, 2, 4]].abs().sum() == 0
    whole = DraftLMHead(lm_head)
    assert whole.size == 20 and torch.equal(whole.tokens(torch.tensor([4])), torch.tensor([4])) and whole.full(probs) is probs


def test_restricted_head_of_an_optimized_head_takes_its_kernel():
    """A few-row head (mmspec.optimize) gives the restricted head a few-row linear of the same
    kernel over the copied rows: its logits are that kernel's on those rows; the whole head is
    called as it is."""
    from mmspec.modeling.fast_linear import FewRowLinear, optimize

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 40, bias=False))
    optimize(model, kernel="transposed")  # (the C kernel where it builds: same path, another product order)
    lm_head, ids = model[0], torch.tensor([7, 3, 39, 0, 12])
    head = DraftLMHead(lm_head, ids)
    assert type(head.projection) is FewRowLinear and head.projection.kernel == lm_head.kernel
    assert head.projection.weight.data_ptr() == head.weight.data_ptr()  # the copied rows, not another copy
    hidden = torch.randn(1, 4, 64)
    torch.testing.assert_close(head(hidden), lm_head(hidden)[..., ids])
    assert torch.equal(head(hidden), torch.mm(head.weight, hidden[0].T).T[None])  # the transposed kernel's product
    whole = DraftLMHead(lm_head)
    assert whole.projection is lm_head and torch.equal(whole(hidden), lm_head(hidden))


def test_optimizing_a_drafter_reaches_its_restricted_head():
    """A head restricted before the target was optimized (a plain linear over the copied rows) is
    replaced when the drafter is optimized (mmspec.optimize replaces children: the rows are held as
    one), with the same logits up to the kernel's rounding."""
    from types import SimpleNamespace

    from mmspec.api import optimize_components
    from mmspec.modeling.fast_linear import FewRowLinear

    torch.manual_seed(1)
    lm_head, ids = nn.Linear(64, 40, bias=False), torch.tensor([7, 3, 39, 0, 12])
    drafter = SimpleNamespace(lm_head=DraftLMHead(lm_head, ids))
    hidden = torch.randn(1, 4, 64)
    before = drafter.lm_head(hidden)
    assert type(drafter.lm_head.projection) is nn.Linear
    assert optimize_components(drafter, kernel="transposed").replaced == 1
    assert type(drafter.lm_head.projection) is FewRowLinear and drafter.lm_head.projection.weight.data_ptr() == drafter.lm_head.weight.data_ptr()
    torch.testing.assert_close(drafter.lm_head(hidden), before)


def test_frequent_tokens_are_counted_on_learnt_positions_only(tmp_path):
    records = [{"ids": torch.tensor([9, 9, 9, 1, 2, 2]), "learn": torch.tensor([False, False, False, True, True, True])},
               {"ids": torch.tensor([9, 2, 3]), "learn": torch.tensor([False, True, True])}]
    ids, counts = frequent_tokens(records, size=2)
    assert ids.tolist() == [2, 1] or ids.tolist() == [2, 3]
    assert counts[2] == 3 and 9 not in counts
    assert coverage(ids, records) == 4 / 5
    save_draft_vocabulary(tmp_path, ids, coverage=0.8)
    assert torch.equal(load_draft_vocabulary(tmp_path), ids)
    assert load_draft_vocabulary(tmp_path / "missing") is None
