"""Batched speculative decoding (mmspec.core.batch): every row of a batch equals its own batch-1
generation, token for token, greedy and sampled with the same seed (so each row is distributed as
the target's own decoding, which tests/test_distribution.py checks at batch 1), over mixed
prompt lengths, early EOS, rows leaving the batch and the cache being squeezed; and the errors."""

import copy

import pytest
import torch
from tiny_models import make_tiny, make_text_only_draft

import mmspec
from mmspec.adapters.hf import TransformersTarget, text_decoder
from mmspec.api import generate_rows, split_rows
from mmspec.core.batch import BatchState
from mmspec.drafters import Eagle2Drafter, EagleDrafter, KangarooDrafter, HydraDrafter, MedusaDrafter
from mmspec.modeling.heads import DraftHeads, EagleHead, KangarooAdapter

MAX_NEW = 18


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


@pytest.fixture(scope="module")
def prompts(tiny):
    """Five prompts of lengths 3 to 14."""
    gen = torch.Generator().manual_seed(7)
    ids = tiny.inputs["input_ids"][0]
    return [ids, ids[:5], torch.randint(3, 400, (9,), generator=gen), ids[-3:], torch.randint(3, 400, (14,), generator=gen)]


def _near_copy(model, scale: float):
    """The target with noise on its weights: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return draft


def _drafter(model, name):
    torch.manual_seed(0)
    width = model.get_output_embeddings().weight.shape[1]
    make = {
        "ar": lambda: None,
        "prompt-lookup": lambda: "prompt-lookup:3",
        "draft-model": lambda: _near_copy(model, 0.3),
        "independent-draft": lambda: make_text_only_draft("llama"),
        "eagle": lambda: EagleDrafter(model, EagleHead(text_decoder(model).config).eval(), num_draft_tokens=3),
        "eagle2": lambda: Eagle2Drafter(model, EagleHead(text_decoder(model).config).eval()),
        "layer-skip": lambda: "layer-skip:1",
        "kangaroo": lambda: KangarooDrafter(model, KangarooAdapter(text_decoder(model).config).eval(), exit_layer=1,
                                            num_draft_tokens=3, stop_threshold=0.003),  # stops at varying lengths
        "medusa": lambda: MedusaDrafter(model, DraftHeads(width, num_heads=4, kind="medusa").eval()),
        "hydra": lambda: HydraDrafter(model, DraftHeads(width, num_heads=4, kind="hydra").eval()),
    }
    return make[name]()


def _rows_equal_batch_one(model, prompts, drafter, monkeypatch, do_sample, eos=None, slack=None):
    if slack is not None:
        monkeypatch.setattr(BatchState, "slack", slack)
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=do_sample, seed=11, eos_token_id=eos)
    batch = generate_rows(model, [{"input_ids": p[None]} for p in prompts], drafter=drafter, **kwargs)
    width = max(len(p) for p in prompts)
    accepted = 0
    for b, prompt in enumerate(prompts):
        one = drafter.for_batch() if isinstance(drafter, mmspec.drafters.Drafter) else drafter
        single = mmspec.generate(model, drafter=one, input_ids=prompt[None], **kwargs)
        new = single.sequences[0, len(prompt):]
        assert torch.equal(batch.sequences[b, width : width + len(new)], new), (b, batch.sequences[b], single.sequences)
        assert batch.row_stats[b].new_tokens == len(new)
        assert batch.row_stats[b].committed_per_step == single.stats.committed_per_step
        accepted += batch.row_stats[b].accepted
    return batch, accepted


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["ar", "prompt-lookup", "draft-model", "independent-draft", "eagle", "eagle2", "layer-skip", "kangaroo", "medusa", "hydra"])
def test_rows_equal_their_batch_one_generation(tiny, prompts, name, do_sample, monkeypatch):
    drafter = _drafter(tiny.model, name)
    batch, accepted = _rows_equal_batch_one(tiny.model, prompts, drafter, monkeypatch, do_sample, slack=2)
    assert batch.stats.rows == len(prompts) and batch.stats.new_tokens == len(prompts) * MAX_NEW
    if name == "draft-model":
        assert accepted > 20  # partial acceptances happened, so rollback per row was exercised
    if name != "ar":
        assert batch.stats.target_forwards < len(prompts) + MAX_NEW  # fewer batched forwards than AR's


@pytest.mark.parametrize("slack", [0, 32])
def test_batched_logits_equal_batch_one_logits(tiny, prompts, slack, monkeypatch):
    """After steps that keep different numbers of slots per row (holes in the cache, squeezed out
    with slack 0) and a row leaving, each row's logits equal a batch-1 forward over its tokens."""
    monkeypatch.setattr(BatchState, "slack", slack)
    target = TransformersTarget(tiny.model)
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        state, _ = target.prefill_rows([{"input_ids": p[None]} for p in prompts])
        for row in state.rows:
            row.tokens = torch.cat([row.tokens, torch.tensor([[9]])], dim=1)  # each row's pending token
        for step, keep in enumerate([[1, 4, 2, 3, 1], [4, 1, 1, 2, 3], [2, 2, 4, 1, 1]]):
            drafts = [torch.randint(3, 400, (1, 3), generator=gen) for _ in state.rows]
            inputs = state.verification_inputs(drafts)
            out = target.forward_rows(state, inputs)
            for p, row in enumerate(state.rows):
                single, _ = target.prefill({"input_ids": row.tokens[:, :-1]})
                expected = target.forward(single, inputs[p : p + 1]).logits
                torch.testing.assert_close(out.logits[p : p + 1], expected, rtol=1e-4, atol=1e-5)
            state.commit([inputs[p : p + 1, 1 : 1 + keep[state.ids[p]]] for p in range(state.size)])
            if step == 1:
                state.keep([0, 2, 3, 4])
        assert state.ids == [0, 2, 3, 4]
        if slack == 0:
            assert state.valid.shape[1] == int(state.valid.sum(dim=1).max())


def test_early_eos_rows_leave_the_batch(tiny, prompts, monkeypatch):
    """Rows stop at different steps (EOS for some, the budget for others); the rest go on unchanged."""
    drafter = _near_copy(tiny.model, 0.3)
    first = mmspec.generate(tiny.model, max_new_tokens=MAX_NEW, input_ids=prompts[0][None])
    eos = int(first.sequences[0, len(prompts[0]) + 5])
    batch, _ = _rows_equal_batch_one(tiny.model, prompts, drafter, monkeypatch, False, eos=eos)
    lengths = [s.new_tokens for s in batch.row_stats]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths
    times = [s.wall_time_s for s in batch.row_stats]
    assert min(times) < max(times)


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_vlm_batch_from_a_left_padded_prompt(family):
    """mmspec.generate with input_ids [B, L] left-padded (as transformers' generate takes them):
    each row equals its own batch-1 generation, and ``sequences`` keeps the padded layout."""
    case = make_tiny(family)
    ids = case.inputs["input_ids"]
    longer = torch.cat([torch.tensor([[17, 23, 5, 41]]), ids], dim=1)
    batch_ids = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1), longer])
    mask = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], dim=1), torch.ones_like(longer)])
    images = {k: torch.cat([v, v]) for k, v in case.inputs.items() if k not in ("input_ids", "attention_mask")}
    draft = _near_copy(case.model, 0.2)
    out = mmspec.generate(case.model, drafter=draft, max_new_tokens=10, input_ids=batch_ids, attention_mask=mask, **images)
    assert out.sequences.shape == (2, batch_ids.shape[1] + 10)
    assert torch.equal(out.sequences[:, : batch_ids.shape[1]], batch_ids)
    for b, row_ids in enumerate([ids, longer]):
        single = mmspec.generate(case.model, drafter=draft, max_new_tokens=10, input_ids=row_ids,
                                 **{k: v[:1] for k, v in images.items()})
        assert torch.equal(out.sequences[b, batch_ids.shape[1] :], single.sequences[0, row_ids.shape[1] :])


def test_batch_stats_count_the_batch(tiny, prompts):
    out = generate_rows(tiny.model, [{"input_ids": p[None]} for p in prompts], drafter="prompt-lookup:3", max_new_tokens=MAX_NEW)
    rows = out.row_stats
    assert out.stats.new_tokens == sum(s.new_tokens for s in rows)
    assert out.stats.verify_steps == sum(s.verify_steps for s in rows)
    tau = sum(s.new_tokens - 1 for s in rows) / sum(s.verify_steps for s in rows)
    assert out.stats.mean_accepted_length == pytest.approx(tau)
    assert out.stats.target_forwards == len(prompts) + max(s.verify_steps for s in rows)
    assert all(s.config["batch_size"] == len(prompts) for s in rows)


def test_each_rows_seed_is_recorded_and_repeats_the_row(tiny, prompts):
    """seed=None's fresh seed (and a given one, one per row too) is in every row's stats, as
    generate records it: the recorded seed gives the row again."""
    rows = [{"input_ids": p[None]} for p in prompts]
    kwargs = dict(drafter="prompt-lookup:3", max_new_tokens=MAX_NEW, do_sample=True)
    fresh = generate_rows(tiny.model, rows, seed=None, **kwargs)
    drawn = fresh.row_stats[0].config["seed"]
    assert isinstance(drawn, int) and all(s.config["seed"] == drawn for s in fresh.row_stats) and fresh.stats.config["seed"] == drawn
    assert torch.equal(generate_rows(tiny.model, rows, seed=drawn, **kwargs).sequences, fresh.sequences)
    per_row = generate_rows(tiny.model, rows, seed=list(range(len(rows))), **kwargs)
    assert [s.config["seed"] for s in per_row.row_stats] == list(range(len(rows))) == per_row.stats.config["seed"]


def test_split_rows_strips_left_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    rows = split_rows({"input_ids": ids, "attention_mask": mask, "pixel_values": torch.zeros(2, 3)})
    assert [r["input_ids"].tolist() for r in rows] == [[[5, 6]], [[7, 8, 9, 10]]]
    assert rows[0]["pixel_values"].shape == (1, 3) and "attention_mask" not in rows[0]


@pytest.mark.parametrize(
    "inputs,match",
    [
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}, "right-padded"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3), "pixel_values": torch.zeros(3, 4)},
         "one entry per prompt"),
        # without its mask a batch's left padding was read as prompt tokens (a row unlike its batch-1 output)
        ({"input_ids": torch.tensor([[0, 0, 5], [4, 5, 6]])}, r"a batch of 2 prompts needs its attention_mask \[B, L\]"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4)}, "attention_mask has shape"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "on_step": print}, "on_row_done"),
    ],
)
def test_bad_batches(tiny, inputs, match):
    with pytest.raises(ValueError, match=match):
        mmspec.generate(tiny.model, max_new_tokens=4, **inputs)


def test_tree_drafters_draft_their_chain_in_a_batch(tiny):
    head = EagleHead(text_decoder(tiny.model).config).eval()
    chain = Eagle2Drafter(tiny.model, head).for_batch()
    assert type(chain) is EagleDrafter and chain.head is head and chain.num_draft_tokens == Eagle2Drafter.batch_chain_tokens
    width = tiny.model.get_output_embeddings().weight.shape[1]
    medusa = MedusaDrafter(tiny.model, DraftHeads(width, num_heads=4, kind="medusa")).for_batch()
    assert medusa.paths == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]


@pytest.mark.parametrize("name", ["eagle", "layer-skip", "kangaroo", "draft-model", "independent-draft"])
def test_batched_drafting_equals_row_by_row_drafting(tiny, prompts, name):
    """The drafters that draft all rows in one forward per token (BatchDrafting.propose_rows overrides)
    give each row the tokens and draft distributions its own propose() gives, sampled."""
    from mmspec.core.drafter import DraftContext
    from mmspec.core.rules import resolve_rule
    from mmspec.core.sampling import SamplingConfig

    resolved = mmspec.drafters.resolve_drafter(_drafter(tiny.model, name), TransformersTarget(tiny.model), 4)
    if name == "eagle":  # a sharper head: drafts that move with any error in positions or masks
        with torch.no_grad():
            for p in resolved.head.parameters():
                p.mul_(3.0)
    target = TransformersTarget(tiny.model)
    sampling = SamplingConfig(do_sample=True, temperature=0.7)
    rows = [{"input_ids": p[None]} for p in prompts]
    hidden_layer = resolved.target_hidden_layer if resolved.requires_target_hidden else None
    with torch.inference_mode():
        state, outputs = target.prefill_rows(rows, hidden_layer=hidden_layer)
        singles = [target.prefill(r, hidden_layer=hidden_layer) for r in rows]
        batch_drafters, row_drafters = [], []
        for b, (row, out) in enumerate(zip(state.rows, outputs)):
            row.tokens = torch.cat([row.tokens, torch.tensor([[9]])], dim=1)
            singles[b][0].tokens = row.tokens.clone()
            for group, view in ((batch_drafters, row), (row_drafters, singles[b][0])):
                d = copy.copy(resolved).for_batch()
                d.start(DraftContext(target, sampling, torch.Generator().manual_seed(b), rows[b], resolve_rule(None, sampling)), view)
                if d.requires_target_hidden:
                    d.on_verified(0, 0, out)
                group.append(d)
        budgets = [4, 2, 4, 3, 1]
        for accepted in ([1, 2, 0, 3, 1], None):  # a second round: each row accepted some drafts, its correction next
            batched = type(resolved).propose_rows(batch_drafters, state, list(range(len(rows))), budgets)
            for b, (d, (single, _)) in enumerate(zip(row_drafters, singles)):
                own = d.propose(single, budgets[b])
                assert torch.equal(batched[b].tokens, own.tokens), (name, b)
                torch.testing.assert_close(batched[b].probs, own.probs, rtol=1e-4, atol=1e-6)
            if accepted is None or name not in ("draft-model", "independent-draft"):
                break  # (the drafters with target caches of their own)
            for b, (row, (single, _)) in enumerate(zip(state.rows, singles)):
                row.tokens = torch.cat([row.tokens, batched[b].tokens[:, : accepted[b]], torch.tensor([[11 + b]])], dim=1)
                single.tokens = row.tokens.clone()
