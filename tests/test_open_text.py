"""The embedded voice's open-domain text (mmspec/train/data/open_text.py): its sources, their
filters, the hash split, and ``mmspec train speech-data --text open``'s checks."""

import subprocess
import sys

import pytest

from mmspec.train.data import open_text
from mmspec.train.data.core import split_of
from mmspec.train.data.open_text import SOURCES, clean_sentence, open_corpus, ordinal


@pytest.mark.parametrize("reply, kept", [
    ("I'm going to take the train to work tomorrow.", "I'm going to take the train to work tomorrow."),
    ('"Your Italian pasta is one of my favorite dishes!" And more.', "Your Italian pasta is one of my favorite dishes!"),
    ("Here's a sample sentence: the garden is full.", None),  # a meta-answer
    ("The library of Eldrador is vast", None),  # no end punctuation
    ("Hi.", None),  # too short
    ("The caf\u00e9 opens at nine.", None),  # a character outside ALLOWED
    ("the bus is late.", None),  # not a sentence start
    ("Is the dentist open on Sunday?\n\nSure!", "Is the dentist open on Sunday?"),
])
def test_generated_replies_are_cut_to_one_plain_sentence(reply, kept):
    assert clean_sentence(reply) == kept


@pytest.mark.parametrize("n, text", [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (12, "12th"),
                                     (13, "13th"), (21, "21st"), (22, "22nd"), (101, "101st"), (111, "111th")])
def test_ordinal(n, text):
    assert ordinal(n) == text


def test_splits_are_disjoint_and_owned_by_the_hash(debian_text_sources):
    train = {t for _, t in open_corpus("train", 600, ["numbers", "words", "fortunes", "smollm2"])}
    test = {t for _, t in open_corpus("test", 200, ["numbers", "words", "fortunes", "smollm2"])}
    assert train and test and not train & test
    assert all(split_of(f"open|{t.lower()}") == "test" for t in test)


def test_the_corpus_is_deterministic_and_follows_the_shares():
    first = open_corpus("train", 400, ["numbers", "grammar"])
    assert first == open_corpus("train", 400, ["numbers", "grammar"])
    counts = {name: sum(source == name for source, _ in first) for name in ("numbers", "grammar")}
    share = SOURCES["numbers"][1] / (SOURCES["numbers"][1] + SOURCES["grammar"][1])
    assert abs(counts["numbers"] / 400 - share) < 0.01, counts


def test_fortunes_and_words_are_parsed_from_their_files(tmp_path, monkeypatch):
    (tmp_path / "fortunes").write_text("A banker lends you his umbrella when the sun is shining.\n\t\t-- Mark Twain\n%\n"
                                       "Q: Why did the chicken cross the road?\n%\nToo short.\n")
    words = tmp_path / "words"
    words.write_text("apple\nBoston\nbanana's\ncherry\n")
    monkeypatch.setattr(open_text, "FORTUNES", tmp_path)
    monkeypatch.setattr(open_text, "WORDS", words)
    every = [t for split in ("train", "validation", "test") for t in open_text.fortunes(split)]
    assert sorted(every) == ["A banker lends you his umbrella when the sun is shining.",
                             "Why did the chicken cross the road?"]
    said = [t for split in ("train", "validation", "test") for t in open_text.words(split, count=50)]
    assert said and all(("apple" in t) or ("cherry" in t) for t in said)
    assert not any("Boston" in t or "banana" in t for t in said)


def test_missing_system_sources_are_one_line_naming_the_package(tmp_path, monkeypatch):
    # they gave no sentences, silently: a corpus (and a benchmark's sentences) without them
    from mmspec.hub import MissingDependencyError

    monkeypatch.setattr(open_text, "FORTUNES", tmp_path / "none")
    monkeypatch.setattr(open_text, "WORDS", tmp_path / "none.txt")
    for source, package in (("fortunes", "fortunes-min"), ("words", "wamerican")):
        for call in (lambda: getattr(open_text, source)("train"), lambda: open_corpus("train", 10, ["numbers", source]),
                     lambda: open_text.check_sources([source])):
            with pytest.raises(MissingDependencyError, match=f"apt-get install {package}\\) or leave {source} out") as info:
                call()
            assert "\n" not in str(info.value) and str(tmp_path / "none") in str(info.value)
    with pytest.raises(MissingDependencyError, match="fortunes-min"):
        open_corpus("train", 10)  # every source: the first missing one is said
    assert open_corpus("train", 10, ["numbers", "grammar"])  # the others need nothing


def test_speech_data_checks_its_sources_once_before_the_voice(tmp_path, monkeypatch, capsys):
    from mmspec.cli import main
    from mmspec.train import speech_data

    monkeypatch.setattr(open_text, "FORTUNES", tmp_path / "none")
    monkeypatch.setattr(speech_data, "load_voice", lambda: pytest.fail("the voice loaded before the sources' check"))
    monkeypatch.setattr(open_text, "WORDS", tmp_path / "none.txt")
    checked = []
    monkeypatch.setattr(open_text, "check_sources", lambda names, real=open_text.check_sources: checked.append(names) or real(names))
    both = "sources 'words' reads Debian's wamerican ({} is missing), 'fortunes' reads Debian's fortunes-min ({} is " \
           "missing): install them (sudo apt-get install wamerican fortunes-min) or leave words, fortunes out of the " \
           "sources".format(tmp_path / "none.txt", tmp_path / "none")
    for sources, said in ((["--sources", "words,fortunes"], both), ([], "'fortunes' reads Debian's fortunes-min"),
                          (["--sources", " , "], "--sources: unknown empty list"),
                          (["--sources", "numbers,poems"], "--sources: unknown ['poems']"),
                          (["--sources", "numbers,grammar,numbers"], "--sources: numbers given more than once")):
        checked.clear()
        assert main(["train", "speech-data", "--text", "open", *sources, "--out", str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
        assert len(checked) == 1  # (one check, not one in the command and another in open_corpus)
    assert not (tmp_path / "d").exists()


def test_the_generated_text_is_kept_in_the_package():
    lines = open_text.SMOLLM2_TEXT.read_text().splitlines()
    assert lines[0].startswith("# source: SmolLM2-135M-Instruct")
    sentences = lines[1:]
    assert len(sentences) >= 1000 and len({s.lower() for s in sentences}) == len(sentences)
    assert all(clean_sentence(s) == s for s in sentences)


def test_speech_data_refuses_an_unknown_source(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mmspec", "train", "speech-data", "--text", "open", "--sources",
                          "smollm2,poems", "--out", str(tmp_path / "d")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "poems" in run.stderr, run.stderr


def test_speech_data_report_counts_hours_words_and_phoneme_pairs(tmp_path):
    import torch

    from mmspec.train.speech_data import coverage

    torch.save({"texts": ["The cat sat.", "The dog ran!"], "sample_rate": 100,
                "phoneme_ids": [torch.tensor([1, 0, 5, 0, 6, 0, 2]), torch.tensor([1, 0, 5, 0, 7, 0, 2])],
                "audio": [torch.zeros(180, dtype=torch.int16), torch.zeros(180, dtype=torch.int16)]},
               tmp_path / "train-00000.pt")
    report = coverage(tmp_path)
    assert report == {"hours": pytest.approx(3.6 / 3600), "sentences": 2, "words": 6, "distinct_words": 5,
                      "phoneme_ids": 5, "phoneme_id_pairs": 5}  # pairs (1,5) (5,6) (6,2) (5,7) (7,2), pads left out


def test_speech_data_report_refuses_text_and_sources_it_would_ignore(tmp_path, capsys):
    # --report covered every shard of the split whatever --text / --sources said, silently
    import torch

    from mmspec.cli import main

    torch.save({"texts": ["The cat sat."], "sample_rate": 100, "phoneme_ids": [torch.tensor([1, 5, 6, 2])],
                "audio": [torch.zeros(180, dtype=torch.int16)]}, tmp_path / "train-00000.pt")
    for extra in (["--sources", "numbers"], ["--text", "open"], ["--text", "grammar", "--sources", "smollm2"]):
        assert main(["train", "speech-data", "--report", "--out", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(f"drop {o}" in err or f"and {o}" in err for o in extra if o.startswith("--")), err
    assert not main(["train", "speech-data", "--report", "--out", str(tmp_path)])
    assert '"sentences": 1' in capsys.readouterr().out


def test_open_text_refuses_a_count_below_one_before_loading_the_model(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mmspec", "train", "open-text", "--count", "0", "--out",
                          str(tmp_path / "t.txt")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--count" in run.stderr, run.stderr
    assert not (tmp_path / "t.txt").exists()


def test_open_text_refuses_a_negative_seed_before_loading_the_model(tmp_path, capsys):
    from mmspec.cli import main

    code = main(["train", "open-text", "--seed", "-1", "--out", str(tmp_path / "t.txt")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--seed" in err, err
    assert not (tmp_path / "t.txt").exists()


def test_more_seeds_are_a_source_of_their_own_without_seed_0s_sentences(tmp_path, monkeypatch):
    header = "# source: SmolLM2-135M-Instruct, mmspec train open-text (seed {})\n"
    first = [f"The bus number {i} is late again." for i in range(60)]
    more = first[:20] + [f"My neighbour bakes {i} loaves of bread." for i in range(60)]
    monkeypatch.setattr(open_text, "HERE", tmp_path)
    monkeypatch.setattr(open_text, "SMOLLM2_TEXT", tmp_path / "open_text_smollm2.txt")
    assert open_text.smollm2_text(0) == tmp_path / "open_text_smollm2.txt"
    assert open_text.smollm2_text(3) == tmp_path / "open_text_smollm2-seed3.txt"
    assert open_text.smollm2_more("train") == []  # no seed files: empty, not an error
    open_text.smollm2_text(0).write_text(header.format(0) + "\n".join(first) + "\n")
    open_text.smollm2_text(1).write_text(header.format(1) + "\n".join(more[:50]) + "\n")
    open_text.smollm2_text(2).write_text(header.format(2) + "\n".join(more[50:]) + "\n")
    every = [t for split in ("train", "validation", "test") for t in open_text.smollm2_more(split)]
    assert sorted(every) == sorted(more[20:])
    # seed 10 comes after seed 2 (by number, not by name), so the earlier sentences keep their places
    before = open_text.smollm2_more("train")
    later = [f"The tram to the harbour leaves at {i}." for i in range(30)]
    open_text.smollm2_text(10).write_text(header.format(10) + "\n".join(later) + "\n")
    after = open_text.smollm2_more("train")
    assert after[: len(before)] == before and set(after[len(before):]) <= set(later) and len(after) > len(before)
    assert sorted(t for split in ("train", "validation", "test") for t in open_text.smollm2(split)) == sorted(first)


def test_the_bench_tunes_on_validation_sentences_it_never_reports_on(debian_text_sources):
    """``mmspec bench tts --text open-validation`` (where a method's settings are tuned) shares no
    sentence with ``--text open`` (the reported test split) nor with the hand-written test split."""
    from mmspec.bench.tts import TEXTS

    validation = {t for _, t in TEXTS["open-validation"](120)}
    assert validation and not validation & {t for _, t in TEXTS["open"](120)}
    assert not validation & {t for _, t in TEXTS["handwritten"](200)}
    assert all(split_of(f"open|{text.lower()}") == "validation" for source, text in TEXTS["open-validation"](40)
               if source != "grammar")  # (the grammar's sentences come from its own split generator)


def test_speech_data_refuses_sources_without_text_open(tmp_path):
    # --sources picks open-corpus sources; with the grammar (the default --text) it was silently ignored
    run = subprocess.run([sys.executable, "-m", "mmspec", "train", "speech-data", "--sources", "fortunes", "--out",
                          str(tmp_path / "d")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--text open" in run.stderr, run.stderr
    assert not (tmp_path / "d").exists()


def test_tts_self_data_refuses_an_unknown_source_in_one_line(tmp_path):
    # it was a KeyError traceback from open_corpus
    from mmspec.cli import main

    code = main(["train", "tts-self-data", "--sources", "poems,words", "--out", str(tmp_path / "d")])
    assert code == 2 and not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match="poems"):
        open_corpus("train", 10, ["poems"])


def test_speech_data_rewrites_a_shard_left_short_and_refuses_another_shard_size(tmp_path, monkeypatch, capsys):
    # a rerun with more --sentences kept the last shard short (fewer sentences than asked, silently), and one with
    # another --shard-size kept shards whose sentences are not those their index names
    import types

    import torch

    from mmspec.cli import main
    from mmspec.train import speech_data

    voice = types.SimpleNamespace(config=types.SimpleNamespace(sample_rate=100, phoneme_id_map={"a": [1]}))
    monkeypatch.setattr(speech_data, "load_voice", lambda: voice)
    monkeypatch.setattr(speech_data, "synthesise", lambda voice, text: (torch.tensor([1, 2]), torch.zeros(4, dtype=torch.int16),
                                                                         torch.tensor([2, 2])))
    args = ["train", "speech-data", "--out", str(tmp_path), "--shard-size", "2"]
    assert not main([*args, "--sentences", "3"])
    assert not main([*args, "--sentences", "4"])
    assert speech_data.coverage(tmp_path)["sentences"] == 4
    stamp = (tmp_path / "train-00001.pt").stat().st_mtime_ns
    assert not main([*args, "--sentences", "3"])  # fewer than the shards hold: kept
    assert (tmp_path / "train-00001.pt").stat().st_mtime_ns == stamp
    capsys.readouterr()
    assert main([*args[:-1], "4", "--sentences", "8"]) == 2
    err = capsys.readouterr().err
    assert "train-00001.pt begins at sentence 2, not 4" in err and "--shard-size" in err and err.count("\n") == 1


def test_open_text_with_its_count_reached_loads_no_model(tmp_path):
    # it loaded SmolLM2 (which a machine may lack) and only then found nothing to do
    out = tmp_path / "t.txt"
    out.write_text("# source: SmolLM2-135M-Instruct, mmspec train open-text (seed 0) (next batch 3)\nThe bus is late.\n"
                   "The cat is asleep.\nWhere is the station?\n")
    assert open_text.generate_smollm2(3, out, model_dir=str(tmp_path / "no-model-here")) == 3
    assert out.read_text().count("\n") == 4


def test_open_text_by_default_leaves_the_shipped_text_alone(tmp_path, monkeypatch, capsys):
    # the default run (seed 0) appended to the package's open_text_smollm2.txt, changing the smollm2
    # source (and bench tts --text open) on that install; now it writes under runs/, the package
    # only with --package
    from mmspec.cli import main

    shipped = open_text.SMOLLM2_TEXT.read_text()
    monkeypatch.chdir(tmp_path)
    made = tmp_path / "runs" / "open-text"
    made.mkdir(parents=True)
    header = "# source: SmolLM2-135M-Instruct, mmspec train open-text (seed {}) (next batch 1)\n"
    for seed in (0, 2):  # (three sentences held: the count is reached, no model loads)
        (made / open_text.smollm2_text(seed).name).write_text(header.format(seed) + "A.\nB.\nC.\n")
        assert not main(["train", "open-text", "--count", "3", "--seed", str(seed)])  # (0 or None: done)
        assert f"3 sentences in {made.relative_to(tmp_path) / open_text.smollm2_text(seed).name}" in capsys.readouterr().out
    assert not main(["train", "open-text", "--count", "3", "--package"])  # the explicit choice: the package's own file
    assert f"sentences in {open_text.SMOLLM2_TEXT}" in capsys.readouterr().out
    assert main(["train", "open-text", "--package", "--out", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--package" in err and err.count("\n") == 1, err
    assert open_text.SMOLLM2_TEXT.read_text() == shipped and not (tmp_path / "t.txt").exists()
