"""``mmspec train tts`` on tiny synthetic speech shards (no Piper): the aligned codec LM trains with
its duration loss, starts from an unaligned model (--init), distils from a teacher
(--distil-from), and bad data or a mismatched teacher is one clear error; the frame durations."""

import json

import pytest
import torch

from mmspec.cli import main
from mmspec.modeling.codec_lm import CodecLM
from mmspec.modeling.heads import DraftHeads, EagleHead
from mmspec.modeling.mel_codec import MelCodecConfig, MelRVQCodec
from mmspec.train.tts import TEXT_VOCAB, frame_durations

RATE, K, CODES = 22050, 3, 8


def test_frame_durations_give_each_frame_to_the_phoneme_at_its_centre():
    samples = torch.tensor([256, 0, 768, 512, 1024])  # 10 frames of 256 samples in all; 512 per codec frame
    frames = frame_durations(samples, 5, 512)  # centres 128, 640, 1152, 1664, 2176
    assert frames.tolist() == [1, 0, 1, 1, 2] and int(frames.sum()) == 5
    assert frame_durations(samples, 7, 512).tolist() == [1, 0, 1, 1, 4]  # frames past the end: the last phoneme


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech")
    gen = torch.Generator().manual_seed(0)
    data, items = root / "data", {"texts": [], "phoneme_ids": [], "audio": [], "samples_per_phoneme": []}
    data.mkdir()
    for i in range(6):
        phonemes = torch.randint(0, 40, (7,), generator=gen)
        spent = torch.randint(1, 5, (7,), generator=gen) * 256
        items["texts"].append(f"sentence {i}")
        items["phoneme_ids"].append(phonemes)
        items["samples_per_phoneme"].append(spent)
        items["audio"].append((torch.randn(int(spent.sum()), generator=gen) * 3000).to(torch.int16))
    torch.save({**items, "sample_rate": RATE, "first_index": 0}, data / "train-00000.pt")
    old = root / "old"
    old.mkdir()
    torch.save({**{k: v for k, v in items.items() if k != "samples_per_phoneme"}, "sample_rate": RATE, "first_index": 0},
               old / "train-00000.pt")
    codec = MelRVQCodec(MelCodecConfig(num_codebooks=K, codebook_size=CODES, griffin_lim_iters=4))
    codec.codebooks.normal_(generator=gen)
    codec.save(root / "codec")
    return root


def train(root, out, *extra):
    return main(["train", "tts", "--data", str(root / "data"), "--codec", str(root / "codec"), "--out", str(out),
                 "--preset", "draft", "--steps", "3", "--batch-size", "2", "--warmup", "1", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def unaligned(shards):
    """An unaligned codec LM of the draft preset's shape."""
    from mmspec.modeling.codec_lm import CodecLMConfig
    from mmspec.train.tts import PRESETS

    torch.manual_seed(0)
    settings = {**PRESETS["draft"], "aligned": False}
    CodecLM(CodecLMConfig(text_vocab=TEXT_VOCAB, num_codebooks=K, codebook_size=CODES, **settings)).save(shards / "unaligned")
    return shards / "unaligned"


def test_training_an_aligned_codec_lm_from_an_unaligned_one_and_distilling(shards, unaligned):
    assert train(shards, shards / "first", "--input-noise", "0.25", "--prefix-dropout", "0.5") == 0
    first = CodecLM.from_pretrained(shards / "first")
    assert first.config.aligned and first.config.text_vocab == TEXT_VOCAB and first.config.num_codebooks == K
    log = json.loads((shards / "first" / "training.json").read_text())["log"]
    assert log and all("durations_loss" in entry and "loss" in entry for entry in log)
    # an unaligned model of the same shape gives the aligned one its shared parts; the alignment inputs start at 0
    assert train(shards, shards / "second", "--init", str(unaligned), "--steps", "1", "--lr", "1e-9") == 0
    second, source = CodecLM.from_pretrained(shards / "second"), CodecLM.from_pretrained(unaligned)
    torch.testing.assert_close(second.heads.weight, source.heads.weight, atol=1e-3, rtol=0)
    assert second.align_phoneme.weight.abs().max() < 1e-3
    assert train(shards, shards / "distilled", "--distil-from", str(shards / "first")) == 0
    log = json.loads((shards / "distilled" / "training.json").read_text())["log"]
    assert log[-1]["loss"] >= 0.0  # a KL divergence
    # Medusa heads by self-distillation; the target's tts.json then names them
    assert main(["train", "tts-drafter", "--target", str(shards / "first"), "--data", str(shards / "data"), "--codec",
                 str(shards / "codec"), "--out", str(shards / "medusa"), "--heads", "2", "--steps", "2", "--batch-size",
                 "2", "--threads", "1"]) == 0
    heads = DraftHeads.load(shards / "medusa", first, "medusa")
    assert heads.num_heads == 2 and json.loads((shards / "medusa" / "training.json").read_text())["log"][-1]["loss"] >= 0
    assert json.loads((shards / "first" / "tts.json").read_text())["medusa"] == "../medusa"
    # an EAGLE head the same way; the pipeline's method "eagle" finds it through tts.json
    assert main(["train", "tts-drafter", "--kind", "eagle", "--target", str(shards / "first"), "--data",
                 str(shards / "data"), "--codec", str(shards / "codec"), "--out", str(shards / "eagle"), "--steps", "2",
                 "--batch-size", "2", "--threads", "1"]) == 0
    head = EagleHead.load(shards / "eagle", first.backbone)
    assert head.config.hidden_size == first.config.dim and head.config.num_hidden_layers == 1
    assert json.loads((shards / "eagle" / "training.json").read_text())["log"][-1]["loss"] >= 0
    assert json.loads((shards / "first" / "tts.json").read_text())["eagle"] == "../eagle"


def test_input_noise_replaces_only_codes_at_its_rate():
    """--input-noise: a fraction of the input codes become random codes; the begin, end and pad
    ids stay, and rate 0 changes nothing."""
    from mmspec.train.tts import noisy_steps

    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 64, (4, 300, 8), generator=gen)
    special = torch.rand(codes.shape, generator=gen) < 0.2
    steps = torch.where(special, 64 + torch.randint(0, 2, codes.shape, generator=gen), codes)  # 64 end, 65 pad
    assert torch.equal(noisy_steps(steps, 0.0, 64, gen), steps)
    noisy = noisy_steps(steps, 0.25, 64, gen)
    assert torch.equal(noisy[special], steps[special])
    changed = (noisy != steps)[~special].float().mean().item()
    assert abs(changed - 0.25 * 63 / 64) < 0.02  # a drawn code may equal the old one
    assert int(noisy[~special].max()) < 64 and int(noisy.min()) >= 0


def test_prefix_dropout_hides_the_phonemes_from_the_steps_only():
    """CodecLM.loss(text_hidden=...): a hidden row's steps see no phoneme (as if its prefix were
    masked out), the other rows and the duration loss are unchanged."""
    from mmspec.modeling.codec_lm import CodecLMConfig
    from mmspec.train.tts import PRESETS, collate

    torch.manual_seed(4)
    model = CodecLM(CodecLMConfig(text_vocab=TEXT_VOCAB, num_codebooks=K, codebook_size=CODES, **PRESETS["draft"])).eval()
    gen = torch.Generator().manual_seed(4)
    items = [{"phonemes": torch.randint(0, 40, (6,), generator=gen), "codes": torch.randint(0, CODES, (K, 9), generator=gen),
              "durations": torch.tensor([2, 1, 2, 1, 2, 1])} for _ in range(2)]
    batch = collate(items, model.config)
    hidden = torch.tensor([True, False])
    with torch.no_grad():
        plain, dropped = model.loss(**batch), model.loss(**batch, text_hidden=hidden)
        masked = model.step_logits(batch["phonemes"], batch["text_mask"] * torch.tensor([[0], [1]]), batch["steps"],
                                   batch["step_mask"], batch["alignment"])
        logits = model.step_logits(batch["phonemes"], batch["text_mask"], batch["steps"], batch["step_mask"], batch["alignment"])
    torch.testing.assert_close(dropped["durations"], plain["durations"])
    assert not torch.allclose(dropped["codes"], plain["codes"])
    assert not torch.allclose(masked[0], logits[0]) and torch.allclose(masked[1], logits[1], atol=1e-6)
    targets = batch["targets"]
    expected = torch.nn.functional.cross_entropy(masked.reshape(-1, masked.shape[-1]), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(dropped["codes"], expected)


def test_grown_depth_computes_the_same_function():
    """grow_depth (--preset deep --init a trained target): each layer repeated, the copies' output
    projections zeroed, so the deeper model starts as exactly the model it came from."""
    from dataclasses import replace

    from mmspec.modeling.codec_lm import CodecLMConfig
    from mmspec.train.tts import PRESETS, grow_depth

    torch.manual_seed(3)
    small = CodecLM(CodecLMConfig(text_vocab=TEXT_VOCAB, num_codebooks=K, codebook_size=CODES, **PRESETS["draft"])).eval()
    deep = CodecLM(replace(small.config, layers=2 * small.config.layers)).eval()
    assert deep.load_state_dict(grow_depth(small.state_dict(), small.config.layers, deep.config.layers), strict=True)
    embeds = torch.randn(2, 7, small.config.dim)
    torch.testing.assert_close(deep(embeds)[0], small(embeds)[0])
    layers = deep.backbone.layers
    assert not layers[1].self_attn.o_proj.weight.any() and not layers[1].mlp.down_proj.weight.any()
    assert torch.equal(layers[1].self_attn.q_proj.weight, layers[0].self_attn.q_proj.weight)


def test_bad_data_and_teachers_are_one_clear_error(shards, unaligned, capsys):
    assert main(["train", "tts", "--data", str(shards / "old"), "--codec", str(shards / "codec"), "--out",
                 str(shards / "x"), "--preset", "draft", "--steps", "1"]) == 2
    assert "has no phoneme durations" in capsys.readouterr().err
    assert train(shards, shards / "y", "--distil-from", str(unaligned)) == 2
    err = capsys.readouterr().err
    assert "--distil-from" in err and "differs from this codec LM in aligned False there, True here" in err, err
    assert "num_codebooks" not in err and err.count("\n") == 1  # (only what differs: every field was named)
    for option in ("--input-noise", "--prefix-dropout"):
        for rate in ("1", "-0.1"):
            assert train(shards, shards / "z", option, rate) == 2
            err = capsys.readouterr().err
            assert f"{option} must lie in [0, 1)" in err and err.count("\n") == 1
    assert not (shards / "z").exists()


def test_the_drafter_recipe_defaults_to_the_default_voice_and_refuses_empty_data(tmp_path, capsys):
    from mmspec.hub import models_dir
    from mmspec.train.tts_drafter import drafter_paths

    assert drafter_paths(None, None, "eagle") == (models_dir() / "tts-valle", models_dir() / "tts-valle-eagle")
    assert drafter_paths("valle", None, "medusa") == (models_dir() / "tts-valle", models_dir() / "tts-valle-medusa")
    assert drafter_paths("delay", None, "medusa") == (models_dir() / "tts", models_dir() / "tts-medusa")
    mine = tmp_path / "voice"
    assert drafter_paths(str(mine), None, "eagle") == (mine, tmp_path / "voice-eagle")
    assert drafter_paths(str(mine), str(tmp_path / "h"), "eagle") == (mine, tmp_path / "h")
    assert main(["train", "tts-drafter", "--data", str(tmp_path), "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err
    assert "no shards there" in err and "mmspec train tts-self-data --out" in err and err.count("\n") == 1
    assert not (tmp_path / "h").exists()


def test_a_valle_voice_trains_its_codebook_0_stage_and_its_nar_stage(shards):
    from mmspec.modeling.codec_nar import CodecNAR

    assert train(shards, shards / "ar-full") == 0
    assert train(shards, shards / "stage", "--codebooks", "1", "--init", str(shards / "ar-full"), "--input-noise", "0.25") == 0
    stage, full = CodecLM.from_pretrained(shards / "stage"), CodecLM.from_pretrained(shards / "ar-full")
    assert stage.config.num_codebooks == 1 and stage.heads.weight.shape[0] == CODES + 1
    assert len(stage.code_embeddings) == 1 and len(full.code_embeddings) == K
    # a codebook-0 stage's draft is the VALL-E-style voice's, not the delay-pattern voice's ../tts-draft
    assert json.loads((shards / "ar-full" / "tts.json").read_text())["draft"] is None  # (a draft names none)
    assert train(shards, shards / "stage-target", "--preset", "target", "--codebooks", "1", "--steps", "1") == 0
    assert json.loads((shards / "stage-target" / "tts.json").read_text())["draft"] == "../tts-valle-draft"
    assert main(["train", "tts-nar", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--out",
                 str(shards / "nar"), "--voice", str(shards / "stage"), "--dim", "32", "--layers", "1", "--steps", "3",
                 "--batch-size", "2", "--threads", "1"]) == 0
    nar = CodecNAR.from_pretrained(shards / "nar")
    assert nar.config.num_codebooks == K and nar.config.codebook_size == CODES and nar.config.dim == 32
    assert json.loads((shards / "stage" / "tts.json").read_text())["nar"] == "../nar"
    assert json.loads((shards / "nar" / "training.json").read_text())["log"][-1]["loss"] > 0
    nar_args = ["train", "tts-nar", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--steps", "2",
                "--batch-size", "2", "--threads", "1"]
    assert main([*nar_args, "--init", str(shards / "nar"), "--depth-layers", "1", "--depth-ffn", "16", "--out",
                 str(shards / "nar-depth")]) == 0
    deep = CodecNAR.from_pretrained(shards / "nar-depth")
    assert (deep.config.depth_layers, deep.config.depth_ffn, deep.config.dim) == (1, 16, 32)
    assert deep.complete(torch.zeros(5, dtype=torch.long), torch.tensor([1, 2]), torch.tensor([2, 3])).shape == (K, 5)


def test_a_codebook_0_stage_goes_to_the_valle_voices_directories_by_default(shards, tmp_path, monkeypatch):
    # (it went to models/tts and models/tts-draft, the delay-pattern voice's)
    monkeypatch.setenv("MMSPEC_MODELS_DIR", str(tmp_path))
    args = ["train", "tts", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--codebooks", "1",
            "--steps", "1", "--batch-size", "2", "--warmup", "1", "--threads", "1"]
    assert main([*args, "--preset", "draft"]) == 0
    assert main([*args, "--preset", "target"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tts-valle", "tts-valle-draft"]
    assert json.loads((tmp_path / "tts-valle" / "tts.json").read_text())["draft"] == "../tts-valle-draft"
    assert CodecLM.from_pretrained(tmp_path / "tts-valle-draft").config.num_codebooks == 1


def test_bad_codebook_counts_and_nar_voices_are_one_clear_error(shards, capsys):
    for bad in (str(K + 1), "0"):
        assert train(shards, shards / "w", "--codebooks", bad) == 2
        err = capsys.readouterr().err
        assert f"--codebooks must lie in [1, {K}]" in err and err.count("\n") == 1
    assert main(["train", "tts-nar", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--out",
                 str(shards / "v"), "--voice", str(shards / "nowhere"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "has no tts.json" in err and err.count("\n") == 1
    delay = shards / "delay-voice"  # (stop 86 audit: an 8-codebook voice trained a NAR stage and had it written in)
    delay.mkdir()
    (delay / "tts.json").write_text("{}")
    (delay / "codec_lm.json").write_text(json.dumps({"num_codebooks": 8}))
    assert main(["train", "tts-nar", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--out",
                 str(shards / "v"), "--voice", str(delay), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "is a codec LM over 8 codebooks" in err and err.count("\n") == 1 and (delay / "tts.json").read_text() == "{}"
    nar_args = ["train", "tts-nar", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--out",
                str(shards / "u"), "--steps", "1", "--dim", "32", "--layers", "1"]
    assert main([*nar_args, "--depth-layers", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--depth-layers -1: give 0" in err and err.count("\n") == 1
    assert main([*nar_args, "--depth-layers", "1", "--steps", "1", "--batch-size", "2"]) == 0
    assert main([*nar_args, "--init", str(shards / "u"), "--depth-layers", "2", "--out", str(shards / "t")]) == 2
    err = capsys.readouterr().err
    assert "has a depth head of 1 blocks" in err and err.count("\n") == 1
    # another shape given with --init was silently ignored (the --init stage's won): refused, before the data is read
    init_args = ["train", "tts-nar", "--data", str(shards / "data"), "--codec", str(shards / "codec"), "--steps", "1"]
    for shape, said in ((["--dim", "64"], "--dim 64 (it has 32)"), (["--layers", "2", "--depth-ffn", "16"],
                                                                     "--layers 2 (it has 1), --depth-ffn 16 (it has 512)")):
        assert main([*init_args, "--init", str(shards / "u"), *shape, "--out", str(shards / "s")]) == 2
        err = capsys.readouterr().err
        assert said in err and "fixes the stage's shape" in err and err.count("\n") == 1, err
        assert not (shards / "s").exists()
    for bad in ("--dim", "--layers", "--depth-ffn"):
        assert main([*init_args, bad, "0", "--out", str(shards / "s")]) == 2
        err = capsys.readouterr().err
        assert f"{bad} must be at least 1, got 0" in err and err.count("\n") == 1


def test_an_init_over_fewer_codebooks_says_codebooks_before_the_data_is_read(shards, tmp_path, capsys):
    # it said "pass the matching --preset" (the preset matched: the codebooks did not), after encoding the data
    from mmspec.modeling.codec_lm import CodecLMConfig
    from mmspec.train.tts import PRESETS

    CodecLM(CodecLMConfig(text_vocab=TEXT_VOCAB, num_codebooks=1, codebook_size=CODES, **PRESETS["draft"])).save(tmp_path / "one")
    assert main(["train", "tts", "--data", str(tmp_path / "no-data"), "--codec", str(shards / "codec"), "--out",
                 str(tmp_path / "x"), "--preset", "draft", "--init", str(tmp_path / "one"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"models 1 codebook(s), this codec LM {K}: add --codebooks 1" in err and err.count("\n") == 1, err
    assert main(["train", "tts", "--data", str(tmp_path / "no-data"), "--codec", str(shards / "codec"), "--out",
                 str(tmp_path / "x"), "--init", str(tmp_path / "one"), "--codebooks", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "is a codec LM of another shape" in err and err.count("\n") == 1, err  # (the preset differs; not the data)


def test_the_codes_cache_encodes_only_new_shards(shards, tmp_path, monkeypatch):
    import shutil

    from mmspec.train import tts as tts_training

    data = tmp_path / "data"
    shutil.copytree(shards / "data", data)
    codec = MelRVQCodec.from_pretrained(shards / "codec")
    first = tts_training.encoded_utterances(data, shards / "codec", codec, "train")
    saved = torch.load(data / "train-00000.pt", weights_only=True)
    torch.save({**saved, "texts": [f"more {i}" for i in range(6)]}, data / "train-00001.pt")
    encoded = []
    monkeypatch.setattr(codec, "encode", lambda audio: encoded.append(audio) or MelRVQCodec.encode(codec, audio))
    both = tts_training.encoded_utterances(data, shards / "codec", codec, "train")
    assert len(encoded) == 6  # the new shard's utterances only
    assert [i["text"] for i in both] == [f"sentence {i}" for i in range(6)] + [f"more {i}" for i in range(6)]
    assert all(torch.equal(a["codes"], b["codes"]) for a, b in zip(first, both))
    assert tts_training.encoded_utterances(data, shards / "codec", codec, "train")[6]["text"] == "more 0"
    assert len(encoded) == 6  # nothing new: nothing encoded
    # a resumed speech-data run rewrites a partial last shard: only it is encoded again
    torch.save({**saved, **{key: saved[key][:2] for key in ("texts", "phoneme_ids", "audio", "samples_per_phoneme")},
                "texts": ["short 0", "short 1"]}, data / "train-00001.pt")
    assert [i["text"] for i in tts_training.encoded_utterances(data, shards / "codec", codec, "train")[6:]] == ["short 0", "short 1"]
    assert len(encoded) == 8


def test_codec_with_fewer_speech_vectors_than_codes_is_one_line(shards, tmp_path, capsys):
    """k-means needs a vector a code: too little speech is refused before the fit, naming the fix."""
    assert main(["train", "codec", "--data", str(shards / "data"), "--out", str(tmp_path / "codec"), "--codebook-size",
                 "4096", "--num-codebooks", "1"]) == 2
    err = capsys.readouterr().err
    assert "fewer than --codebook-size 4096" in err and "pass more --minutes or data" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "codec").exists()
