"""Bark's autoregressive stages (mmspec.adapters.audio.bark) on tiny random ``BarkSemanticModel`` /
``BarkCoarseModel`` stages whose generation configs use small vocabularies with Bark's layout:
greedy output token-identical to Bark's own ``generate`` with no drafter and every chain drafter
(and a tree drafter on the semantic stage), the target's logits equal to Bark's processed scores
(the coarse stage across its sliding windows, and after rollbacks across window boundaries),
sampled tokens inside Bark's masks, sampled sequences distributed as the target's exact joint,
and one clear ValueError per bad input."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from transformers import BarkCoarseConfig, BarkCoarseModel, BarkSemanticConfig, BarkSemanticModel
from transformers.generation.logits_process import (
    AlternatingCodebooksLogitsProcessor,
    BarkEosPrioritizerLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.models.bark.generation_configuration_bark import (
    BarkCoarseGenerationConfig,
    BarkGenerationConfig,
    BarkSemanticGenerationConfig,
)

import mmspec
from mmspec.adapters.audio.bark import BarkCoarseTarget, BarkSemanticTarget, bark_targets
from mmspec.core.sampling import SamplingConfig, logits_to_probs

# Bark's layout, shrunk: semantic ids [0, 20), EOS / semantic pad 20, suppressed 21..23 (real: 10000,
# 10001..10047); text ids offset by 24 (real 10048), text pad 60, infer 63. Coarse: codebook c's
# codes at 20 + 4c .. (real 10000 + 1024c), pad 28, infer 30 inside an output vocabulary of 32.
SVS, CODEBOOK = 20, 4
SEMANTIC_GEN = dict(eos_token_id=SVS, text_encoding_offset=24, text_pad_token=60, semantic_infer_token=63,
                    semantic_vocab_size=SVS, max_input_semantic_length=8, max_new_tokens=40)
COARSE_GEN = dict(coarse_semantic_pad_token=28, coarse_infer_token=30, max_coarse_input_length=8, max_coarse_history=12,
                  sliding_window_len=6)
HISTORY = {"semantic_prompt": torch.tensor([3, 7, 7, 1, 12, 3, 7, 19, 0, 5, 5]),
           "coarse_prompt": torch.tensor([[1, 2, 3, 0, 1, 2, 3, 0, 1], [3, 3, 2, 2, 1, 1, 0, 0, 3]])}
DRAFTERS = [None, "prompt-lookup", "sjd"]


def tiny_stage(model_class, config_class, seed, **config):
    torch.manual_seed(seed)
    return model_class(config_class(num_layers=2, num_heads=2, hidden_size=16, initializer_range=0.5, **config)).eval()


@pytest.fixture(scope="module")
def semantic():
    return tiny_stage(BarkSemanticModel, BarkSemanticConfig, 0, block_size=64, input_vocab_size=64, output_vocab_size=24)


@pytest.fixture(scope="module")
def coarse():
    return tiny_stage(BarkCoarseModel, BarkCoarseConfig, 1, block_size=64, input_vocab_size=32, output_vocab_size=32)


def semantic_config(**changes):
    return BarkSemanticGenerationConfig(**{**SEMANTIC_GEN, **changes})


def coarse_config(**changes):
    return BarkCoarseGenerationConfig(**{**COARSE_GEN, **changes})


TEXT = torch.tensor([[5, 17, 33, 2, 9, 30]])
PADDED = torch.tensor([[5, 17, 33, 2, 0, 0, 0, 0, 0, 0]]), torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])
SEMANTIC_OUT = torch.tensor([[3, 9, 9, 14, 0, 2, 6, 11, SVS]])  # 8 tokens + EOS -> 24 coarse tokens


def bark_semantic(model, config, input_ids, **kwargs):
    return model.generate(input_ids, semantic_generation_config=config, **kwargs)


# ---- semantic stage ------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", [*DRAFTERS, "sjd-pac"])
def test_semantic_greedy_equals_bark_generate(semantic, drafter):
    config = semantic_config()
    target = BarkSemanticTarget(semantic, config)
    cases = [dict(input_ids=TEXT),
             dict(input_ids=PADDED[0], attention_mask=PADDED[1], history_prompt=HISTORY)]
    for inputs in cases:
        # Bark itself needs the processor's padding to max_input_semantic_length
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask", torch.ones_like(ids))
        pad = config.max_input_semantic_length - ids.shape[1]
        bark_ids = torch.cat([ids, ids.new_zeros(1, max(pad, 0))], dim=1)
        bark_mask = torch.cat([mask, mask.new_zeros(1, max(pad, 0))], dim=1)
        reference = bark_semantic(semantic, config, bark_ids, attention_mask=bark_mask,
                                  history_prompt=inputs.get("history_prompt"))
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=target.max_new_tokens, **inputs)
        assert torch.equal(target.semantic_output(out.sequences), reference)
        if drafter is not None:
            assert out.stats.accepted > 0
        if drafter == "sjd-pac":
            assert out.stats.tree_nodes > 0  # the tree path ran
    assert reference[0, -1] == SVS  # the last case stopped at EOS, as Bark did


def bark_raw_logits(model, generate):
    """Run ``generate()`` and capture the raw logits [n, V] Bark's generate computed for each token."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output[0, -1]))
    try:
        with torch.no_grad():
            result = generate()
    finally:
        hook.remove()
    return result, torch.stack(captured)


def teacher_forced(target, inputs, stream):
    """The target's logits [len(stream), V] for each token of ``stream`` [m] (prefill, then one forward)."""
    with torch.no_grad():
        state, first = target.prefill(inputs)
        state.tokens = torch.cat([state.tokens, stream[None, :1]], dim=1)
        rest = target.forward(state, stream[None, :-1])
        state.tokens = torch.cat([state.tokens, stream[None, 1:]], dim=1)
    return state, torch.cat([first.logits, rest.logits], dim=1)[0]


def assert_same_logits(logits, expected):
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(logits[finite], expected[finite], atol=1e-5)


def test_semantic_logits_are_barks_processed_logits_and_min_eos_p_stops_where_bark_does(semantic):
    """Teacher-forced target logits equal the raw logits of Bark's generate passed through Bark's
    own processors (SuppressTokens, then BarkEosPrioritizer); a min_eos_p that bites mid-sequence
    (chosen from the plain run's EOS probabilities) stops Bark and every drafter at the same token."""
    config = semantic_config(max_new_tokens=16)
    ids = torch.cat([TEXT, TEXT.new_zeros(1, 2)], dim=1)
    mask = torch.cat([torch.ones_like(TEXT), TEXT.new_zeros(1, 2)], dim=1)
    suppress = SuppressTokensLogitsProcessor(list(range(SVS + 1, 24)))
    target = BarkSemanticTarget(semantic, config)
    tokens, raw = bark_raw_logits(semantic, lambda: bark_semantic(semantic, config, ids, attention_mask=mask))
    expected = suppress(tokens, raw)
    assert_same_logits(teacher_forced(target, {"input_ids": TEXT}, tokens[0])[1], expected)

    eos = expected.softmax(-1)[:, SVS]
    step = next(s for s in range(3, len(eos)) if eos[s] > eos[:s].max())  # EOS likelier than ever before
    threshold = float(eos[:step].max() + eos[step]) / 2
    reference, raw = bark_raw_logits(
        semantic, lambda: bark_semantic(semantic, config, ids, attention_mask=mask, min_eos_p=threshold))
    assert reference.shape[1] == step + 1 and reference[0, -1] == SVS
    eager = BarkSemanticTarget(semantic, config, min_eos_p=threshold)
    expected = BarkEosPrioritizerLogitsProcessor(SVS, threshold, device="cpu")(reference, suppress(reference, raw))
    assert_same_logits(teacher_forced(eager, {"input_ids": TEXT}, reference[0])[1], expected)
    assert torch.isinf(expected[-1]).sum() == 23  # the last step forced EOS
    for drafter in DRAFTERS:
        out = mmspec.generate(eager, drafter=drafter, max_new_tokens=16, input_ids=TEXT)
        assert torch.equal(eager.semantic_output(out.sequences), reference)


# ---- coarse stage --------------------------------------------------------------------------------
def bark_coarse(model, semantic_gen, coarse_gen, semantic_output, history=None):
    return model.generate(semantic_output.clone(), semantic_generation_config=semantic_gen,
                          coarse_generation_config=coarse_gen, codebook_size=CODEBOOK, history_prompt=history)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_coarse_greedy_equals_bark_generate_across_windows(coarse, drafter):
    """Window length 6 without and 5 (odd: the codebook parity restarts each window) with a
    speaker history: 24 coarse tokens in 4 / 5 windows."""
    for window, history in ((6, None), (5, HISTORY)):
        semantic_gen, coarse_gen = semantic_config(), coarse_config(sliding_window_len=window)
        reference = bark_coarse(coarse, semantic_gen, coarse_gen, SEMANTIC_OUT, history)
        target = BarkCoarseTarget(coarse, semantic_gen, coarse_gen, CODEBOOK)
        n = target.coarse_length(SEMANTIC_OUT)
        assert n == reference.shape[1] > 3 * window
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=n + 1, num_draft_tokens=8,
                              semantic_output=SEMANTIC_OUT, history_prompt=history)
        assert torch.equal(target.coarse_output(out.sequences, history), reference)
        assert out.sequences[0, -1] == target.stop_id
        if drafter is not None:
            assert out.stats.accepted > 0


def test_coarse_logits_are_barks_across_windows_and_after_rollbacks(coarse):
    """One forward over all of Bark's greedy tokens (crossing every window boundary) gives, row by
    row, the raw logits Bark's generate computed, masked by Bark's AlternatingCodebooksLogitsProcessor,
    then the stop row; rolling back into a released window and forwarding a different continuation
    gives the logits of a fresh teacher-forced pass over it."""
    semantic_gen, coarse_gen = semantic_config(), coarse_config(sliding_window_len=5)
    reference, captured = bark_raw_logits(
        coarse, lambda: bark_coarse(coarse, semantic_gen, coarse_gen, SEMANTIC_OUT, HISTORY))
    reference = reference[0]
    n = reference.shape[0]
    assert len(captured) == n
    alternating = AlternatingCodebooksLogitsProcessor(0, SVS, CODEBOOK)
    expected = torch.stack([alternating(torch.zeros(1, p % 5), raw[None])[0] for p, raw in enumerate(captured)])

    target = BarkCoarseTarget(coarse, semantic_gen, coarse_gen, CODEBOOK)
    inputs = {"semantic_output": SEMANTIC_OUT, "history_prompt": HISTORY}

    with torch.no_grad():
        stream = torch.cat([reference, torch.tensor([target.stop_id])])
        state, logits = teacher_forced(target, inputs, stream)
        assert_same_logits(logits[:n, :-1], expected)
        assert torch.isinf(logits[:n, -1]).all()  # no stop before the end ...
        assert logits[n].argmax() == target.stop_id and torch.isinf(logits[n]).sum() == target.vocab_size - 1
        assert set(state.cache.windows) <= {n // 5 - 1, n // 5}  # older windows' caches were released

        changed = stream.clone()
        for keep in (3, 12, 19):  # inside window 0 (released), mid-window 2, a boundary next
            later = torch.arange(keep + 1, n)
            changed[keep + 1 : n] = SVS + (later + keep) % CODEBOOK + CODEBOOK * (later % 5 % 2)
            state.rollback(state.prompt_length + keep + 1)
            state.tokens = torch.cat([state.tokens, changed[None, keep + 1 :]], dim=1)
            out = target.forward(state, changed[None, keep:-1])
            _, fresh = teacher_forced(target, inputs, changed)
            assert_same_logits(out.logits[0], fresh[keep + 1 :])

        state, first = target.prefill({**inputs}, hidden_layer=-1)
        assert first.hidden_states.shape == (1, 1, 16)


def test_two_stages_chain_like_bark(semantic, coarse):
    """semantic_output feeds the coarse target as Bark's semantic output feeds its coarse model."""
    semantic_gen, coarse_gen = semantic_config(max_new_tokens=12), coarse_config()
    semantic_target = BarkSemanticTarget(semantic, semantic_gen)
    coarse_target = BarkCoarseTarget(coarse, semantic_gen, coarse_gen, CODEBOOK)
    tokens = semantic_target.semantic_output(
        mmspec.generate(semantic_target, drafter="prompt-lookup", max_new_tokens=12, input_ids=TEXT).sequences)
    reference = bark_coarse(coarse, semantic_gen, coarse_gen, tokens)
    out = mmspec.generate(coarse_target, drafter="sjd", max_new_tokens=100, semantic_output=tokens)
    assert torch.equal(coarse_target.coarse_output(out.sequences), reference)


def test_no_semantic_tokens_give_no_coarse_tokens_like_bark(coarse):
    semantic_gen, coarse_gen = semantic_config(), coarse_config()
    target = BarkCoarseTarget(coarse, semantic_gen, coarse_gen, CODEBOOK)
    only_eos = torch.tensor([[SVS]])
    out = mmspec.generate(target, drafter="sjd", max_new_tokens=4, semantic_output=only_eos)
    assert out.stats.new_tokens == 1 and out.sequences[0, -1] == target.stop_id
    assert torch.equal(target.coarse_output(out.sequences), bark_coarse(coarse, semantic_gen, coarse_gen, only_eos))


def test_bark_targets_take_a_bark_models_generation_config(semantic, coarse):
    config = BarkGenerationConfig(semantic_config=SEMANTIC_GEN, coarse_acoustics_config=COARSE_GEN,
                                  codebook_size=CODEBOOK)
    bark = SimpleNamespace(generation_config=config, semantic=semantic, coarse_acoustics=coarse)
    semantic_target, coarse_target = bark_targets(bark, min_eos_p=0.3)
    assert semantic_target.min_eos_p == 0.3 and semantic_target.max_new_tokens == 40
    assert coarse_target.codebook_size == CODEBOOK and coarse_target.window_length == 6


def test_models_of_the_wrong_kind_are_refused_in_one_line(semantic, coarse):
    with pytest.raises(ValueError, match="takes a transformers BarkModel.*got Linear"):
        bark_targets(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="expected a transformers BarkSemanticModel.*got BarkCoarseModel"):
        BarkSemanticTarget(coarse, semantic_config())
    with pytest.raises(ValueError, match="expected a transformers BarkCoarseModel.*coarse_acoustics.*got BarkSemanticModel"):
        BarkCoarseTarget(semantic, semantic_config(), coarse_config(), CODEBOOK)


# ---- sampling ------------------------------------------------------------------------------------
def test_sampled_tokens_respect_barks_masks(semantic, coarse):
    semantic_target = BarkSemanticTarget(semantic, semantic_config())
    coarse_target = BarkCoarseTarget(coarse, semantic_config(), coarse_config(sliding_window_len=5), CODEBOOK)
    n = coarse_target.coarse_length(SEMANTIC_OUT)
    for seed, drafter in itertools.product(range(2), DRAFTERS):
        out = mmspec.generate(semantic_target, drafter=drafter, max_new_tokens=40, do_sample=True, temperature=1.5,
                              seed=seed, input_ids=TEXT)
        tokens = semantic_target.semantic_output(out.sequences)[0]
        assert bool((tokens[:-1] < SVS).all()) and tokens[-1] <= SVS
        out = mmspec.generate(coarse_target, drafter=drafter, max_new_tokens=n + 1, do_sample=True, temperature=1.5,
                              seed=seed, semantic_output=SEMANTIC_OUT, history_prompt=HISTORY)
        codes = coarse_target.coarse_output(out.sequences, HISTORY)[0]
        assert codes.shape[0] == n and out.sequences[0, -1] == coarse_target.stop_id
        first = torch.arange(n) % 5 % 2 == 0  # codebook 0 at even offsets within each window
        assert bool(((codes >= SVS) & (codes < SVS + CODEBOOK))[first].all())
        assert bool(((codes >= SVS + CODEBOOK) & (codes < 32))[~first].all())


RUNS = 600


def small_semantic():
    model = tiny_stage(BarkSemanticModel, BarkSemanticConfig, 2, block_size=16, input_vocab_size=16, output_vocab_size=5)
    config = BarkSemanticGenerationConfig(eos_token_id=3, text_encoding_offset=5, text_pad_token=14,
                                          semantic_infer_token=15, semantic_vocab_size=3, max_input_semantic_length=4)
    return BarkSemanticTarget(model, config), {"input_ids": torch.tensor([[1, 7, 4]])}, 3


def small_coarse():
    """Ratio 2 (equal rates): 2 semantic tokens -> 4 coarse tokens, windows of 3 (then 1)."""
    model = tiny_stage(BarkCoarseModel, BarkCoarseConfig, 3, block_size=16, input_vocab_size=8, output_vocab_size=8)
    semantic_gen = BarkSemanticGenerationConfig(eos_token_id=3, semantic_vocab_size=3, semantic_rate_hz=50)
    coarse_gen = BarkCoarseGenerationConfig(coarse_semantic_pad_token=6, coarse_infer_token=7, coarse_rate_hz=50,
                                            max_coarse_input_length=4, max_coarse_history=6, sliding_window_len=3)
    target = BarkCoarseTarget(model, semantic_gen, coarse_gen, codebook_size=2)
    return target, {"semantic_output": torch.tensor([[2, 0, 3]])}, 5


def exact_joint(target, inputs, max_new_tokens, temperature=1.0):
    """Probability of every output the target can produce in ``max_new_tokens`` tokens (stopping at EOS)."""
    config = SamplingConfig(do_sample=True, temperature=temperature)
    joint = {}

    def next_probs(sequence):  # [V] after the generated ``sequence``, from a fresh prefill
        state, first = target.prefill(inputs)
        if not sequence:
            return logits_to_probs(first.logits[0], config)[0]
        state.tokens = torch.cat([state.tokens, torch.tensor([sequence])], dim=1)
        return logits_to_probs(target.forward(state, torch.tensor([sequence])).logits[0, -1:], config)[0]

    def expand(prefix, mass):
        probs = next_probs(prefix)
        for token in probs.nonzero().flatten().tolist():
            sequence, p = prefix + [token], mass * float(probs[token])
            if token in target.eos_token_ids or len(sequence) == max_new_tokens:
                joint[tuple(sequence)] = p
            else:
                expand(sequence, p)

    with torch.no_grad():
        expand([], 1.0)
    return joint


@pytest.mark.parametrize("stage, drafter", [("semantic", None), ("semantic", "sjd"), ("coarse", None), ("coarse", "sjd")])
def test_sampled_sequences_follow_the_target_joint(stage, drafter):
    target, inputs, max_new_tokens = {"semantic": small_semantic, "coarse": small_coarse}[stage]()
    joint = exact_joint(target, inputs, max_new_tokens)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-4)
    counts, accepted = {}, 0
    for seed in range(RUNS):
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=max_new_tokens, do_sample=True, seed=seed,
                              num_draft_tokens=4, **inputs)
        accepted += out.stats.accepted
        key = tuple(out.sequences[0, -out.stats.new_tokens :].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(joint)
    if drafter == "sjd":
        assert accepted > RUNS // 20  # drafts were accepted: the acceptance path ran
    big = [g for g, p in joint.items() if p * RUNS >= 5]
    observed = [counts.get(g, 0) for g in big] + [RUNS - sum(counts.get(g, 0) for g in big)]
    expected = [joint[g] * RUNS for g in big] + [RUNS - sum(joint[g] * RUNS for g in big)]
    assert chisquare(observed, expected).pvalue > 1e-4
    # negative control: the same counts fail against the joint at another temperature
    wrong = exact_joint(target, inputs, max_new_tokens, temperature=2.0)
    expected = [wrong.get(g, 0.0) * RUNS for g in big] + [RUNS - sum(wrong.get(g, 0.0) * RUNS for g in big)]
    assert chisquare(observed, expected).pvalue < 1e-4


# ---- errors --------------------------------------------------------------------------------------
def test_bad_inputs_raise_one_clear_value_error(semantic, coarse):
    semantic_target = BarkSemanticTarget(semantic, semantic_config())
    coarse_target = BarkCoarseTarget(coarse, semantic_config(), coarse_config(), CODEBOOK)
    cases = [
        (semantic_target, dict(input_ids=torch.tensor([[1, 2, 99]])), r"input_ids must be text token ids in \[0, 40\)"),
        (semantic_target, dict(input_ids=torch.tensor([1, 2])), r"input_ids must be one non-empty integer sequence"),
        (semantic_target, dict(), r"input_ids must be an integer tensor \[1, L\]"),
        (semantic_target, dict(input_ids=TEXT, attention_mask=torch.ones(1, 2)), "attention_mask has shape"),
        (semantic_target, dict(input_ids=TEXT, history_prompt=[1, 2]), "history_prompt must be Bark's speaker prompt"),
        (semantic_target, dict(input_ids=TEXT, semantic_output=TEXT), "unknown argument 'semantic_output'"),
        (coarse_target, dict(), r"needs semantic_output=\[1, S\]"),
        (coarse_target, dict(semantic_output=torch.tensor([[1, 2, 40]])), "outside the coarse model's input vocabulary"),
        (coarse_target, dict(semantic_outputs=SEMANTIC_OUT), "did you mean 'semantic_output'"),
        (coarse_target, dict(semantic_output=SEMANTIC_OUT, history_prompt={"semantic_prompt": torch.tensor([1])}),
         "a dict with 'coarse_prompt'"),
    ]
    for target, inputs, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            mmspec.generate(target, max_new_tokens=4, **inputs)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="token trees are not supported on Bark's coarse stage"):
        mmspec.generate(coarse_target, drafter="sjd-pac", max_new_tokens=8, semantic_output=SEMANTIC_OUT)
    with pytest.raises(ValueError, match="exceed Bark's block_size of 64"):
        mmspec.generate(semantic_target, max_new_tokens=60, input_ids=TEXT, eos_token_id=[])
    with pytest.raises(ValueError, match="window 0 needs 66 positions, more than the coarse model's block_size"):
        mmspec.generate(BarkCoarseTarget(coarse, semantic_config(), coarse_config(max_coarse_input_length=60), CODEBOOK),
                        semantic_output=SEMANTIC_OUT)
