"""M-RoPE targets (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE): ladder levels 3-7 (level 2, the
sampled distribution: tests/test_family_distribution.py).

Tiny random models with sharpened attention (tests/tiny_mrope.py): a wrong position changes their
greedy output (:func:`test_a_wrong_offset_changes_the_logits` shows it), so equality with
transformers' ``generate`` checks the prompt's 3-D positions, the decode-phase delta, drafted
chain and tree positions and rollback. The prompts carry an image and a video.
"""

import copy
import json

import numpy as np
import pytest
import torch
from test_conformance import random_eagle_head, random_kangaroo
from test_tree import OracleTreeDrafter, TreeModelDrafter
from tiny_models import make_text_only_draft
from tiny_mrope import IMAGE_ID, MROPE_FAMILIES, VIDEO_ID, make_mrope, mrope_inputs
from transformers import DynamicCache

import mmspec
from mmspec.adapters.hf import VLM_FAMILIES, TransformersTarget
from mmspec.adapters.mrope import MRopePositions, register_position_scheme
from mmspec.api import generate_rows
from mmspec.drafters import Eagle2Drafter, EagleDrafter, KangarooDrafter, MedusaDrafter, ModelDrafter
from mmspec.modeling.heads import DraftHeads

K = 3
MAX_NEW = 1 + 2 * (K + 1)  # the prefill token, then two full verification steps
VIDEO_FAMILIES = MROPE_FAMILIES


@pytest.fixture(scope="module", params=MROPE_FAMILIES)
def case(request):
    return make_mrope(request.param, video=request.param in VIDEO_FAMILIES)


@pytest.fixture(scope="module")
def reference(case):
    with torch.inference_mode():
        return case.model.generate(**case.inputs, do_sample=False, max_new_tokens=MAX_NEW)


def near_copy(model, scale: float, seed: int = 1):
    """The target with noise on its weights: a same-family VLM draft that agrees often, not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return draft


def random_medusa(model):
    torch.manual_seed(4)
    heads = DraftHeads(model.get_output_embeddings().weight.shape[1], num_heads=4, kind="medusa")
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return MedusaDrafter(model, heads.eval())


DRAFTERS = {
    "ar": lambda case: None,
    "prompt-lookup": lambda case: "prompt-lookup",
    "layer-skip:1": lambda case: "layer-skip:1",
    "text-only draft (SPD)": lambda case: make_text_only_draft(case.vocab_size, seed=7),
    "VLM draft": lambda case: ModelDrafter(near_copy(case.model, 0.3), num_draft_tokens=K),
    "target as its own draft": lambda case: ModelDrafter(case.model, num_draft_tokens=K),
    # heads on the target's features (random weights: few drafts accepted; the head keeps its own 1-D positions)
    "eagle (random head)": lambda case: EagleDrafter(case.model, random_eagle_head(case.model), num_draft_tokens=K),
    "eagle2 tree (random head)": lambda case: Eagle2Drafter(case.model, random_eagle_head(case.model), depth=K, top_k=3, num_nodes=8),
    "kangaroo (random adapter)": lambda case: KangarooDrafter(case.model, random_kangaroo(case.model), exit_layer=1,
                                                              num_draft_tokens=K, stop_threshold=0.0),
}


def test_families_are_supported():
    for family in MROPE_FAMILIES:
        assert family in VLM_FAMILIES
        assert TransformersTarget(make_mrope(family).model).positions.name == "mrope"
    with pytest.raises(ValueError, match="a position scheme named 'mrope' is already registered"):
        register_position_scheme(type("Again", (MRopePositions,), {"name": "mrope"}))


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_identical_to_transformers(case, reference, name):
    out = mmspec.generate(case.model, drafter=DRAFTERS[name](case), max_new_tokens=MAX_NEW, num_draft_tokens=K, **case.inputs)
    assert torch.equal(out.sequences, reference), name
    if name == "target as its own draft":  # level 5: every draft accepted
        assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_length == K + 1
    if name == "VLM draft":
        assert out.stats.config["sees_image"] is True
    if name == "text-only draft (SPD)":
        assert out.stats.config["sees_image"] is False


def test_prompt_positions_and_offset(case):
    """The prompt's positions are the model's get_rope_index; later positions are index + delta,
    delta worked out by hand from the layout (tiny_mrope's docstring)."""
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state, out = target.prefill(case.inputs)
        theirs = case.model(**case.inputs)
    # BOS + 5 words at 0..5, <vision_start> 6, image (1, 2, 3) merged at 7, the text after it at
    # 7 + max(2, 3) = 10: <vision_end> 10, then (no video) 4 words 11..14. With a video: <vision_start> 11,
    # video (2, 2, 2) merged at 12 (Qwen2.5-VL: t scaled by 4 tokens/s x 0.5 s, t in {12, 14}), the text
    # after it at 12 + 2: <vision_end> 14, 2 + 4 words 15..20. Qwen3-VL's frames: timestamp 11,
    # <vision_start> 12, frame at 13, <vision_end> 15; timestamp 16, <vision_start> 17, frame at 18,
    # <vision_end> 20, 2 + 4 words 21..26. The last is position L - 1 + delta.
    length = state.prompt_length
    last = 26 if case.family.startswith("qwen3") else 20
    assert state.position_offset == last + 1 - length
    torch.testing.assert_close(out.logits[:, -1], theirs.logits[:, -1], rtol=1e-5, atol=1e-5)


def test_a_wrong_offset_changes_the_logits(case):
    """A chain appended after the prompt gives the logits of transformers' own incremental decoding
    (its rope_deltas path), and a chain at the 1-D positions instead (offset 0) does not: the
    equality tests above can see a position error."""
    target = TransformersTarget(case.model)
    chain = torch.tensor([[17, 230, 41]])
    with torch.inference_mode():
        state, _ = target.prefill(case.inputs)
        mine = target.forward(state, chain).logits
        cache = DynamicCache(config=case.model.config)
        case.model(**case.inputs, cache=cache)  # the model computes and keeps its rope_deltas
        theirs = case.model(input_ids=chain, cache=cache).logits
        state, _ = target.prefill(case.inputs)
        state.position_offset = 0
        wrong = target.forward(state, chain).logits
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert (wrong - mine).abs().max() > 1e-2


def test_rollback_equals_recompute(case):
    """After a verification forward and a commit of a prefix, the next logits equal a fresh prefill
    of the committed sequence's continuation (positions follow the cache length)."""
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state, out = target.prefill(case.inputs)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        state.tokens = torch.cat([state.tokens, first], dim=1)
        drafts = torch.tensor([[33, 44, 55, 66]])
        target.forward(state, state.verification_inputs(drafts))
        state.commit(drafts[:, :2])  # two accepted, the rest rolled back
        after = target.forward(state, state.tokens[:, -1:]).logits
        fresh, _ = target.prefill(case.inputs)
        expected = target.forward(fresh, state.tokens[:, case.prompt_len:]).logits[:, -1:]
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_greedy_tree_decoding_equals_transformers(family):
    """Token trees: nodes at depth d take the text position after their parent in all three
    sections. An oracle tree (the AR continuation hidden at random siblings), a static tree from a
    text-only draft and Medusa heads' tree all reproduce ``generate``."""
    case = make_mrope(family, video=family in VIDEO_FAMILIES)
    new = 14
    with torch.inference_mode():
        reference = case.model.generate(**case.inputs, do_sample=False, max_new_tokens=new)
    drafters = {"oracle": OracleTreeDrafter(reference[0, case.prompt_len :].tolist(), case.vocab_size),
                "text-only static tree": TreeModelDrafter(make_text_only_draft(case.vocab_size, seed=7)),
                "medusa": random_medusa(case.model)}
    for name, drafter in drafters.items():
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=new, **case.inputs)
        assert torch.equal(out.sequences, reference), name
        assert out.stats.tree_nodes > 0
        if name == "oracle":  # deep paths through non-first siblings were accepted
            assert out.stats.mean_accepted_length > 1.8 and out.stats.accepted_per_position[2] > 0


# batches --------------------------------------------------------------------------------------------
def batch_prompts(seed: int = 3) -> list[dict]:
    """Rows whose M-RoPE deltas differ: image 4 x 6 patches (-3), 8 x 8 (-12), text only (0)."""
    gen = torch.Generator().manual_seed(seed)
    return [mrope_inputs(gen), mrope_inputs(gen, image_grid=(1, 8, 8), before=2, after=7), mrope_inputs(gen, image_grid=None)]


@pytest.mark.parametrize("family,name,do_sample", [
    ("qwen2_vl", "prompt-lookup", False), ("qwen2_vl", "layer-skip:1", False), ("qwen2_vl", "VLM draft", False),
    ("qwen2_vl", "text-only draft (SPD)", True), ("qwen2_vl", "VLM draft", True),
    ("qwen2_vl", "eagle (random head)", True), ("qwen2_vl", "kangaroo (random adapter)", False),
    ("qwen3_vl", "layer-skip:1", False), ("qwen3_vl", "VLM draft", True)])
def test_batch_rows_equal_batch_one(family, name, do_sample):
    case = make_mrope(family)
    rows = batch_prompts()
    drafter = DRAFTERS[name](case)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=do_sample, temperature=1.5, seed=11, num_draft_tokens=K)
    batch = generate_rows(case.model, rows, drafter=drafter, **kwargs)
    offsets = []
    for b, row in enumerate(rows):
        one = drafter.for_batch() if isinstance(drafter, mmspec.drafters.Drafter) else drafter
        single = mmspec.generate(case.model, drafter=one, **kwargs, **row)
        length = row["input_ids"].shape[1]
        assert torch.equal(batch.sequences[b, -MAX_NEW:], single.sequences[0, length:]), (b, name)
        assert batch.row_stats[b].committed_per_step == single.stats.committed_per_step
        offsets.append(TransformersTarget(case.model).prefill(row)[0].position_offset)
    assert offsets == [-3, -12, 0]
    if not do_sample:
        reference = case.model.generate(**rows[1], do_sample=False, max_new_tokens=MAX_NEW)
        assert torch.equal(batch.sequences[1, -MAX_NEW:], reference[0, rows[1]["input_ids"].shape[1]:])


def padded_batch(rows: list[dict]) -> dict:
    """Rows as a Qwen processor batches them: input_ids, attention_mask, mm_token_type_ids [B, L]
    left-padded; pixel_values and image_grid_thw of every image concatenated in row order."""
    width = max(row["input_ids"].shape[1] for row in rows)

    def pad(t):
        return torch.cat([torch.zeros(1, width - t.shape[1], dtype=t.dtype), t], dim=1)

    batch = {name: torch.cat([pad(row.get(name, torch.zeros_like(row["input_ids"]))) for row in rows])
             for name in ("input_ids", "attention_mask", "mm_token_type_ids")}
    batch["attention_mask"] = torch.cat([pad(torch.ones_like(row["input_ids"])) for row in rows])
    for name in ("pixel_values", "image_grid_thw"):
        batch[name] = torch.cat([row[name] for row in rows if name in row])
    return batch


def test_a_processor_batch_splits_into_its_rows():
    """mmspec.generate with input_ids [B, L] left-padded and the images' patches flattened over the
    batch (the Qwen processors' layout): each row equals its own batch-1 generation."""
    case = make_mrope("qwen2_vl")
    rows = batch_prompts()
    batch = padded_batch(rows)
    out = mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=MAX_NEW, **batch)
    assert torch.equal(out.sequences[:, : batch["input_ids"].shape[1]], batch["input_ids"])
    for b, row in enumerate(rows):
        single = mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=MAX_NEW, **row)
        assert torch.equal(out.sequences[b, -MAX_NEW:], single.sequences[0, row["input_ids"].shape[1]:]), b
    bad = {**batch, "image_grid_thw": batch["image_grid_thw"][:1]}
    with pytest.raises(ValueError, match="image_grid_thw does not match their placeholder tokens"):
        mmspec.generate(case.model, max_new_tokens=2, **bad)


# inputs ----------------------------------------------------------------------------------------------
def test_bad_inputs_are_refused_in_one_line():
    case = make_mrope("qwen2_vl", video=True)
    inputs = case.inputs
    cases = [
        ({k: v for k, v in inputs.items() if k != "image_grid_thw"}, "without image_grid_thw"),
        ({k: v for k, v in inputs.items() if k not in ("pixel_values_videos", "video_grid_thw")}, "video tokens but no pixel_values_videos"),
        ({**inputs, "mm_token_type_ids": inputs["mm_token_type_ids"][:, 1:]}, "mm_token_type_ids has shape"),
        ({**inputs, "image_grid_thw": torch.tensor([[1, 4, 4]])}, "image_grid_thw covers 16 patches but pixel_values has 24 rows"),
        ({**inputs, "input_ids": torch.where(inputs["input_ids"] == IMAGE_ID, IMAGE_ID - 100, inputs["input_ids"]).index_put(
            (torch.tensor([0]), torch.tensor([7])), torch.tensor(IMAGE_ID))}, "the prompt has 1 image tokens but image_grid_thw needs 6"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            mmspec.generate(case.model, max_new_tokens=2, **bad)
    text_only = TransformersTarget(case.model).text_only_ids(inputs["input_ids"])
    assert not bool(((text_only == IMAGE_ID) | (text_only == VIDEO_ID)).any())


def test_mm_token_type_ids_are_optional():
    """Without mm_token_type_ids the placeholders give them, as the processors do."""
    case = make_mrope("qwen2_vl", video=True)
    without = {k: v for k, v in case.inputs.items() if k != "mm_token_type_ids"}
    a = mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=6, **case.inputs)
    b = mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=6, **without)
    assert torch.equal(a.sequences, b.sequences)


# the captioning pipeline and `mmspec caption` on a saved checkpoint with its processor -----------------------
@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    from tiny_checkpoints import cached_tiny_checkpoint

    return cached_tiny_checkpoint("qwen2_vl", tmp_path_factory)


@pytest.fixture(scope="module")
def pictures():
    """Images of different sizes: different grids, prompt lengths and M-RoPE deltas."""
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((20, 30, 3), (32, 16, 3), (24, 24, 3))]


def test_captioning_pipeline_batches_equal_transformers(qwen2_vl_dir, pictures):
    """A Qwen2-VL checkpoint saved with save_pretrained and its processor: captions equal
    transformers' generate on the processor's inputs, batched or not."""
    captioner = mmspec.pipeline("image-captioning", model=qwen2_vl_dir, dtype="fp32", drafter="layer-skip:1")
    one = captioner(pictures, max_new_tokens=6)
    batched = captioner(pictures, max_new_tokens=6, batch_size=3)
    assert [r.text for r in batched] == [r.text for r in one]
    for picture, r in zip(pictures, one):
        inputs = captioner.preprocess(picture, r.prompt)
        assert "mm_token_type_ids" in inputs and "image_grid_thw" in inputs
        out = captioner.model.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert r.text == captioner.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_caption_cli(qwen2_vl_dir, pictures, tmp_path, capsys):
    from mmspec.cli import main

    path = tmp_path / "a.png"
    pictures[0].save(path)
    code = main(["caption", str(path), "--model", str(qwen2_vl_dir), "--dtype", "fp32", "--max-new-tokens", "5",
                 "--compare-baseline", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err
    result = json.loads(out)[0]
    assert result["identical_to_baseline"] is True and result["stats"]["new_tokens"] == 5


# the CUDA path (`pytest -m gpu`, skipped without a GPU) ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", MROPE_FAMILIES)
def test_greedy_on_cuda_equals_transformers_on_cuda(family):
    case = make_mrope(family, video=family in VIDEO_FAMILIES)
    model = case.model.cuda()
    inputs = {k: v.cuda() for k, v in case.inputs.items()}
    with torch.inference_mode():
        reference = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
    for drafter in ("layer-skip:1", ModelDrafter(near_copy(model, 0.3), num_draft_tokens=K)):
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=MAX_NEW, **inputs)
        assert out.sequences.device.type == "cuda" and torch.equal(out.sequences, reference)
    rows = [{k: v.cuda() for k, v in row.items()} for row in batch_prompts()]
    batch = generate_rows(model, rows, drafter="prompt-lookup", max_new_tokens=MAX_NEW)
    for b, row in enumerate(rows):
        single = mmspec.generate(model, drafter="prompt-lookup", max_new_tokens=MAX_NEW, **row)
        assert torch.equal(batch.sequences[b, -MAX_NEW:], single.sequences[0, row["input_ids"].shape[1]:])
