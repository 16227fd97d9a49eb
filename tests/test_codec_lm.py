"""The embedded voice's codec LM (phoneme prefix + delay-pattern steps with an end code) through
the delay-pattern target: the training layout and the inference stream agree (a tiny model fitted
to one utterance regenerates it and stops by itself, with every chain drafter), and sampled streams
of variable length follow the target's distribution exactly (ladder levels 2-3); the same for the
aligned codec LM (durations per phoneme as an input), whose alignment rows are checked by hand."""

import pytest
import torch

import mmspec
from mmspec.adapters.audio.delay import DelayPatternTarget
from mmspec.core.sampling import SamplingConfig, logits_to_probs
from mmspec.drafters import CodecEagleDrafter, CodecMedusaDrafter, ModelDrafter, StepAwareDrafter, StepCompletionDrafter
from mmspec.drafters.steps import CODEC_TREE
from mmspec.modeling.heads import DraftHeads, EagleHead
from mmspec.modeling.codec_lm import TIMING_BUCKETS, CodecLM, CodecLMConfig, delayed_steps, frame_alignment
from kernel_support import Int8Linear
from distribution_check import joint_pvalue, two_stage

PHONEMES = torch.tensor([[5, 9, 3, 7, 2]])
DURATIONS = torch.tensor([[1, 2, 0, 2, 1]])  # 6 frames (phoneme 3 is skipped)


def tiny(seed, codebooks=3, codes=8, layers=2, dim=32, aligned=False):
    torch.manual_seed(seed)
    config = CodecLMConfig(text_vocab=12, num_codebooks=codebooks, codebook_size=codes, dim=dim, layers=layers, heads=2,
                           ffn=64, max_positions=128, aligned=aligned)
    return CodecLM(config).eval()


def inputs(model, durations=DURATIONS):
    return {"phoneme_ids": PHONEMES, **({"durations": durations} if model.config.aligned else {})}


def test_alignment_rows_by_hand():
    rows = frame_alignment(PHONEMES[0], DURATIONS[0], torch.arange(8), end_id=12)
    b = TIMING_BUCKETS
    expected = [[5, 9, 0, b + 0],  # frame 0: phoneme 5 (1 frame); two frames ahead: 9
                [9, 7, 0, b + 1],  # frame 1: 9, first of 2
                [9, 7, 1, b + 0],
                [7, 2, 0, b + 1],  # 3 is skipped (0 frames)
                [7, 12, 1, b + 0],  # two ahead is past the end
                [2, 12, 0, b + 0],
                [12, 12, 0, b + 0],  # past the last frame: the end id
                [12, 12, 0, b + 0]]
    assert rows.tolist() == expected
    long = frame_alignment(torch.tensor([4]), torch.tensor([20]), torch.tensor([15]), end_id=12)
    assert long.tolist() == [[4, 4, b - 1, b + 4]]  # spent 15 and left 4 are clipped to the buckets


def test_predicted_durations_round_on_the_running_sum():
    model = tiny(0, aligned=True)
    with torch.no_grad():
        model.durations.out.weight.zero_()
        model.durations.out.bias.fill_(float(torch.log1p(torch.tensor(1.4))))  # 1.4 frames per phoneme
    frames = model.predict_durations(PHONEMES)
    assert frames.tolist() == [[1, 2, 1, 2, 1]] and int(frames.sum()) == round(5 * 1.4)
    assert int(model.predict_durations(PHONEMES, speed=2.0).sum()) == round(5 * 0.7)
    with pytest.raises(ValueError, match="not aligned"):
        tiny(0).predict_durations(PHONEMES)


def test_training_layout_matches_the_stream():
    model = tiny(0)
    target = DelayPatternTarget(model)
    codes = torch.randint(0, 8, (3, 5), generator=torch.Generator().manual_seed(0))
    steps, targets = delayed_steps(codes, model.config)
    stream = target.stream_ids(codes)
    # the training inputs after the begin step are the stream's steps (model ids), then the end step
    assert torch.equal(steps[1:], target.model_ids(stream.view(-1, 3)))
    assert targets[5, 0] == model.config.end_code and (targets[6:, 0] == -100).all()
    assert torch.equal(target.codes(stream), codes)
    # cut by the token budget right after the end code (codebooks 1, 2 still owe frames 4 and 3-4):
    # the audio is the frames every codebook holds
    cut = stream[: 6 * 3]  # steps 1..6: codebook 0's end code sits in step 6
    assert torch.equal(target.codes(cut), codes[:, :4])


@pytest.fixture(scope="module", params=[False, True], ids=["unaligned", "aligned"])
def fitted(request):
    """A tiny codec LM (unaligned / aligned) trained until it reproduces one utterance greedily."""
    model = tiny(1, aligned=request.param).train()
    codes = torch.randint(0, 8, (3, 6), generator=torch.Generator().manual_seed(1))
    steps, targets = delayed_steps(codes, model.config)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    extra = {}
    if model.config.aligned:
        extra = {"alignment": frame_alignment(PHONEMES[0], DURATIONS[0], torch.arange(steps.shape[0]), 12)[None],
                 "durations": DURATIONS}
    for _ in range(150):
        losses = model.loss(PHONEMES, torch.ones_like(PHONEMES), steps[None], torch.ones(1, steps.shape[0], dtype=torch.long),
                            targets[None], **extra)
        loss = losses["codes"]
        optimiser.zero_grad()
        sum(losses.values()).backward()
        optimiser.step()
    assert loss.item() < 0.05
    return model.eval(), codes


def random_heads(seed, dim=32, heads=2):
    torch.manual_seed(seed)
    return DraftHeads(dim, heads, "medusa")


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "sjd", "step", "step-aware", "medusa"])
def test_a_fitted_model_says_its_utterance_and_stops(fitted, drafter):
    model, codes = fitted
    target = DelayPatternTarget(model)
    if drafter == "step":
        drafter = StepCompletionDrafter()
    elif drafter == "step-aware":  # an untrained draft: its steps are mostly rejected, the known codes never
        drafter = StepAwareDrafter(DelayPatternTarget(tiny(5, layers=1, aligned=model.config.aligned)), num_draft_tokens=5)
    elif drafter == "medusa":  # untrained heads
        drafter = CodecMedusaDrafter(random_heads(6))
    out = mmspec.generate(target, drafter=drafter, max_new_tokens=200, **inputs(model))
    generated = out.sequences[0, 3:]
    if isinstance(drafter, StepCompletionDrafter):  # one verification per step: 6 frames + 3 delay steps
        assert out.stats.verify_steps == 6 + 3 - 1 and out.stats.accepted == out.stats.drafted
    assert generated[-1] == target.stop_id and out.stats.new_tokens == target.stream_length(6) + 1
    assert torch.equal(target.codes(generated), codes)


def test_bad_phonemes(fitted):
    target = DelayPatternTarget(fitted[0])
    with pytest.raises(ValueError, match="needs phoneme_ids"):
        mmspec.generate(target, max_new_tokens=10)
    with pytest.raises(ValueError, match=r"phoneme_ids must lie in \[0, 12\)"):
        mmspec.generate(target, max_new_tokens=10, phoneme_ids=torch.tensor([[3, 40]]))
    if fitted[0].config.aligned:
        for durations in (None, torch.tensor([[1, 2]]), torch.tensor([[1, 2, 0, -1, 1]]), torch.zeros(1, 5, dtype=torch.long),
                          DURATIONS.float()):
            with pytest.raises(ValueError, match="needs durations, a LongTensor"):
                mmspec.generate(target, max_new_tokens=10, phoneme_ids=PHONEMES, durations=durations)
    else:
        with pytest.raises(ValueError, match="durations"):  # an unaligned target takes none
            mmspec.generate(target, max_new_tokens=10, phoneme_ids=PHONEMES, durations=DURATIONS)


# ---- sampling with a model-chosen length ------------------------------------------------------------
K2, C2, BUDGET, RUNS = 2, 2, 8, 2000
SHORT = torch.tensor([[1, 1, 0, 0, 0]])  # 2 frames: an aligned stream ends (at its durations) within BUDGET
TEMPERATURE = 1.0


def small(seed, layers=2, aligned=False, codebooks=K2):
    model = tiny(seed, codebooks=codebooks, codes=C2, layers=layers, aligned=aligned)
    with torch.no_grad():
        model.heads.weight.mul_(8.0)
    return DelayPatternTarget(model)


def exact_streams(target):
    """Probability of every generated stream (up to BUDGET sub-tokens or the stop id)."""
    config = SamplingConfig(do_sample=True, temperature=TEMPERATURE)
    out = {}

    def walk(prefix, p):
        if prefix and (prefix[-1] == target.stop_id or len(prefix) == BUDGET):
            out[tuple(prefix)] = p
            return
        state, first = target.prefill(inputs(target.model, SHORT))
        logits = first.logits if not prefix else target.forward(state, torch.tensor([prefix])).logits[:, -1:]
        probs = logits_to_probs(logits[0, -1], config)
        for token in probs.nonzero().flatten().tolist():
            walk(prefix + [token], p * float(probs[token]))

    with torch.no_grad():
        walk([], 1.0)
    return out


@pytest.mark.parametrize("drafter,aligned", [("draft", False), ("sjd", False), ("step", False), ("draft", True),
                                             ("step-aware", True), ("medusa", True), ("eagle", True), ("medusa-tree", True),
                                             ("eagle-tree", True), ("sjd-single", True), ("eagle-fused", True),
                                             ("eagle-fused-int8", True), ("eagle-top1", True)])
def test_sampled_streams_follow_the_target(drafter, aligned):
    """medusa-tree / eagle-tree / sjd-single: a single-stream LM (a VALL-E-style AR stage) verifying
    Medusa's or EAGLE's static tree / SJD's window; eagle-fused: EAGLE's chain on a single stream
    through the fused C chain (few-row linears); eagle-fused-int8: that chain on the head's int8
    copy (its q are the int8 head's, which the rule reads); eagle-top1: the head's most likely codes
    after the step's sampled known codes (point masses, q one-hot), still exact."""
    fused = drafter.startswith("eagle-fused") if drafter else False
    if fused and not _fused_chain_runs(torch.float32):
        pytest.skip("the fused kernels do not run here")
    target = small(2, aligned=aligned, codebooks=1 if fused or drafter in ("medusa-tree", "eagle-tree", "sjd-single") else K2)
    if fused:
        mmspec.optimize(target.model, kernel="c")
    exact = exact_streams(target)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-4)
    assert any(s[-1] == target.stop_id for s in exact)  # some streams end by themselves
    counts, accepted = {}, 0
    draft, heads = small(3, layers=1, aligned=aligned), random_heads(3)  # built once, a new drafter per run
    torch.manual_seed(4)
    eagle = EagleHead(target.model.backbone.config).eval()
    chains = []  # eagle-fused: whether each draft came from the C chain
    if fused:
        mmspec.optimize(eagle, kernel="c")

    def fused_eagle():
        d = CodecEagleDrafter(eagle, num_draft_tokens=3, int8_head=drafter == "eagle-fused-int8")
        steps = d._fused_steps
        d._fused_steps = lambda *args: chains.append(steps(*args)) or chains[-1]
        return d

    def draw(seed):
        nonlocal accepted
        d = {"draft": lambda: ModelDrafter(draft, num_draft_tokens=3),
             "step-aware": lambda: StepAwareDrafter(draft, num_draft_tokens=3),
             "medusa": lambda: CodecMedusaDrafter(heads, num_draft_tokens=3),
             "medusa-tree": lambda: CodecMedusaDrafter(heads),
             "sjd-single": lambda: "sjd",
             "eagle": lambda: CodecEagleDrafter(eagle, num_draft_tokens=3),
             "eagle-top1": lambda: CodecEagleDrafter(eagle, num_draft_tokens=3, top1=True),
             "eagle-tree": lambda: CodecEagleDrafter(eagle, tree_paths=CODEC_TREE),
             "eagle-fused": fused_eagle,
             "eagle-fused-int8": fused_eagle,
             "step": StepCompletionDrafter}.get(drafter, lambda: drafter)()
        out = mmspec.generate(target, drafter=d, max_new_tokens=BUDGET, **inputs(target.model, SHORT), do_sample=True,
                              temperature=TEMPERATURE, seed=seed, num_draft_tokens=3)
        accepted += out.stats.accepted
        assert (out.stats.tree_nodes > 0) == (drafter in ("medusa-tree", "eagle-tree"))
        key = tuple(out.sequences[0, target.num_codebooks:].tolist())
        counts[key] = counts.get(key, 0) + 1

    runs, found = two_stage(RUNS, draw, lambda n: [joint_pvalue(counts, exact, n)])
    assert accepted > 0.15 * runs or (drafter == "step" and accepted > 0)  # step drafts exist only mid-step
    assert not fused or (len(chains) > runs and all(c is not None for c in chains))
    assert found[0] > 1e-4


@pytest.mark.parametrize("drafter", [None, "sjd"])
def test_an_aligned_model_says_exactly_its_durations_frames(drafter):
    """Even untrained and sampled, the audio lasts the durations' total (no early or late end)."""
    target = DelayPatternTarget(tiny(8, aligned=True))
    for seed in range(3):
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=200, do_sample=True, seed=seed, **inputs(target.model))
        assert target.codes(out.sequences[0, 3:]).shape[1] == int(DURATIONS.sum())


def test_a_tree_forward_gives_each_node_its_paths_chain_logits_and_keeps_the_accepted_path():
    """On a single-stream LM every node of a token tree gets the logits a chain forward over its
    path gives, and committing a path leaves the state a chain over it would have left."""
    from mmspec.core.tree import TokenTree

    target = DelayPatternTarget(tiny(5, codebooks=1, aligned=True))
    assert target.supports_trees and not DelayPatternTarget(tiny(5, aligned=True)).supports_trees
    prompt, pending = [1, 4], 6  # committed codes, then the pending one
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    tree = TokenTree.from_paths(paths, torch.tensor([2, 7, 0, 3, 5, 1]))

    def chain_state(tokens):
        state, _ = target.prefill(inputs(target.model))
        out = target.forward(state, torch.tensor([tokens]), hidden_layer=-1)
        return state, out

    state, _ = chain_state(prompt)
    state.commit(torch.tensor([prompt + [pending]]))
    rooted = tree.prepend_root(pending)
    out = target.forward(state, rooted.tokens[None], hidden_layer=-1, tree=rooted)
    assert out.logits.shape == (1, tree.size + 1, target.vocab_size)
    for node in range(tree.size + 1):
        path = rooted.path_to(node)
        _, chain = chain_state(prompt + [int(rooted.tokens[i]) for i in path])
        torch.testing.assert_close(out.logits[0, node], chain.logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden_states[0, node], chain.hidden_states[0, -1], atol=1e-4, rtol=1e-4)
    accepted = torch.tensor([1, 4])  # nodes (1,) and (1, 0): codes 7, 5
    state.commit(torch.tensor([[7, 5, 3]]), path=accepted)
    reference, _ = chain_state(prompt + [pending, 7, 5])
    reference.commit(torch.tensor([prompt + [pending, 7, 5, 3]]))
    mine, theirs = state.cache, reference.cache
    assert torch.equal(mine.stream, theirs.stream) and mine.steps_cached == theirs.steps_cached
    for table in ("step_logits", "step_hidden"):  # what each kept step predicted (the EAGLE drafter reads f_t)
        rows = [(a, b) for a, b in zip(getattr(mine, table), getattr(theirs, table)) if b is not None]
        assert len(getattr(mine, table)) == len(getattr(theirs, table)) and len(rows) >= 4  # the path's among them
        for a, b in rows:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    after = target.forward(state, torch.tensor([[3, 2]]))
    torch.testing.assert_close(after.logits, target.forward(reference, torch.tensor([[3, 2]])).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="several codebooks"):
        several = DelayPatternTarget(tiny(5, aligned=True))
        state, _ = several.prefill(inputs(several.model))
        several.forward(state, rooted.tokens[None], tree=rooted)


@torch.no_grad()
def test_eagle_tree_nodes_are_what_the_head_gives_along_their_paths():
    """On a single stream, the EAGLE tree's head features at each node equal those of feeding the
    node's ancestors one by one as a chain (causal, its own cache), and each node is the code the
    head ranks where its path says: the batched tree forwards see exactly their ancestors, at their
    steps' positions."""
    from mmspec.core.cache import crop_cache
    from mmspec.core.drafter import DraftContext

    target = DelayPatternTarget(tiny(2, codebooks=1, codes=8, aligned=True))
    torch.manual_seed(4)
    head = EagleHead(target.model.backbone.config).eval()
    state, _ = target.prefill(inputs(target.model, DURATIONS), hidden_layer=-1)
    for token in (5, 0, 3):  # plain decoding of forced codes: the head catches up with committed steps
        target.forward(state, state.tokens[:, -1:], hidden_layer=-1)
        state.commit(torch.tensor([[token]]))
    context = DraftContext(target, SamplingConfig(do_sample=False), torch.Generator(), {})
    drafter, chain = CodecEagleDrafter(head, tree_paths=CODEC_TREE), CodecEagleDrafter(head)
    drafter.start(context, state)
    chain.start(context, state)
    seen = []  # (step, features [m, D]) each time the tree ranks children
    ranks = drafter._children
    drafter._children = lambda state, step, features, width: seen.append((step, features)) or ranks(state, step, features, width)
    tree, paths = drafter.propose(state, 8).tree, drafter.paths
    assert tree.size == len(paths) == 9 and drafter.describe()["tree"] == "static" and chain.paths is None
    a = state.length - 1
    parents = [()] + [p for p in paths if any(q[:-1] == p for q in paths)]  # the root, then each depth's frontier
    assert [step for step, _ in seen] == [a + 1 + depth for depth in range(len(seen))]
    features = dict(zip(parents, torch.cat([f for _, f in seen])))
    for node, path in enumerate(paths):
        feature = chain._feed_root(state, state.tokens[0], a)  # the committed pairs (first time) and step a's
        committed = chain.cache.get_seq_length() - 1
        for depth in range(1, len(path)):
            code = tree.tokens[paths.index(path[:depth])].view(1)
            feature = chain._run(feature, chain._step_inputs(state, code, a + depth), a + depth)
        crop_cache(chain.cache, committed)
        torch.testing.assert_close(features[path[:-1]], feature[0, 0], atol=1e-5, rtol=1e-5)
        ranked = ranks(state, a + len(path), feature[0], 3)[0]
        assert int(tree.tokens[node]) == int(ranked[path[-1]]), path


def test_alignment_inputs_come_from_a_table_equal_to_frame_alignment():
    """CodecLMSteps looks a step's alignment inputs up in a per-utterance table: the embeddings of
    frame_alignment's rows for every frame and past the last one, rebuilt for new durations."""
    from mmspec.modeling.codec_lm import CodecLM, CodecLMConfig, CodecLMSteps, frame_alignment

    steps_model = CodecLMSteps(CodecLM(CodecLMConfig(text_vocab=20, num_codebooks=1, codebook_size=8, dim=16, layers=1,
                                                     heads=2, ffn=16, aligned=True)))
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        count = int(torch.randint(1, 8, (), generator=gen))
        phonemes = torch.randint(0, 20, (1, count), generator=gen)
        durations = torch.randint(0, 4, (1, count), generator=gen)
        durations[0, 0] += 1
        index = torch.arange(0, int(durations.sum()) + 5)
        rows = frame_alignment(phonemes[0], durations[0], index, steps_model.model.separator)
        want = steps_model.model.embed_alignment(rows)
        conditioning = {"phoneme_ids": phonemes, "durations": durations}
        assert torch.equal(steps_model.alignment_embeddings(conditioning, index), want)
        assert torch.equal(steps_model.alignment_embeddings(conditioning, index.flip(0)), want.flip(0))  # the cached table
        assert steps_model.num_frames(conditioning) == int(durations.sum())


def _fused_chain_runs(dtype) -> bool:
    from mmspec.modeling.fast_linear import KernelUnavailable, bf16_kernel_available, load_kernel
    from mmspec.modeling.fused import fused_enabled

    try:
        load_kernel()
    except KernelUnavailable:
        return False
    return fused_enabled() and (dtype == torch.float32 or bf16_kernel_available())


def _fused_eagle_models(target_model, dtype):
    """A one-codebook target and an EAGLE head whose linears are few-row linears (the fused chain's)."""
    target = DelayPatternTarget(target_model.to(dtype))
    torch.manual_seed(4)
    head = EagleHead(target.model.backbone.config).eval().to(dtype)
    for model in (target.model, head):
        assert mmspec.optimize(model, kernel="c").replaced > 0
    return target, head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned,do_sample", [(True, True), (True, False), (False, True)])
@torch.no_grad()
def test_the_fused_eagle_chain_drafts_what_the_loop_drafts(dtype, aligned, do_sample):
    """On a one-codebook LM whose head and projections run fused, the C chain (the root's pairs,
    then per code the output head, the draw and the next head forward in one call) drafts the
    Python loop's codes with its q (float rounding) from the same generator, and leaves the head's
    cache as the loop does, step after step."""
    if not _fused_chain_runs(dtype):
        pytest.skip("the fused kernels do not run here (or no bf16 kernel)")
    target, head = _fused_eagle_models(tiny(2, codebooks=1, codes=8, aligned=aligned), dtype)
    state, _ = target.prefill(inputs(target.model, DURATIONS), hidden_layer=-1)
    fused, loop = (CodecEagleDrafter(head, num_draft_tokens=4, int8_head=False) for _ in range(2))
    for mine, theirs in _side_by_side(target, state, fused, loop, SamplingConfig(do_sample=do_sample, temperature=0.9)):
        assert torch.equal(mine.tokens, theirs.tokens) and mine.tokens.shape == (1, 4)
        if do_sample:
            assert mine.probs.shape == theirs.probs.shape
            torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-6, rtol=1e-5)
        else:
            assert mine.probs is None and theirs.probs is None
        assert fused.cache.get_seq_length() == loop.cache.get_seq_length() and fused.fed == loop.fed
        length = fused.cache.get_seq_length()
        assert torch.equal(fused.cache.layers[0].keys[..., :length, :], loop.cache.layers[0].keys[..., :length, :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_top1_chain_drafts_the_greedy_chain_under_sampling(dtype):
    """top1=True (eagle-topk's drafter): under sampling the fused chain and the Python loop both
    draft the head's most likely codes, the chain greedy decoding's drafter gives (q None: no
    distribution is drawn from)."""
    if not _fused_chain_runs(dtype):
        pytest.skip("the fused kernels do not run here (or no bf16 kernel)")
    target, head = _fused_eagle_models(tiny(2, codebooks=1, codes=8, aligned=True), dtype)
    drafts = []
    for top1, sampling in ((True, SamplingConfig(do_sample=True, temperature=1.0)), (False, SamplingConfig(do_sample=False))):
        state, _ = target.prefill(inputs(target.model, DURATIONS), hidden_layer=-1)
        fused, loop = (CodecEagleDrafter(head, num_draft_tokens=4, int8_head=False, top1=top1) for _ in range(2))
        pairs = list(_side_by_side(target, state, fused, loop, sampling))
        assert all(torch.equal(a.tokens, b.tokens) and a.probs is None and b.probs is None for a, b in pairs)
        drafts.append([a.tokens for a, _ in pairs])
        assert fused.describe().get("draws") == ("top-1" if top1 else None)
    assert all(torch.equal(a, b) for a, b in zip(*drafts))


def _side_by_side(target, state, fused, loop, sampling):
    """The fused chain's drafter and the Python loop's (its chain call switched off) on one script:
    commit steps 5, 0, 3, 7, 1; the drafters start after the second (the heads first catch up on two
    committed steps and the pending one), each with its own generator of seed 7, and propose after
    each step from then on. Yields (fused draft, loop draft) four times; checks that every fused
    draft came from the C chain."""
    from mmspec.core.drafter import DraftContext

    chain_calls, fused_steps = [], fused._fused_steps
    fused._fused_steps = lambda *args: chain_calls.append(fused_steps(*args)) or chain_calls[-1]
    loop._fused_steps = lambda *args: None  # the Python loop
    for step, token in enumerate((5, 0, 3, 7, 1)):
        target.forward(state, state.tokens[:, -1:], hidden_layer=-1)
        state.commit(torch.tensor([[token]]))
        if step == 1:
            for drafter in (fused, loop):
                drafter.start(DraftContext(target, sampling, torch.Generator().manual_seed(7), {}), state)
        if step >= 1:
            yield fused.propose(state, 8), loop.propose(state, 8)
    assert len(chain_calls) == 4 and all(call is not None for call in chain_calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_int8_eagle_chain_drafts_what_the_loop_drafts_through_int8_linears(dtype):
    """int8_head=True: the C chain reads the head's layer and fc as int8 (pack_int8); the Python
    loop with those linears replaced by the int8 kernel as modules drafts the same codes with the
    same q (float rounding), step after step, so the chain feeds every weight where it belongs."""
    import copy

    if not _fused_chain_runs(dtype):
        pytest.skip("the fused kernels do not run here (or no bf16 kernel)")
    target, head = _fused_eagle_models(tiny(2, codebooks=1, codes=16, aligned=True), dtype)
    quantized = copy.deepcopy(head)
    for parent in [quantized] + list(quantized.decoder.layers[0].children()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
    state, _ = target.prefill(inputs(target.model, DURATIONS), hidden_layer=-1)
    fused, loop = CodecEagleDrafter(head, num_draft_tokens=4, int8_head=True), CodecEagleDrafter(quantized, num_draft_tokens=4)
    for mine, theirs in _side_by_side(target, state, fused, loop, SamplingConfig(do_sample=True, temperature=0.9)):
        assert torch.equal(mine.tokens, theirs.tokens)
        torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-6, rtol=1e-5)
    assert fused.describe()["chain_int8"]


@pytest.mark.parametrize("top_k", [None, 3])
@torch.no_grad()
def test_the_fused_eagle_chain_steps_aside_where_it_does_not_apply(top_k):
    """Top-k sampling (the chain draws by temperature only) and a target of several codebooks go
    through the Python loop."""
    from mmspec.core.drafter import DraftContext

    if not _fused_chain_runs(torch.float32):
        pytest.skip("the fused kernels do not run here")
    codebooks = 1 if top_k else 2
    target, head = _fused_eagle_models(tiny(2, codebooks=codebooks, codes=8, aligned=True), torch.float32)
    state, _ = target.prefill(inputs(target.model, DURATIONS), hidden_layer=-1)
    for token in (5, 0, 3, 7)[: 2 * codebooks]:
        target.forward(state, state.tokens[:, -1:], hidden_layer=-1)
        state.commit(torch.tensor([[token]]))
    drafter = CodecEagleDrafter(head, num_draft_tokens=3)
    drafter.start(DraftContext(target, SamplingConfig(do_sample=True, top_k=top_k), torch.Generator().manual_seed(0), {}), state)
    calls, fused_steps = [], drafter._fused_steps
    drafter._fused_steps = lambda *args: calls.append(fused_steps(*args)) or calls[-1]
    assert drafter.propose(state, 8).tokens.shape[1] == 3 and calls and calls[-1] is None
