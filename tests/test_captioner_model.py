"""The embedded captioner's assembly: real SmolLM2 decoder + vision encoder/connector weights."""

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import mmspec
from mmspec.modeling.captioner import IMAGE_SEQ_LEN, build_captioner, trained_state
from mmspec.train.captioner import IGNORE, answer_loss, build_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def captioner():
    return build_captioner(dtype=torch.float32)


def test_text_only_answers_equal_smollm2(captioner, smollm2):
    """Without an image the captioner is exactly SmolLM2: the decoder's knowledge is kept."""
    model, processor = captioner
    lm, tokenizer = smollm2
    text = processor.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    inputs = processor(text=[text], return_tensors="pt")
    ours = mmspec.generate(model, max_new_tokens=12, **inputs)
    theirs = mmspec.generate(lm, max_new_tokens=12, input_ids=inputs["input_ids"])
    assert torch.equal(ours.sequences, theirs.sequences)
    assert "Paris" in tokenizer.decode(ours.sequences[0])


def test_image_prompt_layout_and_weights_roundtrip(captioner, tmp_path):
    model, processor = captioner
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}], add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.new("RGB", (200, 90), "red")]], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == IMAGE_SEQ_LEN
    weights = tmp_path / "w.safetensors"
    state = trained_state(model)
    assert state and all(k.startswith(("model.vision_model.", "model.connector.")) for k in state)
    save_file({k: v + 1 for k, v in state.items()}, str(weights))  # distinguishable weights
    loaded, _ = build_captioner(dtype=torch.float32, weights=weights)
    for name, tensor in trained_state(loaded).items():
        assert torch.equal(tensor, state[name] + 1), name


def test_training_batch_labels_only_answers(captioner):
    model, processor = captioner
    image = Image.new("RGB", (128, 128), "blue")
    batch = build_batch(processor, [(image, "What color is it?", "Blue."), (image, "Describe the image.", "A plain blue square image.")])
    for row, answer in zip(batch["labels"], ["Blue.<|im_end|>", "A plain blue square image.<|im_end|>"]):
        assert processor.tokenizer.decode(row[row != IGNORE]) == answer
    loss = answer_loss(model, batch)
    assert torch.isfinite(loss) and loss.item() > 0


def test_default_captioner_missing_weights_says_how_to_train(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="mmspec train captioner"):
        mmspec.pipeline("image-captioning", model=None, device="cpu")


def test_stage1_vocabulary_loss_is_cross_entropy_over_the_sub_vocabulary(captioner):
    """answer_loss(vocabulary=ids) == CE of the full logits restricted to ids, out-of-vocabulary
    answer tokens ignored."""
    model, processor = captioner
    image = Image.new("RGB", (128, 128), "green")
    batch = build_batch(processor, [(image, "What color is it?", "Green."), (image, "Name it.", "A zebra.")])
    targets = batch["labels"][:, 1:]
    answer_ids = targets[targets != IGNORE].unique()
    dropped = answer_ids[-1]  # one answer token falls outside the sub-vocabulary
    vocabulary = torch.cat([answer_ids[:-1], torch.tensor([5, 17])]).unique()
    with torch.no_grad():
        loss = answer_loss(model, batch, vocabulary)
        hidden = model.model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state[:, :-1]
        picked = (targets != IGNORE) & (targets != dropped)
        logits = model.lm_head(hidden[picked])[:, vocabulary]
        index = torch.searchsorted(vocabulary, targets[picked])
        expected = torch.nn.functional.cross_entropy(logits, index)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_caption_draft_sees_exactly_the_text_only_prompt(captioner):
    """The SPD draft is trained on the token sequence it sees at generation time: the target's
    prompt ids without the <image> tokens."""
    from mmspec.adapters.hf import TransformersTarget
    from mmspec.train.caption_draft import build_draft, draft_prompt_text
    from mmspec.train.data import make_sample

    model, processor = captioner
    sample = make_sample("charts", "train", 5)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sample.prompt}]}], add_generation_prompt=True)
    inputs = processor(text=[text], images=[[sample.image]], return_tensors="pt")
    seen = TransformersTarget(model).text_only_ids(inputs["input_ids"])[0].tolist()
    assert seen == processor.tokenizer(draft_prompt_text(processor, sample.prompt), add_special_tokens=False)["input_ids"]
    # a self-distillation record of the same sample (the captioner's answer) gives the same prompt
    from mmspec.train.caption_draft import distilled_pairs
    from mmspec.train.selfdistill import extract_caption_features

    records = extract_caption_features(model, processor, [(sample.image, sample.prompt, "Some answer.")])
    prompt, answer = distilled_pairs(records, processor.tokenizer.convert_tokens_to_ids("<image>"))[0]
    assert prompt == seen
    assert answer == processor.tokenizer("Some answer.<|im_end|>", add_special_tokens=False)["input_ids"]
    draft = build_draft(processor.tokenizer)
    assert draft.config.vocab_size == len(processor.tokenizer) and draft.config.tie_word_embeddings
    assert sum(p.numel() for p in draft.parameters()) < 12_000_000


def test_lora_adapters_ship_and_merge_at_load(tmp_path):
    from mmspec.modeling.captioner import save_trained
    from mmspec.modeling.lora import LoRALinear, add_lora

    wrapped, processor = build_captioner(dtype=torch.float32)
    add_lora(wrapped.model.text_model, rank=2, alpha=4.0)
    with torch.no_grad():
        for module in wrapped.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(0, 0.01)
    weights = tmp_path / "w.safetensors"
    save_trained(wrapped, weights)
    loaded, _ = build_captioner(dtype=torch.float32, weights=weights)
    assert not any(isinstance(m, LoRALinear) for m in loaded.modules())  # a plain SmolVLM again
    ids = processor(text=["The capital of France is"], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        torch.testing.assert_close(loaded(input_ids=ids).logits, wrapped(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
