"""Shared helpers of the sampled-distribution (ladder level 2) tests of the VLM and hybrid families.

A target's exact marginals of its first ``new`` sampled tokens are enumerated through plain,
cache-free forwards of ``prompt + prefix`` (every prefix in the sampling transform's support), with
the prompt's per-token inputs grown as transformers' ``generate`` grows them (:func:`extended`);
speculative sampling's token frequencies over seeded runs are then checked against them by
chi-square (:func:`pvalue`), each position on its own.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

import mmspec
from mmspec.core.sampling import SamplingConfig, logits_to_probs


def extended(inputs: dict, tokens: torch.Tensor) -> dict:
    """The prompt ``inputs`` followed by text ``tokens`` [1, n]: ``attention_mask`` ones,
    ``mm_token_type_ids`` zeros (text), Mllama's ``cross_attention_mask`` [1, L, images, tiles]
    its last row once per token (as transformers' generate extends them)."""
    grown = {**inputs, "input_ids": torch.cat([inputs["input_ids"], tokens], dim=1)}
    for name, fill in (("attention_mask", 1), ("mm_token_type_ids", 0)):
        if name in inputs:
            grown[name] = torch.cat([inputs[name], torch.full_like(tokens, fill, dtype=inputs[name].dtype)], dim=1)
    mask = inputs.get("cross_attention_mask")
    if mask is not None:
        grown["cross_attention_mask"] = torch.cat([mask, mask[:, -1:].expand(-1, tokens.shape[1], -1, -1)], dim=1)
    return grown


def exact_marginals(model, inputs: dict, config: SamplingConfig, new: int) -> list[torch.Tensor]:
    """The exact marginal distributions [V] (float64) of the first ``new`` sampled tokens.

    p(x_i = v) = sum over prefixes x_<i of p(x_<i) * p(v | prompt, x_<i), each conditional the
    sampling transform (``config``: temperature, top-k) of one full forward's last logits.
    Cost: one forward per prefix in the support, 1 + k + ... + k^(new-1) for top-k.
    """
    prefixes = {(): 1.0}
    marginals = []
    with torch.inference_mode():
        for i in range(new):
            marginal, following = None, {}
            for prefix, mass in prefixes.items():
                logits = model(**extended(inputs, torch.tensor([prefix], dtype=torch.long).view(1, -1))).logits[0, -1]
                probs = logits_to_probs(logits, config).double()
                marginal = mass * probs if marginal is None else marginal + mass * probs
                if i + 1 < new:
                    following.update({prefix + (t,): mass * probs[t].item() for t in torch.nonzero(probs).flatten().tolist()})
            marginals.append(marginal)
            prefixes = following
    return marginals


def sampled_counts(model, drafter, inputs: dict, config: SamplingConfig, new: int, runs: int | range,
                   num_draft_tokens: int | None = 2) -> tuple[torch.Tensor, int, int]:
    """Speculative sampling with seeds 0..runs-1 (or the seeds of a range) -> (counts [new, V] of
    each position's token, drafted tokens, accepted tokens) over all runs (``num_draft_tokens``
    None: the drafter's own)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    counts = torch.zeros(new, vocab, dtype=torch.float64)
    drafted = accepted = 0
    length = inputs["input_ids"].shape[1]
    for seed in range(runs) if isinstance(runs, int) else runs:
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=new, do_sample=True, temperature=config.temperature,
                              top_k=config.top_k, seed=seed, num_draft_tokens=num_draft_tokens, **inputs)
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        for i, token in enumerate(out.sequences[0, length:].tolist()):
            counts[i, token] += 1
    return counts, drafted, accepted


def pvalue(counts: torch.Tensor, marginal: torch.Tensor) -> float:
    """Chi-square p-value of one position's ``counts`` [V] against ``marginal`` [V]: 0 when a
    token outside the marginal's support was drawn; categories under 5 expected counts pooled."""
    support = marginal > 0
    if counts[~support].sum() > 0:
        return 0.0
    runs = counts.sum()
    expected = marginal[support] / marginal[support].sum() * runs
    observed = counts[support]
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    if len(expected) < 2:
        return 1.0  # one category: nothing to test at this position
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def joint_pvalue(counts: dict, joint: dict, runs: int) -> float:
    """Chi-square p-value of ``counts`` (outcome -> times drawn, over ``runs`` draws) against the
    exact ``joint`` (outcome -> probability): the outcomes expected at least 5 times each a
    category, the rest pooled in one; 0 when an outcome outside the joint's support was drawn."""
    if any(joint.get(outcome, 0) <= 0 for outcome, times in counts.items() if times):
        return 0.0
    big = [g for g, p in joint.items() if p * runs >= 5]
    observed = [counts.get(g, 0) for g in big] + [runs - sum(counts.get(g, 0) for g in big)]
    expected = [joint[g] * runs for g in big] + [runs - sum(joint[g] * runs for g in big)]
    return float(chisquare(observed, expected).pvalue)


#: the first look of :func:`two_stage`: every p-value over half the runs above this passes the test there
EARLY_PASS = 0.2


def two_stage(runs: int, draw, pvalues, early: float = EARLY_PASS) -> tuple[int, list[float]]:
    """A two-stage (group-sequential) sampled-distribution check, so that a correct sampler
    usually costs half the runs: ``draw(seed)`` for seeds 0 .. runs // 2 - 1, then
    ``pvalues(n)`` (the chi-square p-values over the n runs drawn so far, one per position or
    one for the joint); where every one exceeds ``early`` the check stops there, else seeds up to
    ``runs`` are drawn and ``pvalues(runs)`` is returned, for the caller to assert (> 1e-4, as
    with all runs at once). Returns (runs drawn, p-values).

    Under a correct sampler each p-value is uniform, so a single one stops early with probability
    0.8 (k positions: ~0.8^k). Power (scipy's noncentral chi-square, 2-8 degrees of freedom): a
    bias that the full run catches half the time (median p = 1e-4) passes the first look with
    probability 0.08-0.11, one it catches almost always (twice that noncentrality) 0.005-0.006;
    the final test is the full run's."""
    half = runs // 2
    for seed in range(half):
        draw(seed)
    found = pvalues(half)
    if min(found) > early:
        return half, found
    for seed in range(half, runs):
        draw(seed)
    return runs, pvalues(runs)
