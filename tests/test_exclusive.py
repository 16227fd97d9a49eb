"""mmspec computes inside mmspec.core.exclusive.exclusive: one call at a time per process (threads:
tests/test_embedded_captioner.py, tests/test_pipeline_base.py); its outputs do not depend on
PyTorch's default dtype (the tensors it makes name theirs; the lock leaves the caller's default
alone) -- the same seed gives the same output; the fused chains' draw buffers are checked before
their C call writes into them."""

import threading

import pytest
import torch
from tiny_models import make_tiny

import mmspec
from mmspec.core.exclusive import LOCK, exclusive, exclusive_steps


@pytest.fixture
def default_dtype():
    """Set PyTorch's default dtype for the test (float32 back afterwards, whatever happens)."""
    try:
        yield torch.set_default_dtype
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_generate_gives_the_same_tokens_whatever_default_dtype_the_caller_set(dtype, default_dtype):
    case = make_tiny("llama")
    runs = {"greedy": {}, "sampled": {"do_sample": True, "temperature": 0.9, "seed": 5}}
    reference = {name: mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=16, **kw, **case.inputs).sequences
                 for name, kw in runs.items()}
    default_dtype(dtype)
    for name, kw in runs.items():
        out = mmspec.generate(case.model, drafter="prompt-lookup", max_new_tokens=16, **kw, **case.inputs)
        assert torch.equal(out.sequences, reference[name]), name
        assert torch.get_default_dtype() == dtype  # the caller's, back


def test_the_voice_gives_the_same_codes_under_a_float64_default(default_dtype):
    tts = mmspec.pipeline("text-to-speech")
    reference = tts("The train leaves at seven.", seed=3).codes
    default_dtype(torch.float64)
    assert torch.equal(tts("The train leaves at seven.", seed=3).codes, reference)
    chunks = list(tts.stream("The train leaves at seven.", seed=3))
    assert torch.equal(chunks[0].codes, reference)
    built = mmspec.pipeline("text-to-speech")  # built under it too
    assert torch.equal(built("The train leaves at seven.", seed=3).codes, reference)
    assert torch.get_default_dtype() == torch.float64  # the caller's, untouched


def test_exclusive_is_reentrant_and_holds_other_threads_off():
    order = []

    def other():
        with exclusive():
            order.append("other")

    with exclusive():
        with exclusive():  # (a pipeline's call runs mmspec.generate inside)
            thread = threading.Thread(target=other)
            thread.start()
            thread.join(timeout=0.2)
            order.append("mine")
    thread.join()
    assert order == ["mine", "other"] and LOCK.acquire(blocking=False)
    LOCK.release()


def test_a_stream_made_inside_exclusive_is_consumed_outside_it():
    def holding() -> bool:  # whether another thread would wait for the lock now
        free = []
        probe = threading.Thread(target=lambda: free.append(LOCK.acquire(blocking=False) and not LOCK.release()))
        probe.start()
        probe.join()
        return not free[0]

    def steps():
        for _ in range(2):
            yield holding()

    made = []
    for held in exclusive_steps(steps()):
        made.append(held)
        assert not holding()  # the consumer holds no one up
    assert made == [True, True]


@pytest.mark.parametrize("uniforms, probs, message", [
    (torch.zeros(4, dtype=torch.bfloat16), None, "uniforms: a contiguous float32 CPU tensor of >= 4"),
    (torch.zeros(3), None, ">= 4 numbers"),
    (None, None, "samples with uniforms"),
    (torch.zeros(4), torch.zeros(4, 10, dtype=torch.bfloat16), r"probs: a float32 CPU tensor \[>= 4, >= 10\]"),
    (torch.zeros(4), torch.zeros(4, 9), r"\[>= 4, >= 10\]"),
    (torch.zeros(4), torch.zeros(10, 4).t(), "contiguous rows"),
])
def test_a_fused_chains_draw_buffers_are_checked_before_its_c_call(uniforms, probs, message):
    from mmspec.modeling.fused import _check_draws

    with pytest.raises(ValueError, match=message):
        _check_draws("head_chain", 4, 0.8, uniforms, probs, 10)
    _check_draws("head_chain", 4, 0.8, torch.rand(4), torch.zeros(4, 12), 10)  # as chain_draws makes them
    _check_draws("head_chain", 4, 0.0, None, None, 10)  # greedy: no draws


@pytest.mark.parametrize("model, method", [(None, "sjd"), ("mar", "mar-parallel:8")])
def test_images_are_the_same_under_a_float64_default(model, method, default_dtype):
    t2i = mmspec.pipeline("text-to-image", model=model, method=method)
    reference = t2i("a red circle", seed=1).tokens
    default_dtype(torch.float64)
    assert torch.equal(t2i("a red circle", seed=1).tokens, reference)  # (MAR's noise was drawn in float64)
