"""Delay-pattern codec LMs (MusicGen / Parler layout) through the core, on tiny random
``MusicgenForCausalLM`` decoders: the flattened stream's step cache against full forwards, greedy
identical to transformers' own generate (unconditional) and to an uncached greedy reference
(conditioned by encoder states), every chain drafter exact, and sampled frames distributed as the
target's joint frame distribution (ladder levels 2-3)."""

import itertools

import pytest
import torch
from distribution_check import joint_pvalue, two_stage
from transformers import MusicgenDecoderConfig, MusicgenForCausalLM

import mmspec
from mmspec.adapters.audio.delay import DelayPatternTarget
from mmspec.core.sampling import SamplingConfig, logits_to_probs
from mmspec.drafters import ModelDrafter
from mmspec.drafters.jacobi import ProactiveJacobiDrafter

K, CODES, PAD, WIDTH = 3, 16, 16, 16


def tiny_musicgen(seed, layers=2, codebooks=K, codes=CODES, scale=1.0):
    config = MusicgenDecoderConfig(vocab_size=codes, max_position_embeddings=128, num_hidden_layers=layers, ffn_dim=32,
                                   num_attention_heads=2, hidden_size=WIDTH, num_codebooks=codebooks, pad_token_id=codes,
                                   bos_token_id=codes, decoder_start_token_id=codes)
    torch.manual_seed(seed)
    model = MusicgenForCausalLM(config).eval()
    with torch.no_grad():
        for head in model.lm_heads:
            head.weight.mul_(scale)
        for layer in model.model.decoder.layers:  # let the conditioning change the output
            layer.encoder_attn.v_proj.weight.mul_(10.0)
            layer.encoder_attn.out_proj.weight.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_musicgen(0, scale=3.0)


ENCODER = torch.randn(1, 5, WIDTH, generator=torch.Generator().manual_seed(1)) * 3


def uncached_greedy(model, num_frames, encoder=None):
    """Greedy decoding by full forwards over the delayed steps so far (no cache): codes [K, F]."""
    k = model.config.num_codebooks
    steps = torch.full((k, 1), PAD)
    for t in range(1, num_frames + k):
        logits = model(input_ids=steps, encoder_hidden_states=encoder).logits[:, -1]  # [K, V]
        column = logits.argmax(-1)
        for c in range(k):
            if not c + 1 <= t <= c + num_frames:
                column[c] = PAD
        steps = torch.cat([steps, column[:, None]], dim=1)
    return torch.stack([steps[c, 1 + c : 1 + c + num_frames] for c in range(k)])


def codes_of(target, out):
    return target.codes(out.sequences[0, target.num_codebooks :])


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "sjd", "draft"])
def test_greedy_equals_transformers_generate_unconditional(model, drafter):
    frames = 7
    reference = model.generate(torch.full((K, 1), PAD), max_new_tokens=frames + K - 1, do_sample=False,
                               num_return_sequences=1)[0]
    target = DelayPatternTarget(model)
    if drafter == "draft":
        drafter = ModelDrafter(DelayPatternTarget(tiny_musicgen(1, layers=1, scale=3.0)), num_draft_tokens=4)
    out = mmspec.generate(target, drafter=drafter, max_new_tokens=target.stream_length(frames), num_frames=frames)
    assert torch.equal(codes_of(target, out), reference)


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "sjd"])
def test_greedy_with_encoder_states_equals_uncached_reference(model, drafter):
    frames = 6
    reference = uncached_greedy(model, frames, ENCODER)
    assert not torch.equal(reference, uncached_greedy(model, frames))  # the conditioning matters here
    target = DelayPatternTarget(model)
    out = mmspec.generate(target, drafter=drafter, max_new_tokens=target.stream_length(frames), num_frames=frames,
                          encoder_hidden_states=ENCODER)
    assert torch.equal(codes_of(target, out), reference)


def test_stream_logits_match_full_forwards_and_survive_rollback(model):
    """The sub-token logits of one forward over a whole stream equal those of the model's full
    forward; after a rollback into the middle of a step and a different continuation they equal
    the full forward of the new stream."""
    target = DelayPatternTarget(model)
    frames = 4
    gen = torch.Generator().manual_seed(0)
    stream = target.stream_ids(torch.randint(0, CODES, (K, frames), generator=gen))

    def full(stream):
        steps = target.model_ids(torch.cat([torch.full((K,), target.pad_id), stream]).view(-1, K)).T
        return model(input_ids=steps, encoder_hidden_states=ENCODER).logits.view(K, steps.shape[1], -1)

    state, first = target.prefill({"num_frames": frames, "encoder_hidden_states": ENCODER})
    state.tokens = torch.cat([state.tokens, stream[None, :1]], dim=1)
    out = target.forward(state, stream[None, :-1])
    logits = torch.cat([first.logits, out.logits], dim=1)[0]
    reference = full(stream)
    for i in range(stream.shape[0]):
        step, codebook = divmod(i + K, K)
        own = slice(codebook * CODES, (codebook + 1) * CODES)
        if state.cache.position(i + K) == "free":
            assert torch.allclose(logits[i, own], reference[codebook, step - 1], atol=1e-5)
            assert torch.isinf(logits[i]).sum() == target.vocab_size - CODES  # only its codebook's codes
        else:
            assert logits[i].argmax() == target.pad_id and torch.isinf(logits[i]).sum() == target.vocab_size - 1
    # roll back to mid-step 2 (sub-token 1 of step 2) and continue differently
    keep = K + K + 1
    state.tokens = torch.cat([state.tokens[:, :K], stream[None]], dim=1)
    state.rollback(keep + 1)
    assert state.cache.get_seq_length() == keep and state.cache.steps_cached == keep // K
    changed = target.stream_ids(torch.randint(0, CODES, (K, frames), generator=gen))
    changed[: keep - K + 1] = stream[: keep - K + 1]  # the committed tokens and the pending one stay
    out = target.forward(state, changed[None, keep - K : -1])
    reference = full(changed)
    for j, i in enumerate(range(keep - K + 1, changed.shape[0])):
        step, codebook = divmod(i + K, K)
        if state.cache.position(i + K) == "free":
            own = slice(codebook * CODES, (codebook + 1) * CODES)
            assert torch.allclose(out.logits[0, j, own], reference[codebook, step - 1], atol=1e-5)


def test_bad_inputs(model):
    target = DelayPatternTarget(model)
    with pytest.raises(ValueError, match="does not end the audio itself: pass num_frames"):
        mmspec.generate(target, max_new_tokens=6)
    with pytest.raises(ValueError, match="num_frames must be a positive integer"):
        mmspec.generate(target, max_new_tokens=6, num_frames=0)
    with pytest.raises(ValueError, match="unknown argument 'encoder_states'"):
        mmspec.generate(target, max_new_tokens=6, num_frames=2, encoder_states=ENCODER)
    with pytest.raises(ValueError, match="token trees are not supported"):
        mmspec.generate(target, drafter=ProactiveJacobiDrafter(4, branches=2, depth=1), max_new_tokens=6, num_frames=2)
    with pytest.raises(ValueError, match="not a supported delay-pattern codec LM"):
        DelayPatternTarget(torch.nn.Linear(2, 2))


# ---- sampling: the joint distribution of the frames ------------------------------------------------
SMALL_K, SMALL_CODES, FRAMES, RUNS = 2, 3, 2, 2500
#: the negative control's runs: the draft model's joint is far from the target's (p ~ 1e-28 at 700
#: runs, 1e-149 at 2500), so fewer runs still fail it by a wide margin
CONTROL_RUNS = 700
TEMPERATURE = 1.3


@pytest.fixture(scope="module")
def small():
    return DelayPatternTarget(tiny_musicgen(2, codebooks=SMALL_K, codes=SMALL_CODES, scale=4.0))


def small_draft():
    return DelayPatternTarget(tiny_musicgen(3, layers=1, codebooks=SMALL_K, codes=SMALL_CODES, scale=4.0))


def exact_joint(target):
    """Exact probability of every audio code grid [K, F] at TEMPERATURE."""
    config = SamplingConfig(do_sample=True, temperature=TEMPERATURE)
    length = target.stream_length(FRAMES)
    joint = {}
    with torch.no_grad():
        for codes in itertools.product(range(SMALL_CODES), repeat=SMALL_K * FRAMES):
            stream = target.stream_ids(torch.tensor(codes).view(SMALL_K, FRAMES))
            state, first = target.prefill({"num_frames": FRAMES})
            rest = target.forward(state, stream[None, :-1])
            probs = logits_to_probs(torch.cat([first.logits, rest.logits], dim=1)[0], config)
            joint[codes] = float(probs[torch.arange(length), stream].prod())
    return joint


@pytest.fixture(scope="module")
def joint(small):
    return exact_joint(small)


@pytest.mark.parametrize("drafter", ["draft", "sjd", "prompt-lookup"])
def test_sampled_frames_follow_the_target_joint(small, joint, drafter):
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-4)
    counts, accepted = {}, 0
    draft = small_draft() if drafter == "draft" else None  # built once, a new drafter per run

    def draw(seed):
        nonlocal accepted
        d = ModelDrafter(draft, num_draft_tokens=4) if drafter == "draft" else drafter
        out = mmspec.generate(small, drafter=d, max_new_tokens=small.stream_length(FRAMES), num_frames=FRAMES,
                              do_sample=True, temperature=TEMPERATURE, seed=seed, num_draft_tokens=4)
        accepted += out.stats.accepted
        key = tuple(codes_of(small, out).flatten().tolist())
        counts[key] = counts.get(key, 0) + 1

    runs, found = two_stage(RUNS, draw, lambda n: [joint_pvalue(counts, joint, n)])
    assert accepted > 0.08 * runs  # drafts were accepted: the acceptance path ran
    assert found[0] > 1e-4


def test_a_wrong_target_fails_the_distribution_check(small, joint):
    """Negative control: frames sampled from the draft model do not pass against the target's joint."""
    draft = small_draft()
    counts = {}
    for seed in range(CONTROL_RUNS):
        out = mmspec.generate(draft, max_new_tokens=draft.stream_length(FRAMES), num_frames=FRAMES, do_sample=True,
                              temperature=TEMPERATURE, seed=seed)
        key = tuple(codes_of(draft, out).flatten().tolist())
        counts[key] = counts.get(key, 0) + 1
    assert joint_pvalue(counts, joint, CONTROL_RUNS) < 1e-4


def test_text_lm_drafters_and_a_bare_draft_model_are_refused_in_one_line(small):
    """medusa / eagle / layer-skip read a transformers LM's layers (an AttributeError deep inside
    before); a bare draft model was wrapped as a transformers LM: both one line saying what to use."""
    for spec in ("medusa", "eagle", "layer-skip:1"):
        with pytest.raises(ValueError, match=rf"drafter '{spec.partition(':')[0]}' reads a transformers LM's own layers and heads; "
                                             r"a DelayPatternTarget takes prompt-lookup, sjd"):
            mmspec.generate(small, drafter=spec, max_new_tokens=small.stream_length(FRAMES), num_frames=FRAMES)
    with pytest.raises(ValueError, match=r"ModelDrafter\(DelayPatternTarget\(draft\)\), not the bare model"):
        mmspec.generate(small, drafter=small_draft().model, max_new_tokens=small.stream_length(FRAMES), num_frames=FRAMES)


def test_a_budget_shorter_than_num_frames_is_warned_of(small):
    """generate's default max_new_tokens (64) cut a 100-frame stream to 19 frames without a word."""
    with pytest.warns(UserWarning, match=rf"max_new_tokens=4 ends the stream before the {small.stream_length(FRAMES)} tokens"):
        mmspec.generate(small, max_new_tokens=4, num_frames=FRAMES)
