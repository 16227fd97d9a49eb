"""Self-distillation data for a voice's drafters (``mmspec train tts-self-data``) and the EAGLE
head's training-time test (``mmspec train tts-drafter --ttt N``): the unrolled head computes what
the drafter's chain computes, training and the held-out acceptance run on self-distilled shards,
and the data is the same however it is batched or split into runs."""

import json

import pytest
import torch

from mmspec.cli import main
from mmspec.core.cache import make_cache
from mmspec.modeling.codec_lm import CodecLM, CodecLMConfig
from mmspec.modeling.heads import EagleHead
from mmspec.train.tts import PRESETS, TEXT_VOCAB, collate
from mmspec.train.tts_drafter import eagle_acceptance, teacher_forced, unrolled_eagle
from mmspec.train.tts_self_data import self_items

CODES = 16


@pytest.fixture(scope="module")
def voice(tmp_path_factory):
    """A tiny aligned single-codebook codec LM (random weights), an EAGLE head for it and shards of
    {phonemes, codes [1, F], durations} as tts-self-data writes them."""
    root = tmp_path_factory.mktemp("self")
    torch.manual_seed(0)
    lm = CodecLM(CodecLMConfig(text_vocab=TEXT_VOCAB, num_codebooks=1, codebook_size=CODES, **PRESETS["draft"]))
    lm.save(root / "voice")
    (root / "voice" / "tts.json").write_text("{}")
    EagleHead(lm.backbone.config).save(root / "head", target="../voice")
    gen = torch.Generator().manual_seed(1)
    for name, count in (("data", 6), ("held-out", 3)):
        items = []
        for i in range(count):
            durations = torch.randint(0, 4, (9,), generator=gen)
            durations[0] += 1
            frames = int(durations.sum())
            items.append({"text": f"sentence {i}", "phonemes": torch.randint(1, 40, (9,), generator=gen),
                          "codes": torch.randint(0, CODES, (1, frames), generator=gen), "durations": durations})
        (root / name).mkdir()
        torch.save(items, root / name / "self-0000.pt")
    return root


def test_the_unrolled_head_is_the_drafters_chain(voice):
    """Draft k of :func:`unrolled_eagle` at row t equals the head run as the drafter runs it: the
    committed rows through its cache, then a chain of k + 1 forwards each reading the last output."""
    lm = CodecLM.from_pretrained(voice / "voice", dtype=torch.float32).eval()
    head = EagleHead.load(voice / "head", lm.backbone).float().eval()
    batch = collate(self_items(voice / "data")[:2], lm.config)
    with torch.no_grad():
        _, hidden, _ = teacher_forced(lm, batch)
        embeds = lm.step_embeddings(batch["steps"], batch.get("alignment"))
        drafts = unrolled_eagle(head, hidden, embeds, 3)
        steps = hidden.shape[1]
        plain = head(hidden[:, :-1], embeds[:, 1:], None, torch.arange(1, steps)[None])
        torch.testing.assert_close(drafts[0], plain, atol=1e-5, rtol=0)
        for row in (0, 1):
            for t in (0, 3, steps - 5):
                cache = make_cache(head.decoder.config)
                if t:
                    head(hidden[row : row + 1, :t], embeds[row : row + 1, 1 : t + 1], cache, torch.arange(1, t + 1)[None])
                out = hidden[row : row + 1, t : t + 1]
                for k in range(3):
                    out = head(out, embeds[row : row + 1, t + k + 1 : t + k + 2], cache, torch.tensor([[t + k + 1]]))
                    torch.testing.assert_close(out[0, 0], drafts[k][row, t], atol=1e-5, rtol=0)
        # a wrong mask would show: draft 1 must differ from teacher forcing at the same position
        assert not torch.allclose(drafts[1][:, : steps - 2], plain[:, 1:], atol=1e-4)


def test_training_with_the_training_time_test_on_self_distilled_shards(voice):
    def train(out, *extra):
        return main(["train", "tts-drafter", "--kind", "eagle", "--target", str(voice / "voice"), "--data",
                     str(voice / "data"), "--out", str(out), "--steps", "2", "--batch-size", "2", "--warmup", "1",
                     "--threads", "1", "--kl-weight", "1", *extra])

    assert train(voice / "ttt", "--ttt", "3", "--init", str(voice / "head"), "--eval", str(voice / "held-out")) == 0
    log = json.loads((voice / "ttt" / "training.json").read_text())["log"]
    before = next(e["acceptance_before"] for e in log if "acceptance_before" in e)
    after = next(e["acceptance_after"] for e in log if "acceptance_after" in e)
    assert len(before) == len(after) == 6 and all(0.0 <= a <= 1.0 for a in before + after)
    assert any(e.get("loss", 0) > 0 for e in log)
    # the acceptance it reports is the one the function gives for the saved head
    lm = CodecLM.from_pretrained(voice / "voice", dtype=torch.float32).eval()
    head = EagleHead.load(voice / "ttt", lm.backbone).float().eval()
    measured = eagle_acceptance(head, lm, self_items(voice / "held-out"), 6)
    assert measured == pytest.approx(after, abs=1e-3)
    # --init starts from the given head: one step at a tiny learning rate stays next to it
    assert train(voice / "near", "--init", str(voice / "head"), "--steps", "1", "--lr", "1e-9") == 0
    start = EagleHead.load(voice / "head", lm.backbone)
    near = EagleHead.load(voice / "near", lm.backbone)
    torch.testing.assert_close(near.fc.weight.float(), start.fc.weight.float(), atol=1e-3, rtol=0)
    # the voice's tts.json now names the last head trained
    assert json.loads((voice / "voice" / "tts.json").read_text())["eagle"] == "../near"


def test_the_voices_self_data_is_the_same_however_batched_or_split(tmp_path, debian_text_sources):
    """The embedded voice's codes per sentence do not depend on the batch they were decoded in or on
    how the shards were shared between runs; each item's frames equal its durations' total and the
    sentences take the temperatures in turn."""
    common = ["train", "tts-self-data", "--sentences", "4", "--shard-size", "2"]
    assert main([*common, "--out", str(tmp_path / "one"), "--batch-size", "2"]) == 0
    assert main([*common, "--out", str(tmp_path / "split"), "--batch-size", "1", "--shards", "1:2"]) == 0
    assert main([*common, "--out", str(tmp_path / "split"), "--batch-size", "1", "--shards", ":1"]) == 0
    one, split = self_items(tmp_path / "one"), self_items(tmp_path / "split")
    assert [i["text"] for i in one] == [i["text"] for i in split] and len(one) == 4
    for a, b in zip(one, split):
        assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["phonemes"], b["phonemes"])
        assert a["codes"].shape == (1, int(a["durations"].sum())) and len(a["durations"]) == len(a["phonemes"])
    assert [i["temperature"] for i in one] == [1.0, 0.7, 1.0, 0.7]
    # a rerun writes nothing new (every shard exists)
    stamp = (tmp_path / "one" / "self-0000.pt").stat().st_mtime_ns
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / "self-0000.pt").stat().st_mtime_ns == stamp


def test_a_rerun_with_more_sentences_writes_the_short_last_shard_again(tmp_path, debian_text_sources):
    # the last shard a run with fewer --sentences left short was kept: the rerun asked for 4
    # sentences and the data held 3, silently
    common = ["train", "tts-self-data", "--shard-size", "2", "--out", str(tmp_path)]
    assert main([*common, "--sentences", "3"]) == 0
    assert len(self_items(tmp_path)) == 3
    first = (tmp_path / "self-0000.pt").stat().st_mtime_ns
    assert main([*common, "--sentences", "4"]) == 0
    items = self_items(tmp_path)
    assert len(items) == 4 and (tmp_path / "self-0000.pt").stat().st_mtime_ns == first  # (the whole shard kept)
    saved = torch.load(tmp_path / "self-0001.pt", weights_only=True)
    assert (saved["first"], saved["sentences"], len(saved["items"])) == (2, 2, 2)
    # a shard written before the counts were kept (a list of items) is whole when it holds them all
    torch.save(saved["items"], tmp_path / "self-0001.pt")
    stamp = (tmp_path / "self-0001.pt").stat().st_mtime_ns
    assert main([*common, "--sentences", "4"]) == 0
    assert (tmp_path / "self-0001.pt").stat().st_mtime_ns == stamp
    assert [i["text"] for i in self_items(tmp_path)] == [i["text"] for i in items]


def test_sentences_that_do_not_fit_the_context_are_skipped_and_counted(tmp_path, monkeypatch, capsys, debian_text_sources):
    from mmspec.pipelines.text_to_speech.components import TTSComponents

    monkeypatch.setattr(TTSComponents, "max_positions", property(lambda self: 160))
    assert main(["train", "tts-self-data", "--sentences", "6", "--shard-size", "6", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    items = self_items(tmp_path)
    skipped = int(out.split("; ")[1].split()[0]) if "skipped" in out else 0
    assert skipped >= 1 and items and len(items) == 6 - skipped
    assert all(len(i["phonemes"]) + i["codes"].shape[1] + 3 <= 160 for i in items)


def test_a_rerun_with_other_settings_is_refused_before_the_voice_loads(tmp_path, capsys):
    # it kept the shards made with the first settings and wrote nothing, silently
    from mmspec.train.tts_self_data import SETTINGS

    (tmp_path / SETTINGS).write_text(json.dumps({"model": "valle", "split": "train", "sources": ["numbers"],
                                                 "temperature": [1.0, 0.7], "shard_size": 2, "max_seconds": 15.0}))
    assert main(["train", "tts-self-data", "--sources", "grammar", "--sentences", "4", "--shard-size", "2", "--temperature",
                 "1", "--model", str(tmp_path / "no-voice-here"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert ("made with other settings (--model valle there, {} now; --sources numbers there, grammar now; --temperature "
            "1.0,0.7 there, 1.0 now)".format(tmp_path / "no-voice-here")) in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("self-*.pt"))
