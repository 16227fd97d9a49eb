"""``mmspec train drafter --target PATH --data DATA`` on tiny random saved targets: a text Llama
with JSONL prompts (+ given responses) and a LLaVA VLM with a JSONL of images and prompts and no
responses (self-distillation). The trained head loads back with ``drafter="eagle2:OUT"`` and its
greedy output equals plain decoding; bad rows are counted; --resume continues the checkpoint."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmspec.cli import main as cli_main
from tests.tiny_checkpoints import cached_tiny_checkpoint, save_tiny_draft

EOS = "<|im_end|>"


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from mmspec.hub import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


def save_text_target(directory: Path, model, tokenizer) -> Path:
    """A text causal LM saved with SmolLM2's tokenizer (chat template), stopping at its end of turn."""
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(EOS)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def text_target(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-text")
    tokenizer = smollm2_tokenizer()
    save_tiny_draft(directory, len(tokenizer), seed=3)
    return save_text_target(directory, LlamaForCausalLM.from_pretrained(directory), tokenizer)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def train(target: Path, data: Path, out: Path, *extra: str) -> int:
    return cli_main(["train", "drafter", "--target", str(target), "--data", str(data), "--out", str(out), "--dtype", "float32",
                     "--draft-vocab", "0", "--batch-size", "4", "--lr", "3e-3", "--max-new-tokens", "6", "--log-every", "2",
                     "--save-every", "4", "--held-out", "0.25", "--eval-examples", "2", *extra])


def test_text_target_jsonl_with_bad_rows_and_resume(text_target, tmp_path, capsys):
    rows = [{"prompt": f"Tell me about topic {i}.", **({"response": f"Topic {i} is fine."} if i % 2 else {})} for i in range(8)]
    rows += [{"prompt": "  "}, "{not json", {"prompt": "x", "image": "missing.png"}]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "head"
    assert train(text_target, data, out, "--steps", "4", "--method", "hydra", "--num-heads", "2") == 0
    text = capsys.readouterr().out
    assert "skipped 3 rows: 1 empty prompt, 1 missing image, 1 unreadable line" in text
    assert "held-out tau of hydra:" in text
    log = (out / "loss.csv").read_text().splitlines()
    assert log[0].startswith("step,") and len(log) == 3  # steps 2 and 4
    # the trained heads decode exactly
    import mmspec
    from mmspec.api import chat_inputs
    from mmspec.hub import load_causal_lm

    model, tokenizer = load_causal_lm(text_target, dtype=torch.float32)
    inputs = chat_inputs(tokenizer, "Tell me about topic 12.")
    plain = mmspec.generate(model, None, max_new_tokens=10, **inputs)
    drafted = mmspec.generate(model, f"hydra:{out}", max_new_tokens=10, **inputs)
    assert torch.equal(drafted.sequences, plain.sequences) and drafted.stats.mean_accepted_length >= 1.0
    # a second run without --resume is refused; with it, training continues at step 4
    assert train(text_target, data, out, "--steps", "6", "--method", "hydra", "--num-heads", "2") == 2
    assert train(text_target, data, out, "--steps", "6", "--method", "hydra", "--num-heads", "2", "--resume") == 0
    text = capsys.readouterr().out
    assert "resuming at step 4" in text
    assert json.loads((out / "training.json").read_text())["step"] == 6
    assert len((out / "loss.csv").read_text().splitlines()) == 4


def test_vlm_self_distillation_eagle_exact(tmp_path_factory, tmp_path, capsys):
    import mmspec
    from mmspec.pipelines.captioning.components import load_captioning_model

    target = cached_tiny_checkpoint("llava", tmp_path_factory)
    images = tmp_path / "images"
    images.mkdir()
    generator = torch.Generator().manual_seed(0)
    for i in range(6):
        pixels = (torch.rand(24, 24, 3, generator=generator) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(images / f"{i}.png")
    (images / "broken.png").write_bytes(b"not a png")
    rows = [{"image": f"images/{i}.png", "prompt": "Describe the image."} for i in range(6)]
    rows += [{"image": "images/broken.png", "prompt": "What is this?"}, {"prompt": "A question without an image."}]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "eagle"
    assert train(target, data, out, "--steps", "6", "--method", "eagle", "--gen-batch", "4") == 0
    text = capsys.readouterr().out
    assert "skipped 1 rows: 1 unreadable image" in text
    report = json.loads((out / "eval.json").read_text())
    assert report["tau"] >= 1.0 and report["identical_to_target"] == "2/2"
    # the saved head decodes exactly: greedy output identical to plain decoding
    model, processor = load_captioning_model(target, torch.device("cpu"), torch.float32)
    chat = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                         add_generation_prompt=True)
    inputs = dict(processor(text=[chat], images=[Image.open(images / "3.png").convert("RGB")], return_tensors="pt"))
    plain = mmspec.generate(model, None, max_new_tokens=12, **inputs)
    for spec in ("eagle", "eagle2"):
        drafted = mmspec.generate(model, f"{spec}:{out}", max_new_tokens=12, **inputs)
        assert torch.equal(drafted.sequences, plain.sequences)
    # and in the captioning pipeline for that target
    from mmspec.pipelines.captioning import ImageCaptioningPipeline

    captions = [ImageCaptioningPipeline(target, drafter=spec, device="cpu", dtype="float32")(images / "3.png", max_new_tokens=12)
                for spec in (None, f"eagle2:{out}")]
    assert captions[1].text == captions[0].text and captions[1].stats.mean_accepted_length >= 1.0


#: issue-45 families (and the earlier VLMs) x a head method; every issue-45 family trains an EAGLE head
@pytest.mark.parametrize("family, method", [("smolvlm", "eagle"), ("qwen2_vl", "eagle"), ("gemma3", "kangaroo"),
                                            ("internvl", "medusa"), ("internvl", "eagle"), ("llava_next", "eagle"),
                                            ("mistral3", "hydra"), ("idefics3", "kangaroo"), ("gemma4", "eagle"),
                                            ("llava_onevision", "eagle"), ("lfm2_vl", "eagle"), ("qwen3_5", "kangaroo"),
                                            ("qwen3_5", "eagle"), ("qwen3_5_moe", "eagle"), ("mllama", "eagle"),
                                            ("qwen2_5_vl", "eagle"), ("qwen3_vl", "eagle"), ("qwen3_vl_moe", "eagle")])
def test_other_families_self_distil_and_decode_exactly(family, method, tmp_path_factory, tmp_path, capsys):
    """Folder DATA (the default caption prompt), a few steps; the held-out greedy decodes with the
    trained drafter equal the target's own answers; an EAGLE head decodes exactly both as a chain
    (``eagle:OUT``) and as EAGLE-2 trees (``eagle2:OUT``), or, on a recurrent target, refuses trees
    in one line."""
    target = cached_tiny_checkpoint(family, tmp_path_factory)
    images = tmp_path / "images"
    images.mkdir()
    generator = torch.Generator().manual_seed(1)
    for i in range(4):
        Image.fromarray((torch.rand(32, 32, 3, generator=generator) * 255).to(torch.uint8).numpy()).save(images / f"{i}.png")
    out = tmp_path / method
    assert train(target, images, out, "--steps", "2", "--method", method, "--eval-examples", "1", "--max-new-tokens", "5") == 0
    assert "held-out tau" in capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    assert report["identical_to_target"] == "1/1" and report["tau"] >= 1.0
    if method == "eagle":
        from mmspec.train.any_target import Example

        heads_decode_exactly(target, out, Example("Describe the image.", images / "0.png"))


def heads_decode_exactly(target_dir: Path, out: Path, example) -> None:
    """``eagle:OUT`` and ``eagle2:OUT`` greedy equal plain decoding of ``example``; a target that
    verifies no trees refuses ``eagle2`` with one line naming the chain drafters."""
    import mmspec
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.core.target import tree_refusal
    from mmspec.train.any_target import load_target, prompt_inputs

    model, processor, is_vlm = load_target(str(target_dir), torch.float32, torch.device("cpu"))
    target = TransformersTarget(model)
    inputs = prompt_inputs(model, processor, is_vlm, example)
    plain = mmspec.generate(target, None, max_new_tokens=8, **inputs)
    assert torch.equal(mmspec.generate(target, f"eagle:{out}", max_new_tokens=8, **inputs).sequences, plain.sequences)
    if tree_refusal(target) is None:
        assert torch.equal(mmspec.generate(target, f"eagle2:{out}", max_new_tokens=8, **inputs).sequences, plain.sequences)
    else:
        with pytest.raises(ValueError, match="Use a chain drafter") as refused:
            mmspec.generate(target, f"eagle2:{out}", max_new_tokens=8, **inputs)
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe"])
def test_hybrid_text_targets_train_an_eagle_head(family, tmp_path, capsys):
    """The hybrid text models (``*ForCausalLM``), JSONL prompts, self-distilled: the held-out
    greedy decode with the trained head (a chain: trees are refused) equals the target's answer."""
    from test_hybrid import BUILD

    from mmspec.train.any_target import Example

    tokenizer = smollm2_tokenizer()
    target = save_text_target(tmp_path / "target", BUILD[family](0, vocab=len(tokenizer)), tokenizer)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(6)])
    out = tmp_path / "eagle"
    assert train(target, data, out, "--steps", "2", "--method", "eagle", "--eval-examples", "1", "--max-new-tokens", "5") == 0
    assert "held-out tau of eagle:" in capsys.readouterr().out
    report = json.loads((out / "eval.json").read_text())
    assert report["identical_to_target"] == "1/1" and report["tau"] >= 1.0
    heads_decode_exactly(target, out, Example("Tell me about topic 9."))


def test_teacher_forcing_sees_what_decoding_sees():
    """The training forward of ``prompt + response`` (:func:`with_response`) gives the logits of
    the decoding steps: the target's own greedy answer is the argmax at every response position
    (Mllama: the cross-attention mask gains the prompt's last row per response token)."""
    from tiny_vlm_families import make_tiny_family

    import mmspec
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.train.any_target import with_response

    case = make_tiny_family("mllama")
    length = case.inputs["input_ids"].shape[1]
    answer = mmspec.generate(case.model, None, max_new_tokens=6, **case.inputs).sequences[0, length:]
    full = with_response(case.inputs, answer, TransformersTarget(case.model))
    assert full["cross_attention_mask"].shape[1] == length + len(answer)
    with torch.inference_mode():
        logits = case.model(**full).logits[0, length - 1 : -1]
    assert torch.equal(logits.argmax(-1), answer)


def test_bad_arguments(text_target, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": " "}])
    assert train(text_target, data, tmp_path / "o", "--steps", "1") == 2
    assert "holds no usable row" in capsys.readouterr().err
    assert train(text_target, tmp_path / "nothing.jsonl", tmp_path / "o", "--steps", "1") == 2
    assert train(text_target, data, tmp_path / "o", "--steps", "1", "--resume") == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_saved_dataset_without_datasets_says_what_to_install(tmp_path):
    import importlib.util

    from mmspec.train.any_target import read_examples

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    with pytest.raises(ValueError, match="install the datasets package"):
        read_examples(saved)


@pytest.mark.slow  # ~35-45 s on 2 cores: two processes start and import torch + transformers
def test_two_processes_match_one_process_loss_curve(text_target, tmp_path, free_port):
    """accelerate launch --num_processes 2 (CPU, gloo) at the same global batch: each process takes
    half of every step's sequences and the gradients are averaged, so the loss curve is the
    one-process curve (sequences of one length here, so the mean of the two halves' means is the
    mean over the batch)."""
    import os
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(8)])
    common = ["--data", str(data), "--dtype", "float32", "--draft-vocab", "0", "--batch-size", "4", "--lr", "3e-3",
              "--max-new-tokens", "6", "--log-every", "1", "--steps", "5", "--held-out", "0", "--eval-examples", "0",
              "--target", str(text_target), "--method", "eagle"]
    assert cli_main(["train", "drafter", "--out", str(tmp_path / "one"), *common]) == 0
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port),
                           "-m", "mmspec", "train", "drafter", "--out", str(tmp_path / "two"), *common],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    curves = [[e["loss"] for e in json.loads((tmp_path / name / "training.json").read_text())["log"]] for name in ("one", "two")]
    assert len(curves[0]) == 5 and curves[0][-1] < curves[0][0]
    assert curves[1] == pytest.approx(curves[0], rel=1e-3)
