"""Audio codec adapters (mmspec.adapters.audio.codec) on tiny random EnCodec / DAC / Mimi models built
from configs here (8 kHz, a few codebooks of 16 codes; nothing is downloaded).

Every family, through one table of cases: frames and code layout against the transformers model's
own encode / decode, the exact frame count (and its agreement with frame_rate), codes in range,
decode shape / channels / dtype, round trips, codebook embeddings against the quantizer's own
dequantisation (the latent is the sum of the codes' rows), resampling and channel mixing against
doing it by hand, loading a saved checkpoint, and the one-line errors. Then the WAV and log-mel
helpers, and EnCodec's chunk scales."""

from __future__ import annotations

import math
import wave
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torchaudio
from transformers import DacConfig, DacModel, EncodecConfig, EncodecModel, MimiConfig, MimiModel

from mmspec.adapters.audio import (
    CODECS,
    Codec,
    DacCodec,
    EncodecCodec,
    MimiCodec,
    codec_for,
    load_codec,
    log_mel,
    pcm16,
    read_wav,
    register_codec,
    wav_header,
    write_wav,
)
from mmspec.core.relaxed import neighbour_table

RATE = 8000
SIZE = 16  # codes per codebook
WIDTH = 16  # latent width of every tiny model


def tiny_encodec(seed: int = 0, **overrides) -> EncodecModel:
    """Hop 16 (500 frames/s); 2 kbps per codebook, so bandwidths 2 / 4 / 8 kbps = 1 / 2 / 4 codebooks."""
    config = EncodecConfig(sampling_rate=RATE, target_bandwidths=[2.0, 4.0, 8.0], hidden_size=WIDTH, num_filters=4,
                           upsampling_ratios=[4, 4], num_lstm_layers=1, codebook_size=SIZE, **overrides)
    torch.manual_seed(seed)
    model = EncodecModel(config).eval()
    with torch.no_grad():  # transformers initialises the codebooks to zeros: every code would be 0
        audio = speech_like(config.audio_channels, 2000, seed=seed + 100)
        if config.normalize:
            audio = audio / audio.mean(0).pow(2).mean().sqrt()
        fill_codebooks([layer.codebook.embed for layer in model.quantizer.layers], model.encoder(audio[None]))
    return model


def tiny_chunked_encodec(seed: int = 0) -> EncodecModel:
    """The 48 kHz model's layout: stereo, loudness-normalised, chunks of 2000 samples every 1800."""
    return tiny_encodec(seed, chunk_length_s=0.25, overlap=0.1, normalize=True, audio_channels=2)


def tiny_dac(seed: int = 0) -> DacModel:
    """Hop 8 (1000 frames/s), 3 codebooks."""
    config = DacConfig(encoder_hidden_size=4, downsampling_ratios=[2, 4], decoder_hidden_size=16, n_codebooks=3,
                       codebook_size=SIZE, codebook_dim=4, sampling_rate=RATE)
    torch.manual_seed(seed)
    return DacModel(config).eval()


def tiny_mimi(seed: int = 0) -> MimiModel:
    """Frame size 32 (250 frames/s), 1 semantic + 3 acoustic codebooks, a projected quantizer space."""
    config = MimiConfig(sampling_rate=RATE, hidden_size=WIDTH, num_filters=4, upsampling_ratios=[4, 4],
                        codebook_size=SIZE, codebook_dim=8, vector_quantization_hidden_dimension=8, num_quantizers=4,
                        num_semantic_quantizers=1, upsample_groups=WIDTH, num_hidden_layers=1, intermediate_size=32,
                        num_attention_heads=2, num_key_value_heads=2, sliding_window=64, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = MimiModel(config).eval()
    with torch.no_grad():  # zero-initialised codebooks, as EnCodec's
        latents = model.encoder(speech_like(1, 4000, seed=seed + 100)[None]).latents
        quantizer = model.quantizer
        for rvq in (quantizer.semantic_residual_vector_quantizer, quantizer.acoustic_residual_vector_quantizer):
            fill_codebooks([layer.codebook.embed_sum for layer in rvq.layers], rvq.input_proj(latents))
            for layer in rvq.layers:  # cluster_usage is 1: embed = embed_sum
                layer.codebook._embed = None
    return model


def fill_codebooks(codebooks: list[torch.Tensor], latents: torch.Tensor) -> None:
    """Residual codebooks [SIZE, D] (in place) from the frames of latents [1, D, T]: each stage's rows
    are random frames of what the earlier stages leave, so the codes vary as a trained codec's do."""
    residual = latents[0].T.clone()  # [T, D]
    g = torch.Generator().manual_seed(0)
    for codebook in codebooks:
        rows = residual[torch.randperm(residual.shape[0], generator=g)[:SIZE]]
        codebook.copy_(rows)
        residual -= rows[torch.cdist(residual, rows).argmin(1)]


@dataclass
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    kwargs: dict
    codec_class: type
    num_codebooks: int
    channels: int
    frame_rate: float
    frame_tolerance: float  # |frames - frame_rate * duration| allowed besides rounding (chunked: the overlap)
    latent: Callable  # (model, codes [K, F]) -> the quantizer's own dequantised latent [D, F]
    model_encode: Callable | None  # (model, audio [C, S]) -> codes [K, F], for unchunked models
    model_decode: Callable | None  # (model, codes [K, F]) -> audio [C, S]


CASES = [
    Case("encodec", tiny_encodec, {}, EncodecCodec, 4, 1, 500.0, 1.0,
         lambda m, c: m.quantizer.decode(c[:, None])[0],
         lambda m, a: m.encode(a[None], bandwidth=8.0).audio_codes[0, 0],
         lambda m, c: m.decode(c[None, None], [None]).audio_values[0]),
    Case("encodec-chunked", tiny_chunked_encodec, {}, EncodecCodec, 4, 2, 125 * RATE / 1800, 13,
         lambda m, c: m.quantizer.decode(c[:, None])[0], None, None),
    Case("encodec-2kbps", tiny_encodec, {"bandwidth": 2.0}, EncodecCodec, 1, 1, 500.0, 1.0,
         lambda m, c: m.quantizer.decode(c[:, None])[0],
         lambda m, a: m.encode(a[None], bandwidth=2.0).audio_codes[0, 0],
         lambda m, c: m.decode(c[None, None], [None]).audio_values[0]),
    Case("dac", tiny_dac, {}, DacCodec, 3, 1, 1000.0, 1.0,
         lambda m, c: m.quantizer.from_codes(c[None])[0][0],
         lambda m, a: m.encode(a[None]).audio_codes[0],
         lambda m, c: m.decode(audio_codes=c[None]).audio_values),
    Case("mimi", tiny_mimi, {"num_quantizers": 3}, MimiCodec, 3, 1, 250.0, 1.0,
         lambda m, c: m.quantizer.decode(c[None])[0],
         lambda m, a: m.encode(a[None], num_quantizers=3).audio_codes[0],
         lambda m, c: m.decode(c[None]).audio_values[0]),
]


@pytest.fixture(scope="module", params=CASES, ids=[case.name for case in CASES])
def case(request):
    model = request.param.build()
    return request.param, model, codec_for(model, **request.param.kwargs)


def speech_like(channels: int, samples: int, seed: int = 0) -> torch.Tensor:
    """Harmonics under a slow envelope plus a little noise, in [-1, 1]: [channels, samples]."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(samples) / RATE
    tone = sum(torch.sin(2 * math.pi * f * t + float(torch.rand(1, generator=g)) * 6) / (i + 1)
               for i, f in enumerate((180.0, 360.0, 540.0, 1100.0)))
    wave = 0.3 * tone * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t)) + 0.02 * torch.randn(samples, generator=g)
    return torch.stack([wave * (1.0 - 0.2 * c) for c in range(channels)]).clamp(-1, 1)


def test_registry_has_every_family():
    assert {"encodec", "dac", "mimi"} <= set(CODECS)
    classes = [CODECS[name].model_class for name in ("encodec", "dac", "mimi")]
    assert classes == ["EncodecModel", "DacModel", "MimiModel"]
    with pytest.raises(ValueError, match="already registered"):
        register_codec(type("Again", (EncodecCodec,), {"name": "encodec"}))


def test_properties(case):
    spec, model, codec = case
    assert isinstance(codec, spec.codec_class) and isinstance(codec, Codec)
    assert (codec.sampling_rate, codec.channels, codec.num_codebooks, codec.codebook_size) == (
        RATE, spec.channels, spec.num_codebooks, SIZE)
    assert isinstance(codec.frame_rate, float) and codec.frame_rate == pytest.approx(spec.frame_rate)
    assert not model.training


@pytest.mark.parametrize("samples", [RATE, RATE // 2 + 3, 2 * 1800 + 50, 5])
def test_encode_frames_and_range(case, samples):
    spec, model, codec = case
    codes = codec.encode(speech_like(spec.channels, samples), RATE)
    assert codes.dtype == torch.long and codes.shape == (spec.num_codebooks, codec.num_frames(samples))
    assert abs(codes.shape[1] - codec.frame_rate * samples / RATE) <= spec.frame_tolerance + 1
    assert int(codes.min()) >= 0 and int(codes.max()) < SIZE
    if samples > 100:
        assert codes[0].unique().numel() > 1, "degenerate fixture: every frame got the same code"
    codes[0, 0] = 0  # an ordinary tensor, not an inference tensor


def test_encode_matches_the_model(case):
    spec, model, codec = case
    audio = speech_like(spec.channels, RATE)  # whole frames: no padding in any family
    codes = codec.encode(audio, RATE)
    if spec.model_encode is not None:
        with torch.no_grad():
            assert torch.equal(codes, spec.model_encode(model, audio))
    else:  # chunked: the model's chunks, concatenated, the last one without its padding
        with torch.no_grad():
            out = model.encode(audio[None], bandwidth=8.0)
        chunks = out.audio_codes[:, 0]
        last = chunks.shape[-1] - out.last_frame_pad_length
        assert chunks.shape[0] == 5 and codes.shape[1] == 4 * chunks.shape[-1] + last
        assert torch.equal(codes[:, : chunks.shape[-1]], chunks[0])
        assert torch.equal(codes[:, -last:], chunks[-1, :, :last])


def test_decode_shape_and_model_agreement(case):
    spec, model, codec = case
    frames = 40 if spec.name != "encodec-chunked" else 130  # two chunks: 125 + 5 frames
    codes = torch.randint(0, SIZE, (spec.num_codebooks, frames), generator=torch.Generator().manual_seed(3))
    audio = codec.decode(codes)
    assert audio.dtype == torch.float32 and audio.dim() == 2 and audio.shape[0] == spec.channels
    assert torch.isfinite(audio).all() and audio.abs().sum() > 0
    if spec.model_decode is not None:
        assert audio.shape[1] == frames * RATE / spec.frame_rate
        with torch.no_grad():
            assert torch.allclose(audio, spec.model_decode(model, codes), atol=1e-6)
    else:  # chunk 0 then chunk 1 starting chunk_stride samples later
        assert audio.shape[1] == 1800 + 5 * 16


def test_round_trip(case):
    spec, model, codec = case
    samples = RATE // 2 + 3
    audio = codec.decode(codec.encode(speech_like(spec.channels, samples), RATE))
    assert audio.shape[0] == spec.channels
    assert samples <= audio.shape[1] < samples + 2 * RATE / codec.frame_rate
    again = codec.encode(audio, codec.sampling_rate)  # decoded audio encodes again
    assert again.shape[0] == spec.num_codebooks


def test_codebook_embeddings_sum_to_the_quantizer_latent(case):
    spec, model, codec = case
    table = codec.codebook_embeddings()
    assert table.dtype == torch.float32 and table.shape == (spec.num_codebooks, SIZE, WIDTH)
    codes = codec.encode(speech_like(spec.channels, 800), RATE)
    summed = sum(table[k, codes[k]] for k in range(spec.num_codebooks)).T  # [D, F]
    with torch.no_grad():
        assert torch.allclose(summed, spec.latent(model, codes), atol=1e-5)
        # the quantizer's dequantisation of codebook 0 alone, code c at frame c, is its row c
        assert torch.allclose(spec.latent(model, torch.arange(SIZE)[None]).T, table[0], atol=1e-6)
    # rows differ (a table of identical rows would make every neighbour table meaningless)
    assert torch.cdist(table[0], table[0]).fill_diagonal_(1).min() > 0
    for k in range(spec.num_codebooks):
        neighbours = neighbour_table(table[k], 3)
        assert neighbours.shape == (SIZE, 3) and not (neighbours == torch.arange(SIZE)[:, None]).any()


def test_resampling(case):
    spec, model, codec = case
    audio = speech_like(spec.channels, RATE)
    at_16k = torchaudio.functional.resample(audio, RATE, 2 * RATE)
    codes = codec.encode(at_16k, 2 * RATE)
    assert torch.equal(codes, codec.encode(torchaudio.functional.resample(at_16k, 2 * RATE, RATE), RATE))
    assert codes.shape[1] == codec.num_frames(RATE)  # one second at either rate
    assert codec.encode(at_16k, RATE).shape[1] == codec.num_frames(2 * RATE)  # the wrong rate: twice as long


def test_channel_mixing(case):
    spec, model, codec = case
    stereo = speech_like(2, 1600)
    if spec.channels == 1:
        assert torch.equal(codec.encode(stereo, RATE), codec.encode(stereo.mean(0), RATE))
        assert torch.equal(codec.encode(stereo[0], RATE), codec.encode(stereo[:1], RATE))
    else:
        assert torch.equal(codec.encode(stereo[0], RATE), codec.encode(stereo[:1].expand(2, -1), RATE))
        assert not torch.equal(codec.encode(stereo, RATE), codec.encode(stereo[:1].expand(2, -1), RATE))


def test_load_codec_from_a_saved_checkpoint(case, tmp_path):
    spec, model, codec = case
    model.save_pretrained(tmp_path)
    loaded = load_codec(tmp_path, **spec.kwargs)
    assert type(loaded) is type(codec) and not loaded.model.training
    audio = speech_like(spec.channels, 1600)
    assert torch.equal(loaded.encode(audio, RATE), codec.encode(audio, RATE))


def test_a_checkpoint_of_another_kind_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    import transformers

    transformers.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=1).save_pretrained(tmp_path)  # (a config alone: no weights to load)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="is a 'llama' model, not a supported audio codec; supported: EncodecModel"):
        load_codec(tmp_path)


def test_wav_round_trip_through_the_codec(case, tmp_path):
    spec, model, codec = case
    audio = speech_like(spec.channels, 1600)
    write_wav(tmp_path / "in.wav", audio, RATE, subtype="FLOAT")
    read, rate = read_wav(tmp_path / "in.wav")
    assert rate == RATE and torch.equal(read, audio)
    assert torch.equal(codec.encode(read, rate), codec.encode(audio, RATE))
    decoded = codec.decode(codec.encode(read, rate))
    write_wav(tmp_path / "nested" / "out.wav", decoded, codec.sampling_rate)
    back, rate = read_wav(tmp_path / "nested" / "out.wav")
    assert rate == codec.sampling_rate and back.shape == decoded.shape
    assert torch.allclose(back, decoded.clamp(-1, 1), atol=1 / 32768 + 1e-6)


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


@pytest.mark.parametrize("bad, expected", [
    (torch.zeros(0), "empty"),
    (torch.zeros(1, 0), "empty"),
    (torch.tensor([0.1, float("nan"), 0.2]), "NaN"),
    (torch.tensor([[0.1, float("inf")]]), "NaN or infinite"),
    (torch.zeros(1, 1, 100), r"\[channels, samples\]"),
    (torch.zeros(100, dtype=torch.int16), "float"),
])
def test_encode_refuses_bad_waveforms(case, bad, expected):
    codec = case[2]
    with pytest.raises(ValueError, match=expected) as excinfo:
        codec.encode(bad, RATE)
    one_line(excinfo)


@pytest.mark.parametrize("rate", [0, -8000, 8000.0, None])
def test_encode_refuses_bad_rates(case, rate):
    with pytest.raises(ValueError, match="sampling_rate") as excinfo:
        case[2].encode(torch.zeros(100), rate)
    one_line(excinfo)


def test_decode_refuses_bad_codes(case):
    spec, model, codec = case
    k = spec.num_codebooks
    good = torch.zeros(k, 4, dtype=torch.long)
    for bad, expected in [
        (good + SIZE, rf"\[0, {SIZE}\), got values from {SIZE} to {SIZE}"),
        (good - 1, "got values from -1"),
        (torch.zeros(k + 1, 4, dtype=torch.long), f"{k + 1} codebooks but this codec decodes {k}"),
        (good[0], r"\[codebooks, frames\]"),
        (good[None], r"\[codebooks, frames\]"),
        (good.float(), "integer"),
        (good[:, :0], "no frames"),
    ]:
        with pytest.raises(ValueError, match=expected) as excinfo:
            codec.decode(bad)
        one_line(excinfo)
    if k > 1:
        with pytest.raises(ValueError, match="codebooks") as excinfo:
            codec.decode(good[:1])
        one_line(excinfo)


def test_unsupported_model():
    with pytest.raises(ValueError, match="Linear is not a supported audio codec") as excinfo:
        codec_for(torch.nn.Linear(2, 2))
    message = one_line(excinfo)
    assert all(name in message for name in ("EncodecModel", "DacModel", "MimiModel"))


def test_bad_constructor_choices():
    for build, kwargs, expected in [
        (tiny_encodec, {"bandwidth": 3.0}, r"bandwidth 3.0 is not one of .*\[2.0, 4.0, 8.0\]"),
        (tiny_dac, {"num_quantizers": 4}, r"num_quantizers must be in 1..3"),
        (tiny_mimi, {"num_quantizers": 0}, r"num_quantizers must be in 1..4"),
        (tiny_mimi, {"num_quantizers": 5}, r"num_quantizers must be in 1..4"),
    ]:
        with pytest.raises(ValueError, match=expected) as excinfo:
            codec_for(build(), **kwargs)
        one_line(excinfo)


def test_codec_puts_a_training_model_in_eval_mode():
    model = tiny_dac().train()
    codec = codec_for(model)
    assert not model.training
    audio = speech_like(1, 800)
    assert torch.equal(codec.encode(audio, RATE), codec.encode(audio, RATE))  # no quantizer dropout


# ---- EnCodec's scales ------------------------------------------------------------------------------


def test_encodec_chunk_scales_restore_the_models_own_round_trip():
    model = tiny_chunked_encodec()
    codec = codec_for(model)
    audio = speech_like(2, RATE)
    codes, scales = codec.encode_with_scales(audio, RATE)
    assert torch.equal(codes, codec.encode(audio, RATE))
    assert scales.shape == (5,) and (scales > 0).all()
    with torch.no_grad():
        out = model.encode(audio[None], bandwidth=8.0)
        reference = model.decode(out.audio_codes, out.audio_scales, last_frame_pad_length=out.last_frame_pad_length)
    assert torch.allclose(codec.decode(codes, scales), reference.audio_values[0], atol=1e-5)
    # without scales every chunk is decoded at decode_scale
    assert torch.allclose(codec.decode(codes), codec.decode(codes, torch.full((5,), codec.decode_scale)), atol=1e-6)
    louder = codec_for(model, decode_scale=0.2).decode(codes)
    assert torch.allclose(louder, 2 * codec.decode(codes), atol=1e-5)
    with pytest.raises(ValueError, match="5 positive finite values") as excinfo:
        codec.decode(codes, scales[:4])
    one_line(excinfo)


def test_unnormalised_encodec_has_no_scales():
    codec = codec_for(tiny_encodec())
    codes, scales = codec.encode_with_scales(speech_like(1, 800), RATE)
    assert scales is None
    with pytest.raises(ValueError, match="scales=None") as excinfo:
        codec.decode(codes, torch.ones(1))
    one_line(excinfo)


# ---- WAV and mel helpers ---------------------------------------------------------------------------


def test_wav_pcm16_round_trip_and_clipping(tmp_path):
    stereo = speech_like(2, 1000)
    stereo[0, 10] = 1.7  # clipped on writing
    write_wav(tmp_path / "a.wav", stereo, 22050)
    read, rate = read_wav(tmp_path / "a.wav")
    assert rate == 22050 and read.dtype == torch.float32 and read.shape == (2, 1000)
    assert torch.allclose(read, stereo.clamp(-1, 1), atol=1 / 32768 + 1e-6)
    assert read[0, 10] == pytest.approx(1.0, abs=1e-4)
    write_wav(tmp_path / "mono.wav", stereo[1], 16000)
    mono, rate = read_wav(tmp_path / "mono.wav")
    assert rate == 16000 and mono.shape == (1, 1000)
    with pytest.raises(FileNotFoundError, match="no audio file at .*missing.wav"):  # (libsndfile: "System error")
        read_wav(tmp_path / "missing.wav")


def test_pcm16_bytes_are_the_wav_files_samples(tmp_path):
    # a stream or a server's answer holds the samples the written file holds, bit for bit
    mono = speech_like(1, 4000) * 1.3  # some samples past full scale, clipped alike
    write_wav(tmp_path / "m.wav", mono, 22050)
    with wave.open(str(tmp_path / "m.wav")) as wav:
        written = wav.readframes(wav.getnframes())
    assert pcm16(mono) == written and pcm16(mono[0]) == written
    # stereo: the channels interleaved frame by frame, as the file holds them (it was left then right:
    # `tts --out -` of a stereo codec played twice as long), and the CLI's header for a stream says 2
    stereo = speech_like(2, 4000)
    write_wav(tmp_path / "s.wav", stereo, 22050)
    data = (tmp_path / "s.wav").read_bytes()
    with wave.open(str(tmp_path / "s.wav")) as wav:
        assert wav.getnchannels() == 2 and pcm16(stereo) == wav.readframes(wav.getnframes())
    assert wav_header(22050, len(pcm16(stereo)), channels=2) + pcm16(stereo) == data


def test_write_wav_refuses_bad_input(tmp_path):
    for bad, rate, expected in [(torch.zeros(0), RATE, "non-empty"), (torch.zeros(1, 1, 5), RATE, "non-empty"),
                                (torch.tensor([0.0, float("nan")]), RATE, "NaN"), (torch.zeros(5), 0, "rate")]:
        with pytest.raises(ValueError, match=expected) as excinfo:
            write_wav(tmp_path / "x.wav", bad, rate)
        one_line(excinfo)
    for name in ("x.mp3", "x.FLAC", "x.ogg"):  # (WAV data under those names was written silently)
        with pytest.raises(ValueError, match=r"write_wav writes WAV files; name the file .wav, not \.(mp3|flac|ogg)"):
            write_wav(tmp_path / name, torch.zeros(5), RATE)
    assert not list(tmp_path.iterdir())
    write_wav(tmp_path / "y.WAV", torch.zeros(5), np.int64(RATE))  # (a numpy rate: was refused)
    assert read_wav(tmp_path / "y.WAV")[1] == RATE


@pytest.mark.parametrize("samples", [1, 256, 512, 513])
def test_log_mel_of_a_clip_shorter_than_half_a_window(samples):
    """Issue 44: a 512-sample clip (one codec frame) crashed the centred STFT's reflection padding;
    a clip of at most n_fft / 2 samples is zero-padded first and keeps samples // hop + 1 frames."""
    clip = 0.5 * torch.sin(torch.arange(samples) * 0.3)
    mel = log_mel(clip, 22050)
    assert mel.shape == (80, samples // 256 + 1) and torch.isfinite(mel).all()
    if samples > 512:  # long enough: the transform as it always was
        assert torch.equal(mel, torchaudio.transforms.MelSpectrogram(
            sample_rate=22050, n_fft=1024, hop_length=256, n_mels=80, power=1.0, norm="slaney",
            mel_scale="slaney")(clip).clamp_min(1e-5).log())
    assert log_mel(torch.stack([clip, clip]), 22050).shape == (2, 80, samples // 256 + 1)


def test_log_mel_shapes_and_the_peak_of_a_tone():
    rate, samples = 16000, 16000
    tone = 0.5 * torch.sin(2 * math.pi * 1000.0 * torch.arange(samples) / rate)
    mel = log_mel(tone, rate)
    assert mel.shape == (80, samples // 256 + 1) and torch.isfinite(mel).all()
    # the loudest band is the one whose centre is nearest 1 kHz (Slaney mel scale)
    centres = torchaudio.functional.melscale_fbanks(513, 0.0, rate / 2, 80, rate, norm="slaney",
                                                    mel_scale="slaney").argmax(0) * rate / 1024
    assert abs(float(centres[mel.mean(1).argmax()]) - 1000.0) < 100
    assert mel.min() >= math.log(1e-5) - 1e-6
    stereo = log_mel(torch.stack([tone, 0.1 * tone]), rate, n_mels=40)
    assert stereo.shape == (2, 40, samples // 256 + 1)
    loud = stereo[1] > math.log(1e-5) + 1  # bands above the floor: the log of a 10x quieter copy is log(10) lower
    assert loud.sum() > 100
    assert torch.allclose((stereo[0] - stereo[1])[loud], torch.tensor(math.log(10.0)), atol=1e-3)


def test_a_codec_the_hub_cannot_give_is_one_line(tmp_path):
    """A hub id not in the cache (the tests run with HF_HUB_OFFLINE=1) or a missing local folder: one
    line naming it, not transformers' paragraph."""
    with pytest.raises(FileNotFoundError, match=r"^cannot load the codec 'mmspec-test/no-such-codec': [^\n]*$"):
        load_codec("mmspec-test/no-such-codec")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_codec(tmp_path / "missing" / "codec")
