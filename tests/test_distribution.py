"""Ladder level 2 end to end: speculative sampling through the whole loop samples the target's
distribution, for an independent draft, a deterministic (prompt-lookup) draft and layer skip."""

import pytest
import torch
from distribution_check import pvalue, two_stage
from transformers import LlamaConfig, LlamaForCausalLM

import mmspec

VOCAB, NEW, RUNS = 10, 3, 2000  # (as test_codec_lm and test_t2i_core: chi-square per position over <= 7 tokens)


def tiny_llama(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper, more varied next-token distributions
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


PROMPT = torch.tensor([[1, 2, 3, 1, 2]])
TEMPERATURE, TOP_K = 1.3, 7


def eagle_drafter(model, tree=False, draft_vocabulary=None, sampled_children=None, num_nodes=6):
    """An EAGLE head (random weights) on the target's features: a chain drafted from a real
    distribution q (zero outside ``draft_vocabulary`` when given), or (tree) an EAGLE-2 dynamic
    tree, its children drawn from q without replacement (or, ``sampled_children=False``, the
    top-k tree with q = 1 per node); ``num_nodes="auto"`` sizes it by the measured cost curve."""
    from mmspec.adapters.hf import text_decoder
    from mmspec.drafters import Eagle2Drafter, EagleDrafter
    from mmspec.modeling.heads import EagleHead

    torch.manual_seed(5)
    head = EagleHead(text_decoder(model).config).eval()
    if tree:
        return Eagle2Drafter(model, head, depth=2, top_k=3, num_nodes=num_nodes, draft_vocabulary=draft_vocabulary,
                             sampled_children=sampled_children)
    return EagleDrafter(model, head, num_draft_tokens=2, draft_vocabulary=draft_vocabulary)


def hydra_drafter(model):
    """Hydra heads (random weights around the identity): a static tree, q = 1 per node."""
    from mmspec.drafters import HydraDrafter
    from mmspec.modeling.heads import DraftHeads

    torch.manual_seed(6)
    heads = DraftHeads(model.get_output_embeddings().weight.shape[1], num_heads=2, kind="hydra")
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return HydraDrafter(model, heads.eval(), tree_paths=[(0,), (1,), (0, 0), (0, 1), (1, 0)])


def kangaroo_drafter(model):
    """The target's first layer + a random adapter, sampled drafts (q = the shallow model's)."""
    from mmspec.adapters.hf import text_decoder
    from mmspec.drafters import KangarooDrafter
    from mmspec.modeling.heads import KangarooAdapter

    torch.manual_seed(9)
    return KangarooDrafter(model, KangarooAdapter(text_decoder(model).config).eval(), exit_layer=1, num_draft_tokens=2, stop_threshold=0.0)


def exact_marginals(model):
    """Exact marginal distribution of each of the NEW generated tokens (enumeration, :mod:`distribution_check`)."""
    from distribution_check import exact_marginals as enumerated
    from mmspec.core.sampling import SamplingConfig

    return enumerated(model, {"input_ids": PROMPT}, SamplingConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K), NEW)


DRAFT_VOCABULARY = torch.tensor([7, 1, 3, 5, 9, 2])  # a frequency-ranked subset (mmspec.drafters.vocab)


@pytest.mark.parametrize("drafter", ["independent", "prompt-lookup", "layer-skip:1", "eagle", "eagle (draft vocabulary)", "eagle2",
                                     "eagle2 (draft vocabulary)", "eagle2 (top-k children)", "eagle2 (auto size)", "hydra", "kangaroo", "sjd", "sjd-coupled"])
def test_loop_samples_target_distribution(target, drafter):
    spec = {"independent": lambda: tiny_llama(1), "eagle": lambda: eagle_drafter(target), "eagle2": lambda: eagle_drafter(target, tree=True),
            "eagle (draft vocabulary)": lambda: eagle_drafter(target, draft_vocabulary=DRAFT_VOCABULARY),
            "eagle2 (draft vocabulary)": lambda: eagle_drafter(target, tree=True, draft_vocabulary=DRAFT_VOCABULARY),
            "eagle2 (top-k children)": lambda: eagle_drafter(target, tree=True, sampled_children=False),
            "eagle2 (auto size)": lambda: eagle_drafter(target, tree=True, num_nodes="auto"),
            "hydra": lambda: hydra_drafter(target), "kangaroo": lambda: kangaroo_drafter(target)}.get(drafter, lambda: drafter)()
    exact = exact_marginals(target)
    counts = torch.zeros(NEW, VOCAB, dtype=torch.float64)
    accepted = 0

    def draw(seed):
        nonlocal accepted
        out = mmspec.generate(target, drafter=spec, max_new_tokens=NEW, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, seed=seed, num_draft_tokens=2, input_ids=PROMPT)
        accepted += out.stats.accepted
        for i, token in enumerate(out.sequences[0, PROMPT.shape[1]:].tolist()):
            counts[i, token] += 1

    runs, found = two_stage(RUNS, draw, lambda n: [pvalue(counts[i], exact[i]) for i in range(NEW)])
    assert accepted > 0.01 * runs  # drafts were really accepted, so the acceptance path was exercised
    assert min(found) > 1e-4, (found, counts, [e * runs for e in exact])


def test_coupled_sjd_samples_the_target_distribution_through_its_coupling(target, monkeypatch):
    """The stop-78 audit: with NEW = 3 tokens the coupled drafter's carry never held an old draft
    (coupled_redraft, or since stop 80 its C kernel, saw 0 rows), so the case above passed with
    the coupling disabled, or its rows misaligned by one. Four tokens and a window of 2: ~1 coupled
    row a run, checked to happen."""
    import mmspec.drafters.jacobi as jacobi
    from distribution_check import exact_marginals as enumerated
    from mmspec.core.sampling import SamplingConfig

    new = 4
    coupled = []
    redraft, kernel = jacobi.coupled_redraft, jacobi.coupled_rows
    monkeypatch.setattr(jacobi, "coupled_redraft", lambda *args: (coupled.append(args[0].shape[0]), redraft(*args))[1])

    def counted_kernel(new_probs, old_probs, old_tokens, uniforms):  # the C kernel where it builds: its rows with an old draft
        out = kernel(new_probs, old_probs, old_tokens, uniforms)
        if out is not None:
            coupled.append(old_tokens.shape[0])
        return out

    monkeypatch.setattr(jacobi, "coupled_rows", counted_kernel)
    exact = enumerated(target, {"input_ids": PROMPT}, SamplingConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K), new)
    counts = torch.zeros(new, VOCAB, dtype=torch.float64)

    def draw(seed):
        out = mmspec.generate(target, drafter="sjd-coupled", max_new_tokens=new, do_sample=True, temperature=TEMPERATURE,
                              top_k=TOP_K, seed=seed, num_draft_tokens=2, input_ids=PROMPT)
        for i, token in enumerate(out.sequences[0, PROMPT.shape[1]:].tolist()):
            counts[i, token] += 1

    runs, found = two_stage(RUNS, draw, lambda n: [pvalue(counts[i], exact[i]) for i in range(new)])
    assert sum(coupled) > runs // 2  # old drafts were really carried through the coupling
    assert min(found) > 1e-4, (found, counts, [e * runs for e in exact])
