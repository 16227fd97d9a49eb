"""A transformers target with captured forwards (:class:`~mmspec.adapters.hf.CapturedTransformersTarget`):
run eagerly over its static buffers on the CPU, the prompt, chains, rollbacks and trees give the
plain target's logits and hidden states, and every drafter decodes the plain target's greedy tokens;
what it does not cover is refused in one line (tests/test_gpu.py replays the graphs on CUDA)."""

import pytest
import torch
from tiny_models import make_text_only_draft, make_tiny

import mmspec
from mmspec.adapters.hf import CapturedTransformersTarget, TransformersTarget, text_decoder
from mmspec.core.tree import TokenTree
from mmspec.drafters import Eagle2Drafter, EagleDrafter, ModelDrafter
from mmspec.modeling.heads import EagleHead

BUCKETS = (1, 2, 4, 8, 16, 32)


def pair(family="llava"):
    case = make_tiny(family)
    return case, TransformersTarget(case.model), CapturedTransformersTarget(case.model, max_length=128, buckets=BUCKETS)


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "llava"])
def test_prompt_chains_rollback_and_trees_give_the_plain_targets_outputs(family):
    case, plain, captured = pair(family)
    (p_state, p_out), (c_state, c_out) = plain.prefill(case.inputs, hidden_layer=-1), captured.prefill(case.inputs, hidden_layer=-1)
    close(c_out.logits, p_out.logits)
    close(c_out.hidden_states, p_out.hidden_states)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    for state in (p_state, c_state):
        state.commit(tokens[:, :1])
    for n in (3, 1, 6):  # buckets 4, 1, 8: padded inputs, then a rollback past them
        p, c = plain.forward(p_state, tokens[:, :n], hidden_layer=2), captured.forward(c_state, tokens[:, :n], hidden_layer=2)
        close(c.logits, p.logits)
        close(c.hidden_states, p.hidden_states)
        for state in (p_state, c_state):
            state.rollback(state.length)
    tree = TokenTree(torch.tensor([2, 5, 6, 1, 3]), torch.tensor([-1, -1, 0, 0, 2])).prepend_root(7)
    outs = [t.forward(s, tree.tokens[None], tree=tree) for t, s in ((plain, p_state), (captured, c_state))]
    close(outs[1].logits, outs[0].logits)
    for state in (p_state, c_state):  # accept the path 0 -> 2 -> 4 and its bonus token
        state.commit(torch.tensor([[2, 6, 3, 0]]), path=torch.tensor([0, 2, 4]))
    after = [t.forward(s, torch.tensor([[0, 4]])) for t, s in ((plain, p_state), (captured, c_state))]
    close(after[1].logits, after[0].logits)
    assert c_state.cache_length == p_state.cache_length and not captured.captured


def eagle(case, kind, device="cpu"):
    torch.manual_seed(1)
    head = EagleHead(text_decoder(case.model).config).eval().to(device)
    captured = True if kind.endswith("-captured") else None  # the whole step captured (eager on a CPU)
    if kind.startswith("eagle2"):
        return Eagle2Drafter(case.model, head, depth=3, top_k=3, num_nodes=8, budget="nominal", captured_head=captured)
    return EagleDrafter(case.model, head, num_draft_tokens=4, captured_head=captured)


@pytest.mark.parametrize("drafter", ["ar", "prompt-lookup", "draft", "eagle", "eagle2", "eagle-captured", "eagle2-captured"])
def test_greedy_decoding_is_the_plain_targets(drafter):
    case, plain, captured = pair()
    outs = []
    for target in (plain, captured):
        d = drafter
        if drafter == "draft":
            d = ModelDrafter(make_text_only_draft("llava"), num_draft_tokens=3)
        elif drafter.startswith("eagle"):
            d = eagle(case, drafter)
        outs.append(mmspec.generate(target, drafter=d, max_new_tokens=24, **case.inputs))
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    assert outs[1].stats.new_tokens == 24


def sharp_head(vocabulary: bool):
    """The tiny Llama, a random EAGLE head whose attention is sharpened (so that a wrong mask, slot
    or position shows in its outputs) and a draft vocabulary (every third id) or None."""
    case = make_tiny("llama")
    torch.manual_seed(1)
    head = EagleHead(text_decoder(case.model).config).eval()
    attention = head.decoder.layers[0].self_attn
    with torch.no_grad():
        attention.q_proj.weight.mul_(8.0), attention.k_proj.weight.mul_(8.0)
    return case, head, torch.arange(0, case.model.config.vocab_size, 3) if vocabulary else None


@pytest.mark.parametrize("do_sample,vocabulary", [(False, False), (True, False), (True, True)])
def test_the_captured_eagle_step_drafts_what_the_loop_drafts(do_sample, vocabulary):
    """EAGLE's whole drafting step over static buffers (:class:`CapturedEagleChain`: the committed
    pairs, padded to a bucket, then K picks and head forwards with slots, positions and masks made
    from (start, n) on the device) drafts the Python loop's tokens from the same generator, with
    its q, and leaves the head's cache as the loop does, verification after verification; the
    prompt's 9 pairs exceed the largest bucket (8), so its leading pair is fed eagerly first.
    """
    from test_eagle import _started

    from mmspec.core.sampling import SamplingConfig

    case, head, words = sharp_head(vocabulary)
    chained, loop = (EagleDrafter(case.model, head, 4, words, captured_head=flag) for flag in (True, False))
    loop._fused_chain = lambda *args: None  # the Python loop
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state = _started(target, (chained, loop), SamplingConfig(do_sample=do_sample, temperature=0.8))
        chain = chained.captured_step
        assert chain is not None and chain.buckets == (1, 2, 4, 8) and loop.captured_step is None
        for step in range(5):
            mine, theirs = chained.propose(state, 8 if step < 4 else 2), loop.propose(state, 8 if step < 4 else 2)
            assert torch.equal(mine.tokens, theirs.tokens) and mine.tokens.shape == (1, 4 if step < 4 else 2)
            if do_sample:
                torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-6, rtol=1e-5)
            else:
                assert mine.probs is None and theirs.probs is None
            length = loop.cache.get_seq_length()
            assert chain.cache.length == length and chained.fed == loop.fed
            torch.testing.assert_close(chain.cache.keys[0][..., :length, :], loop.cache.layers[0].keys[..., :length, :])
            out = target.forward(state, state.verification_inputs(mine.tokens), hidden_layer=-1)
            accepted = step % 3
            state.commit(torch.cat([mine.tokens[:, :accepted], out.logits[:, accepted].argmax(-1, keepdim=True)], dim=1))
            for drafter in (chained, loop):
                drafter.on_verified(mine.tokens.shape[1], accepted, out)
    assert chained.describe()["captured_head"] and "captured_head" not in loop.describe()


@pytest.mark.parametrize("num_nodes,vocabulary", [(40, False), (12, True)])
def test_the_captured_eagle2_tree_grows_what_the_python_tree_grows(num_nodes, vocabulary):
    """EAGLE-2's greedy tree over static buffers (:class:`CapturedEagle2Tree`: the catch-up, then
    every expansion's frontier fed at its slots under a mask of the committed slots, its fed
    ancestors and itself, built on the device) grows the Python tree's nodes, parents and depths
    with its scores, and leaves the head's committed pairs as the Python tree does, verification
    after verification; a step allowed fewer layers keeps the layers it may verify.
    """
    from test_eagle import _accept_first_children, _started

    case, head, words = sharp_head(vocabulary)
    captured, loop = (Eagle2Drafter(case.model, head, depth=4, top_k=3, num_nodes=num_nodes, draft_vocabulary=words,
                                    captured_head=flag) for flag in (True, False))
    loop._fused_tree = lambda *args: None  # the Python tree
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        state = _started(target, (captured, loop))
        assert captured.captured_step is not None and captured.captured_step.buckets == (1, 2, 4, 8)
        for step in range(4):
            allowed = 8 if step < 3 else 2
            mine, theirs = captured.propose(state, allowed), loop.propose(state, allowed)
            assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.tree.parents, theirs.tree.parents)
            torch.testing.assert_close(mine.tree.scores, theirs.tree.scores, atol=1e-5, rtol=1e-5)
            assert captured.drafted_depths == loop.drafted_depths and mine.tree.max_depth <= min(4, allowed)
            length = loop.cache.get_seq_length()
            assert captured.captured_step.cache.length == length and captured.fed == loop.fed
            torch.testing.assert_close(captured.captured_step.cache.keys[0][..., :length, :], loop.cache.layers[0].keys[..., :length, :])
            _accept_first_children(target, state, mine, step % 3, (captured, loop))
    assert captured.describe()["captured_head"]


@torch.no_grad()
def test_the_captured_eagle_step_refuses_what_it_does_not_cover():
    from mmspec.core.sampling import SamplingConfig
    from mmspec.drafters.captured_chain import CapturedEagleChain

    case, _, captured = pair("llama")
    torch.manual_seed(1)
    head = EagleHead(text_decoder(case.model).config).eval()
    tree = Eagle2Drafter(case.model, head, depth=3, top_k=3, num_nodes=8, captured_head=True)
    with pytest.raises(ValueError, match="captured_head covers EAGLE's chain and EAGLE-2's greedy trees over a text "
                                         "EagleHead, not Eagle2Drafter with EagleHead here"):
        mmspec.generate(captured, drafter=tree, max_new_tokens=4, do_sample=True, **case.inputs)  # (sampled trees)
    drafter = EagleDrafter(case.model, head, num_draft_tokens=4)
    chain = CapturedEagleChain(head, drafter.embed, drafter.lm_head, 4, SamplingConfig(), capacity=16)
    with pytest.raises(ValueError, match="holds 16 head positions and this step needs 18; raise the captured target's max_length"):
        chain(torch.zeros(1, 2, head.fc.out_features), torch.ones(1, 2, dtype=torch.long), 12, None)


def test_sampling_repeats_the_plain_targets_draws():
    case, plain, captured = pair()
    outs = [mmspec.generate(t, drafter="prompt-lookup", max_new_tokens=16, do_sample=True, seed=5, **case.inputs)
            for t in (plain, captured)]
    assert torch.equal(outs[1].sequences, outs[0].sequences)


@torch.no_grad()
def test_what_it_does_not_cover_is_refused_in_one_line():
    case, _, captured = pair()
    first, _ = captured.prefill(case.inputs)
    captured.prefill(case.inputs)  # a new sequence takes the static buffers
    with pytest.raises(ValueError, match="started another sequence"):
        captured.forward(first, torch.tensor([[1]]))
    short = CapturedTransformersTarget(case.model, max_length=case.inputs["input_ids"].shape[1] + 2, buckets=BUCKETS)
    state, _ = short.prefill(case.inputs)
    with pytest.raises(ValueError, match="past this captured target's max_length"):
        short.forward(state, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="pass a larger max_length"):
        CapturedTransformersTarget(case.model, max_length=4).prefill(case.inputs)
    with pytest.raises(ValueError, match="exceeds the largest captured size 32"):
        captured.forward(captured.prefill(case.inputs)[0], torch.ones(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="one sequence at a time"):
        captured.prefill_rows([case.inputs, case.inputs])
    with pytest.raises(ValueError, match="drop cuda_graphs"):
        CapturedTransformersTarget(make_tiny("gemma3").model)
    with pytest.raises(ValueError, match="increasing positive sizes"):
        CapturedTransformersTarget(case.model, buckets=(4, 2))


def test_the_pipeline_refuses_cuda_graphs_off_cuda_before_loading():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        mmspec.pipeline("image-captioning", model="/nonexistent", device="cpu", cuda_graphs=True)
