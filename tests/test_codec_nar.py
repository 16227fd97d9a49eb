"""The NAR stage of a VALL-E-style voice (:class:`CodecNAR`): bidirectional over frames, padding
masked out, ``complete`` keeps codebook 0 and takes the argmax of the rest, and it learns one
utterance's fine codebooks; ``first_codebooks`` slices a delay-pattern voice into an AR stage."""

import torch

from mmspec.modeling.codec_lm import CodecLM, CodecLMConfig, frame_alignment
from mmspec.modeling.codec_nar import CodecNAR, CodecNARConfig
from mmspec.train.tts import first_codebooks

K, CODES, VOCAB = 4, 16, 12


def tiny_nar(seed=0):
    torch.manual_seed(seed)
    return CodecNAR(CodecNARConfig(text_vocab=VOCAB, num_codebooks=K, codebook_size=CODES, dim=32, layers=2, heads=2, ffn=64,
                                   max_positions=64)).eval()


def utterance(seed=0, frames=10):
    gen = torch.Generator().manual_seed(seed)
    phonemes = torch.randint(0, VOCAB, (4,), generator=gen)
    durations = torch.tensor([2, 3, 1, frames - 6])
    return torch.randint(0, CODES, (K, frames), generator=gen), phonemes, durations


def alignment_of(phonemes, durations, frames):
    return frame_alignment(phonemes, durations, torch.arange(frames), VOCAB)[None]


def test_every_frame_sees_the_whole_of_codebook_0_but_not_the_padding():
    nar = tiny_nar()
    codes, phonemes, durations = utterance()
    alignment = alignment_of(phonemes, durations, 10)
    base = nar(codes[None, 0], alignment)
    assert base.shape == (1, 10, K - 1, CODES)
    later = codes[0].clone()
    later[9] = (later[9] + 1) % CODES
    changed = nar(later[None], alignment)
    assert not torch.allclose(changed[0, 0], base[0, 0])  # a later frame's code reaches the first frame: not causal
    padded = torch.cat([codes[0], torch.zeros(3, dtype=torch.long)])[None]
    mask = torch.tensor([[True] * 10 + [False] * 3])
    torch.testing.assert_close(nar(padded, alignment_of(phonemes, durations, 13), mask)[:, :10], base, atol=1e-5, rtol=1e-4)


def test_complete_keeps_codebook_0_and_takes_the_argmax():
    nar = tiny_nar()
    codes, phonemes, durations = utterance()
    full = nar.complete(codes[0], phonemes, durations)
    assert full.shape == (K, 10) and torch.equal(full[0], codes[0])
    expected = nar(codes[None, 0], alignment_of(phonemes, durations, 10))[0].argmax(-1).T
    assert torch.equal(full[1:], expected)
    assert nar.complete(codes[0, :0], phonemes, durations).shape == (K, 0)


def test_it_learns_an_utterances_fine_codebooks():
    nar = tiny_nar().train()
    codes, phonemes, durations = utterance(frames=12)
    alignment = alignment_of(phonemes, durations, 12)
    optimizer = torch.optim.Adam(nar.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = nar.loss(codes[None], alignment, torch.ones(1, 12, dtype=torch.bool))
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1 * first
    assert torch.equal(nar.eval().complete(codes[0], phonemes, durations), codes)


def test_first_codebooks_slices_a_delay_pattern_voice_into_its_codebook_0_stage():
    torch.manual_seed(0)
    config = CodecLMConfig(text_vocab=VOCAB, num_codebooks=K, codebook_size=CODES, dim=32, layers=1, heads=2, ffn=64,
                           max_positions=64)
    voice = CodecLM(config).eval()
    stage = CodecLM(CodecLMConfig(**{**config.__dict__, "num_codebooks": 1})).eval()
    stage.load_state_dict(first_codebooks(voice.state_dict(), 1, CODES + 1))
    with torch.no_grad():
        for table in voice.code_embeddings[1:]:
            table.weight.zero_()  # then the voice reads codebook 0 alone, as the stage does
    steps = torch.randint(0, CODES, (1, 5, K))
    phonemes, mask = torch.randint(0, VOCAB, (1, 3)), torch.ones(1, 3, dtype=torch.long)
    step_mask = torch.ones(1, 5, dtype=torch.long)
    torch.testing.assert_close(stage.step_logits(phonemes, mask, steps[..., :1], step_mask)[:, :, 0],
                               voice.step_logits(phonemes, mask, steps, step_mask)[:, :, 0])
