"""Continuous batching in the core (mmspec.core.batch.batched_decode): rows joining a running
batch between steps (``admit``), rows cancelled between steps (``cancelled``) and the committed
tokens seen as they come (``on_tokens``). Every row that runs to its end equals its own batch-1
generation, token for token, greedy and sampled with the same seed, whoever joined or left."""

import pytest
import torch
from tiny_models import make_tiny

import mmspec
from mmspec.api import generate_rows
from mmspec.core.batch import BatchState
from mmspec.drafters import EagleDrafter
from mmspec.adapters.hf import TransformersTarget, text_decoder
from mmspec.modeling.heads import EagleHead

MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


@pytest.fixture(scope="module")
def prompts(tiny):
    gen = torch.Generator().manual_seed(5)
    ids = tiny.inputs["input_ids"][0]
    return [ids, ids[:4], torch.randint(3, 400, (11,), generator=gen), ids[-3:], torch.randint(3, 400, (7,), generator=gen)]


def _drafter(model, name):
    torch.manual_seed(0)
    return None if name == "ar" else (
        "prompt-lookup:3" if name == "prompt-lookup" else
        EagleDrafter(model, EagleHead(text_decoder(model).config).eval(), num_draft_tokens=3))


def _alone(model, drafter, prompt, **kwargs):
    one = drafter.for_batch() if isinstance(drafter, mmspec.drafters.Drafter) else drafter
    out = mmspec.generate(model, drafter=one, input_ids=prompt[None], **kwargs)
    return out.sequences[0, len(prompt):]


@pytest.mark.parametrize("name, do_sample", [("ar", True), ("prompt-lookup", False), ("eagle", True)])
def test_rows_joining_and_cancelled_leave_the_others_unchanged(tiny, prompts, name, do_sample, monkeypatch):
    monkeypatch.setattr(BatchState, "slack", 2)  # squeeze often: joins meet squeezed caches
    drafter = _drafter(tiny.model, name)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=do_sample, seed=11)
    waiting = [[prompts[2]], [], [prompts[3], prompts[4]]]  # admitted at the start, then after steps 1 and 2
    calls, streamed = [0], {}

    def admit():
        calls[0] += 1
        return [{"input_ids": p[None]} for p in waiting.pop(0)] if waiting else []

    def on_tokens(row, tokens):
        streamed.setdefault(row, []).append(tokens[0])

    def cancelled(row):  # row 1 leaves after its third step's tokens
        return row == 1 and len(streamed.get(1, [])) >= 3

    out = generate_rows(tiny.model, [{"input_ids": p[None]} for p in prompts[:2]], drafter=drafter, admit=admit,
                        on_tokens=on_tokens, cancelled=cancelled, **kwargs)
    order = [prompts[0], prompts[1], prompts[2], prompts[3], prompts[4]]  # row indices: first the rows, then joins
    assert len(out.row_stats) == 5 and calls[0] >= 4
    width = max(len(p) for p in order)
    for b, prompt in enumerate(order):
        alone = _alone(tiny.model, drafter, prompt, **kwargs)
        got = out.sequences[b, width : width + out.row_stats[b].new_tokens]
        assert torch.equal(torch.cat(streamed[b]), got)  # the stream is the output, piece by piece
        if b == 1:
            assert out.row_stats[b].config["cancelled"] and len(streamed[1]) == 3
            assert torch.equal(got, alone[: len(got)]) and len(got) < len(alone)  # its prefix, cut short
        else:
            assert torch.equal(got, alone), (b, got, alone)
            assert "cancelled" not in out.row_stats[b].config


def test_batch_of_admitted_rows_only_and_batch_one_streaming(tiny, prompts):
    """A batch may start empty and take all its rows from ``admit``; at batch 1, ``on_tokens`` and
    ``cancelled`` do the same through ``mmspec.generate``."""
    queue = [[{"input_ids": prompts[0][None]}], [{"input_ids": prompts[1][None]}]]
    out = generate_rows(tiny.model, [], drafter="prompt-lookup:3", max_new_tokens=MAX_NEW,
                        admit=lambda: queue.pop(0) if queue else [])
    assert out.stats.rows == 2
    pieces = []
    whole = mmspec.generate(tiny.model, drafter="prompt-lookup:3", max_new_tokens=MAX_NEW, input_ids=prompts[0][None])
    cut = mmspec.generate(tiny.model, drafter="prompt-lookup:3", max_new_tokens=MAX_NEW, input_ids=prompts[0][None],
                          on_tokens=pieces.append, cancelled=lambda: len(pieces) >= 2)
    new = cut.sequences[0, len(prompts[0]):]
    assert torch.equal(torch.cat([p[0] for p in pieces]), new) and cut.stats.config["cancelled"]
    assert torch.equal(new, whole.sequences[0, len(prompts[0]) : len(prompts[0]) + len(new)]) and len(new) < MAX_NEW
    with pytest.raises(ValueError, match="no prompts"):
        generate_rows(tiny.model, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="one seed"):
        generate_rows(tiny.model, [{"input_ids": prompts[0][None]}], seed=[1], admit=lambda: [])


@pytest.mark.parametrize("family", ["llama", "smolvlm"])
def test_equal_length_prompts_prefill_as_one_forward(family):
    """Rows of one prompt length prefill as one [B, L] forward through the lean decoder: each row's
    cache and first logits equal its batch-1 prefill bit for bit (fp32), and so do its tokens."""
    case = make_tiny(family)
    base = {k: v for k, v in case.inputs.items() if k != "attention_mask"}
    gen = torch.Generator().manual_seed(2)
    rows = []
    for b in range(3):  # the same length, other text tokens (and for the VLM other pixels)
        row = dict(base)
        ids = row["input_ids"].clone()
        text = ids >= 3
        if family == "llama":
            ids[text] = torch.randint(3, 400, (int(text.sum()),), generator=gen)
        else:
            row["pixel_values"] = row["pixel_values"] + 0.1 * b
        row["input_ids"] = ids
        rows.append(row)
    target = TransformersTarget(case.model)
    with torch.inference_mode():
        singles = [target.prefill(r) for r in rows]
        assert target.lean_prefill, "the tiny model should prefill through the lean decoder"
        batch, outputs = target.prefill_rows(rows)
    assert batch.valid.all() and batch.size == 3
    for b, (state, out) in enumerate(singles):
        assert torch.equal(outputs[b].logits, out.logits)
        for layer, one in zip(batch.cache.layers, state.cache.layers):
            assert torch.equal(layer.keys[b], one.keys[0]) and torch.equal(layer.values[b], one.values[0])
    kwargs = dict(max_new_tokens=8, do_sample=True, seed=4)
    together = generate_rows(case.model, rows, drafter="prompt-lookup:2", **kwargs)
    for b, row in enumerate(rows):
        alone = mmspec.generate(case.model, drafter="prompt-lookup:2", **kwargs, **row)
        width = row["input_ids"].shape[1]
        assert torch.equal(together.sequences[b, width : width + together.row_stats[b].new_tokens], alone.sequences[0, width:])
