"""Batched decoding of a guided image target (LlamaGen-style, two cache rows per sequence): every
row equals its batch-1 generation with the same seed, greedy and sampled, for AR, SJD, coupled SJD,
a draft generator, the image EAGLE head (and EAGLE-2's chain form) and LANTERN's relaxed rule."""

import pytest
import torch
from tiny_models import tiny_llamagen

import mmspec
from mmspec.adapters.image_gen import LlamaGenTarget
from mmspec.api import generate_rows
from mmspec.core.batch import BatchState
from mmspec.drafters import ImageEagle2Drafter, ImageEagleDrafter, JacobiDrafter, ModelDrafter
from mmspec.drafters.jacobi import CoupledJacobiDrafter, ProactiveJacobiDrafter
from mmspec.modeling.heads import ImageEagleConfig, ImageEagleHead

VOCAB, SIDE, PREFIX, CAPTION_DIM = 16, 4, 3, 8


def tiny_generator(seed: int, dim: int = 32) -> LlamaGenTarget:
    return tiny_llamagen(seed, dim, VOCAB, SIDE, PREFIX, CAPTION_DIM, sharpen=4.0)


@pytest.fixture(scope="module")
def target():
    return tiny_generator(0)


def make(target, name):
    torch.manual_seed(5)
    head = ImageEagleHead(ImageEagleConfig(dim=32, n_head=2, grid=(SIDE, SIDE))).eval()
    return {
        "ar": lambda: None,
        "sjd": lambda: JacobiDrafter(4),
        "sjd-coupled": lambda: CoupledJacobiDrafter(4),
        "draft": lambda: ModelDrafter(tiny_generator(1, dim=16), num_draft_tokens=3),
        "eagle": lambda: ImageEagleDrafter(target, head, num_draft_tokens=3),
        "eagle2": lambda: ImageEagle2Drafter(target, head, depth=3, top_k=2, num_nodes=5),
    }[name]()


CAPTIONS = [torch.randn(1, PREFIX, CAPTION_DIM, generator=torch.Generator().manual_seed(s)) for s in range(5)]


@pytest.mark.parametrize("guidance", [2.0, None], ids=["guided", "unguided"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["ar", "sjd", "sjd-coupled", "draft", "eagle", "eagle2"])
def test_image_rows_equal_their_batch_one_generation(target, name, do_sample, guidance, monkeypatch):
    monkeypatch.setattr(BatchState, "slack", 1)
    drafter = make(target, name)
    rows = [{"caption": c, "guidance_scale": guidance} for c in CAPTIONS]
    seeds = [3, 4, 5, 6, 7]
    options = dict(max_new_tokens=SIDE * SIDE, do_sample=do_sample, temperature=1.1, top_k=8)
    batch = generate_rows(target, rows, drafter=drafter, seed=seeds, **options)
    n = SIDE * SIDE
    for b, (row, seed) in enumerate(zip(rows, seeds)):
        one = drafter.for_batch() if drafter is not None else None
        single = mmspec.generate(target, drafter=one, seed=seed, **options, **row)
        assert torch.equal(batch.sequences[b, -n:], single.sequences[0, -n:]), (name, b)
        assert batch.row_stats[b].committed_per_step == single.stats.committed_per_step
    if name != "ar":
        assert batch.stats.target_forwards < len(rows) + n


def test_lantern_rows_equal_their_batch_one_generation(target):
    """A relaxed rule with its parameters (latent neighbours) per row, as at batch size 1."""
    neighbours = torch.stack([torch.roll(torch.arange(VOCAB), -s) for s in range(3)], dim=1)  # [V, 3]
    rule = dict(acceptance="lantern", rule_kwargs={"neighbours": neighbours, "delta": 0.3})
    rows = [{"caption": c, "guidance_scale": 2.0} for c in CAPTIONS[:3]]
    options = dict(max_new_tokens=SIDE * SIDE, do_sample=True, **rule)
    batch = generate_rows(target, rows, drafter=JacobiDrafter(4), seed=9, **options)
    for b, row in enumerate(rows):
        single = mmspec.generate(target, drafter=JacobiDrafter(4), seed=9, **options, **row)
        assert torch.equal(batch.sequences[b, -SIDE * SIDE:], single.sequences[0, -SIDE * SIDE:])


def test_image_batch_errors(target):
    with pytest.raises(ValueError, match="one guidance_scale"):
        generate_rows(target, [{"caption": CAPTIONS[0], "guidance_scale": 2.0}, {"caption": CAPTIONS[1], "guidance_scale": 3.0}],
                      max_new_tokens=4)
    with pytest.raises(ValueError, match="proactive branches"):
        generate_rows(target, [{"caption": c, "guidance_scale": 2.0} for c in CAPTIONS[:2]], drafter=ProactiveJacobiDrafter(3),
                      max_new_tokens=4)
    with pytest.raises(ValueError, match="one seed, or one per prompt"):
        generate_rows(target, [{"caption": c, "guidance_scale": 2.0} for c in CAPTIONS[:2]], seed=[1], max_new_tokens=4)
