"""transformers' Dia (``DiaForConditionalGeneration``) through the delay-pattern adapter, on tiny
random models with a non-uniform delay pattern ([0, 2, 3]): greedy output identical to Dia's own
``generate`` (fed ``DiaProcessor``'s delayed BOS prefix) with five chain drafters, when the model
ends the audio itself, when the length limit ends it, and with classifier-free guidance; each
position's distribution equal to Dia's logits processors on a full forward (also after a
rollback); sampled frames distributed as the target's exact joint (ladder levels 2-3)."""

import itertools

import pytest
import torch
from distribution_check import joint_pvalue, two_stage
from transformers import DiaConfig, DiaForConditionalGeneration
from transformers.generation.logits_process import (DiaClassifierFreeGuidanceLogitsProcessor,
                                                    DiaEOSChannelFilterLogitsProcessor)
from transformers.models.dia.processing_dia import DiaProcessor

import mmspec
from mmspec.adapters.audio.delay import DelayPatternTarget
from mmspec.core.sampling import SamplingConfig, logits_to_probs
from mmspec.drafters.jacobi import ProactiveJacobiDrafter
from mmspec.drafters.steps import StepAwareDrafter, StepCompletionDrafter

DELAYS, CODES, TEXT_VOCAB = (0, 2, 3), 16, 32
K = len(DELAYS)


def tiny_dia(seed, codes=CODES, delays=DELAYS, layers=2, scale=3.0):
    """A random Dia: codes 0 .. codes - 1, then EOS, PAD, BOS."""
    encoder = dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                   intermediate_size=32, vocab_size=TEXT_VOCAB, max_position_embeddings=64)
    decoder = dict(num_hidden_layers=layers, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, cross_num_attention_heads=2, cross_head_dim=8,
                   cross_num_key_value_heads=2, cross_hidden_size=16, vocab_size=codes + 3, num_channels=len(delays),
                   eos_token_id=codes, pad_token_id=codes + 1, bos_token_id=codes + 2, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = DiaForConditionalGeneration(DiaConfig(encoder_config=encoder, decoder_config=decoder,
                                                  delay_pattern=list(delays))).eval()
    with torch.no_grad():
        model.logits_dense.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_dia(1)


def text(seed, length=5):
    return torch.randint(0, TEXT_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def delayed_begin(model):
    """DiaProcessor's decoder inputs for text-to-speech: BOS at step 0 and at each channel's
    delayed steps, PAD (= free) after: [1, 1 + max delay, K]."""
    decoder, delays = model.config.decoder_config, model.config.delay_pattern
    prefill = torch.full((1, 1 + max(delays), len(delays)), decoder.pad_token_id, dtype=torch.long)
    prefill[:, :1] = decoder.bos_token_id
    indices = DiaProcessor.build_indices(bsz=1, seq_len=prefill.shape[1], num_channels=len(delays),
                                         delay_pattern=delays, revert=False)
    return DiaProcessor.apply_audio_delay(prefill, decoder.pad_token_id, decoder.bos_token_id, indices)


def dia_generate(model, ids, max_new_tokens, **kwargs):
    """Dia's own greedy generate: the delayed grid [L, K] it returns (BOS, codes, EOS, PAD)."""
    begin = delayed_begin(model)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=begin,
                          decoder_attention_mask=torch.ones(begin.shape[:2], dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, **kwargs)[0]


def undelayed(grid, eos, delays=DELAYS):
    """Dia's grid [L, K] -> codes [K, F] (F: the step of channel 0's EOS, minus 1)."""
    frames = int((grid[:, 0] == eos).nonzero()[0]) - 1
    return torch.stack([grid[1 + d : 1 + d + frames, c] for c, d in enumerate(delays)])


def mmspec_generate(target, ids, max_new_tokens, drafter=None, **kwargs):
    """mmspec's generation under Dia's max_new_tokens: the stream and the model-id grid [L, K]."""
    frames = max_new_tokens - 1 - max(target.delays)  # Dia forces channel 0's EOS at step frames + 1
    out = mmspec.generate(target, drafter=drafter, max_new_tokens=target.stream_length(frames) + 1, num_frames=frames,
                          input_ids=ids, attention_mask=torch.ones_like(ids), num_draft_tokens=4, **kwargs)
    stream = out.sequences[0]
    assert stream[-1] == target.stop_id  # the stream ends where Dia stops
    return stream, target.model_ids(stream[:-1].view(-1, target.num_codebooks))


def make_drafter(name):
    if name == "draft":  # a one-layer random Dia drafting after the current step's known codes
        return StepAwareDrafter(DelayPatternTarget(tiny_dia(7, layers=1)), num_draft_tokens=4)
    return StepCompletionDrafter() if name == "step-completion" else name


DRAFTERS = [None, "prompt-lookup", "sjd", "step-completion", "draft"]


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("limit", [30, 7], ids=["model-ends", "length-limit"])
def test_greedy_equals_dia_generate(model, drafter, limit):
    target = DelayPatternTarget(model)
    eos = model.config.decoder_config.eos_token_id
    for seed in range(2):
        ids = text(seed)
        reference = dia_generate(model, ids, limit)
        if limit == 30:
            assert reference.shape[0] < limit + 1  # the model ended the audio itself
        else:
            assert reference.shape[0] == limit + 1 and int((reference[:, 0] == eos).nonzero()[0]) == limit - max(DELAYS)
        stream, grid = mmspec_generate(target, ids, limit, make_drafter(drafter))
        assert torch.equal(grid, reference)
        assert torch.equal(target.codes(stream[K:]), undelayed(reference, eos))


@pytest.mark.parametrize("drafter", [None, "prompt-lookup", "sjd", "draft"])
def test_greedy_with_guidance_equals_dia_generate(model, drafter):
    target = DelayPatternTarget(model)
    ids = text(0)
    reference = dia_generate(model, ids, 20, guidance_scale=3.0, top_k=6)  # top_k: Dia's guidance top-k
    assert not torch.equal(reference, dia_generate(model, ids, 20))  # the guidance matters here
    _, grid = mmspec_generate(target, ids, 20, make_drafter(drafter), guidance_scale=3.0, guidance_top_k=6)
    assert torch.equal(grid, reference)
    if drafter is None:  # without a guidance top-k (Dia: top_k=None), and guidance from the generation config
        reference = dia_generate(model, ids, 20, guidance_scale=3.0, top_k=None)
        _, grid = mmspec_generate(target, ids, 20, guidance_scale=3.0, guidance_top_k=0)
        assert torch.equal(grid, reference)
        config = model.generation_config
        saved = config.guidance_scale, config.top_k
        config.guidance_scale, config.top_k = 3.0, 5
        try:
            reference = dia_generate(model, ids, 20)
            _, grid = mmspec_generate(target, ids, 20)
            assert torch.equal(grid, reference)
            _, grid = mmspec_generate(target, ids, 20, guidance_scale=1)  # guidance off
            assert torch.equal(grid, dia_generate(model, ids, 20, guidance_scale=1))
        finally:
            config.guidance_scale, config.top_k = saved


def test_stream_layout_is_dia_processor_layout(model):
    """stream_ids of codes [K, F] is, as model ids, DiaProcessor's delayed training layout (BOS
    prefix, codes, an EOS frame, PAD); codes() undoes it; stream_length counts it."""
    target = DelayPatternTarget(model)
    decoder = model.config.decoder_config
    for frames in (0, 1, 5):
        codes = torch.randint(0, CODES, (K, frames), generator=torch.Generator().manual_seed(frames))
        prefill = torch.full((1, frames + 2 + max(DELAYS), K), decoder.pad_token_id)
        prefill[0, 0], prefill[0, frames + 1] = decoder.bos_token_id, decoder.eos_token_id
        prefill[0, 1 : frames + 1] = codes.T
        indices = DiaProcessor.build_indices(bsz=1, seq_len=prefill.shape[1], num_channels=K,
                                             delay_pattern=list(DELAYS), revert=False)
        expected = DiaProcessor.apply_audio_delay(prefill, decoder.pad_token_id, decoder.bos_token_id, indices)[0]
        stream = target.stream_ids(codes)
        assert stream.shape[0] == target.stream_length(frames)
        full = torch.cat([torch.full((K,), target.pad_id), stream])
        assert torch.equal(target.model_ids(full.view(-1, K)), expected)
        assert torch.equal(target.codes(torch.cat([stream, torch.tensor([target.stop_id])])), codes)


@pytest.mark.parametrize("guidance", [None, 3.0])
def test_stream_logits_are_dia_processors_on_full_forwards(model, guidance):
    """Every free position's logits are Dia's own processors (its CFG, then its EOS channel
    filter) on the model's uncached forward over the steps so far, also after a rollback into a
    step; forced positions put all mass on one id."""
    target = DelayPatternTarget(model)
    decoder = model.config.decoder_config
    ids, frames = text(3), 6
    extra = {} if guidance is None else {"guidance_scale": guidance, "guidance_top_k": 6}
    processors = [DiaEOSChannelFilterLogitsProcessor(K, decoder.eos_token_id)]
    if guidance is not None:
        processors.insert(0, DiaClassifierFreeGuidanceLogitsProcessor(guidance, guidance_top_k=6))

    def reference(stream):  # [L, K, C]: Dia's scores after each step of the stream (begin step included)
        grid = target.model_ids(torch.cat([torch.full((K,), target.pad_id), stream]).view(-1, K))[None]
        text_ids = ids if guidance is None else torch.cat([ids, torch.zeros_like(ids)])
        with torch.no_grad():
            logits = model(input_ids=text_ids, decoder_input_ids=grid.expand(text_ids.shape[0], -1, -1)).logits
        scores = []
        for step in range(grid.shape[1]):
            row = logits[:, step].float()  # [B * K, V]
            for processor in processors:
                row = processor(grid[0, : step + 1].T, row.clone())
            scores.append(row.view(K, -1)[:, : target.codebook_size])
        return torch.stack(scores)

    def check(logits, stream, state, first):
        expected = reference(stream)
        for j, i in enumerate(range(first, stream.shape[0])):
            step, codebook = divmod(i + K, K)
            own = slice(codebook * target.codebook_size, (codebook + 1) * target.codebook_size)
            if state.cache.position(i + K) == "free":
                assert torch.allclose(logits[j, own], expected[step - 1, codebook], atol=1e-5)
            else:
                assert torch.isinf(logits[j]).sum() == target.vocab_size - 1

    gen = torch.Generator().manual_seed(0)
    stream = target.stream_ids(torch.randint(0, CODES, (K, frames), generator=gen))
    state, first = target.prefill({"num_frames": frames, "input_ids": ids, **extra})
    state.tokens = torch.cat([state.tokens, stream[None, :1]], dim=1)
    out = target.forward(state, stream[None, :-1])
    check(torch.cat([first.logits, out.logits], dim=1)[0], stream, state, 0)
    keep = 2 * K + 1  # roll back to sub-token 1 of step 2 and continue differently
    state.tokens = torch.cat([state.tokens[:, :K], stream[None]], dim=1)
    state.rollback(keep + 1)
    changed = target.stream_ids(torch.randint(0, CODES, (K, frames), generator=gen))
    changed[: keep - K + 1] = stream[: keep - K + 1]
    out = target.forward(state, changed[None, keep - K : -1])
    check(out.logits[0], changed, state, keep - K + 1)


def test_bad_inputs(model):
    target = DelayPatternTarget(model)
    with pytest.raises(ValueError, match="Dia needs input_ids"):
        mmspec.generate(target, max_new_tokens=6)
    with pytest.raises(ValueError, match="guidance_scale must be a number > 1"):
        mmspec.generate(target, max_new_tokens=6, input_ids=text(0), guidance_scale=0.5)
    with pytest.raises(ValueError, match="token trees are not supported"):
        mmspec.generate(target, drafter=ProactiveJacobiDrafter(4, branches=2, depth=1), max_new_tokens=6,
                        input_ids=text(0))
    with pytest.raises(ValueError, match="channel 0 .* must not be delayed"):
        DelayPatternTarget(tiny_dia(0, delays=(1, 2, 3)))


# ---- sampling: the joint distribution of the frames ------------------------------------------------
SMALL_DELAYS, SMALL_CODES, FRAMES, RUNS, CONTROL_RUNS = (0, 2), 2, 2, 1200, 200
TEMPERATURE = 1.3


@pytest.fixture(scope="module")
def small():
    return DelayPatternTarget(tiny_dia(7, codes=SMALL_CODES, delays=SMALL_DELAYS, scale=2.0))


def exact_joint(target, ids):
    """Exact probability of every audio code grid [K, F], F <= FRAMES (the model's EOS or the
    limit ends it), at TEMPERATURE."""
    config = SamplingConfig(do_sample=True, temperature=TEMPERATURE)
    joint = {}
    with torch.no_grad():
        for frames in range(FRAMES + 1):
            for codes in itertools.product(range(SMALL_CODES), repeat=len(SMALL_DELAYS) * frames):
                grid = torch.tensor(codes, dtype=torch.long).view(len(SMALL_DELAYS), frames)
                stream = target.stream_ids(grid)
                state, first = target.prefill({"num_frames": FRAMES, "input_ids": ids})
                rest = target.forward(state, stream[None, :-1])
                probs = logits_to_probs(torch.cat([first.logits, rest.logits], dim=1)[0], config)
                joint[(frames, *codes)] = float(probs[torch.arange(stream.shape[0]), stream].prod())
    return joint


def sampled_counts(target, ids, seeds, drafter=None, counts=None):
    """Frames sampled with each of ``seeds`` (an int n: seeds 0 .. n - 1) -> (counts: code grid
    (F, *codes) -> times drawn, added into ``counts`` where given; drafts accepted)."""
    counts, accepted = {} if counts is None else counts, 0
    for seed in range(seeds) if isinstance(seeds, int) else seeds:
        out = mmspec.generate(target, drafter=drafter, max_new_tokens=target.stream_length(FRAMES) + 1,
                              num_frames=FRAMES, input_ids=ids, do_sample=True, temperature=TEMPERATURE, seed=seed,
                              num_draft_tokens=4)
        accepted += out.stats.accepted
        codes = target.codes(out.sequences[0, target.num_codebooks :])
        key = (codes.shape[1], *codes.flatten().tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts, accepted


def test_sampled_frames_follow_the_target_joint(small):
    ids = text(0)
    joint = exact_joint(small, ids)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-4)
    lengths = [sum(p for g, p in joint.items() if g[0] == frames) for frames in range(FRAMES + 1)]
    assert sum(mass > 0.1 for mass in lengths) >= 2  # the model's EOS and the length limit both end audios
    counts, accepted = {}, []
    runs, found = two_stage(RUNS, lambda seed: accepted.append(sampled_counts(small, ids, [seed], "sjd", counts)[1]),
                            lambda n: [joint_pvalue(counts, joint, n)])
    assert sum(accepted) > 200 * runs / RUNS  # drafts were accepted: the acceptance path ran
    assert min(found) > 1e-4
    # negative control: frames sampled from another model do not pass against the target's joint
    other = DelayPatternTarget(tiny_dia(10, codes=SMALL_CODES, delays=SMALL_DELAYS, layers=1, scale=2.0))
    other_counts, _ = sampled_counts(other, ids, CONTROL_RUNS)
    assert joint_pvalue(other_counts, joint, CONTROL_RUNS) < 1e-4
