"""The CUDA path, in one command on a machine with a GPU: ``pytest -m gpu`` (skipped elsewhere).

The same core and adapters run on CUDA: greedy speculative decoding gives the CPU's plain-decoding
tokens (fp32), seeded sampling repeats, few-row linears leave CUDA layers alone, cost curves are
timed with synchronisation, and the pipelines keep their tables on the device."""

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


def test_pipelines_run_on_cuda():
    cap = mmspec.pipeline("image-captioning", device="cuda", dtype="fp32", drafter="prompt-lookup")
    from PIL import Image

    r = cap(Image.new("RGB", (64, 64), "red"), max_new_tokens=8, compare_baseline=True)
    assert r.identical_to_baseline and cap.model.device.type == "cuda"
    t2i = mmspec.pipeline("text-to-image", method="lantern", device="cuda")
    assert t2i.components.neighbours(8).device.type == "cuda"  # the LANTERN table lives on the device
    image = t2i("a red circle", seed=0, progress=False)
    assert image.tokens.shape[-1] == t2i.target.num_image_tokens
