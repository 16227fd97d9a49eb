"""Ladder levels 1-3 for the pure acceptance rules."""

import math

import pytest
import torch

from mmspec.core.verify import PAD, exact_argmax, greedy_verify, speculative_verify, typical_verify

NEG = float("-inf")


def one_hot_logits(ids, vocab=6):
    logits = torch.full((len(ids), vocab), NEG)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
    return logits.unsqueeze(0)


# level 1: hand-built logits ---------------------------------------------------------------------
def test_greedy_accepts_matching_prefix_then_corrects():
    draft = torch.tensor([[3, 1, 4]])
    target = one_hot_logits([3, 1, 5, 2])  # agrees on 3, 1; disagrees at position 2
    v = greedy_verify(draft, target)
    assert v.num_accepted.tolist() == [2]
    assert v.tokens.tolist() == [[3, 1, 5, PAD]]


def test_speculative_with_nothing_drafted_draws_from_p():
    """An empty draft (plain decoding): no acceptance, one token drawn from p by inversion with the
    row's uniform (the CDF's first index whose cumulative mass exceeds u)."""
    p = torch.tensor([[[0.1, 0.0, 0.5, 0.4]], [[0.0, 0.0, 0.0, 1.0]], [[0.25, 0.25, 0.25, 0.25]]])
    for u, want in ((0.05, [0, 3, 0]), (0.1, [2, 3, 0]), (0.59, [2, 3, 2]), (0.61, [3, 3, 2]), (0.999, [3, 3, 3])):
        v = speculative_verify(torch.empty(3, 0, dtype=torch.long), None, p, torch.empty(3, 0), torch.full((3,), u))
        assert v.num_accepted.tolist() == [0, 0, 0] and v.tokens.dtype == torch.long
        assert v.tokens.tolist() == [[t] for t in want], u


def test_greedy_all_accepted_emits_bonus():
    v = greedy_verify(torch.tensor([[3, 1]]), one_hot_logits([3, 1, 2]))
    assert v.num_accepted.tolist() == [2] and v.tokens.tolist() == [[3, 1, 2]]


def test_greedy_first_rejected_and_empty_draft():
    v = greedy_verify(torch.tensor([[0, 1]]), one_hot_logits([4, 1, 2]))
    assert v.tokens.tolist() == [[4, PAD, PAD]]
    empty = greedy_verify(torch.zeros((1, 0), dtype=torch.long), one_hot_logits([5]))
    assert empty.num_accepted.tolist() == [0] and empty.tokens.tolist() == [[5]]


def test_speculative_forced_accept_and_reject():
    draft = torch.tensor([[2, 3]])
    target = one_hot_logits([2, 0, 5]).softmax(-1)  # p(2)=1 at pos 0, p(3)=0 at pos 1
    q = torch.full((1, 2, 6), 1 / 6)
    v = speculative_verify(draft, q, target, torch.tensor([[0.999, 0.0]]), torch.tensor([0.5]))
    assert v.num_accepted.tolist() == [1]
    assert v.tokens.tolist() == [[2, 0, PAD]]  # residual max(0, p - q) is all at token 0


def test_speculative_deterministic_draft_residual_excludes_draft():
    # q = None: x accepted with prob p(x); on rejection the residual is p without x.
    draft = torch.tensor([[1]])
    target = torch.tensor([[[0.5, 0.5, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]])
    reject = speculative_verify(draft, None, target, torch.tensor([[0.7]]), torch.tensor([0.99]))
    assert reject.tokens.tolist() == [[0, PAD]]
    accept = speculative_verify(draft, None, target, torch.tensor([[0.3]]), torch.tensor([0.99]))
    assert accept.tokens.tolist() == [[1, 0]]


def test_typical_threshold():
    # position 0: peaked p -> threshold eps; the draft has p = 0.05 < 0.09 -> rejected
    probs = torch.tensor([[[0.95, 0.05, 0, 0], [0.25, 0.25, 0.25, 0.25]]])
    v = typical_verify(torch.tensor([[1]]), probs, torch.tensor([0.0]), posterior_threshold=0.09, posterior_alpha=0.3)
    assert v.num_accepted.tolist() == [0] and v.tokens.tolist() == [[0, PAD]]
    # uniform p: threshold = min(0.09, 0.3 * exp(-ln 4)) = 0.075 < 0.25 -> accepted
    probs = torch.tensor([[[0.25, 0.25, 0.25, 0.25], [0, 0, 1.0, 0]]])
    v = typical_verify(torch.tensor([[3]]), probs, torch.tensor([0.5]), posterior_threshold=0.09, posterior_alpha=0.3)
    assert v.tokens.tolist() == [[3, 2]]


def test_batch_shapes_and_padding():
    torch.manual_seed(0)
    b, k, vocab = 5, 4, 7
    p = torch.rand(b, k + 1, vocab).softmax(-1)
    q = torch.rand(b, k, vocab).softmax(-1)
    draft = torch.randint(0, vocab, (b, k))
    v = speculative_verify(draft, q, p, torch.rand(b, k), torch.rand(b))
    assert v.tokens.shape == (b, k + 1) and v.num_accepted.shape == (b,)
    for row, drafted, n in zip(v.tokens.tolist(), draft.tolist(), v.num_accepted.tolist()):
        assert row[:n] == drafted[:n]
        assert row[n] != PAD and all(t == PAD for t in row[n + 1 :])


# level 2: distributions ---------------------------------------------------------------------------
def _first_token_histogram(p, q_or_none, vocab, n, seed):
    """Run the rule n times (as a batch) with K=1 and return the histogram of the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    k = 1
    if q_or_none is None:
        draft = torch.full((n, k), 2)
        q = None
    else:
        draft = torch.multinomial(q_or_none, n, replacement=True, generator=g).view(n, k)
        q = q_or_none.expand(n, k, vocab)
    target = torch.stack([p, p]).unsqueeze(0).expand(n, k + 1, vocab)
    v = speculative_verify(draft, q, target, torch.rand(n, k, generator=g), torch.rand(n, generator=g))
    return torch.bincount(v.tokens[:, 0], minlength=vocab).double() / n


@pytest.mark.parametrize("draft_kind", ["independent", "deterministic", "same"])
def test_speculative_sampling_preserves_target_distribution(draft_kind):
    vocab, n = 8, 200_000
    p = torch.tensor([0.30, 0.02, 0.18, 0.0, 0.25, 0.05, 0.15, 0.05])
    q = {"independent": torch.tensor([0.05, 0.30, 0.05, 0.2, 0.05, 0.15, 0.1, 0.1]), "deterministic": None, "same": p}[draft_kind]
    freq = _first_token_histogram(p, q, vocab, n, seed=1)
    tv = 0.5 * (freq - p.double()).abs().sum().item()
    # the TV of an exact sampler's empirical histogram is ~ sqrt(V / n) / 2 ~ 0.003
    assert tv < 0.006, tv
    assert freq[3] == 0  # a zero-probability token is never emitted


def test_ignoring_residual_would_be_detected():
    """The distribution test has power: sampling the correction from p instead of the residual fails it."""
    vocab, n = 8, 200_000
    p = torch.tensor([0.30, 0.02, 0.18, 0.0, 0.25, 0.05, 0.15, 0.05])
    q = torch.tensor([0.05, 0.30, 0.05, 0.2, 0.05, 0.15, 0.1, 0.1])
    g = torch.Generator().manual_seed(2)
    draft = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    target = torch.stack([p, p]).unsqueeze(0).expand(n, 2, vocab)
    # feed q = p to the rule: it then never subtracts the real q -> biased towards drafts
    v = speculative_verify(draft, p.expand(n, 1, vocab), target, torch.rand(n, 1, generator=g), torch.rand(n, generator=g))
    freq = torch.bincount(v.tokens[:, 0], minlength=vocab).double() / n
    assert 0.5 * (freq - p.double()).abs().sum().item() > 0.05


def test_multi_position_chi_square():
    """K = 3 with position-dependent p and q: the emitted token at every position is ~ p."""
    from scipy.stats import chisquare

    torch.manual_seed(3)
    vocab, k, n = 6, 3, 100_000
    p = torch.rand(k + 1, vocab).double()
    p = (p / p.sum(-1, keepdim=True)).float()
    q = torch.rand(k, vocab)
    q = q / q.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(4)
    # p does not depend on the prefix here, so every emitted token at position i must follow p[i]
    draft = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], dim=1)
    v = speculative_verify(draft, q.expand(n, k, vocab), p.expand(n, k + 1, vocab), torch.rand(n, k, generator=g), torch.rand(n, generator=g))
    for i in range(k + 1):
        emitted = v.tokens[:, i]
        emitted = emitted[emitted != PAD]
        if emitted.numel() < 1000:
            continue
        observed = torch.bincount(emitted, minlength=vocab).double()
        expected = p[i].double() / p[i].double().sum() * emitted.numel()
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4


# level 3: determinism -----------------------------------------------------------------------------
def test_rules_are_pure_functions_of_their_uniforms():
    torch.manual_seed(5)
    p = torch.rand(1, 4, 9).softmax(-1)
    q = torch.rand(1, 3, 9).softmax(-1)
    d = torch.randint(0, 9, (1, 3))
    u, s = torch.rand(1, 3), torch.rand(1)
    a = speculative_verify(d, q, p, u, s)
    b = speculative_verify(d, q, p, u.clone(), s.clone())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_argmax_is_argmax_with_its_tie_breaking(dtype):
    """exact_argmax (and greedy logits_to_probs) pick argmax's index: the first of tied maxima."""
    from mmspec.core.sampling import SamplingConfig, logits_to_probs
    from mmspec.core.verify import exact_argmax

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(2, 5, 1031, generator=gen).to(dtype)
        if trial % 2:  # tied maxima at random places
            top = logits.amax(-1, keepdim=True)
            logits.scatter_(-1, torch.randint(0, 1031, (2, 5, 3), generator=gen), top.expand(-1, -1, 3))
        want = logits.float().argmax(-1)
        assert torch.equal(exact_argmax(logits), want)
        assert torch.equal(logits_to_probs(logits, SamplingConfig(do_sample=False)).argmax(-1), want)
    tied = torch.zeros(1, 8, dtype=dtype)
    tied[0, 3] = tied[0, 6] = 1
    assert int(exact_argmax(tied)) == 3  # the first of the tie, not the last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_c_row_argmax_is_max_indices(dtype):
    """The C row argmax (registered with exact_argmax) gives max(dim=-1).indices: the first of tied
    maxima (rounded rows tie often), an all -inf row, a row's first NaN, a row of equal values, a
    maximum in the scalar tail, at widths around the 16-lane blocks."""
    from mmspec.modeling.fast_linear import rows_argmax

    generator = torch.Generator().manual_seed(0)
    for width in (1, 7, 16, 33, 1000, 49152):
        x = (4 * torch.randn(6, 3, width, generator=generator)).round().to(dtype)
        x[1, 1] = float("-inf")
        x[2, 2, width // 2] = float("nan")
        x[2, 2, -1] = float("nan")
        x[3, 0] = 1.0
        x[4, 1, -1] = 100.0
        indices = rows_argmax(x)
        if indices is None:
            pytest.skip("the C row argmax needs an AVX-512 CPU and the built kernels")
        assert torch.equal(indices, x.max(dim=-1).indices)
        assert torch.equal(exact_argmax(x), indices)


@pytest.mark.parametrize("rule", ["speculative", "block"])
def test_the_c_verification_rules_are_the_pytorch_rules_bitwise(monkeypatch, rule):
    """The C speculative and block rules (registered with speculative_verify / block_verify) accept
    and draw exactly what the PyTorch path does: sampled and one-hot drafts, rows accepted whole (the bonus from p), rejected
    at once, a residual left empty (q = p: the draw falls back to p), a batch of rows, and the draws'
    uniforms at the edges of [0, 1)."""
    from mmspec.core import verify
    from mmspec.modeling import fast_linear

    kernel = getattr(fast_linear, f"{rule}_rows")
    function, registry = getattr(verify, f"{rule}_verify"), f"{rule.upper()}_KERNELS"

    generator = torch.Generator().manual_seed(0)
    cases = 0
    for trial in range(300):
        batch, k, vocab = 1 + trial % 3, trial % 6, (3, 17, 1027)[trial % 3]  # (k = 0: plain decoding)
        p = torch.softmax(3 * torch.randn(batch, k + 1, vocab, generator=generator), -1)
        q = torch.softmax(3 * torch.randn(batch, k, vocab, generator=generator), -1) if trial % 4 else None
        if q is not None and trial % 5 == 0:
            q = p[:, :k].clone()  # q = p: every draft is accepted or the residual is empty
        tokens = (torch.multinomial(q.view(-1, vocab), 1).view(batch, k) if q is not None
                  else torch.randint(vocab, (batch, k), generator=generator))
        accept = torch.rand(batch, k, generator=generator) if trial % 7 else torch.zeros(batch, k)
        sample = torch.rand(batch, generator=generator) if trial % 11 else torch.full((batch,), 0.9999999)
        fast = kernel(tokens, q, p, accept, sample, verify.PAD)
        if fast is None:
            pytest.skip("the C kernels did not build here")
        with monkeypatch.context() as m:
            m.setattr(verify, registry, [])
            reference = function(tokens, q, p, accept, sample)
        assert torch.equal(fast[0], reference.num_accepted) and torch.equal(fast[1], reference.tokens), trial
        chosen = function(tokens, q, p, accept, sample)  # through the registry
        assert torch.equal(chosen.tokens, reference.tokens)
        cases += int(k > 0 and bool((reference.num_accepted < k).any()))
    assert cases > 50  # rejections were among the cases
    bad = torch.tensor([[5]])
    assert kernel(bad, None, torch.full((1, 2, 3), 1 / 3), torch.zeros(1, 1), torch.zeros(1), verify.PAD) is None
