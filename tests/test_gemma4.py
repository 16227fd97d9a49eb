"""Gemma 4 as a target (sliding + full attention, KV-shared layers, per-layer input embeddings;
the causal LM and the multimodal class) and Gemma 4's MTP assistant as a drafter.

Every sequence here outgrows the tiny sliding window (8 positions), so each rejected draft rolls
a full window back across its boundary (:class:`mmspec.core.cache.SlidingLayer`), token trees are
verified and compacted past it, and batch rows keep every position with the window as masks."""

import pytest
import torch
from distribution_check import joint_pvalue, two_stage
from test_tree import OracleTreeDrafter
from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4Config, Gemma4ForCausalLM,
                          Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig, GenerationConfig)
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

import mmspec
from mmspec.adapters.hf import TransformersTarget
from mmspec.core.cache import SlidingLayer
from mmspec.core.drafter import DraftContext
from mmspec.core.sampling import SamplingConfig
from mmspec.core.tree import TokenTree
from mmspec.drafters import AssistantDrafter, resolve_drafter

VOCAB, WINDOW, HIDDEN = 96, 8, 32
IMAGE, BOI, EOI = 90, 91, 92
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
#: what the assistant's cross-attention needs of the target: its KV heads and head sizes
KV = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=WINDOW)
SPECIAL = dict(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=2)
PROMPT = torch.tensor([[2, 17, 33, 5, 17, 33, 40, 41, 17, 33, 5, 60, 61]])  # 13 > WINDOW, with repeats for prompt lookup
NEW = 24


def text_config(layers=LAYERS, shared=2, **overrides):
    """A tiny Gemma 4 decoder: sliding and full layers, the last ``shared`` reusing earlier layers'
    keys and values, per-layer input embeddings, soft-capped logits (as the real checkpoints)."""
    kwargs = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=len(layers), layer_types=list(layers),
                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=shared,
                  final_logit_softcapping=30.0, **KV, **SPECIAL)
    kwargs.update(overrides)
    return Gemma4TextConfig(**kwargs)


def finish(model):
    model.generation_config.eos_token_id = None  # fixed-length outputs
    model.generation_config.pad_token_id = 0
    return model.eval()


def causal_lm(seed=0, **overrides):
    torch.manual_seed(seed)
    return finish(Gemma4ForCausalLM(text_config(**overrides)))


def assistant_model(seed=5, backbone=HIDDEN, ordered=False, **overrides):
    """A tiny random Gemma4AssistantForCausalLM over a target of hidden size ``backbone``; with
    ``ordered``, logits from its centroid-masked head (8 centroids of 12 tokens, the top 2 kept,
    a random token ordering)."""
    torch.manual_seed(seed)
    config = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                     layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                                     vocab_size_per_layer_input=0, **{**KV, **overrides}, **SPECIAL),
        backbone_hidden_size=backbone, use_ordered_embeddings=ordered, num_centroids=8, centroid_intermediate_top_k=2)
    model = Gemma4AssistantForCausalLM(config).eval()
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    model.generation_config.num_assistant_tokens = 4
    return model


def vlm(seed=0):
    """Gemma4ForConditionalGeneration with a one-layer vision tower: a 4 x 4 patch image pooled
    2 x 2 into 4 soft tokens, bidirectional attention over them (``use_bidirectional_attention="vision"``)."""
    torch.manual_seed(seed)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=16)
    layers = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = Gemma4Config(text_config=text_config(layers=layers, shared=1, use_bidirectional_attention="vision"),
                          vision_config=vision, audio_config=None, image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI,
                          video_token_id=93, audio_token_id=94, boa_token_id=95, eoa_token_index=89)
    return finish(Gemma4ForConditionalGeneration(config))


def vlm_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[2, 10, 11, BOI, IMAGE, IMAGE, IMAGE, IMAGE, EOI, 12, 13, 10, 11, 14]])
    positions = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    return {"input_ids": ids, "pixel_values": torch.rand(1, 16, 48, generator=gen), "image_position_ids": positions,
            "mm_token_type_ids": (ids == IMAGE).long(), "attention_mask": torch.ones_like(ids)}


@pytest.fixture(scope="module")
def target():
    return causal_lm()


@pytest.fixture(scope="module")
def reference(target):
    with torch.no_grad():
        return target.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def test_sliding_layer_rolls_back_across_its_window():
    """SlidingLayer gives the model what transformers' own sliding layer gives it, and a rollback
    after the window filled equals a layer that never saw the rolled-back positions."""
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 1, n, 2, generator=gen) for n in (3, 4, 2, 5, 1, 3)]
    ours, theirs = SlidingLayer(4, slack=5), DynamicSlidingWindowLayer(4)
    for chunk in chunks[:3]:
        assert torch.equal(ours.update(chunk, -chunk)[0], theirs.update(chunk, -chunk)[0])
        assert ours.get_mask_sizes(2) == theirs.get_mask_sizes(2)
    ours.crop(-4)  # 9 positions, window full: back to 5 (two past the window's 3 kept)
    fresh = DynamicSlidingWindowLayer(4)
    fresh.update(torch.cat([chunks[0], chunks[1][..., :2, :]], dim=2), torch.zeros(1, 1, 5, 2))
    assert ours.get_seq_length() == fresh.get_seq_length() == 5
    for chunk in chunks[3:]:
        assert torch.equal(ours.update(chunk, -chunk)[0], fresh.update(chunk, -chunk)[0])
    with pytest.raises(ValueError, match="draft at most 5 tokens"):
        ours.crop(-6)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip:3", "layer-skip:5", "draft model", "self", "assistant"])
def test_greedy_equals_transformers_generate(target, reference, drafter):
    """Every chain drafter gives transformers' greedy tokens across the sliding window; layer-skip:5
    runs a KV-shared layer in the draft; the target drafting for itself accepts everything."""
    spec = {"draft model": lambda: causal_lm(seed=1), "self": lambda: target,
            "assistant": lambda: AssistantDrafter(assistant_model(), num_draft_tokens=3)}.get(drafter, lambda: drafter)()
    out = mmspec.generate(target, drafter=spec, input_ids=PROMPT, max_new_tokens=NEW, num_draft_tokens=3)
    assert torch.equal(out.sequences, reference)
    if drafter == "self":
        assert out.stats.acceptance_rate == 1.0
    else:
        assert out.stats.drafted > out.stats.accepted  # drafts were rejected: the window rolled back


@pytest.mark.parametrize("kind", ["eagle", "eagle2", "kangaroo", "hydra"])
def test_head_drafters_are_exact(target, reference, kind):
    """Random EAGLE / EAGLE-2 (trees past the window) / Kangaroo / Hydra heads over Gemma 4 (their
    one decoder layer: a Gemma 4 layer without KV sharing or per-layer inputs) give transformers'
    greedy tokens."""
    from test_distribution import eagle_drafter, hydra_drafter, kangaroo_drafter

    make = {"eagle": eagle_drafter, "eagle2": lambda m: eagle_drafter(m, tree=True), "kangaroo": kangaroo_drafter,
            "hydra": hydra_drafter}[kind]
    out = mmspec.generate(target, drafter=make(target), input_ids=PROMPT, max_new_tokens=NEW)
    assert torch.equal(out.sequences, reference) and out.stats.drafted > 0


@pytest.mark.parametrize("ordered", [False, True])
def test_assistant_drafts_what_transformers_drafts(target, ordered):
    """The first round (after the prefill, the prompt past the window) drafts the tokens of
    transformers' SinglePositionMultiTokenCandidateGenerator, and transformers' own assisted
    generation with the same assistant gives the same greedy output as mmspec; also with the
    centroid-masked head (``use_ordered_embeddings``)."""
    assistant = assistant_model(ordered=ordered)
    with torch.no_grad():
        out = target(PROMPT, output_hidden_states=True, return_shared_kv_states=True)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([PROMPT, first], dim=1)
        theirs = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(), GenerationConfig(max_length=99))
        candidates, _ = theirs.get_candidates(sequence, {"attention_mask": torch.ones_like(sequence)}, out, False, 0)
        assisted = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, assistant_model=assistant)
    adapter = TransformersTarget(target)
    with torch.inference_mode():
        state, prefill = adapter.prefill({"input_ids": PROMPT}, hidden_layer=-1)
        state.tokens = sequence
        drafter = AssistantDrafter(assistant, num_draft_tokens=4)
        drafter.start(DraftContext(adapter, SamplingConfig(), torch.Generator(), {"input_ids": PROMPT}), state)
        drafter.on_verified(0, 0, prefill)
        ours = drafter.propose(state, 4)
    assert torch.equal(ours.tokens, candidates[:, sequence.shape[1]:])
    mine = mmspec.generate(target, drafter=AssistantDrafter(assistant, 4), input_ids=PROMPT, max_new_tokens=NEW)
    assert torch.equal(mine.sequences, assisted)


def test_assistant_refuses_what_it_cannot_draft_for(target):
    with pytest.raises(ValueError, match="hidden size 48"):
        mmspec.generate(target, drafter=AssistantDrafter(assistant_model(backbone=48)), input_ids=PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match="Gemma4AssistantForCausalLM"):
        AssistantDrafter(target)
    narrow = assistant_model(head_dim=8)
    with pytest.raises(ValueError, match=r"sliding_attention layers do not fit the target's keys and values \(\(16, 1\)"):
        mmspec.generate(target, drafter=AssistantDrafter(narrow), input_ids=PROMPT, max_new_tokens=4)
    with pytest.raises(ValueError, match='drafter="assistant:DIR"'):
        resolve_drafter("assistant", TransformersTarget(target))


def test_assistant_by_name_from_a_directory(target, tmp_path):
    assistant_model().save_pretrained(tmp_path / "assistant")
    drafter = resolve_drafter(f"assistant:{tmp_path / 'assistant'}", TransformersTarget(target), num_draft_tokens=2)
    assert isinstance(drafter, AssistantDrafter) and drafter.num_draft_tokens == 2


def test_tree_verification_across_the_window(target, reference):
    """Token trees past the sliding window (the sliding layers get the window form of the tree
    mask, their kept positions are compacted to the accepted path): an oracle tree that hides the
    greedy continuation at random siblings gives transformers' tokens, deep paths accepted; so
    does the multimodal class."""
    new_tokens = reference[0, PROMPT.shape[1]:].tolist()
    out = mmspec.generate(target, drafter=OracleTreeDrafter(new_tokens, VOCAB, seed=1), input_ids=PROMPT, max_new_tokens=NEW)
    assert torch.equal(out.sequences, reference) and out.stats.accepted_per_position[2] > 0
    model, inputs = vlm(), vlm_inputs()
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    drafter = OracleTreeDrafter(expected[0, inputs["input_ids"].shape[1]:].tolist(), VOCAB)
    assert torch.equal(mmspec.generate(model, drafter=drafter, max_new_tokens=16, **inputs).sequences, expected)


def test_tree_commit_equals_recomputation(target):
    """After a tree forward past the window and the commit of a path through a second sibling, the
    cache equals a fresh prefill of the committed tokens: every full layer's entries, every sliding
    layer's last window - 1, the same length."""
    adapter = TransformersTarget(target)
    with torch.inference_mode():
        state, _ = adapter.prefill({"input_ids": PROMPT})
        state.tokens = torch.cat([PROMPT, torch.tensor([[7]])], dim=1)
        tree = TokenTree.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 1, 0)], [11, 12, 13, 14, 15])
        rooted = tree.prepend_root(state.tokens[0, -1])
        adapter.forward(state, rooted.tokens[None], tree=rooted)
        state.commit(torch.tensor([[12, 14, 15, 16]]), path=torch.tensor([1, 3, 4]))
        fresh, _ = adapter.prefill({"input_ids": state.tokens[:, :-1]})
    assert state.cache_length == fresh.cache_length == state.length - 1
    for mine, theirs in zip(state.cache.layers, fresh.cache.layers):
        if isinstance(mine, SlidingLayer):
            torch.testing.assert_close(mine.keys[..., -(WINDOW - 1):, :], theirs.keys[..., -(WINDOW - 1):, :], atol=1e-5, rtol=1e-4)
        elif mine.keys is not None:
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4)


def test_assistant_trees(target, reference):
    """The assistant's static tree: one forward per depth over the nodes as a batch of queries; its
    first-choice path is the chain the assistant drafts, and tree decoding gives transformers'
    greedy tokens across the window."""
    assistant = assistant_model()
    tree_drafter = AssistantDrafter(assistant, tree_paths=AssistantDrafter.DEFAULT_TREE)
    out = mmspec.generate(target, drafter=tree_drafter, input_ids=PROMPT, max_new_tokens=NEW)
    assert torch.equal(out.sequences, reference) and out.stats.tree_nodes > 0
    adapter = TransformersTarget(target)
    with torch.inference_mode():
        state, prefill = adapter.prefill({"input_ids": PROMPT}, hidden_layer=-1)
        state.tokens = reference[:, : PROMPT.shape[1] + 1]
        drafts = []
        for drafter in (AssistantDrafter(assistant, 4), tree_drafter):
            drafter.start(DraftContext(adapter, SamplingConfig(), torch.Generator(), {"input_ids": PROMPT}), state)
            drafter.on_verified(0, 0, prefill)
            drafts.append(drafter.propose(state, 4))
    chain, tree = drafts
    first = [AssistantDrafter.DEFAULT_TREE.index((0,) * d) for d in range(1, 5)]
    order = {p: i for i, p in enumerate(sorted(AssistantDrafter.DEFAULT_TREE, key=lambda p: (len(p), p)))}
    assert tree.tokens[0, [order[AssistantDrafter.DEFAULT_TREE[i]] for i in first]].tolist() == chain.tokens[0].tolist()
    with pytest.raises(ValueError, match="every prefix"):
        AssistantDrafter(assistant, tree_paths=[(0, 0)])


SAMPLED_NEW, RUNS, TOP_K = 3, 300, 4


def exact_joint(model, prompt):
    """Probabilities of every sampled continuation of SAMPLED_NEW tokens (enumerated)."""
    from mmspec.core.sampling import logits_to_probs

    config = SamplingConfig(do_sample=True, top_k=TOP_K)
    joint = {(): 1.0}
    with torch.inference_mode():
        for _ in range(SAMPLED_NEW):
            grown = {}
            for prefix, mass in joint.items():
                ids = torch.cat([prompt, torch.tensor([prefix], dtype=torch.long).view(1, -1)], dim=1)
                probs = logits_to_probs(model(ids).logits[0, -1], config).double()
                for token in torch.nonzero(probs).flatten().tolist():
                    grown[prefix + (token,)] = mass * probs[token].item()
            joint = grown
    return joint


def test_sampling_follows_the_target_distribution(target):
    """Speculative sampling with the assistant's sampled drafts (q from its logits, the same top-k
    transform), past the window: the continuations' frequencies pass a chi-square test against
    the enumerated joint and fail one against another model's joint."""
    prompt = PROMPT[:, :11]
    joint = exact_joint(target, prompt)
    spec = AssistantDrafter(assistant_model(), 2)
    counts, accepted = {}, [0]

    def draw(seed):
        out = mmspec.generate(target, drafter=spec, input_ids=prompt, max_new_tokens=SAMPLED_NEW, do_sample=True,
                              top_k=TOP_K, seed=seed, num_draft_tokens=2)
        accepted[0] += out.stats.accepted
        key = tuple(out.sequences[0, prompt.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1

    runs, found = two_stage(RUNS, draw, lambda n: [joint_pvalue(counts, joint, n)])
    assert accepted[0] > 10 * runs / RUNS  # the acceptance path ran (a random assistant: most drafts are rejected)
    assert min(found) > 1e-4
    assert joint_pvalue(counts, exact_joint(causal_lm(seed=1), prompt), runs) < 1e-4  # the test can fail


SHORT = torch.tensor([[2, 9, 8, 7, 9, 8, 7, 50, 51, 9, 8]])  # 11 tokens, left-padded by 2 in the batch


@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip:3", "draft model", "self"])
def test_batch_rows_equal_batch_one_rows(target, drafter):
    """Two prompts of different lengths decode together (sliding layers stored whole, the window
    applied by 4-D masks over each row's positions, whose slots have gaps): each row is its
    batch-1 output, greedy and seeded-sampled."""
    batch = torch.cat([PROMPT, torch.cat([torch.zeros(1, 2, dtype=torch.long), SHORT], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :2] = 0
    spec = {"draft model": lambda: causal_lm(seed=1), "self": lambda: target}.get(drafter, lambda: drafter)()
    for options in ({}, {"do_sample": True, "top_k": 5, "seed": 3}):
        out = mmspec.generate(target, drafter=spec, input_ids=batch, attention_mask=mask, max_new_tokens=20,
                              num_draft_tokens=3, **options)
        for row, prompt in zip(out.sequences, (PROMPT, SHORT)):
            alone = mmspec.generate(target, drafter=spec, input_ids=prompt, max_new_tokens=20, num_draft_tokens=3, **options)
            assert torch.equal(row[-alone.sequences.shape[1]:], alone.sequences[0])
    assert sum(s.drafted for s in out.row_stats) > 0


def test_the_assistant_refuses_batches_in_one_line(target):
    with pytest.raises(ValueError, match="the assistant drafter reads the target's sliding-window cache"):
        mmspec.generate(target, drafter=AssistantDrafter(assistant_model()), input_ids=torch.cat([PROMPT, PROMPT]),
                        attention_mask=torch.ones(2, PROMPT.shape[1], dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip:2", "self", "assistant", "text-only draft (SPD)"])
def test_multimodal_greedy_with_an_image(drafter):
    """Gemma4ForConditionalGeneration: the image encoded in the prefill, then text-only steps
    across the window give transformers' greedy tokens; a text-only Gemma 4 draft sees the prompt
    without its image tokens."""
    model, inputs = vlm(), vlm_inputs()
    with torch.no_grad():
        reference = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    spec = {"self": lambda: model, "assistant": lambda: AssistantDrafter(assistant_model(), 3),
            "text-only draft (SPD)": lambda: causal_lm(seed=1)}.get(drafter, lambda: drafter)()
    out = mmspec.generate(model, drafter=spec, max_new_tokens=16, num_draft_tokens=3, **inputs)
    assert torch.equal(out.sequences, reference)
    if drafter == "self":
        assert out.stats.acceptance_rate == 1.0
    if drafter == "text-only draft (SPD)":
        assert out.stats.config["sees_image"] is False and out.stats.drafted > 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved Gemma 4 checkpoint with its processor (tests/tiny_checkpoints.py) and a tiny
    assistant for it (its hidden size and vocabulary)."""
    from tiny_checkpoints import TEXT_HIDDEN, cached_tiny_checkpoint

    directory = cached_tiny_checkpoint("gemma4", tmp_path_factory)
    vocab = Gemma4ForConditionalGeneration.config_class.from_pretrained(directory).text_config.vocab_size
    torch.manual_seed(7)
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                                     vocab_size_per_layer_input=0, vocab_size=vocab, **KV),
        backbone_hidden_size=TEXT_HIDDEN)).eval()
    assistant_dir = tmp_path_factory.mktemp("gemma4-assistant")
    assistant.save_pretrained(assistant_dir)
    return str(directory), str(assistant_dir)


def test_captioning_pipeline_and_cli_with_the_assistant(checkpoint, tmp_path, capsys):
    """``mmspec.pipeline("image-captioning", drafter="assistant:DIR")`` and ``mmspec caption
    --drafter assistant:DIR`` on a saved checkpoint: the caption of plain decoding."""
    from PIL import Image

    from mmspec.cli import main

    model_dir, assistant_dir = checkpoint
    image = Image.new("RGB", (40, 30), (200, 30, 30))
    captioner = mmspec.pipeline("image-captioning", model=model_dir, drafter=f"assistant:{assistant_dir}", dtype="fp32")
    result = captioner(image, max_new_tokens=10, compare_baseline=True)
    assert result.text == result.baseline_text and result.stats.new_tokens == 10
    assert result.stats.config["drafter"] == f"assistant:{assistant_dir}" and result.stats.drafted > 0
    image.save(tmp_path / "red.png")
    code = main(["caption", str(tmp_path / "red.png"), "--model", model_dir, "--drafter", f"assistant:{assistant_dir}",
                 "--dtype", "fp32", "--max-new-tokens", "6", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err and f'"drafter": "assistant:{assistant_dir}"' in out
    with pytest.raises(ValueError, match='drafter="assistant:DIR"'):
        mmspec.pipeline("image-captioning", model=model_dir, drafter="assistant", dtype="fp32")


def test_captioning_batches_give_the_batch_one_captions(checkpoint):
    """batch_size=2 over 3 images of different sizes (prompts of different lengths, every one past
    the window): the captions of batch size 1, greedy and sampled."""
    import numpy as np

    captioner = mmspec.pipeline("image-captioning", model=checkpoint[0], drafter="prompt-lookup", dtype="fp32")
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((30, 40, 3), (64, 16, 3), (20, 20, 3))]
    for options in ({}, {"do_sample": True, "seed": 4}):
        one = captioner(images, max_new_tokens=8, **options)
        batched = captioner(images, max_new_tokens=8, batch_size=2, **options)
        assert [r.text for r in batched] == [r.text for r in one]
        assert [r.stats.config["batch_size"] for r in batched] == [2, 2, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip:3", "assistant"])
def test_greedy_on_cuda_equals_the_cpu(target, reference, drafter):
    """``pytest -m gpu``: Gemma 4 on CUDA (fp32) gives transformers' CPU greedy tokens across the
    window with each drafter, and a batch of two rows gives the batch-1 rows."""
    model = causal_lm().cuda()
    spec = AssistantDrafter(assistant_model().cuda(), 3) if drafter == "assistant" else drafter
    out = mmspec.generate(model, drafter=spec, input_ids=PROMPT.cuda(), max_new_tokens=NEW, num_draft_tokens=3)
    assert out.sequences.device.type == "cuda" and torch.equal(out.sequences.cpu(), reference)
    if drafter != "assistant":
        batch = torch.cat([PROMPT, PROMPT]).cuda()
        rows = mmspec.generate(model, drafter=spec, input_ids=batch, max_new_tokens=NEW, num_draft_tokens=3).sequences
        assert torch.equal(rows.cpu(), torch.cat([reference, reference]))
