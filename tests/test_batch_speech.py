"""Batched decoding of delay-pattern codec LMs (DelayPatternTarget.prefill_rows / forward_rows):
every row of a batch equals its own batch-1 generation, stream sub-token for sub-token, greedy and
sampled with the same seed, for every drafter the text-to-speech methods use, over texts of
different lengths and durations, rows that end early or are cut by the budget, and the shared
cache squeezed every step; the pipeline's lists; the layouts that refuse, in one line."""

import sys

import pytest
import torch
from kernel_support import needs_kernel
from test_bark import HISTORY, PADDED, SEMANTIC_OUT, TEXT, coarse_config, semantic_config, tiny_stage
from test_codec_lm import random_heads, tiny
from test_delay_pattern import tiny_musicgen
from test_tts_pipeline import make_model_dir

import mmspec
from mmspec.adapters.audio.bark import BarkCoarseTarget, BarkSemanticTarget
from mmspec.adapters.audio.delay import DelayPatternTarget
from mmspec.api import generate_rows
from mmspec.core.batch import BatchState
from mmspec.drafters import CodecMedusaDrafter, StepAwareDrafter, StepCompletionDrafter
from mmspec.modeling.fast_linear import bf16_kernel_available, optimize
from mmspec.pipelines.text_to_speech.methods import METHODS
from transformers import BarkCoarseConfig, BarkCoarseModel, BarkSemanticConfig, BarkSemanticModel

ROWS = [  # phoneme ids [1, P] and durations [1, P] (frames): 6, 2, 9 and 4 frames
    (torch.tensor([[5, 9, 3, 7, 2]]), torch.tensor([[1, 2, 0, 2, 1]])),
    (torch.tensor([[4]]), torch.tensor([[2]])),
    (torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), torch.tensor([[1, 1, 2, 0, 1, 1, 2, 1]])),
    (torch.tensor([[11, 10]]), torch.tensor([[3, 1]])),
]


def _drafter(name, aligned):
    return {
        "ar": lambda: None,
        "step": StepCompletionDrafter,
        "step-aware": lambda: StepAwareDrafter(DelayPatternTarget(tiny(5, layers=1, aligned=aligned)), num_draft_tokens=7),
        "medusa": lambda: CodecMedusaDrafter(random_heads(6)),
        "prompt-lookup": lambda: "prompt-lookup:2",
        "sjd": lambda: "sjd",
    }[name]()


@pytest.mark.parametrize("aligned", [False, True], ids=["unaligned", "aligned"])
@pytest.mark.parametrize("drafter", ["ar", "step", "step-aware", "medusa", "prompt-lookup", "sjd"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_rows_equal_their_batch_one_generation(monkeypatch, aligned, drafter, do_sample):
    """An unaligned model ends where its end code comes (or at the budget); an aligned one after
    its durations' frames, so the rows leave at different steps; each row has its own seed. slack 0: the cache is squeezed
    (every row's valid slots gathered to the left) whenever a slot is invalid."""
    monkeypatch.setattr(BatchState, "slack", 0)
    target = DelayPatternTarget(tiny(19, aligned=aligned))
    rows = [{"phoneme_ids": p, **({"durations": d} if aligned else {})} for p, d in ROWS]
    seeds = [3, 4, 5, 6]
    batch = generate_rows(target, rows, drafter=_drafter(drafter, aligned), max_new_tokens=40, do_sample=do_sample,
                          seed=seeds)
    for b, row in enumerate(rows):
        alone = mmspec.generate(target, drafter=_drafter(drafter, aligned), max_new_tokens=40, do_sample=do_sample,
                                seed=seeds[b], **row)
        new = alone.sequences[0, 3:]
        assert torch.equal(batch.sequences[b, 3 : 3 + len(new)], new), f"row {b}"
        assert batch.row_stats[b].new_tokens == len(new) and batch.row_stats[b].accepted == alone.stats.accepted
    assert len({s.new_tokens for s in batch.row_stats}) > 1  # rows left the batch at different steps
    assert batch.stats.rows == len(rows)


@pytest.mark.parametrize("slack", [0, 32])
def test_batched_logits_equal_batch_one_logits(slack, monkeypatch):
    """After forwards that complete different numbers of steps per row and keep different numbers
    of sub-tokens (released steps: holes in the cache, squeezed out with slack 0) and a row
    leaving, each row's logits and hidden states equal a batch-1 forward over its stream."""
    monkeypatch.setattr(BatchState, "slack", slack)
    target = DelayPatternTarget(tiny(19, aligned=True))
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        state, _ = target.prefill_rows([{"phoneme_ids": p, "durations": d} for p, d in ROWS], hidden_layer=-1)
        for row in state.rows:
            row.tokens = torch.cat([row.tokens, torch.tensor([[2]])], dim=1)  # each row's pending token
        for step, keep in enumerate([[1, 7, 2, 4], [5, 1, 3, 8], [2, 4, 9, 1], [6, 3, 1, 2]]):
            drafts = [torch.randint(0, 3 * 8, (1, 8), generator=gen) for _ in state.rows]
            inputs = state.verification_inputs(drafts)
            out = target.forward_rows(state, inputs, hidden_layer=-1)
            for p, row in enumerate(state.rows):
                b = state.ids[p]
                single, _ = target.prefill({"phoneme_ids": ROWS[b][0], "durations": ROWS[b][1]}, hidden_layer=-1)
                if row.length > 4:  # the committed sub-tokens after the begin step and before the pending one
                    target.forward(single, row.tokens[:, 3:-1], hidden_layer=-1)
                single.tokens = row.tokens[:, :-1]
                expected = target.forward(single, inputs[p : p + 1], hidden_layer=-1)
                torch.testing.assert_close(out.logits[p : p + 1], expected.logits, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(out.hidden_states[p : p + 1], expected.hidden_states, rtol=1e-4, atol=1e-5)
            state.commit([inputs[p : p + 1, 1 : 1 + keep[state.ids[p]]] for p in range(state.size)])
            if step == 1:
                state.keep([0, 2, 3])
        assert state.ids == [0, 2, 3]
        if slack == 0:
            assert state.valid.shape[1] == int(state.valid.sum(dim=1).max())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if bf16_kernel_available() else []), ids=str)
@pytest.mark.parametrize("width", [5, 17])
def test_optimized_batch_rows_equal_batch_one_forwards_bitwise(dtype, width):
    """Issue 44: with the few-row kernels (mmspec.optimize, as the pipeline loads a voice) every row
    of a batched forward is bitwise its batch-1 forward, bf16 included, where transformers'
    attention over the batch's 2-D padding mask rounded otherwise: the 2-D mask is made 4-D so each
    row is attended alone, and 4 rows of 17 tokens (more than the kernels' rows) run in groups."""
    model = tiny(19, codebooks=1, aligned=True).cast_steps(dtype)
    optimize(model)
    target = DelayPatternTarget(model)
    gen = torch.Generator().manual_seed(3)
    rows = [{"phoneme_ids": p, "durations": d * 3} for p, d in ROWS]
    with torch.inference_mode():
        state, _ = target.prefill_rows(rows, hidden_layer=-1)
        for row in state.rows:
            row.tokens = torch.cat([row.tokens, torch.tensor([[2]])], dim=1)  # each row's pending token
        for step in range(3):
            drafts = [torch.randint(0, 8, (1, width - 1), generator=gen) for _ in state.rows]
            inputs = state.verification_inputs(drafts)
            out = target.forward_rows(state, inputs, hidden_layer=-1)
            for p, row in enumerate(state.rows):
                single, _ = target.prefill(rows[state.ids[p]], hidden_layer=-1)
                for t in range(1, row.tokens.shape[1] - 1):  # the committed tokens one at a time, as plain decoding
                    target.forward(single, row.tokens[:, t : t + 1], hidden_layer=-1)
                single.tokens = row.tokens[:, :-1]
                expected = target.forward(single, inputs[p : p + 1], hidden_layer=-1)
                assert torch.equal(out.logits[p : p + 1], expected.logits), f"step {step}, row {p}"
                assert torch.equal(out.hidden_states[p : p + 1], expected.hidden_states), f"step {step}, row {p}"
            state.commit([inputs[p : p + 1, 1 : 2 + (step + p) % 3] for p in range(state.size)])


def test_the_batch_feeds_the_model_once_per_step():
    """Plain decoding with the step drafter: one batched forward per step for every row at once."""
    target = DelayPatternTarget(tiny(19, aligned=True))
    rows = [{"phoneme_ids": p, "durations": d} for p, d in ROWS]
    out = generate_rows(target, rows, drafter=StepCompletionDrafter(), max_new_tokens=200)
    longest = max(int(d.sum()) for _, d in ROWS)  # frames of the longest row, then the delays and the end
    assert out.stats.target_forwards == len(rows) + longest + 3 - 1  # prefills, then one forward per step


@pytest.mark.parametrize("method", list(METHODS))
def test_pipeline_lists_equal_texts_said_alone(tmp_path, method):
    """Every method, exact and tolerant, with a list of texts in batches of 3: each text's codes are
    the codes of that text said alone with the same seed (sampled)."""
    tts = mmspec.pipeline("text-to-speech", model=make_model_dir(tmp_path, aligned=True), method=method)
    texts = ["a red star.", "two blue cubes on a box.", "hi.", "the green ball is under the small red table."]
    together = tts(texts, max_seconds=0.6, batch_size=3, seed=4)
    assert [o.text for o in together] == texts
    for text, out in zip(texts, together):
        alone = tts(text, max_seconds=0.6, seed=4)
        assert torch.equal(out.codes, alone.codes) and out.audio.shape == alone.audio.shape
    assert [o.stats.generation["config"].get("batch_size") for o in together] == [3, 3, 3, None]  # the last alone


def test_pipeline_batch_compares_with_plain_decoding(tmp_path):
    tts = mmspec.pipeline("text-to-speech", model=make_model_dir(tmp_path, aligned=True), method="spec")
    outs = tts(["a red star.", "two blue cubes."], do_sample=False, max_seconds=0.4, batch_size=2, compare_baseline=True)
    for out in outs:
        assert torch.equal(out.codes, out.baseline_codes) and out.stats.speedup > 0


def test_bad_batches(tmp_path):
    tts = mmspec.pipeline("text-to-speech", model=make_model_dir(tmp_path, aligned=True))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        tts(["a", "b"], batch_size=0)
    with pytest.raises(ValueError, match="no text given"):
        tts([], batch_size=2)
    with pytest.raises(ValueError, match="text"):  # the empty text is named before anything decodes
        tts(["a red star.", ""], batch_size=2)


def test_musicgen_refuses_batches_in_one_line():
    target = DelayPatternTarget(tiny_musicgen(0))
    with pytest.raises(ValueError, match=r"MusicgenForCausalLM, which numbers positions by cache slot .* use batch size 1"):
        generate_rows(target, [{"num_frames": 4}, {"num_frames": 5}], max_new_tokens=20)


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "sjd"])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_bark_semantic_rows_equal_their_batch_one_generation(monkeypatch, drafter, do_sample):
    """Bark's semantic stage (its processors: suppression, min_eos_p) in a batch: texts of different
    lengths, with and without a speaker prompt, each row equal to its own generation."""
    monkeypatch.setattr(BatchState, "slack", 0)
    model = tiny_stage(BarkSemanticModel, BarkSemanticConfig, 0, block_size=64, input_vocab_size=64, output_vocab_size=24)
    target = BarkSemanticTarget(model, semantic_config())
    rows = [{"input_ids": TEXT}, {"input_ids": PADDED[0], "attention_mask": PADDED[1]},
            {"input_ids": TEXT[:, :2], "history_prompt": HISTORY}, {"input_ids": TEXT.flip(1)}]
    seeds = [1, 2, 3, 4]
    batch = generate_rows(target, rows, drafter=drafter, max_new_tokens=20, do_sample=do_sample, seed=seeds)
    width = target.prompt_length
    for b, row in enumerate(rows):
        alone = mmspec.generate(target, drafter=drafter, max_new_tokens=20, do_sample=do_sample, seed=seeds[b], **row)
        new = alone.sequences[0, width:]
        assert torch.equal(batch.sequences[b, width : width + len(new)], new), f"row {b}"
    assert len({s.new_tokens for s in batch.row_stats}) > 1 or not do_sample


def test_bark_coarse_refuses_batches_in_one_line():
    model = tiny_stage(BarkCoarseModel, BarkCoarseConfig, 1, block_size=64, input_vocab_size=32, output_vocab_size=32)
    target = BarkCoarseTarget(model, semantic_config(), coarse_config(), codebook_size=4)
    with pytest.raises(ValueError, match="sliding window .* use batch size 1"):
        generate_rows(target, [{"semantic_output": SEMANTIC_OUT}] * 2, max_new_tokens=8)
