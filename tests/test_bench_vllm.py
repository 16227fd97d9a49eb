"""``mmspec bench vllm`` without vLLM: its mmspec side on a tiny saved SmolVLM and a random EAGLE-3
head, with a stand-in ``vllm`` package (put first on PYTHONPATH for the worker's interpreter)
that decodes greedily with transformers from the files the benchmark writes. The stand-in's
tokens equal mmspec's plain decoding only if the written decoder checkpoint (LM head included),
the prompt embeddings with the image features and the mixed prompt's mask are right. Bad
options are one line before any model loads. (The real vLLM run: docs/drafters.md.)"""

import json
import sys
import textwrap

import pytest
import torch
from tiny_checkpoints import cached_tiny_checkpoint, write_eagle3_images, write_eagle3_lm

from mmspec.cli import main

#: a stand-in for vLLM's LLM: greedy decoding of the written target with transformers; its
#: spec-decode counters say every step drafted K and kept none (what a drafter that never hits gives)
FAKE_VLLM = textwrap.dedent('''
    import torch
    from types import SimpleNamespace
    from transformers import AutoModelForCausalLM
    __version__ = "0.0-standin"

    class SamplingParams:
        def __init__(self, temperature, max_tokens, stop_token_ids):
            assert temperature == 0
            self.max_tokens, self.stop = max_tokens, set(stop_token_ids)

    class LLM:
        def __init__(self, model, dtype, speculative_config, **kwargs):
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
            self.k = 0 if speculative_config is None else speculative_config["num_speculative_tokens"]
            if self.k:
                assert (__import__("pathlib").Path(speculative_config["model"]) / "config.json").is_file()
            self.steps = 0

        def generate(self, prompts, params, use_tqdm=False):
            prompt = prompts[0]
            ids = torch.tensor([prompt["prompt_token_ids"]])
            embeds = self.model.get_input_embeddings()(ids)
            if "prompt_embeds" in prompt:
                mask = torch.tensor(prompt["prompt_is_token_ids"])[None, :, None]
                embeds = torch.where(mask, embeds, prompt["prompt_embeds"][None].to(embeds.dtype))
            tokens = []
            with torch.inference_mode():
                while len(tokens) < params.max_tokens:
                    token = int(self.model(inputs_embeds=embeds).logits[0, -1].argmax())
                    tokens.append(token)
                    if token in params.stop:
                        break
                    embeds = torch.cat([embeds, self.model.get_input_embeddings()(torch.tensor([[token]]))], dim=1)
            self.steps += (len(tokens) - 1) if self.k else 0
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)])]

        def get_metrics(self):
            return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.steps),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=0)]
''')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    checkpoint = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    folder = tmp_path_factory.mktemp("bench-vllm")
    write_eagle3_images(checkpoint, folder)
    (folder / "fake" / "vllm").mkdir(parents=True)
    (folder / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    return checkpoint, folder


def test_the_served_decoder_decodes_what_mmspec_decodes(setup, capsys, monkeypatch):
    checkpoint, folder = setup
    monkeypatch.setenv("PYTHONPATH", str(folder / "fake"))
    argv = ["bench", "vllm", "--vllm-python", sys.executable, "--model", str(checkpoint), "--drafter", f"eagle3:{folder / 'head'}",
            "--data", str(folder / "data.jsonl"), "--per-family", "1", "--draft-tokens", "3", "--max-new-tokens", "8",
            "--dtype", "fp32", "--work", str(folder / "work"), "--results", str(folder / "r.json"), "--markdown", str(folder / "t.md")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    results = json.loads((folder / "r.json").read_text())
    summary = results["summary"]
    # the stand-in decoded the written decoder from the written embeddings: mmspec's plain decoding
    assert summary["vllm"]["plain_identical_to_mmspec"] == 2 and summary["vllm"]["eagle3_identical_to_mmspec"] == 2
    assert summary["mmspec"]["identical_to_plain"] == 2  # exact in fp32
    # the stand-in's counters (K drafted and none kept each step) are what its row reports
    steps = sum(len(item["tokens"]) - 1 for item in results["vllm"]["3"]["items"])
    assert summary["vllm"]["steps"] == steps and summary["vllm"]["accepted"] == 0
    mm = [results["runs"][f"{group}/0/eagle3"] for group in ("red", "blue")]
    assert summary["vllm"]["items_with_mmspec_steps_and_accepted"] == sum((r["steps"], r["accepted"]) == (len(r["tokens"]) - 1, 0) for r in mm)
    assert summary["mmspec"]["steps"] == sum(r["steps"] for r in mm) > 0
    assert "| vLLM 0.0-standin | eagle3, K = 3 |" in out and out == (folder / "t.md").read_text() + "\n"
    # what vLLM loads: an untied LM head written out, the head in vLLM's layout, the prompts' files
    from safetensors import safe_open

    with safe_open(str(folder / "work" / "target" / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" in handle.keys()
    assert json.loads((folder / "work" / "head" / "config.json").read_text())["architectures"] == ["Eagle3LlamaForCausalLM"]
    items = json.loads((folder / "work" / "items.json").read_text())["items"]
    assert all(item["embeds"] and not all(item["is_token_ids"]) for item in items)


@pytest.mark.parametrize("extra,message", [
    (["--draft-tokens", "0"], "--draft-tokens must be at least 1, got 0"),
    (["--drafter", "eagle"], "vLLM serves EAGLE-3 heads"),
    (["--vllm-python", "/nonexistent/python"], "cannot run it"),
    (["--vllm-python", sys.executable], "cannot import vllm"),
])
def test_bad_options_are_one_line_errors(setup, capsys, extra, message):
    _, folder = setup
    argv = ["bench", "vllm", "--vllm-python", sys.executable, "--data", str(folder / "data.jsonl"),
            "--work", str(folder / "bad-work"), "--results", str(folder / "bad.json"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (folder / "bad.json").exists() and not (folder / "bad-work").exists()


def test_a_tied_lm_head_is_written_out(tmp_path):
    """A decoder whose LM head shares the embedding table (the embedded captioner's) is written
    with its own lm_head.weight and an untied config, so an engine that reads the config gets the
    same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from mmspec.bench.vllm import write_decoder
    from mmspec.hub import smollm2_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    write_decoder(model, AutoTokenizer.from_pretrained(smollm2_checkpoint()), tmp_path / "target")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()
    assert not loaded.config.tie_word_embeddings
    ids = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_causal_lm_is_served_from_its_prompt_ids(setup, tmp_path, capsys, monkeypatch):
    """Rows of prompts alone serve a causal LM: no embeddings file, the prompt ids in its chat
    template, and the stand-in's greedy tokens equal mmspec's plain decoding."""
    _, folder = setup
    write_eagle3_lm(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(folder / "fake"))
    argv = ["bench", "vllm", "--vllm-python", sys.executable, "--model", str(tmp_path / "lm"), "--drafter",
            f"eagle3:{tmp_path / 'head'}", "--data", str(tmp_path / "prompts.jsonl"), "--per-family", "1", "--draft-tokens", "2",
            "--max-new-tokens", "6", "--dtype", "fp32", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "r.json")]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["vllm"]["plain_identical_to_mmspec"] == 2 and summary["mmspec"]["identical_to_plain"] == 2
    items = json.loads((tmp_path / "work" / "items.json").read_text())["items"]
    assert all(item["embeds"] is None and item["is_token_ids"] is None for item in items)
    assert "| vLLM 0.0-standin | plain decoding |" in capsys.readouterr().out


def test_a_vlm_with_multimodal_positions_is_refused(tmp_path_factory, capsys, monkeypatch):
    """Qwen2-VL's decoder takes M-RoPE positions, which its decoder served alone would not get:
    one line that says to serve the VLM itself, before anything is measured."""
    checkpoint = cached_tiny_checkpoint("qwen2_vl", tmp_path_factory)
    folder = tmp_path_factory.mktemp("bench-vllm-qwen")
    write_eagle3_images(checkpoint, folder)
    (folder / "fake" / "vllm").mkdir(parents=True)
    (folder / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(folder / "fake"))
    argv = ["bench", "vllm", "--vllm-python", sys.executable, "--model", str(checkpoint), "--drafter", f"eagle3:{folder / 'head'}",
            "--data", str(folder / "data.jsonl"), "--per-family", "1", "--dtype", "fp32", "--work", str(folder / "work"),
            "--results", str(folder / "r.json")]
    assert main(argv) == 2
    assert "multimodal positions (M-RoPE)" in capsys.readouterr().err and not (folder / "r.json").exists()
