"""Captured forwards (:mod:`mmspec.core.captured`): the static path a CUDA graph records — a static
KV cache, inputs padded to a bucket, the chain or tree mask written into a full-capacity mask — run
eagerly on the CPU gives the plain target's logits, rollbacks and tree compaction, and the same
tokens under every drafter (tests/test_gpu.py replays the captured graphs on CUDA)."""

import pytest
import torch
from tiny_models import tiny_llamagen

import mmspec
from mmspec.adapters.image_gen import LlamaGenTarget
from mmspec.core.captured import GraphRunner
from mmspec.core.tree import TokenTree
from mmspec.drafters import ImageEagle2Drafter, ImageEagleDrafter
from mmspec.drafters.image_eagle import CapturedHeadChain
from mmspec.modeling.heads import ImageEagleConfig, ImageEagleHead

VOCAB, SIDE, PREFIX, CAPTION_DIM = 16, 4, 3, 8
CAPTION = torch.randn(1, PREFIX, CAPTION_DIM, generator=torch.Generator().manual_seed(3))
INPUTS = {"caption": CAPTION, "guidance_scale": 2.0}


def pair(buckets=(1, 2, 4, 8)):
    plain = tiny_llamagen(0, 32, VOCAB, SIDE, PREFIX, CAPTION_DIM)
    return plain, LlamaGenTarget(plain.model, captured=True, buckets=buckets)


def test_runner_pads_to_the_smallest_bucket_and_refuses_larger_forwards():
    runner = GraphRunner(lambda x: (x * 2,), lambda b: {"x": torch.full((b,), float(b))}, buckets=(1, 4, 8))
    assert [runner.bucket(n) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8] and not runner.captured
    assert torch.equal(runner.run(4)[0], torch.full((4,), 8.0))
    with pytest.raises(ValueError, match="exceeds the largest captured size 8"):
        runner.bucket(9)
    with pytest.raises(ValueError, match="increasing positive sizes"):
        GraphRunner(lambda x: (x,), lambda b: {"x": torch.zeros(b)}, buckets=(4, 2))


@torch.no_grad()
def test_chain_forwards_and_rollback_give_the_plain_logits():
    plain, captured = pair()
    (p_state, p_out), (c_state, c_out) = plain.prefill(INPUTS, hidden_layer=-1), captured.prefill(INPUTS, hidden_layer=-1)
    torch.testing.assert_close(c_out.logits, p_out.logits, atol=1e-5, rtol=1e-5)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    for state, target in ((p_state, plain), (c_state, captured)):
        state.commit(tokens[:, :1])
    for n in (3, 1, 6):  # buckets 4, 1, 8: padded inputs, then a rollback past them
        p = plain.forward(p_state, tokens[:, :n], hidden_layer=-1)
        c = captured.forward(c_state, tokens[:, :n], hidden_layer=-1)
        torch.testing.assert_close(c.logits, p.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.hidden_states, p.hidden_states, atol=1e-5, rtol=1e-5)
        for state in (p_state, c_state):
            state.rollback(state.length)
    assert c_state.cache_length == p_state.cache_length


@torch.no_grad()
def test_tree_forward_and_compaction_give_the_plain_logits():
    plain, captured = pair()
    states = [t.prefill(INPUTS)[0] for t in (plain, captured)]
    for state in states:
        state.commit(torch.tensor([[7]]))
    tree = TokenTree(torch.tensor([2, 5, 6, 1, 3]), torch.tensor([-1, -1, 0, 0, 2]))
    rooted = tree.prepend_root(7)  # a verification forward's layout: [pending, node_0 .. node_4]
    outs = [t.forward(s, rooted.tokens[None], tree=rooted) for t, s in zip((plain, captured), states)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
    for state in states:  # accept the path 0 -> 2 -> 4 and its bonus token
        state.commit(torch.tensor([[2, 6, 3, 0]]), path=torch.tensor([0, 2, 4]))
    after = [t.forward(s, torch.tensor([[0, 4]])) for t, s in zip((plain, captured), states)]
    torch.testing.assert_close(after[1].logits, after[0].logits, atol=1e-5, rtol=1e-5)


def head(seed=5):
    torch.manual_seed(seed)
    return ImageEagleHead(ImageEagleConfig(dim=32, n_head=2, grid=(SIDE, SIDE))).eval()


@pytest.mark.parametrize("drafter", [None, "sjd", "prompt-lookup", "eagle", "eagle2"])
def test_greedy_decoding_is_token_identical(drafter):
    plain, captured = pair(buckets=(1, 2, 4, 8, 16))
    outs, drafters = [], []
    for target in (plain, captured):
        d = drafter
        if drafter == "eagle":
            d = ImageEagleDrafter(target, head(), num_draft_tokens=3)
        if drafter == "eagle2":
            d = ImageEagle2Drafter(target, head(), depth=3, top_k=2, num_nodes=6)
        drafters.append(d)
        out = mmspec.generate(target, drafter=d, max_new_tokens=SIDE * SIDE, do_sample=False, **INPUTS)
        outs.append(out.sequences)
        if drafter == "eagle":  # the chain drafts through captured head forwards for the captured target only
            assert out.stats.config["captured_head"] is (target is captured)
    assert torch.equal(outs[1], outs[0])


def test_sampled_eagle_chains_repeat_the_plain_drafters_draws():
    """Under sampling with one seed, the captured head's drafts (and so every draw) are the plain
    head's: the same tokens and the same acceptance counts."""
    plain, captured = pair(buckets=(1, 2, 4, 8, 16))
    outs = [mmspec.generate(t, drafter=ImageEagleDrafter(t, head(), num_draft_tokens=3), max_new_tokens=SIDE * SIDE,
                            do_sample=True, seed=11, **INPUTS) for t in (plain, captured)]
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    assert outs[1].stats.accepted_per_position == outs[0].stats.accepted_per_position


def test_eagle2_measures_its_tree_budget_on_the_live_sequence_of_a_captured_target():
    """EAGLE-2's timed tree budget measures C(n) at the first generation of a model (a GPU check
    found it prefilling a second sequence into the captured target's one static cache, which ended
    the generation's own): measured on the live sequence, the generation goes on and its tokens
    are the plain target's."""
    from mmspec.core import cost

    plain, captured = pair(buckets=(1, 2, 4, 8, 16, 32, 64))
    outs = []
    for target in (captured, plain):
        cost._CURVES.clear()  # each target measures its own curve in the middle of its generation
        drafter = ImageEagle2Drafter(target, head(), depth=3, top_k=2, num_nodes="auto", budget="timed")
        outs.append(mmspec.generate(target, drafter=drafter, max_new_tokens=SIDE * SIDE, do_sample=False, **INPUTS))
        assert len(cost._CURVES) == 1
    assert torch.equal(outs[0].sequences, outs[1].sequences)


@torch.no_grad()
def test_captured_head_forwards_equal_the_heads_own():
    """Chain forwards through padded buckets, a crop (rejected drafts) and more forwards: the same
    predicted features as the head with a plain cache."""
    from mmspec.core.cache import crop_cache, make_cache

    h, plain = head(), tiny_llamagen(0, 32, VOCAB, SIDE, PREFIX, CAPTION_DIM)
    chain = CapturedHeadChain(h, plain.embed_codes, 2, (1, 2, 4, 8), torch.device("cpu"), torch.float32)
    cache = make_cache(None)
    features = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(0))
    codes = torch.randint(VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    start = 0
    for n, keep in ((3, 3), (1, 4), (5, 6), (2, 8)):  # buckets 4, 1, 8, 2; crop 3 after the 5
        got = chain(features[:, start : start + n], codes[:, start : start + n], start)
        want = h(features[:, start : start + n], plain.embed_codes(codes[:, start : start + n]), cache,
                 torch.arange(start, start + n)[None])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        crop_cache(chain.cache, keep)
        crop_cache(cache, keep)
        start = keep
    assert chain.cache.get_seq_length() == cache.get_seq_length() == 8


def test_one_sequence_at_a_time_and_no_batches():
    _, captured = pair()
    first, _ = captured.prefill(INPUTS)
    first.commit(torch.tensor([[1]]))
    second, _ = captured.prefill(INPUTS)
    with pytest.raises(ValueError, match="started another sequence"):
        captured.forward(first, torch.tensor([[1]]))
    captured.forward(second, torch.tensor([[1]]))  # the new sequence owns the buffers
    with pytest.raises(ValueError, match="one image at a time; use batch_size=1"):
        captured.prefill_rows([INPUTS, INPUTS])
    with pytest.raises(ValueError, match="exceeds the largest captured size 8"):
        captured.forward(second, torch.zeros(1, 9, dtype=torch.long))


def test_cuda_graphs_need_a_cuda_device_and_the_llamagen_layout():
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device and mmspec's LlamaGen-style layout"):
        mmspec.pipeline("text-to-image", device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        mmspec.pipeline("text-to-image", model="mar", method="cspd", device="cpu", cuda_graphs=True)
