"""LLaVA-OneVision (images and video), InternVL and Llama-3.2-Vision (Mllama) as targets.

Tiny random models (tests/tiny_vlm_families.py, never downloaded), fp32. For each family: greedy
output identical to transformers' ``generate`` with every chain drafter (prompt lookup, layer skip,
a text-only draft model (SPD), the target drafting for itself with acceptance 1), with token
trees and with the head drafters (EAGLE, EAGLE-2, Medusa, Hydra, Kangaroo; random heads); batch
rows equal to their batch-1 outputs (Mllama's with different numbers of images and tiles); the image really
reaches the output; the captioning pipeline and ``mmspec caption`` run saved checkpoints. Mllama also: its
cross-attention (image) keys and values survive every rollback, tree compaction and layer-skip crop.
Sampled outputs of every family: tests/test_family_distribution.py.
"""

import pytest
import torch
from test_tree import OracleTreeDrafter, TreeModelDrafter
from tiny_models import IMAGE_ID, TEXT_HIGH, TEXT_LOW, make_text_only_draft
from tiny_vlm_families import FAMILIES, make_tiny_family

import mmspec
from mmspec.adapters.hf import TransformersTarget
from mmspec.adapters.mllama import CrossAttentionCache, ImageKVLayer
from mmspec.api import generate_rows
from mmspec.core.tree import TokenTree
from mmspec.drafters import ModelDrafter


K = 3
MAX_NEW = 1 + 2 * (K + 1)  # the prefill's token, then two full verification steps


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    return make_tiny_family(request.param)


def reference(case, **kwargs):
    with torch.inference_mode():
        return case.model.generate(**{**case.inputs, **kwargs}, do_sample=False, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def expected(case):
    return reference(case)


def chain_drafters(case):
    # Mllama's layer 1 is its cross-attention layer: layer-skip:2 drafts through it and crops it
    layers = 2 if case.family == "mllama" else 1
    return {
        "prompt-lookup": "prompt-lookup",
        f"layer-skip:{layers}": f"layer-skip:{layers}",
        "text-only draft (SPD)": make_text_only_draft(case.vocab_size, seed=7),
        # SmolLM2 drafting for SmolVLM: the VLM's added tokens (image framing, its end of utterance)
        # are past the draft's vocabulary; it drafts without them (an IndexError before)
        "text-only draft, smaller vocabulary": make_text_only_draft(TEXT_HIGH - 40, seed=7),
        "same model": ModelDrafter(case.model, num_draft_tokens=K),
    }


def test_greedy_identical_to_transformers_with_every_chain_drafter(case, expected):
    for name, drafter in chain_drafters(case).items():
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K, **case.inputs)
        assert torch.equal(out.sequences, expected), name
        if name == "same model":  # the target drafting for itself: everything accepted, tau = K + 1
            assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_length == K + 1
            assert out.stats.config["sees_image"] is True
        if name.startswith("text-only draft"):
            assert out.stats.config["sees_image"] is False


def test_greedy_identical_with_token_trees(case, expected):
    """Trees of several branches: verification under the ancestor mask, then compaction of the
    accepted path (Mllama: of its self-attention layers only)."""
    drafters = [OracleTreeDrafter(expected[0, case.prompt_len:].tolist(), case.vocab_size)]
    if case.family == "mllama":
        drafters.append(TreeModelDrafter(make_text_only_draft(case.vocab_size, seed=7)))
    for drafter in drafters:
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=MAX_NEW, **case.inputs)
        assert torch.equal(out.sequences, expected), type(drafter).__name__
        assert out.stats.tree_nodes > 0 and out.stats.new_tokens == MAX_NEW
        if isinstance(drafter, OracleTreeDrafter):  # paths through other siblings were accepted
            assert out.stats.mean_accepted_length > 1.5


def test_greedy_identical_with_head_drafters(case, expected):
    """The drafters that read the target's hidden states (random heads, as in test_conformance):
    EAGLE (chain), EAGLE-2 (dynamic tree), Medusa and Hydra (static trees), Kangaroo (its early
    exit and adapter; for Mllama the heads' decoder layer is a Llama layer of its widths)."""
    if case.family == "llava_onevision_video":
        pytest.skip("the image case covers the model; the video only changes the prefill")
    from test_conformance import random_eagle_head, random_heads, random_kangaroo

    from mmspec.drafters import Eagle2Drafter, EagleDrafter, HydraDrafter, KangarooDrafter, MedusaDrafter

    model = case.model
    drafters = {
        "eagle": EagleDrafter(model, random_eagle_head(model), num_draft_tokens=K),
        "eagle2": Eagle2Drafter(model, random_eagle_head(model), depth=K, top_k=3, num_nodes=8),
        "medusa": MedusaDrafter(model, random_heads(model, "medusa")),
        "hydra": HydraDrafter(model, random_heads(model, "hydra")),
        "kangaroo": KangarooDrafter(model, random_kangaroo(model), exit_layer=1, num_draft_tokens=K, stop_threshold=0.0),
    }
    for name, drafter in drafters.items():
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=MAX_NEW, **case.inputs)
        assert torch.equal(out.sequences, expected), name


def test_the_image_reaches_the_output(case, expected):
    """The tests above would pass for a model that ignored its image; this one does not."""
    name = "pixel_values_videos" if "pixel_values_videos" in case.inputs else "pixel_values"
    other = reference(case, **{name: torch.zeros_like(case.inputs[name])})
    assert not torch.equal(other, expected)


def _other_prompt(case, seed):
    """``case``'s prompt with other text tokens and other pixels (same image layout)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(case.inputs)
    ids = inputs["input_ids"].clone()
    text = (ids >= TEXT_LOW) & (ids < TEXT_HIGH)
    ids[text] = torch.randint(TEXT_LOW, TEXT_HIGH, (int(text.sum()),), generator=gen)
    inputs["input_ids"] = ids
    for name in ("pixel_values", "pixel_values_videos"):
        if name in inputs:
            inputs[name] = torch.randn(inputs[name].shape, generator=gen)
    inputs.pop("attention_mask")
    return inputs


@pytest.mark.parametrize("family", ["llava_onevision", "internvl"])
def test_batch_rows_equal_batch_one_rows(family):
    """Rows of different prompts (for LLaVA-OneVision an image row and a video row, of other
    lengths) decode together; each row is its batch-1 output (transformers' generate, which the
    tests above equal), with prompt lookup (LLaVA-OneVision) or a draft model drafting all rows in
    one forward (InternVL)."""
    case = make_tiny_family(family)
    rows = [_other_prompt(case, 1), {k: v for k, v in case.inputs.items() if k != "attention_mask"}]
    if family == "llava_onevision":
        # (the video case's model is built from the same seed: the same weights)
        rows.append({k: v for k, v in make_tiny_family("llava_onevision_video").inputs.items() if k != "attention_mask"})
    drafter = "prompt-lookup" if family == "llava_onevision" else make_text_only_draft(case.vocab_size, seed=7)
    batch = generate_rows(case.model, rows, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K)
    for b, row in enumerate(rows):
        with torch.inference_mode():
            single = case.model.generate(**row, do_sample=False, max_new_tokens=MAX_NEW)
        assert torch.equal(batch.sequences[b, -MAX_NEW:], single[0, row["input_ids"].shape[1]:]), b


def mllama_rows(case):
    """Prompts of different lengths with different images: the case's (one 1 x 2-tile image), one with
    two images (1 x 2 and 1 x 1 tiles; each token's mask row covers the image before it, as the
    processor lays it out), one with a 2 x 2-tile image, one without an image."""
    gen = torch.Generator().manual_seed(11)

    def text(n):
        return torch.randint(TEXT_LOW, TEXT_HIGH, (n,), generator=gen).tolist()

    def row(images, aspect_ids, tiles):
        ids, mask = [1] + text(4), []
        for i in range(images):
            ids += [IMAGE_ID] + text(3 + 2 * i)
        ids = torch.tensor([ids])
        mask = torch.zeros(1, ids.shape[1], images, 4, dtype=torch.long)
        starts = (ids[0] == IMAGE_ID).nonzero()[:, 0].tolist() + [ids.shape[1]]
        ratio = torch.zeros(1, images, 4, dtype=torch.long)
        for i, n in enumerate(tiles):
            mask[0, starts[i] : starts[i + 1], i, :n] = 1
            ratio[0, i, :n] = 1
        return {"input_ids": ids, "pixel_values": torch.randn(1, images, 4, 3, 16, 16, generator=gen),
                "aspect_ratio_ids": torch.tensor([aspect_ids]), "aspect_ratio_mask": ratio, "cross_attention_mask": mask}

    return [{k: v for k, v in case.inputs.items() if k != "attention_mask"}, row(2, [2, 1], [2, 1]), row(1, [6], [4]),
            {"input_ids": torch.tensor([[1, *text(9)]])}]


def test_mllama_batch_rows_equal_batch_one_rows(monkeypatch):
    """Rows with different numbers of images and tiles (and none) decode together: their image keys and
    values padded to the most tiles, the padding masked out of every row's cross-attention. Each
    row is transformers' greedy output with prompt lookup, layer skip (through the cross-attention
    layer: each row drafts as alone, step for step) and a text-only draft model; rows joining a
    running batch (continuous batching) meet padded image keys too."""
    from mmspec.core.batch import BatchState

    monkeypatch.setattr(BatchState, "slack", 2)  # squeeze the attention slots often
    case = make_tiny_family("mllama")
    rows = mllama_rows(case)
    with torch.inference_mode():
        references = [case.model.generate(**row, do_sample=False, max_new_tokens=MAX_NEW)[0, row["input_ids"].shape[1]:]
                      for row in rows]
    assert len({tuple(r.tolist()) for r in references}) == len(rows)
    for drafter in ("prompt-lookup", "layer-skip:2", make_text_only_draft(case.vocab_size, seed=7)):
        batch = generate_rows(case.model, rows, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K)
        for b, (row, reference) in enumerate(zip(rows, references)):
            assert torch.equal(batch.sequences[b, -MAX_NEW:], reference), (drafter, b)
            if drafter == "layer-skip:2":
                single = mmspec.generate(case.model, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K, **row)
                assert batch.row_stats[b].committed_per_step == single.stats.committed_per_step, b
    waiting = [[rows[2]], [rows[3], rows[1]]]
    joined = generate_rows(case.model, rows[:1], drafter="layer-skip:2", max_new_tokens=MAX_NEW, num_draft_tokens=K,
                           admit=lambda: waiting.pop(0) if waiting else [])
    for b, reference in enumerate([references[0], references[2], references[3], references[1]]):
        assert torch.equal(joined.sequences[b, -MAX_NEW:], reference), b


def test_mllama_layer_skip_drafts_each_row_of_a_batch_as_alone():
    """A layer-skip draft through the cross-attention layer of a padded batch: each row's shallow
    hidden state equals its draft alone (which passes no cross-attention mask): the padding is hidden
    (``draft_inputs``), and the row without an image comes out as if the layer were skipped."""
    from mmspec.core.cache import layer_prefix_view
    from mmspec.drafters.layer_skip import LayerSkipDrafter, draft_rows_through_target_cache

    case = make_tiny_family("mllama")
    target = TransformersTarget(case.model)
    rows = mllama_rows(case)
    drafter = LayerSkipDrafter(case.model, 2)
    seen = []

    def next_tokens(hidden, drafting):
        seen.append(hidden)
        return [(torch.tensor([5]), None, False) for _ in drafting]

    with torch.inference_mode():
        batch, _ = target.prefill_rows(rows)
        for row in batch.rows:
            row.tokens = torch.cat([row.tokens, torch.tensor([[7]])], dim=1)  # each row's pending token
        draft_rows_through_target_cache(batch, [0, 1, 2, 3], [1] * 4, 2, drafter.decoder, next_tokens, target.row_masks,
                                        target.draft_inputs)
        for b, row in enumerate(rows):
            state, _ = target.prefill(row)
            alone = drafter.decoder(input_ids=torch.tensor([[7]]), cache=layer_prefix_view(state.cache, 2),
                                    position_ids=state.position_ids(1), use_cache=True).last_hidden_state
            torch.testing.assert_close(seen[0][b : b + 1], alone, rtol=1e-5, atol=1e-6)


def test_mllama_padded_tiles_get_no_attention():
    """A batch's stacked cross-attention layer: keys [B, H, tiles x P, D] zero-padded to the most tiles,
    the mask row [B, 1, 1, tiles] each row's own tiles (its prompt's last row, flattened) and 0 on
    the padding; a row without an image is all padding."""
    case = make_tiny_family("mllama")
    target = TransformersTarget(case.model)
    rows = mllama_rows(case)
    with torch.inference_mode():
        batch, _ = target.prefill_rows(rows)
    cross = case.model.config.text_config.cross_attention_layers[0]
    layer = batch.cache.layers[cross]
    assert isinstance(layer, ImageKVLayer) and layer.keys.shape[0] == 4 and layer.keys.shape[-2] == 8 * 17
    expected = torch.zeros(4, 8, dtype=torch.long)
    expected[0, :2] = 1  # the case's image: tiles 1-2 of 4
    expected[1, 4] = 1  # two images: the last row's mask covers the second image's one tile
    expected[2, :4] = 1
    assert torch.equal(layer.mask_row[:, 0, 0], expected)
    assert not layer.keys[0, :, 4 * 17 :].any() and not layer.keys[3].any()
    step = target.family.step_inputs(batch.cache, 3)["cross_attention_mask"]
    assert step.shape == (4, 3, 1, 8) and torch.equal(step[:, 2, 0], expected)
    # a shallow draft sees every tile of its own image (as alone, without a mask), none of the padding
    assert torch.equal(layer.draft_mask()[:, 0, 0].sum(1), torch.tensor([4, 8, 4, 0]))
    draft = target.family.draft_inputs(batch.cache, 1)
    seen = draft["cross_attention_mask"][:, 0, 0] == 0  # [B, tiles x P]
    assert torch.equal(seen[:3].sum(1), torch.tensor([4, 8, 4]) * 17)
    assert torch.equal(draft["full_text_row_masked_out_mask"].flatten(), torch.tensor([1.0, 1, 1, 0]))  # no image: zeroed


def test_mllama_image_keys_values_are_never_rolled_back():
    """Crop (rollback) and tree compaction move only the self-attention layers; the cross-attention
    layer keeps the keys/values of every image tile exactly as the prefill wrote them."""
    case = make_tiny_family("mllama")
    target = TransformersTarget(case.model)
    cross = case.model.config.text_config.cross_attention_layers
    with torch.inference_mode():
        state, _ = target.prefill(case.inputs)
        cache = state.cache
        assert isinstance(cache, CrossAttentionCache) and all(isinstance(cache.layers[i], ImageKVLayer) for i in cross)
        image_keys = [cache.layers[i].keys.clone() for i in cross]
        assert image_keys[0].shape[-2] == 4 * (4 * 4 + 1)  # max tiles x (patches + class token)
        prompt = state.length
        state.tokens = torch.cat([state.tokens, torch.tensor([[7]])], dim=1)
        target.forward(state, torch.tensor([[7, 8, 9, 10]]))
        state.commit(torch.tensor([[8]]))  # one draft accepted: two of the four entries dropped
        assert state.cache_length == prompt + 1 == state.length - 1
        tree = TokenTree(torch.tensor([11, 12, 13, 14]), torch.tensor([-1, -1, 1, 2])).prepend_root(8)
        target.forward(state, tree.tokens[None], tree=tree)
        state.commit(torch.tensor([[12, 13, 14]]), path=torch.tensor([2, 3, 4]))
        assert state.cache_length == state.length - 1
        state.rollback(prompt + 1)  # back to the first generated token, the pending one
        assert state.cache_length == prompt
        for i, keys in zip(cross, image_keys):
            assert torch.equal(cache.layers[i].keys, keys)
        # the rolled-back state continues exactly as a fresh prefill does
        fresh, _ = target.prefill(case.inputs)
        fresh.tokens = torch.cat([fresh.tokens, torch.tensor([[7]])], dim=1)
        inputs = torch.tensor([[7, 5, 6]])
        assert torch.equal(target.forward(state, inputs).logits, target.forward(fresh, inputs).logits)


def test_mllama_decoding_steps_take_the_prompts_last_mask_row():
    """A step's cross_attention_mask is the prompt's last row once per token, as generate passes it."""
    case = make_tiny_family("mllama")
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state, _ = target.prefill(case.inputs)
    step = target.family.step_inputs(state.cache, 3)["cross_attention_mask"]
    assert torch.equal(step, case.inputs["cross_attention_mask"][:, -1:].expand(1, 3, 1, 4))


def test_mllama_prompt_without_an_image():
    """No image: transformers skips the cross-attention layer (its cache stays empty), so does mmspec."""
    case = make_tiny_family("mllama")
    ids = case.inputs["input_ids"][:, case.inputs["input_ids"][0] != IMAGE_ID]
    with torch.inference_mode():
        expected = case.model.generate(input_ids=ids, do_sample=False, max_new_tokens=MAX_NEW)
    out = mmspec.generate(case.model, drafter="layer-skip:2", input_ids=ids, max_new_tokens=MAX_NEW, num_draft_tokens=K)
    assert torch.equal(out.sequences, expected)


def test_bad_inputs_are_refused_in_one_line():
    mllama = make_tiny_family("mllama")
    bad = dict(mllama.inputs, cross_attention_mask=mllama.inputs["cross_attention_mask"][:, :-1])
    with pytest.raises(ValueError, match="cross_attention_mask has shape"):
        mmspec.generate(mllama.model, max_new_tokens=2, **bad)
    with pytest.raises(ValueError, match="need aspect_ratio_ids"):
        mmspec.generate(mllama.model, max_new_tokens=2, **{k: v for k, v in mllama.inputs.items() if k != "aspect_ratio_ids"})
    video = make_tiny_family("llava_onevision_video")
    with pytest.raises(ValueError, match="video tokens but no pixel_values_videos"):
        mmspec.generate(video.model, max_new_tokens=2, **{k: v for k, v in video.inputs.items() if k != "pixel_values_videos"})


@pytest.mark.parametrize("family", ["llava_onevision", "internvl", "mllama"])
def test_captioning_pipeline_and_cli_on_a_saved_checkpoint(family, tmp_path_factory, tmp_path, capsys):
    """A checkpoint saved with save_pretrained plus its processor (the family's real processor at a
    tiny resolution): the captioning pipeline's speculative captions equal its baseline's, alone and
    in batches (images of different aspect ratios: InternVL's give different numbers of tiles);
    ``mmspec caption --model DIR`` runs it."""
    import json

    import numpy as np
    from PIL import Image
    from tiny_checkpoints import cached_tiny_checkpoint

    from mmspec.cli import main

    directory = cached_tiny_checkpoint(family, tmp_path_factory)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((40, 24, 3), (16, 48, 3))]
    captioner = mmspec.pipeline("image-captioning", model=directory, dtype="fp32", drafter="prompt-lookup")
    results = captioner(images, max_new_tokens=6, compare_baseline=True)
    assert all(r.identical_to_baseline and r.stats.new_tokens == 6 for r in results)
    batched = captioner(images, max_new_tokens=6, batch_size=2)
    assert [r.text for r in batched] == [r.text for r in results]
    images[0].save(tmp_path / "a.png")
    code = main(["caption", str(tmp_path / "a.png"), "--model", str(directory), "--dtype", "fp32", "--max-new-tokens", "6",
                 "--drafter", "prompt-lookup", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["text"] == results[0].text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llava_onevision", "llava_onevision_video", "internvl", "mllama"])
def test_greedy_on_cuda_equals_transformers_on_the_cpu(family):
    """The CUDA path (``pytest -m gpu``): the chain drafters give the CPU's tokens."""
    case = make_tiny_family(family)
    expected = reference(case)
    model = case.model.cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.inputs.items()}
    for drafter in ("prompt-lookup", "layer-skip:2" if family == "mllama" else "layer-skip:1",
                    ModelDrafter(make_text_only_draft(case.vocab_size, seed=7).cuda(), num_draft_tokens=K),
                    ModelDrafter(model, num_draft_tokens=K)):
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=MAX_NEW, num_draft_tokens=K, **inputs)
        assert out.sequences.device.type == "cuda" and torch.equal(out.sequences.cpu(), expected), drafter


def test_a_vlm_draft_of_another_family_is_refused():
    """Its image tokens and inputs are another family's: one line that says what to use instead."""
    target, other = make_tiny_family("llava_onevision"), make_tiny_family("internvl")
    with pytest.raises(ValueError, match=r"must be of the target's family \(llava_onevision\), got internvl; use a text-only draft"):
        mmspec.generate(target.model, drafter=ModelDrafter(other.model), max_new_tokens=4, **target.inputs)
