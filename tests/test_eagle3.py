"""EAGLE-3: the target's fused layers, the draft vocabulary maps, greedy identity and the sampled
distribution of chains and dynamic trees, the training-time test, export to vLLM / SGLang and back."""

import json

import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import chisquare
from distribution_check import sampled_counts
from test_distribution import NEW, PROMPT, TEMPERATURE, TOP_K, VOCAB, exact_marginals, tiny_llama
from tiny_models import make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget, text_decoder
from mmspec.core.sampling import SamplingConfig
from mmspec.drafters import Eagle3Drafter, Eagle3TreeDrafter
from mmspec.drafters.eagle3 import Eagle3LMHead
from mmspec.modeling.eagle3 import Eagle3Config, Eagle3Head
from mmspec.train.eagle3 import collate_ids, draft_vocabulary, eagle3_loss, target_states, unroll


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: one thread each (on a shared machine more threads only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


def random_head(model, size=None, seed=0):
    torch.manual_seed(seed)
    config = text_decoder(model).config
    head = Eagle3Head(Eagle3Config.for_target(config, draft_vocab_size=size or config.vocab_size)).eval()
    if size:
        head.set_draft_vocabulary(torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))[:size])
    return head


def test_target_returns_the_fused_layers(tiny):
    """A tuple hidden_layer gives those hidden_states entries concatenated, on the lean path and
    transformers' (a tree verification) alike."""
    target = TransformersTarget(tiny.model)
    layers = (2, 0, 1)
    state, out = target.prefill(dict(tiny.inputs), hidden_layer=layers)
    with torch.no_grad():
        reference = tiny.model(**tiny.inputs, output_hidden_states=True).hidden_states
    expected = torch.cat([reference[i] for i in layers], dim=-1)
    assert out.hidden_states.shape == (1, tiny.prompt_len, 3 * text_decoder(tiny.model).config.hidden_size)
    torch.testing.assert_close(out.hidden_states, expected, rtol=1e-4, atol=1e-4)
    step = target.forward(state, torch.tensor([[5, 6]]), hidden_layer=layers)
    with torch.no_grad():
        ids = torch.cat([tiny.inputs["input_ids"], torch.tensor([[5, 6]])], dim=1)
        full = tiny.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(step.hidden_states, torch.cat([full[i][:, -2:] for i in layers], dim=-1), rtol=1e-4, atol=1e-4)


def test_fused_layers_keep_the_fused_states():
    """lean_states with a tuple on the fused C path (a step after a prefill) keeps each layer's
    input as transformers' hidden_states does (the fused layers run in segments between them)."""
    from test_fused import llama

    from mmspec.core.cache import make_cache
    from mmspec.modeling.fused import fused_plans
    from mmspec.modeling.lean import lean_states

    model = llama(torch.float32)
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(1))
    layers = (2, 1, 0)
    with torch.inference_mode():
        want = model(inputs_embeds=x, output_hidden_states=True).hidden_states
        cache = make_cache(model.config)
        lean_states(model, x[:, :6], cache)
        if fused_plans(model.layers, cache, 3, torch.float32, x.device) is None:
            pytest.skip("the fused layers do not run on this CPU")
        last, kept = lean_states(model, x[:, 6:], cache, hidden_layer=layers)
    torch.testing.assert_close(kept, torch.cat([want[i][:, 6:] for i in layers], dim=-1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, want[-1][:, 6:], rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_maps(tiny):
    head = random_head(tiny.model, size=16)
    ids = head.token_ids
    assert torch.equal(ids, torch.arange(16) + head.d2t)  # draft j -> target j + d2t[j]
    assert head.t2d.sum() == 16 and head.t2d[ids].all()
    lm = Eagle3LMHead(head)
    assert torch.equal(lm.tokens(torch.tensor([0, 5])), ids[[0, 5]])
    q = torch.softmax(torch.randn(1, 16), dim=-1)
    full = lm.full(q)
    assert full.shape == (1, head.config.vocab_size) and torch.allclose(full[0, ids], q[0]) and full[0, ~head.t2d].eq(0).all()
    with pytest.raises(ValueError, match="distinct"):
        head.set_draft_vocabulary(torch.zeros(16, dtype=torch.long))


def greedy_matches(tiny, head, tree, prompt=None):
    """(whether EAGLE-3 greedy decoding gives plain decoding's output, tokens accepted)."""
    inputs = tiny.inputs if prompt is None else {"input_ids": prompt}
    reference = mmspec.generate(tiny.model, drafter=None, max_new_tokens=24, **inputs).sequences
    drafter = (Eagle3TreeDrafter(tiny.model, head, depth=3, top_k=3, num_nodes=8) if tree
               else Eagle3Drafter(tiny.model, head, num_draft_tokens=3))
    out = mmspec.generate(tiny.model, drafter=drafter, max_new_tokens=24, **inputs)
    return torch.equal(out.sequences, reference), out.stats.accepted


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_output_is_the_targets(tiny, tree):
    """A random head (draft vocabulary: 64 random ids); a trained one, whose drafts are accepted:
    test_a_few_training_steps_lower_the_loss."""
    assert greedy_matches(tiny, random_head(tiny.model, size=64), tree)[0]


RUNS = 600


@pytest.mark.parametrize("tree", [False, True, "stop"])
def test_sampled_distribution_is_the_targets(tree):
    """Chains (q over target ids, zero outside the draft vocabulary), chains ended by their own
    confidence (a draft length that depends on the draws) and sampled dynamic trees keep
    the target's distribution: chi-square against the exact marginals (test_distribution's model)."""
    target = tiny_llama(0)
    torch.manual_seed(5)
    head = Eagle3Head(Eagle3Config.for_target(text_decoder(target).config, draft_vocab_size=6)).eval()
    head.set_draft_vocabulary(torch.tensor([7, 1, 3, 5, 9, 2]))  # a q that is zero outside these ids
    drafter = (Eagle3TreeDrafter(target, head, depth=2, top_k=3, num_nodes=6) if tree is True
               else Eagle3Drafter(target, head, num_draft_tokens=3, sampled_stop_below=0.3) if tree == "stop"  # (lengths 1-3 by q)
               else Eagle3Drafter(target, head, num_draft_tokens=2))
    exact = exact_marginals(target)
    counts, _, accepted = sampled_counts(target, drafter, {"input_ids": PROMPT},
                                         SamplingConfig(temperature=TEMPERATURE, top_k=TOP_K), NEW, RUNS,
                                         num_draft_tokens=None)  # (the drafter's own length)
    assert counts.shape[1] == VOCAB and accepted > 50
    for i in range(NEW):
        support = exact[i] > 0
        assert counts[i][~support].sum() == 0
        result = chisquare(counts[i][support].numpy(), (exact[i][support] / exact[i][support].sum() * RUNS).numpy())
        assert result.pvalue > 1e-4, (i, counts[i], exact[i] * RUNS)


@pytest.fixture(scope="module")
def records(tiny):
    """The tiny target's own greedy continuations of 12 prompts."""
    records, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        for seed in range(12):
            prompt = torch.randint(10, 400, (1, 6), generator=torch.Generator().manual_seed(seed))
            ids = tiny.model.generate(input_ids=prompt, max_new_tokens=20, do_sample=False)[0]
            learn = torch.zeros(len(ids), dtype=torch.bool)
            learn[6:] = True
            records.append({"ids": ids, "learn": learn})
    torch.set_num_threads(threads)
    return records


def test_training_time_test_unrolls_as_the_drafter_drafts(tiny):
    """Step 1 of the unrolled training forward at position t equals the head drafting after the
    committed position t: step-0 pairs 0..t in its cache, then (s_0[t], x_{t+2}) at position t + 1."""
    head = random_head(tiny.model, size=64)
    ids = torch.randint(10, 400, (1, 12), generator=torch.Generator().manual_seed(3))
    states = target_states(tiny.model, ids, head.config.aux_layers)
    embed = tiny.model.get_input_embeddings().weight
    with torch.no_grad():
        s0, s1, s2 = unroll(head, embed, ids, states, 3)
        t = 6
        from mmspec.core.cache import make_cache

        cache = make_cache(None)
        first = head(states[:, : t + 1], embed[ids[:, 1 : t + 2]], cache, torch.arange(t + 1)[None])
        torch.testing.assert_close(first[:, t], s0[:, t], rtol=1e-5, atol=1e-5)
        second = head(first[:, t : t + 1], embed[ids[:, t + 2 : t + 3]], cache, torch.tensor([[t + 1]]))
        torch.testing.assert_close(second[:, 0], s1[:, t], rtol=1e-5, atol=1e-5)
        third = head(second, embed[ids[:, t + 3 : t + 4]], cache, torch.tensor([[t + 2]]))
        torch.testing.assert_close(third[:, 0], s2[:, t], rtol=1e-5, atol=1e-5)


def test_a_few_training_steps_lower_the_loss(tiny, records):
    vocab = text_decoder(tiny.model).config.vocab_size
    token_ids = draft_vocabulary(records, 96, vocab)
    assert len(token_ids) == 96 and len(set(token_ids.tolist())) == 96
    head = Eagle3Head(Eagle3Config.for_target(text_decoder(tiny.model).config, draft_vocab_size=96))
    head.set_draft_vocabulary(token_ids)
    embed = tiny.model.get_input_embeddings().weight.detach()
    batch = collate_ids(records)
    states = target_states(tiny.model, batch["ids"], head.config.aux_layers)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    first, _ = eagle3_loss(head, embed, batch, states, ttt_steps=3)
    for _ in range(25):
        loss, _ = eagle3_loss(head, embed, batch, states, ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last, accuracy = eagle3_loss(head, embed, batch, states, ttt_steps=3)
    assert last.item() < 0.7 * first.item(), (first.item(), last.item())
    assert accuracy > 0.2
    head.eval()
    for tree in (False, True):  # the trained head's drafts are accepted, the output stays the target's
        same, accepted = greedy_matches(tiny, head, tree, prompt=records[0]["ids"][None, :6])
        assert same and accepted >= 5, (tree, accepted)


@pytest.mark.parametrize("fmt", ["vllm-eagle3", "sglang-eagle3"])
def test_export_round_trip(tiny, tmp_path, fmt):
    head = random_head(tiny.model, size=64, seed=4)
    head.save(tmp_path / "own", target="tiny")
    (tmp_path / "own" / "chain_settings.json").write_text('{"bfloat16": {"greedy": {"num_draft_tokens": 9, "stop_below": 0.2}}}')  # (bench chain-stop's)
    from mmspec.cli import main

    assert main(["export", "drafter", str(tmp_path / "own"), "--format", fmt, "--out", str(tmp_path / fmt), "--dtype", "float32"]) == 0
    assert (tmp_path / fmt / "chain_settings.json").read_text() == '{"bfloat16": {"greedy": {"num_draft_tokens": 9, "stop_below": 0.2}}}'  # loaded back with it
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    assert config["architectures"] == [{"vllm-eagle3": "Eagle3LlamaForCausalLM", "sglang-eagle3": "LlamaForCausalLMEagle3"}[fmt]]
    assert config["draft_vocab_size"] == 64 and config["target_hidden_size"] == head.config.hidden_size
    layers = config.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert tuple(layers) == head.config.aux_layers
    # readable by the serving engine's user too (safetensors alone writes owner-only files)
    assert (tmp_path / fmt / "model.safetensors").stat().st_mode & 0o044 == 0o044
    tensors = load_file(str(tmp_path / fmt / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * head.config.hidden_size
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    runs = {}
    for name in ("own", fmt):
        out = mmspec.generate(tiny.model, drafter=f"eagle3:{tmp_path / name}", max_new_tokens=12, do_sample=True, seed=3,
                              num_draft_tokens=3, **tiny.inputs)
        runs[name] = (out.sequences, out.stats.drafted_per_position, out.stats.accepted_per_position)
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(runs["own"], runs[fmt]))
    # a second export into the same directory replaces the first; a model's own files or the head's
    # own directory are refused in one line, nothing written (the stop-74 audit: a target was overwritten)
    argv = ["export", "drafter", str(tmp_path / "own"), "--format", fmt, "--out"]
    assert main([*argv, str(tmp_path / fmt)]) == 0
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    notes = tmp_path / "notes"  # (any other files: the stop-77 audit exported into the captioner's own folder)
    notes.mkdir()
    (notes / "notes.txt").write_text("keep")
    for out, match in ((model, "holds a model's config.json that is no EAGLE-3 export"), (tmp_path / "own", "holds an mmspec EAGLE-3 head"),
                       (notes, "holds other files; exporting would mix them")):
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(ValueError, match=match):
            head.export(out, fmt)
        assert main([*argv, str(out)]) == 2 and sorted(p.name for p in out.iterdir()) == before
    assert (model / "config.json").read_text() == '{"architectures": ["LlamaForCausalLM"]}'


def test_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="eagle3:PATH"):
        mmspec.generate(tiny.model, drafter="eagle3", max_new_tokens=2, **tiny.inputs)
    with pytest.raises(FileNotFoundError, match="mmspec train drafter --method eagle3"):
        Eagle3Head.load(tmp_path)
    from mmspec.cli import main
    from mmspec.modeling.heads import EagleHead

    EagleHead(text_decoder(tiny.model).config).save(tmp_path / "eagle")  # another method's head: named, with its drafter
    with pytest.raises(FileNotFoundError, match=r"holds an EAGLE head \(eagle_config.json\).*'eagle:DIR'"):
        Eagle3Head.load(tmp_path / "eagle")

    random_head(tiny.model, size=8).save(tmp_path / "h")
    assert main(["export", "drafter", str(tmp_path / "nothing"), "--format", "vllm-eagle3", "--out", str(tmp_path / "o")]) == 2
    head = random_head(tiny.model, size=8)  # an engine layout naming no target layers, without t2d (as some trainers write)
    head.export(tmp_path / "bare", "vllm-eagle3", torch.float32)
    config = json.loads((tmp_path / "bare" / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "bare" / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    tensors = load_file(str(tmp_path / "bare" / "model.safetensors"))
    del tensors["t2d"]
    save_file(tensors, str(tmp_path / "bare" / "model.safetensors"))
    with pytest.raises(ValueError, match="names no target layers"):
        Eagle3Head.load(tmp_path / "bare")
    loaded = Eagle3Head.load(tmp_path / "bare", tiny.model)
    assert loaded.config.aux_layers == head.config.aux_layers and torch.equal(loaded.t2d, head.t2d)
    other = make_tiny("idefics3")
    if text_decoder(other.model).config.hidden_size != text_decoder(tiny.model).config.hidden_size:
        with pytest.raises(ValueError, match="width"):
            Eagle3Head.load(tmp_path / "h", other.model)


@pytest.mark.parametrize("tree", [False, True, "stop"])
def test_batch_rows_equal_their_batch_one_generation(tiny, tree):
    """In a batch each row drafts EAGLE-3 chains (a tree drafter's chain form: the same head; or
    chains with a confidence stop, each row ending its own) and gets what its own generation gives,
    greedy and sampled."""
    from mmspec.api import generate_rows

    head = random_head(tiny.model, size=64)
    drafter = (Eagle3TreeDrafter(tiny.model, head, depth=3) if tree is True
               else Eagle3Drafter(tiny.model, head, num_draft_tokens=3, **({"stop_below": 0.02, "sampled_stop_below": 0.02}
                                                                           if tree == "stop" else {})))
    chain = drafter.for_batch()
    assert type(chain) is Eagle3Drafter and chain.head is head and chain.target_hidden_layer == head.config.aux_layers
    ids = tiny.inputs["input_ids"][0]
    prompts = [ids, ids[:5], torch.randint(3, 400, (9,), generator=torch.Generator().manual_seed(7))]
    for do_sample in (False, True):
        kwargs = dict(max_new_tokens=10, do_sample=do_sample, seed=11)
        batch = generate_rows(tiny.model, [{"input_ids": p[None]} for p in prompts], drafter=drafter, **kwargs)
        width = max(len(p) for p in prompts)
        for b, prompt in enumerate(prompts):
            single = mmspec.generate(tiny.model, drafter=drafter.for_batch(), input_ids=prompt[None], **kwargs)
            new = single.sequences[0, len(prompt) :]
            assert torch.equal(batch.sequences[b, width : width + len(new)], new), (do_sample, b)


@pytest.mark.parametrize("family", ["llava", "smolvlm"])
def test_vlm_greedy_output_is_the_targets(family):
    """Over a VLM the three target layers come from the model's forward with the image (prefill)
    and its lean steps; the output stays plain decoding's."""
    case = make_tiny(family)
    reference = mmspec.generate(case.model, drafter=None, max_new_tokens=12, **case.inputs).sequences
    head = random_head(case.model, size=64)
    for drafter in (Eagle3Drafter(case.model, head, num_draft_tokens=3), Eagle3TreeDrafter(case.model, head, depth=3, top_k=3)):
        out = mmspec.generate(case.model, drafter=drafter, max_new_tokens=12, **case.inputs)
        assert torch.equal(out.sequences, reference)


def test_captured_target_returns_the_fused_layers():
    """A target with captured forwards (static buffers, eager on a CPU) keys its forward by the
    tuple and gives the plain target's output under EAGLE-3."""
    from mmspec.adapters.hf import CapturedTransformersTarget

    case = make_tiny("llama")
    reference = mmspec.generate(case.model, drafter=None, max_new_tokens=12, **case.inputs).sequences
    captured = CapturedTransformersTarget(case.model, max_length=128, buckets=(1, 2, 4, 8, 16, 32))
    head = random_head(case.model, size=64)
    for drafter in (Eagle3Drafter(case.model, head, num_draft_tokens=3), Eagle3TreeDrafter(case.model, head, depth=3, top_k=3, num_nodes=8)):
        out = mmspec.generate(captured, drafter=drafter, max_new_tokens=12, **case.inputs)
        assert torch.equal(out.sequences, reference)


def _sharpened_fused_head(dtype, norm_before_residual):
    """The tiny Llama and a random EAGLE-3 head in ``dtype`` through ``mmspec.optimize`` (the fused
    calls run; else the test skips), its attention sharpened so that a wrong mask or position shows."""
    from test_eagle import _fused_model_and_head

    model, _ = _fused_model_and_head(dtype)
    head = random_head(model, size=64, seed=2).to(dtype)
    head.config.norm_before_residual = norm_before_residual
    with torch.no_grad():
        head.midlayer.self_attn.q_proj.weight.mul_(8.0), head.midlayer.self_attn.k_proj.weight.mul_(8.0)
    assert mmspec.optimize(head, kernel="c").replaced > 0
    return model, head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("do_sample,norm_before_residual,stop_below", [(False, False, 0.0), (True, False, 0.0), (False, True, 0.0),
                                                                      (False, False, 0.05), (True, False, 0.02)])
def test_the_fused_eagle3_chain_drafts_what_the_loop_drafts(dtype, do_sample, norm_before_residual, stop_below):
    """Where the head and its projections run fused (``mmspec.optimize``), the EAGLE-3 chain in one
    C call (the committed pairs fused by fc, then per token the final norm, the draft LM head over
    the draft vocabulary, the pick and the next step over [N1(e); Nh(s)]) drafts the Python loop's
    tokens from the same generator, with its q (float rounding), and leaves the head's cache as the
    loop does, verification after verification. (Attention sharpened, so a wrong position shows.)
    With a confidence stop both end each chain at the same draw and leave the generator alike."""
    import copy

    from mmspec.core.drafter import DraftContext

    model, head = _sharpened_fused_head(dtype, norm_before_residual)
    stops = {"sampled_stop_below" if do_sample else "stop_below": stop_below}
    fused, loop = Eagle3Drafter(model, head, 4, **stops), Eagle3Drafter(model, copy.deepcopy(head), 4, **stops)
    chains, fused_chain = [], fused._fused_chain
    fused._fused_chain = lambda *args: chains.append(fused_chain(*args)) or chains[-1]
    loop._fused_chain = lambda *args: None  # the Python loop
    target, layers = TransformersTarget(model), head.config.aux_layers
    sampling = SamplingConfig(do_sample=do_sample, temperature=0.8)
    with torch.inference_mode():
        state, prefill = target.prefill({"input_ids": torch.arange(5, 14)[None]}, hidden_layer=layers)
        state.tokens = torch.cat([state.tokens, prefill.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for drafter in (fused, loop):
            drafter.start(DraftContext(target, sampling, torch.Generator().manual_seed(3), {}), state)
            drafter.on_verified(0, 0, prefill)
        lengths = []
        for step in range(4):
            mine, theirs = fused.propose(state, 8), loop.propose(state, 8)
            assert torch.equal(mine.tokens, theirs.tokens) and (stop_below or mine.tokens.shape == (1, 4)), step
            lengths.append(mine.length)
            if do_sample:
                torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-6, rtol=1e-5)
                assert torch.equal(fused.context.generator.get_state(), loop.context.generator.get_state())
            length = fused.cache.get_seq_length()
            assert length == loop.cache.get_seq_length() and fused.fed == loop.fed
            # (the loop's norms and rotation are PyTorch's: the same formula, sums in another order)
            torch.testing.assert_close(fused.cache.layers[0].keys[..., :length, :], loop.cache.layers[0].keys[..., :length, :],
                                       **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}))
            out = target.forward(state, state.verification_inputs(mine.tokens), hidden_layer=layers)
            accepted = min(step % 3, mine.length)  # 0, 1, 2, 0 drafts kept, then the target's next token
            state.commit(torch.cat([mine.tokens[:, :accepted], out.logits[:, accepted].argmax(-1, keepdim=True)], dim=1))
            for drafter in (fused, loop):
                drafter.on_verified(mine.length, accepted, out)
    assert len(chains) == 4 and all(chain is not None for chain in chains)
    if stop_below:  # (the random head's confidences, ~1/64 a draw: the stop ends every chain early)
        assert max(lengths) < 4, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_nodes,norm_before_residual", [(40, False), (12, True), ("auto", False)])
def test_the_fused_eagle3_tree_grows_what_the_python_tree_grows(dtype, num_nodes, norm_before_residual):
    """Where the head runs fused, EAGLE-3's top-k tree grows in one C call (the committed pairs fused
    by fc, then every layer's expansion over [N1(e); Nh(s)] with its tree mask, the final norm, the
    draft LM head, the softmax and the top-k): the Python tree's nodes, parents and depths, its
    scores within float rounding, and the head's cache as the Python tree leaves it, verification
    after verification; with num_nodes="auto" (nominal budget) the same layers are grown, the rule
    asked between them. (Attention sharpened, so that a wrong mask or position shows.)"""
    import copy

    from test_eagle import _accept_first_children, _same_tree_step, _started

    model, head = _sharpened_fused_head(dtype, norm_before_residual)
    fused, loop = (Eagle3TreeDrafter(model, h, depth=4, top_k=3, num_nodes=num_nodes, budget="nominal", int8_head=False)
                   for h in (head, copy.deepcopy(head)))
    trees, fused_tree = [], fused._fused_tree
    fused._fused_tree = lambda *args: trees.append(fused_tree(*args)) or trees[-1]
    loop._fused_tree = lambda *args: None  # the Python tree
    target, layers = TransformersTarget(model), head.config.aux_layers
    with torch.inference_mode():
        state = _started(target, (fused, loop), layers=layers)
        for step in range(4):
            mine, theirs = fused.propose(state, 8), loop.propose(state, 8)
            length = _same_tree_step(fused, loop, mine, theirs)
            # (the loop's norms and rotation are PyTorch's: the same formula, sums in another order)
            torch.testing.assert_close(fused.cache.layers[0].keys[..., :length, :], loop.cache.layers[0].keys[..., :length, :],
                                       **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}))
            _accept_first_children(target, state, mine, step % 3, (fused, loop), layers=layers)
    assert len(trees) == 4 and all(tree is not None for tree in trees)  # (the first: the prompt's pairs but the last fed first)
    assert max(fused.drafted_depths) > 1 and (num_nodes == "auto" or sum(fused.chosen_nodes) > 0)
    assert fused.describe().get("fused_head") and not loop.describe().get("fused_head")


def test_the_int8_eagle3_head_drafts_what_the_loop_drafts_through_int8_linears():
    """int8_head=True: EAGLE-3's fused tree and chain read the head's mid layer, fc and draft LM head
    (64 rows) as int8 (pack_int8); the Python tree and loop with those linears replaced by the int8
    kernel as modules draft the same tokens (tree: the same nodes, scores within rounding; chain:
    sampled, q within rounding), step after step; decoding stays plain decoding's. (The fused
    drafter's first step feeds the prompt's pairs but the last through the head's own, unquantised
    modules: its head cache takes the loop's after that step, and the drafts after it are compared.)"""
    import copy

    from kernel_support import Int8Linear
    from test_eagle import _fused_model_and_head, _started

    model, _ = _fused_model_and_head(torch.float32)  # (skips where the fused kernels do not run)
    head = random_head(model, size=64, seed=2)
    with torch.no_grad():  # (a random head drafts nearly alike after every token: paths x y and y x would tie)
        layer = head.midlayer
        for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight, head.lm_head.weight):
            weight.mul_(4.0)
    assert mmspec.optimize(head, kernel="c").replaced > 0
    quantized = copy.deepcopy(head)
    for parent in list(quantized.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8Linear(child))
    quantized.lm_head.weight = head.lm_head.weight  # (the draft LM head's rows, which Eagle3LMHead keeps beside it)
    target, layers = TransformersTarget(model), head.config.aux_layers
    for tree in (True, False):
        trees, chains = [], []
        if tree:
            fused = Eagle3TreeDrafter(model, head, depth=4, top_k=3, num_nodes=30, int8_head=True)
            loop = Eagle3TreeDrafter(model, quantized, depth=4, top_k=3, num_nodes=30, int8_head=False)
            fused_tree, loop._fused_tree = fused._fused_tree, lambda *args: None
            fused._fused_tree = lambda *args: (lambda grown: grown is not None and trees.append(grown) or grown)(fused_tree(*args))
        else:
            fused, loop = Eagle3Drafter(model, head, 4, int8_head=True), Eagle3Drafter(model, quantized, 4)
            fused_chain, loop._fused_chain = fused._fused_chain, lambda *args: None
            fused._fused_chain = lambda *args: (lambda drawn: drawn is not None and chains.append(drawn) or drawn)(fused_chain(*args))
        sampling = SamplingConfig(do_sample=not tree, temperature=0.8)
        with torch.inference_mode():
            state = _started(target, (fused, loop), sampling, layers=layers)
            for step in range(4):
                mine, theirs = fused.propose(state, 8), loop.propose(state, 8)
                if step:
                    assert torch.equal(mine.tokens, theirs.tokens), (tree, step)
                    if tree:
                        torch.testing.assert_close(mine.tree.scores, theirs.tree.scores, atol=2e-3, rtol=1e-3)
                    else:
                        torch.testing.assert_close(mine.probs, theirs.probs, atol=1e-3, rtol=1e-2)
                out = target.forward(state, state.verification_inputs(mine.tokens[:, :0]), hidden_layer=layers)
                state.commit(out.logits[:, :1].argmax(-1))
                for drafter in (fused, loop):
                    drafter.on_verified(mine.length, 0, out)
                if step == 0:  # (the same head cache from here on)
                    length = loop.cache.get_seq_length()
                    for name in ("keys", "values"):
                        getattr(fused.cache.layers[0], name)[..., :length, :] = getattr(loop.cache.layers[0], name)[..., :length, :]
            assert len(trees if tree else chains) == 4
        assert fused.describe()["head_int8"] and not loop.describe().get("head_int8")
    reference = mmspec.generate(model, drafter=None, max_new_tokens=12, input_ids=torch.arange(5, 14)[None]).sequences
    for drafter in (Eagle3TreeDrafter(model, head, depth=4, top_k=3, int8_head=True), Eagle3Drafter(model, head, 4, int8_head=True)):
        out = mmspec.generate(model, drafter=drafter, max_new_tokens=12, input_ids=torch.arange(5, 14)[None])
        assert torch.equal(out.sequences, reference) and drafter.describe()["head_int8"]


def test_chain_settings_beside_a_head_set_its_length_and_stop(tiny, tmp_path):
    """``chain_settings.json`` beside a head gives ``from_spec`` K and the confidence stop per dtype
    of the target and kind of generation (a K the user gives sets both; another dtype's part is
    left out); a stopped greedy chain drafts fewer tokens and decoding stays the target's; a bad
    file or value is one ValueError line."""
    head = random_head(tiny.model, size=64, seed=5)
    head.save(tmp_path / "h", target="tiny")
    settings = {"float32": {"greedy": {"num_draft_tokens": 5, "stop_below": 0.05}, "sampled": {"num_draft_tokens": 2}},
                "bfloat16": {"greedy": {"num_draft_tokens": 8, "stop_below": 0.5}}}
    (tmp_path / "h" / "chain_settings.json").write_text(json.dumps(settings))
    target = TransformersTarget(tiny.model)  # (float32)
    drafter = Eagle3Drafter.from_spec(target, str(tmp_path / "h"))
    assert (drafter.num_draft_tokens, drafter.greedy_draft_tokens, drafter.stop_below, drafter.sampled_stop_below) == (2, 5, 0.05, 0.0)
    assert drafter.describe()["stop_below"] == 0.05 and "sampled_stop_below" not in drafter.describe()
    mine = Eagle3Drafter.from_spec(target, str(tmp_path / "h"), num_draft_tokens=3)
    assert (mine.num_draft_tokens, mine.greedy_draft_tokens, mine.stop_below) == (3, None, 0.05)
    reference = mmspec.generate(tiny.model, drafter=None, max_new_tokens=16, **tiny.inputs)
    out = mmspec.generate(tiny.model, drafter=drafter, max_new_tokens=16, **tiny.inputs)
    full = mmspec.generate(tiny.model, drafter=Eagle3Drafter(tiny.model, head, 5), max_new_tokens=16, **tiny.inputs)
    assert torch.equal(out.sequences, reference.sequences)
    assert out.stats.drafted < full.stats.drafted and len(out.stats.drafted_per_position) <= 5  # (random drafts: ~1/64 sure)
    sampled = mmspec.generate(tiny.model, drafter=drafter, max_new_tokens=16, do_sample=True, seed=1, **tiny.inputs)
    assert len(sampled.stats.drafted_per_position) <= 2
    del settings["float32"]  # only another dtype's part: the defaults
    (tmp_path / "h" / "chain_settings.json").write_text(json.dumps(settings))
    other = Eagle3Drafter.from_spec(target, str(tmp_path / "h"))
    assert (other.num_draft_tokens, other.greedy_draft_tokens, other.stop_below) == (Eagle3Drafter.default_length, None, 0.0)
    for bad in ({"float32": {"greedy": {"num_draft_tokens": 0}}}, {"bfloat16": {"greedy": {"stop_below": 1.5}}},
                {"float32": {"sampled": {"stop_below": "high"}}}, {"greedy": {"num_draft_tokens": 4}}, [1, 2]):
        (tmp_path / "h" / "chain_settings.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="chain_settings.json must map a dtype"):
            Eagle3Drafter.from_spec(target, str(tmp_path / "h"))
    with pytest.raises(ValueError, match="sampled_stop_below=-0.1"):
        Eagle3Drafter(tiny.model, head, 4, sampled_stop_below=-0.1)


def test_an_edited_or_damaged_head_directory_is_one_line(tiny, tmp_path):
    """The drafter audit: an engine export whose config.json was edited (draft vocabulary, heads,
    layer ids as a string, a field's type), cut-short weights or a config that is no JSON object
    loaded with torch's many-line size-mismatch RuntimeError or a TypeError traceback (or was sent
    to 'spd:'); each is now one ValueError line naming the file, in Python and in the CLI."""
    from mmspec.cli import main
    from mmspec.drafters.shipped import check_drafter_dir

    random_head(tiny.model, size=8).export(tmp_path / "export", "vllm-eagle3", torch.float32)
    original = json.loads((tmp_path / "export" / "config.json").read_text())
    edits = {"draft_vocab_size": ({"draft_vocab_size": 9}, r"model.safetensors: d2t is \[8\], but the head its config describes has \[9\]"),
             "heads": ({"num_attention_heads": 2 * original["num_attention_heads"]}, "the config does not match these weights"),
             "layers": ({"eagle_aux_hidden_state_layer_ids": "2,1,0"}, "target layer ids must be a list of layer indices"),
             "eps": ({"rms_norm_eps": "x"}, "rms_norm_eps must be a positive number, got 'x'"),
             "missing": ({"hidden_size": None}, "has no 'hidden_size'")}
    for name, (edit, match) in edits.items():
        directory = tmp_path / name
        directory.mkdir()
        (directory / "model.safetensors").write_bytes((tmp_path / "export" / "model.safetensors").read_bytes())
        config = {**original, **edit}
        (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        with pytest.raises(ValueError, match=match):
            Eagle3Head.load(directory, tiny.model)
        with pytest.raises(ValueError, match=match):
            mmspec.generate(tiny.model, drafter=f"eagle3:{directory}", max_new_tokens=2, **tiny.inputs)
        assert main(["export", "drafter", str(directory), "--format", "sglang-eagle3", "--out", str(tmp_path / f"o-{name}")]) == 2
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text(json.dumps(original))
    (damaged / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="a weights file cannot be read"):
        Eagle3Head.load(damaged, tiny.model)
    (damaged / "config.json").write_text("[1]")  # no JSON object: named, not "it holds what spd reads"
    check_drafter_dir("eagle3", str(damaged))
    with pytest.raises(ValueError, match="holds a JSON list, not the head's config"):
        Eagle3Head.load(damaged, tiny.model)


def test_an_export_converted_in_place_and_a_stale_chain_settings_file(tiny, tmp_path):
    """The drafter audit: converting an export to the other engine's layout in place (SRC = OUT)
    failed with "cannot write OUT: ... are the same file" after rewriting config.json, and an export
    of a head without chain_settings.json into an earlier export kept that export's file, so
    eagle3:OUT drafted with another head's tuned chain."""
    from mmspec.cli import main

    settings = '{"float32": {"greedy": {"num_draft_tokens": 4, "stop_below": 0.2}}}'
    random_head(tiny.model, size=8).save(tmp_path / "own")
    (tmp_path / "own" / "chain_settings.json").write_text(settings)
    out = tmp_path / "export"
    assert main(["export", "drafter", str(tmp_path / "own"), "--format", "vllm-eagle3", "--out", str(out)]) == 0
    assert main(["export", "drafter", str(out), "--format", "sglang-eagle3", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (out / "chain_settings.json").read_text() == settings
    random_head(tiny.model, size=8, seed=1).save(tmp_path / "other")  # (no tuned chain)
    assert main(["export", "drafter", str(tmp_path / "other"), "--format", "vllm-eagle3", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
