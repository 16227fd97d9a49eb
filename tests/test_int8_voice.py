"""The voice's AR stage read as int8 weights (``int8=True``, ``mmspec tts --int8``;
:func:`mmspec.modeling.fused.read_as_int8`), on the tiny VALL-E-style voice of test_tts_pipeline:
exact methods give the int8 model's plain decoding's codes, the stack really reads int8 weights
(close to the float model's states, not equal), and the one-line refusals."""

import pytest
import torch

import mmspec
from mmspec.cli import main
from mmspec.modeling.fused import read_as_int8, reads_as_int8
from mmspec.modeling.lean import lean_states
from test_tts_pipeline import make_model_dir


@pytest.fixture(scope="module")
def voice(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tts-int8"), aligned=True, valle=True)


@pytest.mark.parametrize("method", ["sjd-coupled", "sjd", "eagle", "spec", "medusa"])
def test_exact_methods_give_the_int8_models_plain_codes(voice, method):
    tts = mmspec.pipeline("text-to-speech", model=voice, method=method, int8=True)
    out = tts("a red star and two blue hearts.", do_sample=False, max_seconds=0.4, compare_baseline=True)
    assert torch.equal(out.codes, out.baseline_codes) and out.stats.config["int8"] is True
    assert reads_as_int8(tts.components.target.model.backbone.layers)


def test_the_stack_reads_int8_weights(voice):
    """The same inputs through the float stack and the int8 one: the first layer's update to the
    residual stream (its state after the layer less its input) close (quantisation error of a few
    percent), not equal; a prompt and then one step, as decoding runs them."""
    from mmspec.core.cache import make_cache

    pipes = [mmspec.pipeline("text-to-speech", model=voice, method="ar", dtype="float32", int8=int8) for int8 in (False, True)]
    torch.manual_seed(0)
    prompt, step = torch.randn(1, 12, 32), torch.randn(1, 1, 32)
    states = []
    with torch.no_grad():
        for pipe in pipes:
            backbone = pipe.components.target.model.backbone
            cache = make_cache(backbone.config)
            kept = [lean_states(backbone, x, cache, hidden_layer=(0, 1))[1] for x in (prompt, step)]
            states.append(torch.cat([k[..., 32:] - k[..., :32] for k in kept], 1))  # [1, 13, 32]
    error = (states[1] - states[0]).norm() / states[0].norm()
    assert 1e-3 < error < 0.1, error
    assert pipes[0].components.int8 is False and not reads_as_int8(pipes[0].components.target.model.backbone.layers)


def test_an_int8_stack_takes_long_and_masked_prompts_in_chunks(voice):
    """More rows than the fused layers take at once (150 > 128, the most any kernel takes; a 4-D
    mask, which their own long-prompt chunks refuse): the int8 stack runs them in causal chunks,
    exactly as one-token steps; a mask that lets a token see a later one is refused."""
    from mmspec.core.cache import make_cache

    backbone = mmspec.pipeline("text-to-speech", model=voice, method="ar", dtype="float32", int8=True
                               ).components.target.model.backbone
    torch.manual_seed(0)
    prompt, n = torch.randn(1, 150, 32), 150
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        whole = lean_states(backbone, prompt, make_cache(backbone.config))[0]
        masked = lean_states(backbone, prompt, make_cache(backbone.config), attention_mask=causal)[0]
        cache = make_cache(backbone.config)
        steps = torch.cat([lean_states(backbone, prompt[:, i : i + 1], cache)[0] for i in range(n)], 1)
        assert torch.equal(whole, steps) and torch.equal(masked, steps)
        with pytest.raises(ValueError, match="attend to a later one"):
            lean_states(backbone, prompt, make_cache(backbone.config), attention_mask=torch.ones_like(causal))


def test_the_nar_stage_reads_int8_weights(voice):
    """int8=True: the NAR stage's linears through the int8 kernel (the tiny stage's 8-code heads,
    not a multiple of 16, stay float): its logits close to the float stage's, not equal."""
    pipes = [mmspec.pipeline("text-to-speech", model=voice, method="ar", dtype="float32", int8=int8) for int8 in (False, True)]
    torch.manual_seed(0)
    codes0, alignment = torch.randint(0, 8, (1, 20)), torch.zeros(1, 20, 4, dtype=torch.long)
    with torch.no_grad():
        logits = [pipe.components.nar(codes0, alignment) for pipe in pipes]
    error = (logits[1] - logits[0]).norm() / logits[0].norm()
    assert 1e-3 < error < 0.1, error


def test_int8_refusals(voice):
    with pytest.raises(ValueError, match="int8 weights run on the CPU's fused C layers"):
        mmspec.pipeline("text-to-speech", model=voice, int8=True, optimize=False)
    with pytest.raises(TypeError, match="int8 is True or False"):
        mmspec.pipeline("text-to-speech", model=voice, int8="yes")
    tts = mmspec.pipeline("text-to-speech", model=voice, method="ar", int8=True)
    backbone = tts.components.target.model.backbone
    with pytest.raises(ValueError, match="runs only through the fused C layers"):  # gradients on: PyTorch's modules
        lean_states(backbone, torch.randn(1, 3, 32), None)
    with pytest.raises(ValueError, match="int8 path 'nope' does not run here"):
        read_as_int8(backbone.layers, path="nope")


def test_cli_int8(voice, tmp_path, capsys):
    out = tmp_path / "x.wav"
    assert main(["tts", "a red star.", "--model", str(voice), "--int8", "--out", str(out), "--no-spectrogram",
                 "--compare-baseline", "--greedy", "--json"]) == 0
    assert '"int8": true' in capsys.readouterr().out and out.is_file()
    assert main(["tts", "a red star.", "--model", str(voice), "--int8", "--no-optimize", "--out", str(tmp_path / "y.wav")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "int8 weights run on the CPU" in err[0]
