"""``mmspec train drafter --target PATH --data DATA`` on tiny random saved targets: a text Llama
with JSONL prompts (+ given responses) and a LLaVA VLM with a JSONL of images and prompts and no
responses (self-distillation). The trained head loads back with ``drafter="eagle2:OUT"`` and its
greedy output equals plain decoding; bad rows are counted; --resume continues the checkpoint."""

import json
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmspec.cli import main as cli_main
from tests.tiny_checkpoints import cached_tiny_checkpoint, save_tiny_draft

EOS = "<|im_end|>"


def random_images(folder, seed: int, count: int = 4):
    """``folder`` with ``count`` random 32x32 PNGs (0.png ..), the same for the same seed."""
    folder.mkdir()
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        Image.fromarray((torch.rand(32, 32, 3, generator=generator) * 255).to(torch.uint8).numpy()).save(folder / f"{i}.png")
    return folder


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
    assert (f"skipped 3 rows: 1 empty prompt (line 9), 1 missing image (line 11; no file {tmp_path / 'missing.png'}: an image "
            "path is relative to the JSONL file's folder), 1 unreadable line (line 10)") in text
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


def test_steps_0_makes_the_data_only_and_a_trained_out_is_refused_before_anything_is_written(text_target, tmp_path, capsys):
    """The stop-78 audit: the cards' data-only commands (--steps 0) were refused since --steps had
    to be >= 1; a run into a folder holding a trained head rewrote its draft_vocab.json, then refused."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}.", "response": "Fine."} for i in range(8)])
    out = tmp_path / "head"
    assert train(text_target, data, out, "--steps", "0", "--cache", str(tmp_path / "cache")) == 0
    assert "--steps 0: the data is ready in" in capsys.readouterr().out
    assert any((tmp_path / "cache").iterdir()) and not out.exists()
    assert train(text_target, data, out, "--steps", "-1") == 2  # (0 allowed: the refusal says so)
    assert "--steps must be at least 0, got -1" in capsys.readouterr().err
    out.mkdir()
    (out / "eagle_head.safetensors").write_bytes(b"weights")
    (out / "draft_vocab.json").write_text("[1, 2]")
    assert train(text_target, data, out, "--steps", "2") == 2
    assert "holds a trained model (eagle_head.safetensors) and no checkpoint to resume" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["draft_vocab.json", "eagle_head.safetensors"]
    assert (out / "draft_vocab.json").read_text() == "[1, 2]"


def test_a_resume_that_changes_the_heads_shape_is_refused_before_anything_loads(text_target, tmp_path, capsys):
    """The stop-85 audit: --resume with another --method was told to delete its data cache (and
    after remaking it, that the checkpoint is another run's); with another EAGLE-3 --draft-vocab
    the data were read and draft_vocab.json rewritten before the checkpoint failed to load."""
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}.", "response": "Fine, thanks."} for i in range(6)])
    out = tmp_path / "head"
    assert train(text_target, data, out, "--steps", "2", "--method", "eagle3", "--eval-examples", "0") == 0
    vocabulary = (out / "eagle3_config.json").read_text()
    capsys.readouterr()
    for changed, shown in [(["--method", "eagle"], "--method eagle3 (its training.json), not --method eagle"),
                           (["--method", "eagle3", "--draft-vocab", "2"], "--draft-vocab 0 (its training.json), not --draft-vocab 2"),
                           (["--method", "eagle3", "--vision-tokens", "2"], "--vision-tokens 0 (its training.json), not --vision-tokens 2")]:
        assert train(text_target, data, out, "--steps", "4", "--resume", *changed) == 2
        captured = capsys.readouterr()
        assert f"--resume: the checkpoint in {out} trains a head of {shown}" in captured.err and "data:" not in captured.out
    assert (out / "eagle3_config.json").read_text() == vocabulary and not (out / "draft_vocab.json").exists()
    assert train(text_target, data, out, "--steps", "4", "--resume", "--method", "eagle3", "--ttt-steps", "2", "--eval-examples", "0") == 0
    assert "resuming at step 2; changed since the checkpoint: ttt_steps 3 there, 2 now" in capsys.readouterr().out


def test_a_data_cache_of_another_target_is_refused(text_target, tmp_path, capsys, monkeypatch):
    """The stop-85 audit: the cache's manifest did not record the target, so a --cache (or an --out's
    data/) made by one checkpoint trained another's head on the first one's hidden states, without
    a word. Refused before the target loads (stop 86; was after). A cache made before the target
    was recorded is still taken."""
    import shutil

    from mmspec.train import any_target

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}.", "response": "Fine."} for i in range(4)])
    cache = tmp_path / "cache"
    assert train(text_target, data, tmp_path / "a", "--steps", "0", "--cache", str(cache)) == 0
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["target"] == str(text_target.resolve())
    other = shutil.copytree(text_target, tmp_path / "other-model")
    with monkeypatch.context() as patch:
        patch.setattr(any_target, "load_target", lambda *a: pytest.fail("the target loaded before the cache was checked"))
        assert train(other, data, tmp_path / "b", "--steps", "0", "--cache", str(cache)) == 2
    err = capsys.readouterr().err
    assert f"the data cache {cache} was made with other settings (target {str(text_target.resolve())!r} there" in err
    del manifest["target"]  # (as written before the target was recorded)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    assert train(other, data, tmp_path / "b", "--steps", "0", "--cache", str(cache)) == 0


def test_another_seed_reuses_greedy_data_but_not_sampled_data(text_target, tmp_path, capsys, monkeypatch):
    """The drafter audit: the data cache recorded --seed, so a second head trained on the same greedy
    self-distilled answers with another --seed (another initialisation and batch order) was refused
    ("delete it"), its data to be made again, though a greedy answer draws nothing. The seed now
    counts only where the answers are sampled (--sample-temperature)."""
    from mmspec.train import any_target

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(4)])
    cache = tmp_path / "cache"
    assert train(text_target, data, tmp_path / "a", "--steps", "0", "--cache", str(cache)) == 0
    shards = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*.pt")}
    monkeypatch.setattr(any_target, "self_distil", lambda *a, **k: pytest.fail("the greedy answers were made again"))
    assert train(text_target, data, tmp_path / "b", "--steps", "0", "--cache", str(cache), "--seed", "7") == 0
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*.pt")} == shards
    sampled = tmp_path / "sampled"
    monkeypatch.undo()
    assert train(text_target, data, tmp_path / "c", "--steps", "0", "--cache", str(sampled), "--sample-temperature", "1") == 0
    capsys.readouterr()
    assert train(text_target, data, tmp_path / "d", "--steps", "0", "--cache", str(sampled), "--sample-temperature", "1",
                 "--seed", "7") == 2
    assert "(seed 0 there, 7 now;" in capsys.readouterr().err


def test_a_data_that_gives_no_row_leaves_no_cache_behind(text_target, tmp_path, capsys):
    """The drafter audit: a DATA whose every row was skipped while encoding (images given to a
    text-only target, unreadable images) was refused after writing empty shards and a manifest,
    so the corrected command (the file fixed in place) read the same empty shards and was refused
    again, or (another --target) was told to delete the cache."""
    random_images(tmp_path / "imgs", seed=0, count=4)
    data = write_jsonl(tmp_path / "data.jsonl", [{"image": f"imgs/{i}.png", "prompt": f"Topic {i}?"} for i in range(4)])
    out = tmp_path / "head"
    assert train(text_target, data, out, "--steps", "2", "--eval-examples", "0") == 2
    assert "no row could be used (4 images given to a text-only target (lines 1, 2, 3, 4); nothing was cached)" in capsys.readouterr().err
    assert not (out / "data").exists()
    write_jsonl(data, [{"prompt": f"Topic {i}?"} for i in range(4)])  # (fixed in place: the same path and row count)
    assert train(text_target, data, out, "--steps", "2", "--eval-examples", "0") == 0
    assert "data: 4 sequences" in capsys.readouterr().out


def test_an_image_folder_holding_a_jsonl_is_not_read_as_bare_images(text_target, tmp_path, capsys):
    """The drafter audit: --data DIR for `mmspec train caption-data`'s output (images + data.jsonl)
    trained on every image with the default prompt, its rows' prompts, answers and groups dropped
    without a word. Refused unless --prompt says the bare images are meant."""
    from mmspec.train.any_target import read_examples

    folder = random_images(tmp_path / "data", seed=0, count=2)
    write_jsonl(folder / "data.jsonl", [{"image": "0.png", "prompt": "What colour?", "group": "a"}])
    assert train(text_target, folder, tmp_path / "head", "--steps", "0") == 2
    assert (f"is read as a folder of images, each with the prompt 'Describe the image.', but it holds data.jsonl: pass "
            f"--data {folder / 'data.jsonl'} to use its rows, or give --prompt") in capsys.readouterr().err
    assert [e.prompt for e in read_examples(folder, "Hi", prompt_given=True)[0]] == ["Hi", "Hi"]


def test_overwrite_trains_anew_over_a_finished_run(text_target, tmp_path, capsys):
    """The stop-85 audit: --overwrite ("train anew into an --out that holds a trained model") was
    refused over any finished run of this route ("holds a checkpoint; pass --resume"), which left
    deleting the folder, and its data, as the only way to train anew."""
    import argparse

    from mmspec.train.cli import interrupted

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}.", "response": "Fine."} for i in range(6)])
    out = tmp_path / "head"
    medusa = ("--method", "medusa", "--num-heads", "2", "--eval-examples", "0")
    assert train(text_target, data, out, "--steps", "4", *medusa) == 0
    assert train(text_target, data, out, "--steps", "2", *medusa) == 2
    assert "--overwrite to train anew there" in capsys.readouterr().err
    assert train(text_target, data, out, "--steps", "2", "--overwrite", "--resume", *medusa) == 2
    assert "--overwrite trains anew and --resume continues the checkpoint" in capsys.readouterr().err
    assert train(text_target, data, out, "--steps", "2", "--lr", "1e-3", "--overwrite", *medusa) == 0
    assert "resuming" not in capsys.readouterr().out
    summary = json.loads((out / "training.json").read_text())
    assert summary["step"] == 2 and [entry["step"] for entry in summary["log"]] == [2] and summary["args"]["lr"] == 1e-3
    # interrupted after its checkpoint, an --overwrite run is resumed with --resume in its place
    args = argparse.Namespace(recipe="drafter", save_every=4, data=str(data), target=str(text_target), out=str(out))
    note = interrupted(args, f"mmspec train drafter --out {out} --overwrite")
    assert note.endswith(f"mmspec train drafter --out {out} --resume")


def test_loss_csv_has_every_logged_step_before_a_checkpoint(text_target, tmp_path, capsys, monkeypatch):
    """docs/drafters.md: a row of OUT/loss.csv every --log-every steps (the stop-74 audit: it was
    written only with a checkpoint, so a run stopped before one had none)."""
    from mmspec.train.checkpoint import TrainingRun

    def stopped(self, **state):
        raise KeyboardInterrupt  # Ctrl-C at the first checkpoint, after the logged steps

    monkeypatch.setattr(TrainingRun, "save", stopped)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}.", "response": "Fine."} for i in range(6)])
    assert train(text_target, data, tmp_path / "head", "--steps", "3", "--log-every", "1", "--save-every", "100",
                 "--method", "medusa", "--num-heads", "2") == 130
    log = (tmp_path / "head" / "loss.csv").read_text().splitlines()
    assert log[0].startswith("step,") and [row.split(",")[0] for row in log[1:]] == ["1", "2", "3"]


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
    assert "skipped 1 row: 1 unreadable image (line 7)" in text  # (the row, found only when encoded, named too)
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
    images = random_images(tmp_path / "images", seed=1)
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
    assert "holds no checkpoint (train_state.pt) to continue; rerun without --resume\n" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "hi"}])
    # stopped before its first checkpoint (docs: "the same command plus --resume"): the refusal says to rerun without it
    assert train(text_target, good, tmp_path / "o", "--steps", "0") == 0
    assert train(text_target, good, tmp_path / "o", "--steps", "1", "--resume") == 2
    assert f"rerun without --resume (it reuses the data made so far in {tmp_path / 'o' / 'data'})" in capsys.readouterr().err
    for target in ("./no-such-model", str(tmp_path / "no-such-model")):  # a path, not a hub id with bad characters
        assert cli_main(["train", "drafter", "--target", target, "--data", str(good), "--out", str(tmp_path / "o")]) == 2
        assert f"--target {target}: no such directory; give a checkpoint directory" in capsys.readouterr().err


def test_methods_the_target_cannot_run_are_refused_before_self_distillation(text_target, tmp_path, capsys):
    """Kangaroo on a one-layer target (its draft exits after layer min(2, layers - 1)) and Medusa on
    a hybrid recurrent one (token trees) are one line each before any answer is generated, not
    after training."""
    from test_hybrid import BUILD

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(4)])
    assert train(text_target, data, tmp_path / "k", "--steps", "1", "--method", "kangaroo") == 2
    captured = capsys.readouterr()
    assert "--method kangaroo needs a target of at least 2 decoder layers" in captured.err and "data:" not in captured.out
    assert not (tmp_path / "k" / "data").exists()
    hybrid = save_text_target(tmp_path / "q35", BUILD["qwen3_5"](0, vocab=len(smollm2_tokenizer())), smollm2_tokenizer())
    for method in ("medusa", "hydra"):
        assert train(hybrid, data, tmp_path / method, "--steps", "1", "--method", method) == 2
        captured = capsys.readouterr()
        assert f"--method {method} drafts token trees" in captured.err and "Train --method eagle or eagle3" in captured.err
        assert "data:" not in captured.out


def test_an_init_that_is_no_head_of_the_method_is_refused_before_self_distillation(text_target, tmp_path, capsys):
    """The stop-85 audit: ``--init`` naming a missing folder, another method's heads or the target
    itself was refused only after every answer was self-distilled (EAGLE, Medusa, Hydra, Kangaroo)."""
    from mmspec.modeling.heads import DraftHeads

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(4)])
    DraftHeads(32, 2, "hydra").save(tmp_path / "hydra")
    cases = [("eagle", tmp_path / "nowhere", "--init {}: no such directory"), ("medusa", tmp_path / "hydra", "holds hydra heads, not medusa"),
             ("eagle", tmp_path / "hydra", "no eagle head in"), ("hydra", text_target, "no hydra heads in"),
             ("hydra", tmp_path / "hydra", "holds 2 hydra heads, not 4; pass --num-heads 2")]  # (the saved count won, unsaid)
    for method, init, refusal in cases:
        out = tmp_path / f"out-{method}"
        assert train(text_target, data, out, "--steps", "1", "--method", method, "--init", str(init)) == 2
        captured = capsys.readouterr()
        assert refusal.format(init) in captured.err and "data:" not in captured.out
        assert not (out / "data").exists()


def test_the_embedded_recipes_data_options_are_refused_not_ignored(text_target, tmp_path, capsys):
    """The stop-85 audit: ``--sequences 2`` (or --extra-data, --skip, --families, ...) with a --data of
    rows was ignored without a word: every row was used."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(4)])
    for extra, named in [(["--sequences", "2"], "--sequences applies"), (["--extra-data", str(tmp_path)], "--extra-data applies"),
                         (["--skip", "1", "--families", "scenes"], "--skip, --families apply")]:
        assert train(text_target, data, tmp_path / "o", "--steps", "1", *extra) == 2
        captured = capsys.readouterr()
        assert f"mmspec: error: {named} to the embedded recipes' own data" in captured.err and "data:" not in captured.out
    assert not (tmp_path / "o").exists()


def test_saved_dataset_without_pyarrow_says_what_to_install(tmp_path):
    import importlib.util

    from mmspec.train.any_target import read_examples

    if importlib.util.find_spec("pyarrow") is not None:
        pytest.skip("pyarrow is installed")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    with pytest.raises(ValueError, match="install pyarrow"):
        read_examples(saved)
    with pytest.raises(ValueError, match="matches no .parquet file"):
        read_examples(tmp_path / "nothing-*.parquet")


def png_bytes(seed: int) -> bytes:
    import io

    buffer = io.BytesIO()
    pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_parquet_and_arrow_forms_count_bad_rows_and_train(tmp_path_factory, tmp_path, capsys):
    """--data as a folder of parquet files, a glob of them, and a save_to_disk-layout folder (Arrow
    stream + state.json, as ``datasets`` writes it), read with pyarrow: image bytes ({bytes, path},
    datasets' Image feature), relative paths, text-only rows; every bad row counted (an empty or
    null prompt, a missing image, bytes that are no image, a parquet file that cannot be read),
    then an EAGLE-3 head trained on it."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from mmspec.train.any_target import read_examples

    folder = tmp_path / "pq"
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "1.png").write_bytes(png_bytes(1))
    table = pa.table({
        "prompt": ["Describe the image.", "What is it?", "", "Hi", "Hi", None, "Caption it.", "Describe it."],
        "image": [{"bytes": png_bytes(0), "path": None}, {"bytes": None, "path": "images/1.png"}, {"bytes": png_bytes(2), "path": None},
                  {"bytes": None, "path": "images/missing.png"}, {"bytes": b"not a png", "path": None}, None, None,
                  {"bytes": png_bytes(3), "path": None}],
        "response": [None, None, None, None, None, None, "A picture of noise.", None],
    })
    pq.write_table(table.slice(0, 4), folder / "part-0.parquet")
    pq.write_table(table.slice(4), folder / "part-1.parquet")
    (folder / "part-2.parquet").write_bytes(b"PAR1 this is not parquet")
    for data, name in ((folder, ""), (f"{folder}/part-*.parquet", f"{folder}/")):
        examples, skipped = read_examples(data)
        assert skipped == {f"empty prompt ({name}part-0.parquet row 3; {name}part-1.parquet row 2)": 2,
                           f"missing image ({name}part-0.parquet row 4)": 1, f"unreadable data file ({name}part-2.parquet)": 1}
        assert [e.prompt for e in examples] == ["Describe the image.", "What is it?", "Hi", "Caption it.",
                                                                          "Describe it."]
    assert isinstance(examples[0].image, bytes) and examples[1].image == folder / "images" / "1.png" and examples[3].image is None
    saved = tmp_path / "saved"  # save_to_disk's layout: state.json naming Arrow stream files
    saved.mkdir()
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (saved / "images").mkdir()
    (saved / "images" / "1.png").write_bytes(png_bytes(1))
    examples, skipped = read_examples(saved)
    assert len(examples) == 5 and skipped == {"empty prompt (data-00000-of-00001.arrow rows 3, 6)": 2,
                                              "missing image (data-00000-of-00001.arrow row 4)": 1}
    # end to end: the undecodable bytes are counted when encoded; the text-only row with its response is used
    target = cached_tiny_checkpoint("llava", tmp_path_factory)
    out = tmp_path / "eagle3"
    assert train(target, folder, out, "--steps", "2", "--method", "eagle3", "--eval-examples", "1", "--max-new-tokens", "5") == 0
    text = capsys.readouterr().out
    assert "data: 4 sequences from" in text
    assert ("skipped 4 rows and 1 data file: 2 empty prompts (part-0.parquet row 3; part-1.parquet row 2), 1 missing image "
            "(part-0.parquet row 4), 1 unreadable data file (part-2.parquet), 1 unreadable image (part-1.parquet row 1)") in text
    assert json.loads((out / "eval.json").read_text())["tau"] >= 1.0


def test_a_parquet_file_without_a_prompt_column_is_skipped_and_named(tmp_path):
    """A folder of parquet files where one file lacks the ``prompt`` column stopped the whole run
    ("no 'prompt' column"), though the docs promise bad data is skipped with a count: the file is
    now counted and named with its columns, the other files' rows are used; a DATA with no usable
    row is one line naming the file, its columns and the ones it needs. A reason names its first
    5 rows, then "..."."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from mmspec.train.any_target import format_skipped, read_examples, skipped_total

    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["a", "", "c", "", "", "", "", "", "h"]}), folder / "part-0.parquet")
    pq.write_table(pa.table({"question": ["x", "y"], "image": [None, None]}), folder / "part-1.parquet")
    examples, skipped = read_examples(folder)
    assert [e.prompt for e in examples] == ["a", "c", "h"]
    assert format_skipped(skipped) == ("1 data file without a 'prompt' column (part-1.parquet, columns question, image), "
                                       "6 empty prompts (part-0.parquet rows 2, 4, 5, 6, 7, ...)")
    assert skipped_total(skipped) == "6 rows and 1 data file" and skipped_total({"empty prompt (line 2)": 1}) == "1 row"
    with pytest.raises(ValueError) as refused:
        read_examples(folder / "part-1.parquet")
    assert str(refused.value) == (f"--data {folder / 'part-1.parquet'} holds no usable row (skipped: 1 data file without a "
                                  f"'prompt' column ({folder / 'part-1.parquet'}, columns question, image)); the columns are "
                                  "prompt, image (optional), response (optional)")


def test_a_missing_image_names_the_path_it_was_looked_for_at(tmp_path):
    """A JSONL's image paths are relative to its folder; one written relative to the working folder
    (``imgs/a.png`` in ``ds/data.jsonl``) was skipped as "1 missing image (line 1)", a file the user
    could see: the reason names the path looked for and what image paths are relative to."""
    from PIL import Image

    from mmspec.train.any_target import format_skipped, read_examples

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "a.png")
    rows = [{"image": "imgs/a.png", "prompt": "x"}, {"image": "../imgs/a.png", "prompt": "y"}, {"image": "imgs/b.png", "prompt": "z"}]
    (tmp_path / "ds").mkdir()
    examples, skipped = read_examples(write_jsonl(tmp_path / "ds" / "data.jsonl", rows))
    assert [e.prompt for e in examples] == ["y"]
    assert format_skipped(skipped) == (f"2 missing images (lines 1, 3; no file {tmp_path / 'ds' / 'imgs' / 'a.png'}: an image "
                                       "path is relative to the JSONL file's folder)")
    # an absolute path is where it was looked for: no hint about relative paths (the drafter audit)
    _, skipped = read_examples(write_jsonl(tmp_path / "abs.jsonl", [{"image": str(tmp_path / "nope.png"), "prompt": "x"},
                                                                     {"image": str(tmp_path / "imgs" / "a.png"), "prompt": "y"}]))
    assert format_skipped(skipped) == f"1 missing image (line 1; no file {tmp_path / 'nope.png'})"


def test_a_misspelt_image_or_response_field_is_a_skipped_row(tmp_path):
    """``{"img": ..., "prompt": ...}`` was read as a text-only row (a VLM's drafter trained on the
    prompt without its image, "no row skipped"), ``{"respone": ...}`` as a row to self-distil: such
    a row is now skipped and counted under what it holds; other extra fields (an id) are kept."""
    from PIL import Image

    from mmspec.train.any_target import format_skipped, read_examples

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"img": "a.png", "prompt": "x"}, {"images": ["a.png"], "prompt": "y"}, {"prompt": "z", "respone": "It is."},
            {"image": "a.png", "prompt": "w", "image_id": 7, "id": "r4"}, {"prompt": "v", "response": "Yes.", "response_id": 2}]
    examples, skipped = read_examples(write_jsonl(tmp_path / "data.jsonl", rows))
    assert [e.prompt for e in examples] == ["w", "v"]
    assert format_skipped(skipped) == ("2 rows with a field like 'image' but none named so (lines 1, 2), "
                                       "1 row with a field like 'response' but none named so (line 3)")


def test_jsonl_encodings_and_the_lines_of_skipped_rows(tmp_path):
    """A JSONL is UTF-8 (a byte-order mark read past, any case of .jsonl); another encoding is one
    line naming where, not a prompt with replacement characters; a skipped row names its line."""
    from mmspec.train.any_target import format_skipped, read_examples

    (tmp_path / "BOM.JSONL").write_bytes(b'\xef\xbb\xbf{"prompt": "Describe it."}\n')
    assert [e.prompt for e in read_examples(tmp_path / "BOM.JSONL")[0]] == ["Describe it."]
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": "D\xe9cris l\'image."}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl is not UTF-8 text \(line 2\); save it as UTF-8"):
        read_examples(tmp_path / "latin.jsonl")
    rows = [{"prompt": "ok"}, "not json", {"prompt": ""}, {"image": "x.png"}, "[1]", "{oops", {"prompt": None},
            {"prompt": "hi", "response": 5}, {"prompt": "hi", "response": None}]  # (a response 5 was self-distilled, unsaid)
    examples, skipped = read_examples(write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert len(examples) == 2 and format_skipped(skipped) == (
        "1 empty prompt (line 3), 1 row without a prompt (line 4), 5 unreadable lines (lines 2, 5, 6, 7, 8)")
    # a .json dataset file holding one array was "17 unreadable line (lines 1, 2, 3, 4, 5, ...)" (the drafter audit)
    (tmp_path / "array.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    with pytest.raises(ValueError, match=r"array.json is one JSON array, not JSON Lines: write one \{\"prompt\": ...\} object a line"):
        read_examples(tmp_path / "array.json")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "response": [1, 2]}), tmp_path / "numbers.parquet")
    with pytest.raises(ValueError, match=r"holds no usable row \(skipped: 2 unreadable rows \(.*numbers.parquet rows 1, 2\)\)"):
        read_examples(tmp_path / "numbers.parquet")


def test_saved_datasets_dataset_and_dataset_dict(tmp_path_factory, tmp_path, capsys):
    """A real ``datasets`` Dataset (Image feature) and DatasetDict saved with save_to_disk: the
    same rows as written, bad ones counted; an EAGLE-3 head trains on the DatasetDict's train split."""
    datasets = pytest.importorskip("datasets")
    from mmspec.train.any_target import read_examples

    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        (images / f"{i}.png").write_bytes(png_bytes(10 + i))
    rows = {"image": [str(images / f"{i}.png") for i in range(4)], "prompt": ["Describe the image.", "", "What is this?", "Hi"],
            "response": [None, None, "Noise.", ""]}
    dataset = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    dataset.save_to_disk(str(tmp_path / "saved"))
    text_only = datasets.Dataset.from_dict({"prompt": ["Tell me a story."]})
    datasets.DatasetDict({"test": text_only, "train": dataset}).save_to_disk(str(tmp_path / "dict"))
    for name in ("saved", "dict"):
        examples, skipped = read_examples(tmp_path / name)
        assert list(skipped.values()) == [1] and next(iter(skipped)).startswith("empty prompt (") and "row 2)" in next(iter(skipped))
        assert [(e.prompt, e.response) for e in examples] == [("Describe the image.", None), ("What is this?", "Noise."), ("Hi", None)]
        assert all(isinstance(e.image, bytes) for e in examples)  # (the Image feature embeds the files)
    target = cached_tiny_checkpoint("llava", tmp_path_factory)
    out = tmp_path / "eagle3"
    assert train(target, tmp_path / "dict", out, "--steps", "2", "--method", "eagle3", "--eval-examples", "1",
                 "--max-new-tokens", "5") == 0
    text = capsys.readouterr().out
    assert "data: 3 sequences from" in text and "skipped 1 row: 1 empty prompt (data-00000-of-00001.arrow row 2)" in text
    assert "over 1 prompt;" in text  # (was "1 prompts")


@pytest.mark.slow  # ~20-40 s on 2 cores: two processes start and import torch + transformers
@pytest.mark.parametrize("method", ["eagle3"])  # the DDP path is the shared loop's; every head takes it
def test_two_processes_match_one_process_loss_curve(method, text_target, tmp_path, free_port):
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
              "--target", str(text_target), "--method", method]
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


# ------------------------------------------------------------------------------------------ EAGLE-3
def greedy_pair(model, spec: str, inputs, new: int = 10):
    """(plain decoding, decoding with ``spec``) of batch-1 ``inputs``, greedy."""
    import mmspec

    return (mmspec.generate(model, None, max_new_tokens=new, **inputs),
            mmspec.generate(model, spec, max_new_tokens=new, **inputs))


def test_eagle3_text_target_vocabulary_resume_eval_export(text_target, tmp_path, capsys):
    """--method eagle3 on a text Llama: the head's d2t / t2d are the data's most frequent answer
    tokens, the shared loop's loss log / checkpoint / --resume / held-out tau hold for it, the
    trained head decodes exactly (chains and trees), and its vLLM export loads back and decodes the
    same tokens with the same acceptance. The self-distillation shards (the three target layers
    stored) resume: a lost shard is remade alone; a cache of last-layer features is refused."""
    from mmspec.api import chat_inputs
    from mmspec.drafters.vocab import frequent_tokens
    from mmspec.hub import load_causal_lm
    from mmspec.modeling.eagle3 import Eagle3Head

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(8)] + [{"prompt": ""}])
    out = tmp_path / "eagle3"
    common = ["--method", "eagle3", "--draft-vocab", "4", "--ttt-steps", "2", "--shard-size", "3"]
    assert train(text_target, data, out, "--steps", "4", *common) == 0
    captured = capsys.readouterr()
    assert "skipped 1 row: 1 empty prompt (line 9)" in captured.out and "held-out tau of eagle3-tree:" in captured.out
    assert re.search(r"/4 \[\d\d:\d\d<", captured.err)  # the bar over the 4 steps, with its ETA field (tqdm: elapsed<remaining)
    report = json.loads((out / "eval.json").read_text())
    assert report["drafter"] == f"eagle3-tree:{out}" and report["identical_to_target"] == "2/2" and report["tau"] >= 1.0
    model, tokenizer = load_causal_lm(text_target, dtype=torch.float32)
    head = Eagle3Head.load(out, model)
    records = [r for s in sorted((out / "data").glob("shard-*.pt")) for r in torch.load(s, weights_only=True)["records"]]
    assert records[0]["features"].shape[-1] == 3 * model.config.hidden_size  # the three fused layers, stored
    from mmspec.train.any_target import split_held_out

    train_ids, _ = split_held_out(len(records), 0.25, 0)
    expected, counts = frequent_tokens([records[i] for i in train_ids], 4)
    assert len(counts) > 4 and head.config.draft_vocab_size == len(expected) == 4  # (the data has more distinct tokens)
    assert torch.equal(head.token_ids, expected) and int(head.t2d.sum()) == 4 and head.t2d[expected].all()
    # the loss log and --resume of the shared loop; a lost data shard is remade alone
    assert len((out / "loss.csv").read_text().splitlines()) == 3  # header + steps 2 and 4
    shards = sorted((out / "data").glob("shard-*.pt"))
    assert len(shards) == 3
    (out / "data" / "shard-00001.pt").unlink()
    kept = {s.name: s.stat().st_mtime_ns for s in shards if s.name != "shard-00001.pt"}
    assert train(text_target, data, out, "--steps", "6", *common, "--resume") == 0
    captured = capsys.readouterr()
    assert "resuming at step 4" in captured.out and re.search(r"/3 \[\d\d:\d\d<", captured.err)  # (the bar over shard 1's 3 rows)
    assert {s.name: s.stat().st_mtime_ns for s in shards if s.name != "shard-00001.pt"} == kept
    assert len(torch.load(out / "data" / "shard-00001.pt", weights_only=True)["records"]) == 3
    assert train(text_target, data, tmp_path / "eagle", "--steps", "1", "--method", "eagle", "--shard-size", "3",
                 "--cache", str(out / "data")) == 2
    assert "made with other settings" in capsys.readouterr().err
    log = json.loads((out / "training.json").read_text())["log"]
    assert [e["step"] for e in log] == [2, 4, 6] and log[-1]["loss"] < log[0]["loss"]
    # exact decoding with the trained head, and with its vLLM export loaded back
    inputs = chat_inputs(tokenizer, "Tell me about topic 12.")
    for spec in ("eagle3-tree", "eagle3"):
        plain, drafted = greedy_pair(model, f"{spec}:{out}", inputs)
        assert torch.equal(drafted.sequences, plain.sequences)
    exported = tmp_path / "vllm"
    assert cli_main(["export", "drafter", str(out), "--format", "vllm-eagle3", "--out", str(exported), "--dtype", "float32"]) == 0
    assert json.loads((exported / "config.json").read_text())["draft_vocab_size"] == 4
    again = greedy_pair(model, f"eagle3:{exported}", inputs)[1]  # (drafted: the eagle3 chain's run above)
    assert torch.equal(again.sequences, drafted.sequences)
    assert again.stats.mean_accepted_length == drafted.stats.mean_accepted_length > 1.0  # (drafts accepted: 1.29 here)


def test_eagle3_kl_weight_fine_tunes_an_init_on_sampled_answers(text_target, tmp_path, capsys):
    """--method eagle3 --kl-weight (a head for drafting under sampling): the data keeps the target's
    last hidden_states entry after the three fused layers, whose LM-head rows give the target's own
    logits; the loss adds w KL(p || q) over the draft vocabulary, equal to the sum over positions of
    p (log p - log q) with p from the target's logits (an independent forward); an --init head keeps
    its draft vocabulary (written next to it, not the new data's); the head decodes exactly; and
    --kl-weight for a head without a KL term is refused in one line."""
    from mmspec.hub import load_causal_lm
    from mmspec.api import chat_inputs
    from mmspec.modeling.eagle3 import Eagle3Head
    from mmspec.drafters.vocab import load_draft_vocabulary
    from mmspec.train.drafter import collate, input_embedding_table
    from mmspec.train.eagle3 import eagle3_loss, unroll

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"Tell me about topic {i}."} for i in range(8)])
    base = tmp_path / "base"
    assert train(text_target, data, base, "--steps", "2", "--method", "eagle3", "--draft-vocab", "6", "--eval-examples", "0") == 0
    out = tmp_path / "t1"
    assert train(text_target, data, out, "--steps", "4", "--method", "eagle3", "--init", str(base), "--kl-weight", "1",
                 "--sample-temperature", "1", "--ttt-steps", "2", "--eval-examples", "1") == 0
    model, tokenizer = load_causal_lm(text_target, dtype=torch.float32)
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["feature_layer"][-1] == layers and len(manifest["feature_layer"]) == 4
    head, first = Eagle3Head.load(out, model), Eagle3Head.load(base, model)
    assert torch.equal(head.token_ids, first.token_ids) and torch.equal(load_draft_vocabulary(out), first.token_ids)
    records = [r for s in sorted((out / "data").glob("shard-*.pt")) for r in torch.load(s, weights_only=True)["records"]]
    batch = collate(records[:2])
    states = batch["features"].float()
    assert states.shape[-1] == 4 * hidden
    logits = model(input_ids=batch["ids"]).logits[..., head.token_ids].float()  # [B, L, N], the target's own
    embed, rows = input_embedding_table(model), model.get_output_embeddings().weight.detach()[head.token_ids]
    head = head.float()
    with torch.no_grad():
        plain, _ = eagle3_loss(head, embed, batch, states[..., : 3 * hidden], ttt_steps=1)
        both, _ = eagle3_loss(head, embed, batch, states, ttt_steps=1, kl_weight=0.5, target_rows=rows)
        log_q = torch.log_softmax(head.logits(unroll(head, embed, batch["ids"], states[..., : 3 * hidden], 1)[0]).float(), -1)
    learnt = batch["learn"][:, 2:]
    log_p = torch.log_softmax(logits[:, 1:-1], -1)[learnt]  # x_{t+2}'s distribution, read at t + 1
    kl = (log_p.exp() * (log_p - log_q[learnt])).sum(-1).mean()
    assert learnt.sum() > 4
    torch.testing.assert_close(both - plain, 0.5 * kl, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="kl_weight needs the target's last layer"):
        eagle3_loss(head, embed, batch, states[..., : 3 * hidden], ttt_steps=1, kl_weight=0.5, target_rows=rows)
    inputs = chat_inputs(tokenizer, "Tell me about topic 12.")
    plain_run, drafted = greedy_pair(model, f"eagle3:{out}", inputs)
    assert torch.equal(drafted.sequences, plain_run.sequences)
    capsys.readouterr()
    assert train(text_target, data, tmp_path / "m", "--steps", "1", "--method", "medusa", "--kl-weight", "1") == 2
    assert "--kl-weight is an option of the EAGLE heads (--method eagle or eagle3), not --method medusa: drop it" in \
        capsys.readouterr().err


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen3_5", "gemma3"])
def test_eagle3_vlm_families_decode_exactly_and_export(family, tmp_path_factory, tmp_path, capsys):
    """--method eagle3 for VLMs (an image folder, self-distilled): the held-out greedy decodes equal
    the target's own answers; the head and its SGLang export decode an image prompt exactly (eagle3
    chains; the hybrid Qwen3.5 verifies no trees, so its held-out check uses chains)."""
    from mmspec.pipelines.captioning.components import load_captioning_model

    target = cached_tiny_checkpoint(family, tmp_path_factory)
    images = random_images(tmp_path / "images", seed=2)
    out = tmp_path / "eagle3"
    assert train(target, images, out, "--steps", "2", "--method", "eagle3", "--eval-examples", "1", "--max-new-tokens", "5") == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["identical_to_target"] == "1/1" and report["tau"] >= 1.0
    assert report["drafter"] == f"{'eagle3' if family == 'qwen3_5' else 'eagle3-tree'}:{out}"
    exported = tmp_path / "sglang"
    assert cli_main(["export", "drafter", str(out), "--format", "sglang-eagle3", "--out", str(exported), "--dtype", "float32"]) == 0
    model, processor = load_captioning_model(target, torch.device("cpu"), torch.float32)
    chat = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                         add_generation_prompt=True)
    inputs = dict(processor(text=[chat], images=[Image.open(images / "3.png").convert("RGB")], return_tensors="pt"))
    for directory in (out, exported):
        plain, drafted = greedy_pair(model, f"eagle3:{directory}", inputs, new=8)
        assert torch.equal(drafted.sequences, plain.sequences)


def test_eagle3_vision_option_trains_on_a_vlm_decodes_exactly_and_is_not_exported(tmp_path_factory, tmp_path, capsys):
    """--method eagle3 --vision-tokens 2 on a VLM (an image folder, self-distilled): the head's card
    records the option, its chain decodes an image prompt exactly, and the export is one line, exit 2."""
    from mmspec.modeling.eagle3 import Eagle3Head, VisionEagle3Head
    from mmspec.pipelines.captioning.components import load_captioning_model

    target = cached_tiny_checkpoint("llava", tmp_path_factory)
    images = random_images(tmp_path / "images", seed=4)
    out = tmp_path / "eagle3"
    assert train(target, images, out, "--steps", "2", "--method", "eagle3", "--vision-tokens", "2", "--eval-examples", "1",
                 "--max-new-tokens", "5") == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["identical_to_target"] == "1/1" and report["tau"] >= 1.0
    model, processor = load_captioning_model(target, torch.device("cpu"), torch.float32)
    head = Eagle3Head.load(out, model)
    assert type(head) is VisionEagle3Head and head.vision_tokens == 2
    chat = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                         add_generation_prompt=True)
    inputs = dict(processor(text=[chat], images=[Image.open(images / "3.png").convert("RGB")], return_tensors="pt"))
    plain, drafted = greedy_pair(model, f"eagle3:{out}", inputs, new=8)
    assert torch.equal(drafted.sequences, plain.sequences) and drafted.stats.config["vision_tokens"] == 2
    capsys.readouterr()
    assert cli_main(["export", "drafter", str(out), "--format", "vllm-eagle3", "--out", str(tmp_path / "vllm")]) == 2
    error = capsys.readouterr().err.strip()
    assert "vision option" in error and len(error.splitlines()) == 1 and not (tmp_path / "vllm").exists()


def test_input_embedding_table_is_what_the_target_applies(tmp_path_factory):
    """Gemma scales its token embeddings by sqrt(H) in the embedding's forward; the table the
    drafter losses read is the scaled one (what the drafters see at generation time)."""
    from mmspec.pipelines.captioning.components import load_captioning_model
    from mmspec.train.drafter import input_embedding_table

    model, _ = load_captioning_model(cached_tiny_checkpoint("gemma3", tmp_path_factory), torch.device("cpu"), torch.float32)
    module = model.get_input_embeddings()
    ids = torch.tensor([0, 5, 17])
    assert getattr(module, "embed_scale", None) is not None
    torch.testing.assert_close(input_embedding_table(model)[ids], module(ids).float())
    assert not torch.allclose(input_embedding_table(model)[ids], module.weight[ids].float())


def test_train_drafter_takes_trust_remote_code_off_by_default(tmp_path, capsys, custom_code_lm, no_terminal):
    """The audit's: ``mmspec train drafter --target DIR`` of a checkpoint with its own code read its
    config with trust_remote_code=None (transformers' [y/N] question on the terminal), then refused
    in a line naming a flag the command lacked. Now --trust-remote-code (off by default: one line)
    loads the target with its code; the embedded recipes, which load no user's checkpoint, refuse it."""
    from mmspec.hub import remote_code_refused

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"hi {i}", "response": "hello"}) + "\n" for i in range(4)))
    argv = ["train", "drafter", "--target", str(custom_code_lm), "--data", str(data), "--out", str(tmp_path / "o"),
            "--method", "eagle", "--vision-tokens", "4"]
    assert cli_main(argv) == 2
    captured = capsys.readouterr()
    assert "[y/N]" not in captured.out + captured.err
    assert captured.err.strip().splitlines()[-1] == f"mmspec: error: {remote_code_refused(custom_code_lm)}"
    assert cli_main([*argv, "--trust-remote-code"]) == 2  # (loaded with its code: then --vision-tokens of a text model)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"mmspec: error: --vision-tokens: {custom_code_lm} is a text model; the vision-aware head reads a VLM's image tokens")
    assert cli_main(["train", "drafter", "--target", "smollm2", "--trust-remote-code"]) == 2
    assert "--trust-remote-code applies to a target given by its path or hub id" in capsys.readouterr().err
