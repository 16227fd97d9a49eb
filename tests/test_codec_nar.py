"""The NAR stage of a VALL-E-style voice (:class:`CodecNAR`): bidirectional over frames, padding
masked out, ``complete`` keeps codebook 0 and takes the argmax of the rest, and it learns one
utterance's fine codebooks; ``first_codebooks`` slices a delay-pattern voice into an AR stage."""

import pytest
import torch

from mmspec.modeling.codec_lm import CodecLM, CodecLMConfig, frame_alignment
from mmspec.modeling.codec_nar import CodecNAR, CodecNARConfig
from mmspec.train.tts import first_codebooks

K, CODES, VOCAB = 4, 16, 12


def tiny_nar(seed=0, **depth):
    torch.manual_seed(seed)
    return CodecNAR(CodecNARConfig(text_vocab=VOCAB, num_codebooks=K, codebook_size=CODES, dim=32, layers=2, heads=2, ffn=64,
                                   max_positions=64, **depth)).eval()


def depth_nar(seed=0):
    """A depth head whose zero-started parts are drawn at random, so that every path carries signal."""
    nar = tiny_nar(seed, depth_layers=2, depth_ffn=48)
    with torch.no_grad():
        for name, p in nar.named_parameters():
            if name.startswith(("codebook_inputs", "fine_embeddings", "depth_blocks")) and not p.any():
                p.normal_(0, 0.5)
    return nar


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


@pytest.mark.parametrize("make", [tiny_nar, depth_nar])
def test_inference_on_a_cpu_gives_the_modules_logits(make):
    """Without gradients on a CPU the stage runs its encoder layers and depth blocks as oneDNN calls
    with the GELU and residual sums fused: the modules' logits (float32), with and without padding."""
    nar = make()
    codes, phonemes, durations = utterance(frames=12)
    padded = torch.cat([codes[0], torch.zeros(4, dtype=torch.long)])[None]
    alignment = alignment_of(phonemes, durations, 16)
    mask = torch.tensor([[True] * 12 + [False] * 4])
    for m in (None, mask):
        reference = nar(padded, alignment, m)  # (gradients on: the modules' own forward)
        with torch.no_grad():
            fused = nar(padded, alignment, m)
        assert reference.requires_grad  # (the module path: gradients wanted)
        rows = slice(None) if m is None else slice(0, 12)
        torch.testing.assert_close(fused[:, rows], reference.detach()[:, rows], atol=1e-5, rtol=1e-4)


def test_a_depth_head_added_to_a_one_pass_stage_starts_as_that_stage():
    from dataclasses import replace

    from mmspec.train.tts_nar import with_depth_head

    one_pass = tiny_nar()
    deep = with_depth_head(one_pass, replace(one_pass.config, depth_layers=2, depth_ffn=48)).eval()
    codes, phonemes, durations = utterance()
    alignment = alignment_of(phonemes, durations, 10)
    base = one_pass(codes[None, 0], alignment)
    torch.testing.assert_close(deep(codes[None, 0], alignment), base)  # its own argmax codes
    torch.testing.assert_close(deep(codes[None, 0], alignment, fine=codes[None, 1:].transpose(1, 2)), base)  # teacher forced


def test_with_a_depth_head_codebook_k_reads_codebooks_1_to_k_minus_1_only():
    nar = depth_nar()
    codes, phonemes, durations = utterance()
    alignment = alignment_of(phonemes, durations, 10)
    fine = codes[None, 1:].transpose(1, 2)  # [1, F, K-1]
    base = nar(codes[None, 0], alignment, fine=fine)
    for j in range(K - 1):
        changed_fine = fine.clone()
        changed_fine[0, 3, j] = (changed_fine[0, 3, j] + 1) % CODES
        changed = nar(codes[None, 0], alignment, fine=changed_fine)
        torch.testing.assert_close(changed[:, :, : j + 1], base[:, :, : j + 1])  # codebooks 1 .. j+1: untouched
        torch.testing.assert_close(changed[:, torch.arange(10) != 3], base[:, torch.arange(10) != 3])  # other frames too
        if j < K - 2:
            assert not torch.allclose(changed[0, 3, j + 1], base[0, 3, j + 1])
    # generation feeds each codebook's argmax to the next: the same logits as teacher forcing on those codes
    full = nar.complete(codes[0], phonemes, durations)
    generated = nar(codes[None, 0], alignment)
    assert torch.equal(full[1:], generated[0].argmax(-1).T)
    torch.testing.assert_close(nar(codes[None, 0], alignment, fine=full[None, 1:].transpose(1, 2)), generated)


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


def test_a_depth_head_learns_an_utterances_fine_codebooks_and_saves(tmp_path):
    nar = tiny_nar(depth_layers=1, depth_ffn=48).train()
    codes, phonemes, durations = utterance(frames=12)
    alignment = alignment_of(phonemes, durations, 12)
    optimizer = torch.optim.Adam(nar.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        losses.append(nar.loss(codes[None], alignment, torch.ones(1, 12, dtype=torch.bool)))
        optimizer.zero_grad()
        losses[-1].backward()
        optimizer.step()
    assert losses[-1].item() < 0.1 * losses[0].item()
    assert torch.equal(nar.eval().complete(codes[0], phonemes, durations), codes)
    nar.save(tmp_path / "nar")
    again = CodecNAR.from_pretrained(tmp_path / "nar")
    assert again.config.depth_layers == 1 and torch.equal(again.complete(codes[0], phonemes, durations), codes)


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
