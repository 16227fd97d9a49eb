"""``mmspec bench caption`` on a tiny saved SmolVLM checkpoint: table shape, greedy exactness, SPD
draft path, resumption."""

import json

import pytest
from tiny_checkpoints import cached_tiny_checkpoint, save_tiny_draft

from mmspec.bench.caption import parse_method
from mmspec.cli import main


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    checkpoint = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    folder = tmp_path_factory.mktemp("bench")
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(checkpoint))
    draft = save_tiny_draft(folder / "draft", vocab_size=vocab)
    results = folder / "caption.json"
    argv = ["bench", "caption", "--model", str(checkpoint), "--methods", f"ar,prompt-lookup@3,layer-skip:1,spd={draft}",
            "--families", "scenes,text", "--per-family", "2", "--repeats", "1", "--temperatures", "0,1",
            "--max-new-tokens", "8", "--dtype", "fp32", "--threads", "1", "--results", str(results), "--json"]
    return argv, results


def test_summary_shape_and_greedy_exactness(bench_run, capsys):
    argv, results = bench_run
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    methods = ["ar", "prompt-lookup@3", "layer-skip:1", argv[5].split(",")[-1]]
    assert set(summary) == {"0", "1"}
    for temperature, table in summary.items():
        assert set(table) == {"scenes", "text", "mean"}
        for family, row in table.items():
            assert list(row) == methods
            assert row["ar"]["S"] == pytest.approx(1.0) and row["ar"]["tau"] == pytest.approx(1.0)
            for method in methods[1:]:
                assert row[method]["S"] > 0 and 1.0 <= row[method]["tau"] <= 9
                if temperature == "0" and family != "mean":
                    assert row[method]["exact"] == "2/2"  # fp32 greedy: identical to AR
    runs = json.loads(results.read_text())["runs"]
    assert len(runs) == 2 * 2 * 2 * 2 * len(methods)  # temperatures x families x items x rounds x methods


def test_rerun_resumes_without_measuring_again(bench_run, capsys):
    argv, results = bench_run
    assert main(argv) == 0
    before = json.loads(results.read_text())["runs"]
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(results.read_text())["runs"] == before


def test_missing_spd_draft_is_a_one_line_error(bench_run, tmp_path, capsys):
    argv, _ = bench_run
    argv = [a if not a.startswith("ar,") else f"ar,spd={tmp_path / 'nothing'}" for a in argv]
    assert main(argv[:-3] + ["--results", str(tmp_path / "r.json")]) == 2
    assert "train it with `mmspec train caption-draft`" in capsys.readouterr().err


def test_method_parsing():
    assert parse_method("prompt-lookup:10@6") == ("prompt-lookup:10", 6)
    assert parse_method("ar") == ("ar", None)
