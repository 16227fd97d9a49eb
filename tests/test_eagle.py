"""The EAGLE head: save/load, errors, and its training loss learning a tiny target's features.
(Greedy identity and distribution preservation of the EAGLE drafter: test_conformance.py and
test_distribution.py.)"""

import pytest
import torch
from kernel_support import Int8Linear
from tiny_models import make_tiny

import mmspec
from mmspec.adapters.hf import text_decoder
from mmspec.drafters import EagleDrafter
from mmspec.modeling.heads import EagleHead
from mmspec.train.drafter import collate, eagle_loss


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


@pytest.fixture(scope="module")
def records(tiny):
    """Self-distillation records of the tiny target: its own greedy continuations of 24 prompts,
    with its last hidden states and its layer-1 states (teacher-forced)."""
    model = tiny.model
    with torch.no_grad():
        records = []
        for seed in range(24):
            prompt = torch.randint(10, 400, (1, 6), generator=torch.Generator().manual_seed(seed))
            ids = model.generate(input_ids=prompt, max_new_tokens=24, do_sample=False)[0]
            learn = torch.zeros(len(ids), dtype=torch.bool)
            learn[6:] = True
            out = model.model(input_ids=ids[None], output_hidden_states=True)
            records.append({"ids": ids, "learn": learn, "features": out.last_hidden_state[0], "shallow": out.hidden_states[1][0]})
    return records


def test_save_load_roundtrip_and_width_check(tiny, tmp_path):
    torch.manual_seed(0)
    head = EagleHead(text_decoder(tiny.model).config)
    head.save(tmp_path / "head", target="tiny")
    loaded = EagleHead.load(tmp_path / "head", tiny.model)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    other = make_tiny("idefics3")
    if text_decoder(other.model).config.hidden_size != text_decoder(tiny.model).config.hidden_size:
        with pytest.raises(ValueError, match="width"):
            EagleHead.load(tmp_path / "head", other.model)
    with pytest.raises(FileNotFoundError, match="mmspec train drafter"):
        EagleHead.load(tmp_path / "nothing", tiny.model)


@pytest.mark.parametrize("name", ["eagle", "eagle2", "medusa", "hydra", "kangaroo"])
def test_spec_without_a_shipped_drafter_says_how_to_get_one(tiny, name):
    with pytest.raises(ValueError, match=f"{name}:PATH.*mmspec train drafter"):
        mmspec.generate(tiny.model, drafter=name, max_new_tokens=4, **tiny.inputs)


def test_trained_head_drafts_the_target(tiny, records):
    """A head trained on the target's own greedy continuations (features teacher-forced) drafts
    them: acceptance far above an untrained head's."""
    model = tiny.model
    torch.manual_seed(0)
    head = EagleHead(text_decoder(model).config)
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()

    def acceptance():
        drafter = EagleDrafter(model, head.eval(), num_draft_tokens=4)
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=24, input_ids=records[0]["ids"][None, :6])
        assert torch.equal(out.sequences[0], records[0]["ids"])  # lossless either way
        return out.stats.acceptance_rate

    before = acceptance()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    head.train()
    for step in range(300):
        loss, _ = eagle_loss(head, embed, lm_head, collate(records[step % 3 * 8 : step % 3 * 8 + 8]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = acceptance()
    assert after > before + 0.3, (before, after)


def test_eagle2_tree_scores_equal_sequential_head_runs(tiny):
    """Every node's cumulative confidence in the EAGLE-2 tree equals the one obtained by running the
    head along the node's path from scratch (no cache, no tree mask): the tree mask, positions and
    cache handling of the head are right."""
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.core.drafter import DraftContext
    from mmspec.core.sampling import SamplingConfig
    from mmspec.drafters import Eagle2Drafter

    model = tiny.model
    torch.manual_seed(1)
    head = EagleHead(text_decoder(model).config).eval()
    drafter = Eagle2Drafter(model, head, depth=3, top_k=3, num_nodes=21)  # 3 + 9 + 9 candidates: all kept
    target = TransformersTarget(model)
    with torch.inference_mode():
        state, prefill = target.prefill(tiny.inputs, hidden_layer=-1)
        state.tokens = torch.cat([state.tokens, prefill.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        drafter.start(DraftContext(target, SamplingConfig(), torch.Generator(), tiny.inputs), state)
        drafter.on_verified(0, 0, prefill)
        tree = drafter.propose(state, 10).tree
        assert tree.size == 21 and tree.max_depth == 3
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        features, tokens = prefill.hidden_states, state.tokens[:, 1:]
        for node in range(tree.size):
            seq_features, seq_tokens, score = features, tokens, 0.0
            for step in tree.path_to(node):
                positions = torch.arange(seq_tokens.shape[1])[None]
                predicted = head(seq_features, embed(seq_tokens), None, positions)[:, -1:]
                score += torch.log_softmax(lm_head(predicted[0, 0]).float(), -1)[tree.tokens[step]].item()
                seq_features = torch.cat([seq_features, predicted], dim=1)
                seq_tokens = torch.cat([seq_tokens, tree.tokens[step].view(1, 1)], dim=1)
            assert score == pytest.approx(tree.scores[node].item(), abs=1e-4), node


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_trained_heads_draft_the_target(tiny, records, kind, tmp_path):
    """Medusa / Hydra heads trained on the target's own greedy continuations raise acceptance;
    save/load keeps them; output stays identical to AR."""
    from mmspec.drafters import HydraDrafter, MedusaDrafter
    from mmspec.modeling.heads import DraftHeads
    from mmspec.train.drafter import heads_loss

    model = tiny.model
    torch.manual_seed(0)
    heads = DraftHeads(model.get_output_embeddings().weight.shape[1], num_heads=3, kind=kind)
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    cls = {"medusa": MedusaDrafter, "hydra": HydraDrafter}[kind]
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]

    def acceptance(h):
        out = mmspec.generate(model, drafter=cls(model, h.eval(), tree_paths=paths), max_new_tokens=24, input_ids=records[0]["ids"][None, :6])
        assert torch.equal(out.sequences[0], records[0]["ids"])
        return out.stats.mean_accepted_length

    before = acceptance(heads)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    heads.train()
    for step in range(200):
        loss, _ = heads_loss(heads, embed, lm_head, collate(records[step % 3 * 8 : step % 3 * 8 + 8]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = acceptance(heads)
    assert after > before + 0.3, (before, after)  # tau; measured 1.0 -> 1.44 (medusa)
    heads.save(tmp_path / kind)
    assert acceptance(DraftHeads.load(tmp_path / kind, model, kind)) == after
    with pytest.raises(ValueError, match="holds"):
        DraftHeads.load(tmp_path / kind, model, "hydra" if kind == "medusa" else "medusa")


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_heads_over_a_draft_vocabulary_smaller_than_the_trees_top_k(tiny, kind):
    """A head trained on a few short answers gets a draft vocabulary of fewer tokens than its tree's
    top-k: the drafter keeps the branches those tokens fill (it raised "selected index k out of
    range" at its first draft: the drafter audit after stop 86) and decodes exactly."""
    from mmspec.drafters import HydraDrafter, MedusaDrafter
    from mmspec.modeling.heads import DraftHeads

    model = tiny.model
    heads = DraftHeads(model.get_output_embeddings().weight.shape[1], num_heads=3, kind=kind).eval()
    cls = {"medusa": MedusaDrafter, "hydra": HydraDrafter}[kind]
    prompt = torch.randint(10, 400, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = mmspec.generate(model, max_new_tokens=12, input_ids=prompt).sequences
    drafter = cls(model, heads, draft_vocabulary=torch.tensor([11, 12]))  # 2 tokens: child indices 0 and 1
    assert drafter.top_k == 2 and drafter.paths and all(max(p) < 2 for p in drafter.paths)
    assert torch.equal(mmspec.generate(model, drafter=drafter, max_new_tokens=12, input_ids=prompt).sequences, plain)


def test_trained_kangaroo_adapter_drafts_the_target(tiny, records, tmp_path):
    """The adapter over the first layer's normalised states, trained on the target's own greedy
    continuations, raises acceptance; output identical to AR; save/load keeps it."""
    from mmspec.drafters import KangarooDrafter
    from mmspec.modeling.heads import KangarooAdapter
    from mmspec.train.drafter import kangaroo_loss

    model = tiny.model
    decoder = text_decoder(model)
    torch.manual_seed(0)
    adapter = KangarooAdapter(decoder.config)
    lm_head = model.get_output_embeddings().weight.detach()

    def acceptance(a):
        drafter = KangarooDrafter(model, a.eval(), exit_layer=1, num_draft_tokens=4, stop_threshold=0.0)
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=24, input_ids=records[0]["ids"][None, :6])
        assert torch.equal(out.sequences[0], records[0]["ids"])
        return out.stats.acceptance_rate

    before = acceptance(adapter)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=3e-3)
    adapter.train()
    for step in range(150):
        loss, _ = kangaroo_loss(adapter, decoder.norm, lm_head, collate(records[step % 3 * 8 : step % 3 * 8 + 8]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = acceptance(adapter)
    assert after > before + 0.3, (before, after)
    adapter.save(tmp_path / "k", exit_layer=1)
    assert acceptance(KangarooAdapter.load(tmp_path / "k", model)) == after


def test_kl_term_matches_the_target_distribution(tiny, records):
    """eagle_loss's KL(p || q) term: zero for a head that predicts the target's own next features
    (q = p), positive otherwise, and computed on the draft vocabulary's rows when one is given."""
    model = tiny.model
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    batch = collate(records[:4])
    exact = batch["features"].float()[:, 1:]
    noisy = exact + 3.0 * torch.randn(exact.shape, generator=torch.Generator().manual_seed(0))
    for predicted, kl_is_zero in ((exact, True), (noisy, False)):
        def head(features, token_embeds, cache, positions, predicted=predicted):
            assert features.shape[1] == positions.shape[1] == predicted.shape[1]
            return predicted
        base, _ = eagle_loss(head, embed, lm_head, batch)
        full, _ = eagle_loss(head, embed, lm_head, batch, kl_weight=1.0)
        restricted, _ = eagle_loss(head, embed, lm_head, batch, kl_weight=1.0, draft_vocabulary=torch.arange(10, 60))
        if kl_is_zero:
            assert full.item() == pytest.approx(base.item(), abs=1e-5) and restricted.item() == pytest.approx(base.item(), abs=1e-5)
        else:
            assert full.item() > base.item() + 1e-3 and restricted.item() > base.item() + 1e-4
            assert restricted.item() != pytest.approx(full.item(), abs=1e-4)


def _fused_model_and_head(dtype):
    """A copy of the tiny Llama and a random EAGLE head in ``dtype``, both through
    ``mmspec.optimize`` (few-row C linears), where the fused kernels run (else the test skips)."""
    import copy

    from mmspec.modeling.fast_linear import KernelUnavailable, bf16_kernel_available, load_kernel
    from mmspec.modeling.fused import fused_enabled

    try:
        runs = load_kernel() is not None and fused_enabled() and (dtype == torch.float32 or bf16_kernel_available())
    except KernelUnavailable:
        runs = False
    if not runs:
        pytest.skip("the fused kernels do not run here (or no bf16 kernel)")
    model = copy.deepcopy(make_tiny("llama").model).to(dtype)
    torch.manual_seed(1)
    head = EagleHead(text_decoder(model).config).eval().to(dtype)
    for module in (model, head):
        assert mmspec.optimize(module, kernel="c").replaced > 0
    return model, head


def _started(target, drafters, sampling=None, layers=-1, prompt=None):
    """Prefill the tiny prompt (``prompt``, default the ids 5 ... 13; its first token committed; the
    target's ``hidden_layer=layers``) and start every drafter on it, each with a generator seeded 3;
    returns the sequence state (inside inference mode)."""
    from mmspec.core.drafter import DraftContext
    from mmspec.core.sampling import SamplingConfig

    prompt = torch.arange(5, 14) if prompt is None else prompt
    state, prefill = target.prefill({"input_ids": prompt[None]}, hidden_layer=layers)
    state.tokens = torch.cat([state.tokens, prefill.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    for drafter in drafters:
        drafter.start(DraftContext(target, sampling or SamplingConfig(), torch.Generator().manual_seed(3), {}), state)
        drafter.on_verified(0, 0, prefill)
    return state


def _same_head_cache(fused, loop, length, dtype):
    """The head's keys after the fused drafter and after the Python loop: bitwise in bf16; in fp32
    within an ULP. The fused drafter feeds all but the last prompt pair through the head's modules and
    the last in C, the loop all through the modules; the C layer's RMSNorm sums its squares in 8
    lanes, PyTorch's mean in an order of its own, so in fp32 a row's norm can differ by an ULP (a fc
    output on a Zen 5 core: mean of squares 0.14111826 in C against 0.14111829), which the packed
    fp32 fc of stop 65 brought out; in bf16 the normed row's rounding hides it. Plain and
    speculative decoding keep to one path: plain steps and verifications up to the fused layers'
    limit (64 rows packed) run the C layer."""
    mine, theirs = fused.layers[0].keys[..., :length, :], loop.layers[0].keys[..., :length, :]
    if dtype == torch.float32:
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(mine, theirs)


def _same_tree_step(fused, loop, mine, theirs) -> int:
    """A fused tree drafter's step against its Python tree's: the same draft, nodes and parents,
    scores within float rounding, depths drafted, head forwards (the fused one feeds the prompt's
    pairs in two) and head cache length; returns that length."""
    assert torch.equal(mine.tokens, theirs.tokens) and (mine.tree is None) == (theirs.tree is None)
    if mine.tree is not None:
        assert torch.equal(mine.tree.parents, theirs.tree.parents)
        torch.testing.assert_close(mine.tree.scores, theirs.tree.scores, atol=1e-5, rtol=1e-5)
    assert fused.drafted_depths == loop.drafted_depths and fused.forwards == loop.forwards + 1
    length = fused.cache.get_seq_length()
    assert length == loop.cache.get_seq_length() and fused.fed == loop.fed
    return length


def _accept_first_children(target, state, draft, most, drafters, layers=-1):
    """Verify a tree ``draft`` as if up to ``most`` of its first children were accepted (fewer where
    the line ends), commit them and the target's next token, and tell every drafter."""
    tree, path = draft.tree, []
    while tree is not None and len(path) < most and tree.children(path[-1] if path else -1):
        path.append(tree.children(path[-1] if path else -1)[0])
    drafted = draft.tokens[0, path]
    out = target.forward(state, state.verification_inputs(drafted[None]), hidden_layer=layers)
    state.commit(torch.cat([drafted[None], out.logits[:, len(path)].argmax(-1, keepdim=True)], dim=1))
    for drafter in drafters:
        drafter.on_verified(draft.length, len(path), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("do_sample,vocabulary,stop_below", [(False, False, 0.0), (True, False, 0.0), (True, True, 0.0),
                                                             (False, True, 0.05), (True, True, 0.02)])
def test_the_fused_eagle_chain_drafts_what_the_loop_drafts(dtype, do_sample, vocabulary, stop_below):
    """Where the head and its projections run fused, EAGLE's chain in one C call (the committed
    pairs, then per token the draft LM head, the pick and the next head forward) drafts the Python
    loop's tokens from the same generator, with its q (float rounding), over a draft vocabulary or
    the whole one, and leaves the head's cache as the loop does, verification after verification."""
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.core.sampling import SamplingConfig

    model, head = _fused_model_and_head(dtype)
    words = torch.arange(0, model.config.vocab_size, 3) if vocabulary else None
    stops = {"sampled_stop_below" if do_sample else "stop_below": stop_below}
    fused, loop = EagleDrafter(model, head, 4, words, int8_head=False, **stops), EagleDrafter(model, head, 4, words, int8_head=False, **stops)
    chains, fused_chain = [], fused._fused_chain
    fused._fused_chain = lambda *args: chains.append(fused_chain(*args)) or chains[-1]
    loop._fused_chain = lambda *args: None  # the Python loop
    target = TransformersTarget(model)
    sampling = SamplingConfig(do_sample=do_sample, temperature=0.8)
    with torch.inference_mode():
        state = _started(target, (fused, loop), sampling)
        lengths = []
        for step in range(4):
            mine, theirs = fused.propose(state, 8), loop.propose(state, 8)
            assert torch.equal(mine.tokens, theirs.tokens) and (stop_below or mine.tokens.shape == (1, 4))
            lengths.append(mine.length)
            if do_sample:
                torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-6, rtol=1e-5)
                assert torch.equal(fused.context.generator.get_state(), loop.context.generator.get_state())
            else:
                assert mine.probs is None and theirs.probs is None
            length = fused.cache.get_seq_length()
            assert length == loop.cache.get_seq_length() and fused.fed == loop.fed
            _same_head_cache(fused.cache, loop.cache, length, dtype)
            out = target.forward(state, state.verification_inputs(mine.tokens), hidden_layer=-1)
            accepted = min(step % 3, mine.length)  # 0, 1, 2, 0 drafts kept, then the target's next token
            state.commit(torch.cat([mine.tokens[:, :accepted], out.logits[:, accepted].argmax(-1, keepdim=True)], dim=1))
            for drafter in (fused, loop):
                drafter.on_verified(mine.length, accepted, out)
    if stop_below:  # (a random head is unsure of every draw: the stop ends chains early)
        assert max(lengths) < 4, lengths
    assert len(chains) == 4 and all(chain is not None for chain in chains)  # (the first: the prompt's pairs but the last fed first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_nodes,vocabulary", [(40, False), (12, True), ("auto", True)])
def test_the_fused_eagle2_tree_grows_what_the_python_tree_grows(dtype, num_nodes, vocabulary):
    """Where the head runs fused, EAGLE-2's top-k tree grows in one C call (the committed pairs,
    then every layer's expansion over the frontier with its tree mask, the draft LM head, the
    softmax and the top-k): the Python tree's nodes, parents and depths, its scores within float
    rounding, and the head's cache as the Python tree leaves it, verification after verification;
    with num_nodes="auto" (nominal budget) the same layers are grown, the rule asked between them.
    (Attention sharpened, so that a wrong mask or position shows.)"""
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.drafters import Eagle2Drafter

    model, head = _fused_model_and_head(dtype)
    attention = head.decoder.layers[0].self_attn
    with torch.no_grad():  # sharpened attention: a wrong mask or position shows in the scores
        attention.q_proj.weight.mul_(8.0), attention.k_proj.weight.mul_(8.0)
    words = torch.arange(0, model.config.vocab_size, 3) if vocabulary else None
    fused, loop = (Eagle2Drafter(model, head, depth=4, top_k=3, num_nodes=num_nodes, draft_vocabulary=words, budget="nominal",
                                 int8_head=False) for _ in range(2))
    trees, fused_tree = [], fused._fused_tree
    fused._fused_tree = lambda *args: trees.append(fused_tree(*args)) or trees[-1]
    loop._fused_tree = lambda *args: None  # the Python tree
    target = TransformersTarget(model)
    with torch.inference_mode():
        state = _started(target, (fused, loop))
        for step in range(4):
            mine, theirs = fused.propose(state, 8), loop.propose(state, 8)
            length = _same_tree_step(fused, loop, mine, theirs)
            _same_head_cache(fused.cache, loop.cache, length, dtype)
            _accept_first_children(target, state, mine, step % 3, (fused, loop))
    assert len(trees) == 4 and all(tree is not None for tree in trees)  # (the first: the prompt's pairs but the last fed first)
    assert max(fused.drafted_depths) > 1 and (num_nodes == "auto" or sum(fused.chosen_nodes) > 0)  # (a random head: auto keeps none)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_head_drafts_what_the_loop_drafts_through_int8_linears(dtype):
    """int8_head=True: the fused chain and EAGLE-2's fused tree read the head's layer and fc as int8
    (pack_int8; the draft LM heads over 21 and 22 rows are not 16-row multiples and stay as they are,
    each drafter reading its own though the head's int8 copy is shared); the
    Python loop and tree with those linears replaced by the int8 kernel as modules draft the same
    tokens (chain: sampled, with the same q within float rounding; tree, fp32: the same nodes, scores
    within rounding), step after step."""
    import copy

    from mmspec.adapters.hf import TransformersTarget
    from mmspec.core.sampling import SamplingConfig
    from mmspec.drafters import Eagle2Drafter

    model, head = _fused_model_and_head(dtype)
    quantized = copy.deepcopy(head)
    for parent in [quantized] + list(quantized.decoder.layers[0].children()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
    target, drafters = TransformersTarget(model), []  # (every drafter kept: the tree's head copy must not read the chain's LM head)
    for tree in (False, True) if dtype == torch.float32 else (False,):  # (a random bf16 head's flat top-k reorders on a rounding)
        if tree:
            words = torch.arange(1, 67, 3)  # 22 rows, another draft LM head over the same head
            fused = Eagle2Drafter(model, head, depth=4, top_k=3, num_nodes=30, draft_vocabulary=words, int8_head=True)
            loop = Eagle2Drafter(model, quantized, depth=4, top_k=3, num_nodes=30, draft_vocabulary=words)
        else:
            words = torch.arange(0, 63, 3)
            fused, loop = EagleDrafter(model, head, 4, words, int8_head=True), EagleDrafter(model, quantized, 4, words)
        drafters.append(fused)
        sampling = SamplingConfig(do_sample=not tree, temperature=0.8)
        with torch.inference_mode():
            state = _started(target, (fused, loop), sampling)
            for step in range(3):
                mine, theirs = fused.propose(state, 8), loop.propose(state, 8)
                assert torch.equal(mine.tokens, theirs.tokens), (tree, step)
                if tree:
                    torch.testing.assert_close(mine.tree.scores, theirs.tree.scores, atol=2e-3, rtol=1e-3)
                else:
                    torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-3, rtol=1e-2)  # (a row rounded at a quantisation step moves q a little)
                drafted = mine.tokens[0, :0]  # (no draft accepted: the target's next token)
                out = target.forward(state, state.verification_inputs(drafted[None]), hidden_layer=-1)
                state.commit(out.logits[:, :1].argmax(-1))
                for drafter in (fused, loop):
                    drafter.on_verified(mine.length, 0, out)
        assert fused.describe()["head_int8"] and not loop.describe().get("head_int8")


def test_the_fused_tree_asks_its_rule_between_layers_and_passes_on_what_it_raises(monkeypatch):
    """head_tree's ``expand_while`` is asked with the best log V of the nodes about to be expanded,
    before every layer after the first: False stops the growth there; an exception raised in it
    comes out of the C call as itself."""
    import mmspec.drafters.eagle as eagle_module
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.drafters import Eagle2Drafter

    model, head = _fused_model_and_head(torch.float32)
    drafter = Eagle2Drafter(model, head, depth=5, top_k=2, num_nodes=30, int8_head=False)  # (no policy: the rule below is the only one)
    target = TransformersTarget(model)
    asked, answers, real = [], [], eagle_module.head_tree

    def rule(best):
        asked.append(best)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(eagle_module, "head_tree", lambda *args, expand_while=None, **kwargs: real(*args, expand_while=rule, **kwargs))
    with torch.inference_mode():
        state = _started(target, (drafter,))
        answers[:] = [True] * 4
        first = drafter.propose(state, 8).tree
        assert first.max_depth == 5 and len(asked) == 4
        asked.clear()

        def commit_one(drafted: int) -> None:  # (the target's next token, no draft accepted)
            out = target.forward(state, state.verification_inputs(state.tokens[:, :0]), hidden_layer=-1)
            state.commit(out.logits[:, :1].argmax(-1))
            drafter.on_verified(drafted, 0, out)

        commit_one(first.size)
        answers[:] = [True, True, False]
        tree = drafter.propose(state, 8).tree
        assert tree.max_depth == 3 and len(asked) == 3 and drafter.drafted_depths[-1] == 3
        assert asked[0] == pytest.approx(float(tree.scores[tree.depth == 1].max()), abs=1e-6)
        assert asked[1] == pytest.approx(float(tree.scores[tree.depth == 2].max()), abs=1e-6)
        commit_one(tree.size)
        answers[:] = [True, KeyError("from the rule")]
        with pytest.raises(KeyError, match="from the rule"):
            drafter.propose(state, 8)


def test_the_eagle_chain_feeds_each_drafted_pair_at_its_position(tiny):
    """Chain drafting gives the head features of running the head from scratch over the whole
    sequence of pairs (f_t, x_{t+1}) at positions t = 0, 1, ... with its own predictions fed back, as
    it was trained: a drafted pair sits right after the committed ones (no gap), in the loop and in
    batches. (Sharpened attention, so that a position off by one shows.)"""
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.core.drafter import DraftContext
    from mmspec.core.sampling import SamplingConfig

    model = tiny.model
    torch.manual_seed(2)
    head = EagleHead(text_decoder(model).config).eval()
    attention = head.decoder.layers[0].self_attn
    with torch.no_grad():
        attention.q_proj.weight.mul_(40.0), attention.k_proj.weight.mul_(40.0)
    target = TransformersTarget(model)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.inference_mode():
        state, prefill = target.prefill(tiny.inputs, hidden_layer=-1)
        state.tokens = torch.cat([state.tokens, prefill.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        features, tokens = prefill.hidden_states, state.tokens[:, 1:]
        expected, predictions = [], []
        for _ in range(4):  # from scratch: pairs 0 .. n-1 at positions 0 .. n-1
            predicted = head(features, embed(tokens), None, torch.arange(tokens.shape[1])[None])[:, -1:]
            predictions.append(predicted[0, 0])
            expected.append(int(lm_head(predicted[0, 0]).argmax()))
            features, tokens = torch.cat([features, predicted], dim=1), torch.cat([tokens, torch.tensor([[expected[-1]]])], dim=1)
        for batch in (False, True):
            drafter = EagleDrafter(model, head, 4)
            drafter.start(DraftContext(target, SamplingConfig(), torch.Generator(), tiny.inputs), state)
            drafter.on_verified(0, 0, prefill)
            seen = []  # the last row of every head forward: f^ after the committed pairs, then after each drafted one
            hook = head.register_forward_hook(lambda module, args, out: seen.append(out[0, -1]))
            draft = EagleDrafter.propose_rows([drafter], _Rows(state), [0], [8])[0] if batch else drafter.propose(state, 8)
            hook.remove()
            assert draft.tokens[0].tolist() == expected, batch
            assert len(seen) == 4
            for mine, theirs in zip(seen, predictions):
                torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


class _Rows:
    """A batch of one row for propose_rows (its state's rows)."""

    def __init__(self, state):
        self.rows = [state]


def test_eagle2_branching_is_chosen_by_device_and_mode_unless_given():
    """top_k=None: 4 for greedy trees on a CPU target (measured faster there), 8 for sampled trees
    (and on GPUs); a given top_k is kept; a bad one is refused in one line."""
    from mmspec.drafters import Eagle2Drafter

    case = make_tiny("llama")
    torch.manual_seed(1)
    head = EagleHead(text_decoder(case.model).config).eval()
    chosen = {}
    for name, top_k, sample in (("greedy", None, False), ("sampled", None, True), ("given", 6, False)):
        drafter = Eagle2Drafter(case.model, head, depth=3, top_k=top_k)
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=6, do_sample=sample, seed=0, **case.inputs)
        chosen[name] = out.stats.config["top_k"]
    assert chosen == {"greedy": 4, "sampled": 8, "given": 6}
    for bad in (0, 2.5):
        with pytest.raises(ValueError, match="top_k must be a positive int or None"):
            Eagle2Drafter(case.model, head, top_k=bad)

