"""Batched decoding of continuous-token (MAR-style) generators: MARTarget.prefill_rows / forward_rows
read every row's contexts in one transformer forward and run every row's chains in one batch; each
row equals its own batch-1 generation (the same acceptances, tokens up to float rounding: the wider
forward sums in another order), under both attentions, with and without guidance, for plain
decoding, CSpD with a draft MAR and with the target's own parallel steps, and MAR's parallel
decoding; the text-to-image pipeline's lists; the errors."""

import pytest
import torch
from test_mar import tiny_components, tiny_mar

import mmspec
from mmspec.adapters.image.mar import MARTarget
from mmspec.api import generate_rows
from mmspec.core.continuous import MaskedARBatch
from mmspec.drafters.continuous import MARDrafter
from mmspec.pipelines.text_to_image import TextToImagePipeline

CLOSE = dict(rtol=1e-3, atol=1e-3)


def _drafter(name, target):
    return {
        "ar": lambda: None,
        "self-parallel": lambda: MARDrafter(target, 4, prefill_fraction=0.1, parallel=True),
        "self-sequential": lambda: MARDrafter(target.model, 3, prefill_fraction=0.2),
        "other": lambda: MARDrafter(tiny_mar(4, attention=target.config.attention), 3, prefill_fraction=0.25),
    }[name]()


@pytest.mark.parametrize("attention,guidance", [("causal", 1.0), ("causal", 2.0), ("bidirectional", 2.0)])
@pytest.mark.parametrize("drafter", ["ar", "self-parallel", "self-sequential", "other"])
def test_rows_equal_their_batch_one_generation(attention, guidance, drafter):
    """Three images (own class, order, noise and generator each), max_new_tokens cutting them short."""
    target = MARTarget(tiny_mar(2, attention=attention))
    rows = [target.prepare_inputs(torch.Generator().manual_seed(s), labels=torch.tensor([s]), guidance_scale=guidance)
            for s in range(3)]
    seeds = [5, 6, 7]
    batch = generate_rows(target, rows, drafter=_drafter(drafter, target), max_new_tokens=50, seed=seeds, do_sample=True)
    assert batch.sequences.shape == (3, 50, 4)
    for b, row in enumerate(rows):
        alone = mmspec.generate(target, drafter=_drafter(drafter, target), max_new_tokens=50, seed=seeds[b],
                                do_sample=True, **row)
        torch.testing.assert_close(batch.sequences[b : b + 1], alone.sequences, **CLOSE)
        mine = batch.row_stats[b]
        assert (mine.accepted, mine.drafted, mine.verify_steps) == (alone.stats.accepted, alone.stats.drafted,
                                                                    alone.stats.verify_steps)
    if drafter == "self-sequential":  # the target's own samples under the same noise: all accepted
        assert batch.stats.accepted == batch.stats.drafted > 0
    if drafter == "self-parallel":  # its first draft of a step is the target's own sample; later ones may be rejected
        assert 0 < batch.stats.accepted < batch.stats.drafted


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_batched_final_steps_equal_each_rows_own(attention):
    """Rows of different lengths with drafts of different lengths (none included): each row's final
    steps equal its own verification forward."""
    target = MARTarget(tiny_mar(7, attention=attention))
    states = []
    for s, (length, guidance) in enumerate([(5, 1.5), (12, 1.5), (1, 1.5)]):
        state, _ = target.prefill(target.prepare_inputs(torch.Generator().manual_seed(s), labels=torch.tensor([s]),
                                                        guidance_scale=guidance))
        state.commit(torch.randn(1, length - 1, 4, generator=torch.Generator().manual_seed(10 + s)))
        states.append(state)
    drafts = [torch.randn(1, k, 4, generator=torch.Generator().manual_seed(k)) for k in (3, 0, 6)]
    out = target.forward_rows(MaskedARBatch(states), drafts)
    assert out.steps.mean.shape == (3, 7, 4)
    for b, (state, draft) in enumerate(zip(states, drafts)):
        alone = target.forward(state, draft).steps
        mine = out.row(b, draft.shape[1] + 1).steps
        for name in ("mean", "std", "sample", "log_scale"):
            torch.testing.assert_close(getattr(mine, name), getattr(alone, name), rtol=1e-4, atol=1e-5)
    parallel = target.parallel_step_rows(states, [4, 2, 3])
    for state, step, count in zip(states, parallel, [4, 2, 3]):
        torch.testing.assert_close(step.sample, target.parallel_step(state, count).sample, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["ar", "cspd", "cspd-self", "cspd-tempered", "mar-parallel:4"])
def test_pipeline_lists_equal_prompts_alone(method):
    pipe = TextToImagePipeline(components=tiny_components(), method=method)
    prompts = ["a red circle", "two blue squares", "a green star"]
    together = pipe(prompts, seed=5, guidance_scale=2.0, batch_size=3)
    for prompt, out in zip(prompts, together):
        alone = pipe(prompt, seed=5, guidance_scale=2.0)
        torch.testing.assert_close(out.tokens, alone.tokens, **CLOSE)
        assert torch.equal(out.accepted_map, alone.accepted_map)  # each token from the same step, in raster order


def test_rows_must_share_guidance_and_temperature():
    target = MARTarget(tiny_mar(2))
    rows = [target.prepare_inputs(torch.Generator().manual_seed(0), labels=torch.tensor([1]), guidance_scale=g)
            for g in (1.5, 2.0)]
    with pytest.raises(ValueError, match="must share the guidance scale and the temperature"):
        generate_rows(target, rows, max_new_tokens=8, do_sample=True)
