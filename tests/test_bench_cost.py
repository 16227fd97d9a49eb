"""mmspec bench cost: the per-part split of a forward, and the command end to end."""

import json

import pytest
from tiny_checkpoints import save_tiny_draft, smollm2_checkpoint
from tiny_models import make_tiny
from transformers import AutoTokenizer

from mmspec.adapters.hf import TransformersTarget
from mmspec.bench.cost import PARTS, measure_parts, part_of
from mmspec.cli import main


def test_modules_are_split_into_parts():
    llama = dict(make_tiny("llama").model.named_modules())
    assert part_of("model.layers.0.self_attn.q_proj", llama["model.layers.0.self_attn.q_proj"]) == "attn linears"
    assert part_of("model.layers.0.self_attn", llama["model.layers.0.self_attn"]) == "attention"
    assert part_of("model.layers.0.mlp.down_proj", llama["model.layers.0.mlp.down_proj"]) == "mlp linears"
    assert part_of("model.layers.0.input_layernorm", llama["model.layers.0.input_layernorm"]) == "norms"
    assert part_of("lm_head", llama["lm_head"]) == "lm head"
    assert part_of("model.layers.0", llama["model.layers.0"]) is None  # its children say
    llava = dict(make_tiny("llava").model.named_modules())
    tower = next(name for name in llava if name.endswith("vision_tower"))
    assert part_of(tower, llava[tower]) == "vision"
    inner = next(name for name in llava if name.startswith(tower + ".") and name.endswith("q_proj"))
    assert part_of(inner, llava[inner]) is None  # counted once, in the tower's time


def test_parts_add_up_to_at_most_the_forward():
    case = make_tiny("llama")
    parts = measure_parts(TransformersTarget(case.model), case.model, [1, 4], None, repeats=3)
    for n in (1, 4):
        assert set(parts[n]) == set(PARTS)
        assert all(parts[n][p] >= 0 for p in PARTS if p != "other")
        assert parts[n]["attn linears"] > 0 and parts[n]["mlp linears"] > 0 and parts[n]["lm head"] > 0
        assert parts[n]["vision"] == 0


@pytest.mark.parametrize("args,match", [(["--sizes", "0,2"], "--sizes must be"), (["--sizes", "a"], "--sizes must be"),
                                        (["--variants", "fast"], "--variants must be"), (["--repeats", "0"], "--repeats")])
def test_bad_arguments_are_one_line(args, match, capsys):
    assert main(["bench", "cost", "--model", "no/such-model", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err


def test_plain_is_measured_before_optimized_in_any_order():
    """optimize() changes the model in place: ``--variants optimized,plain`` timed the optimized
    linears a second time and labelled them plain."""
    import argparse

    from mmspec.bench.cost import check

    for variants in ("optimized,plain", "plain,optimized", "optimized,plain,optimized"):
        args = argparse.Namespace(sizes="4", variants=variants, repeats=1)
        assert check(args) == ([1, 4], ["plain", "optimized"])
    assert check(argparse.Namespace(sizes="4", variants="optimized", repeats=1))[1] == ["optimized"]


def test_the_command_measures_plain_and_optimized(tmp_path, capsys, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    model = save_tiny_draft(tmp_path / "model", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model)
    results, table = tmp_path / "cost.json", tmp_path / "cost.md"
    assert main(["bench", "cost", "--model", str(model), "--dtype", "fp32", "--threads", "1", "--sizes", "4",
                 "--repeats", "1", "--results", str(results), "--markdown", str(table)]) == 0
    saved = json.loads(results.read_text())
    assert saved["meta"]["machine"]["dtype"] == "float32" and saved["meta"]["sizes"] == [1, 4]
    for variant in ("plain", "optimized"):
        assert set(saved["variants"][variant]["ms"]) == {"1", "4"}
        assert set(saved["variants"][variant]["parts_ms"]["4"]) == set(PARTS)
    text = table.read_text()
    assert "**optimized**" in text and "optimized / plain: n=1" in text and "| 4 |" in text
    assert saved["meta"]["lean"] and "counted in `other`" in text  # a Llama model steps through the lean forward
    assert saved["meta"]["order"] == "turns" and "the sizes in turns each round" in text
    from mmspec.bench.cost import markdown_table

    del saved["meta"]["order"]  # a results file from before the sizes took turns says so
    assert "one size after another" in markdown_table(saved)
    # the same command again writes the table from the complete file, measuring nothing (it measured
    # again and overwrote the file); other settings are refused, the file left as it is
    from mmspec.bench import cost

    before = results.read_bytes()
    monkeypatch.setattr(cost, "load_target", lambda *a: pytest.fail("measured again"))
    argv = ["bench", "cost", "--model", str(model), "--dtype", "fp32", "--threads", "1", "--sizes", "4",
            "--repeats", "1", "--results", str(results), "--markdown", str(tmp_path / "again.md")]
    assert main(argv) == 0 and (tmp_path / "again.md").read_text() == text and results.read_bytes() == before
    capsys.readouterr()
    assert main([*argv[:-4], "--sizes", "8", *argv[-4:]]) == 2
    assert "holds a cost curve of other settings (sizes [1, 4] there, [1, 8] now)" in capsys.readouterr().err
    assert results.read_bytes() == before


def test_bench_threads_default_to_the_cores_this_process_may_run_on(monkeypatch):
    """``taskset -c 1 mmspec bench caption`` runs one thread, not two on one core (whose timing is
    the threads' contention)."""
    import argparse
    import os

    from mmspec.bench import caption, cost, t2i, text

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    for suite in (caption, cost, t2i, text):
        parser = argparse.ArgumentParser()
        suite.add_arguments(parser)
        assert parser.parse_args([]).threads == 1, suite.__name__
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    parser = argparse.ArgumentParser()
    caption.add_arguments(parser)
    assert parser.parse_args([]).threads == 3 and parser.parse_args(["--threads", "2"]).threads == 2
