"""``mmspec bench caption`` on a tiny saved SmolVLM checkpoint: table shape, greedy exactness, SPD
draft path, resumption."""

import json

import numpy as np
import pytest
import torch
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
    argv = ["bench", "caption", "--model", str(checkpoint), "--methods", f"ar,prompt-lookup@3,layer-skip:1,spd:{draft}",
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
            assert row["ar"]["S_token"] == pytest.approx(1.0)
            for method in methods[1:]:
                assert row[method]["S"] > 0 and row[method]["S_token"] > 0 and 1.0 <= row[method]["tau"] <= 9
                if temperature == "0" and family != "mean":
                    assert row[method]["exact"] == "2/2"  # fp32 greedy: identical to AR
    runs = json.loads(results.read_text())["runs"]
    assert len(runs) == 2 * 2 * 2 * 2 * len(methods)  # temperatures x families x items x rounds x methods
    assert all(0 < run["prefill"] < run["seconds"] for run in runs.values())
    for table in summary.values():
        assert table["mean"]["ar"]["S_decode"] == pytest.approx(1.0)
        assert all(table["mean"][m]["S_decode"] > 0 for m in methods)


def test_the_decoding_only_speedup_leaves_the_prefill_out():
    from mmspec.bench.caption import render_tables, summarise

    def run(seconds, prefill, tokens):
        return {"seconds": seconds, "prefill": prefill, "tokens": list(range(tokens)), "tau": 1.0, "acceptance": None}

    # both spend 1 s on the prefill; AR decodes 10 tokens after the first in 2 s, the method in 0.5 s
    runs = {"0/scenes/0/ar/1": run(3.0, 1.0, 11), "0/scenes/0/m/1": run(1.5, 1.0, 11)}
    summary = summarise({"runs": runs}, ["ar", "m"], [0.0], {"scenes": [0]}, repeats=1)
    mean = summary["0"]["mean"]["m"]
    assert mean["S"] == pytest.approx(2.0) and mean["S_decode"] == pytest.approx(4.0)
    meta = {"model": "m", "dtype": "fp32", "threads": 1, "per_family": 1, "repeats": 1}
    assert "| mean, decoding only" in render_tables(summary, meta) and "| 1.00 | 4.00 |" in render_tables(summary, meta)
    del runs["0/scenes/0/m/1"]["prefill"]  # a run recorded before the prefill was: no decoding-only row
    summary = summarise({"runs": runs}, ["ar", "m"], [0.0], {"scenes": [0]}, repeats=1)
    assert "S_decode" not in summary["0"]["mean"]["m"] and "decoding only" not in render_tables(summary, meta)


def test_rerun_resumes_without_measuring_again(bench_run, capsys):
    argv, results = bench_run
    assert main(argv) == 0
    before = json.loads(results.read_text())["runs"]
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(results.read_text())["runs"] == before


def test_missing_spd_draft_is_a_one_line_error(bench_run, tmp_path, capsys):
    argv, _ = bench_run
    argv = [a if not a.startswith("ar,") else f"ar,spd:{tmp_path / 'nothing'}" for a in argv]
    assert main(argv[:-3] + ["--results", str(tmp_path / "r.json")]) == 2
    assert "train it with `mmspec train caption-draft`" in capsys.readouterr().err


def test_spd_by_name_needs_the_shipped_draft(bench_run, tmp_path, capsys):
    """A checkpoint that is not the embedded captioner has no shipped SPD draft: one-line error."""
    argv, _ = bench_run
    argv = [a if not a.startswith("ar,") else "ar,spd" for a in argv]
    assert main(argv[:-3] + ["--results", str(tmp_path / "r.json")]) == 2
    assert "spd:PATH" in capsys.readouterr().err


def test_results_of_another_model_are_refused(bench_run, tmp_path, capsys):
    argv, results = bench_run
    assert main(argv) == 0
    argv = list(argv)
    argv[argv.index("--model") + 1] = str(tmp_path)
    assert main(argv) == 2 and "pass another --results file" in capsys.readouterr().err


def test_method_parsing():
    assert parse_method("prompt-lookup:10@6") == ("prompt-lookup:10", 6)
    assert parse_method("ar") == ("ar", None)


def test_write_drafters_file_feeds_auto(bench_run, tmp_path, capsys):
    import shutil

    import mmspec

    argv, results = bench_run
    model_dir = tmp_path / "model"
    shutil.copytree(argv[argv.index("--model") + 1], model_dir)
    argv = list(argv)
    argv[argv.index("--model") + 1] = str(model_dir)
    argv[argv.index("--results") + 1] = str(tmp_path / "results.json")
    assert main(argv + ["--write-drafters-file"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    # (another model's file: docs/captioning.md quotes only the embedded captioner's)
    assert f"wrote {model_dir / 'mmspec_drafters.json'}; drafter=\"auto\" reads it as:\n" in captured.err
    assert "docs/captioning.md" not in captured.err
    from mmspec.bench.caption import quoted_as
    from mmspec.modeling.captioner import default_captioner_dir

    assert quoted_as(default_captioner_dir() / "mmspec_drafters.json") == "docs/captioning.md quotes it as"
    table = json.loads((model_dir / "mmspec_drafters.json").read_text())
    entries = table["drafters"]
    assert [e["drafter"] for e in entries][:2] == ["prompt-lookup", "layer-skip:1"] and entries[0]["num_draft_tokens"] == 3
    assert entries[1]["speedup"] == round(summary["0"]["mean"]["layer-skip:1"]["S"], 3)
    assert entries[1]["sampled_speedup_per_token"] == round(summary["1"]["mean"]["layer-skip:1"]["S_token"], 3)
    machine = table["machine"]  # what the numbers depend on, recorded by the benchmark itself
    assert machine["threads"] == 1 and machine["dtype"] == "float32" and machine["torch"] == torch.__version__
    assert machine["cpu"] and isinstance(machine["cpu_flags"], list) and machine["device"] == "cpu"
    assert table["benchmark"]["max_new_tokens"] == 8 and table["sampled_temperature"] == 1.0
    best = max(entries, key=lambda e: e["speedup"])
    captioner = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32")
    assert f"{best['speedup']:.2f}x on float32, 1 thread" in captioner.drafter_reason


def test_drafters_file_keeps_a_table_per_kind_of_machine(tmp_path):
    """A run on another kind of machine (AMX, AVX-512 BF16, AVX2, GPU) adds its table to
    "other_machines" (replacing one of its kind), a run on the top table's kind replaces that one,
    and drafter="auto" reads the table of the kind it runs on, else the top one."""
    from mmspec.bench.caption import write_drafters_file
    from mmspec.pipelines.captioning import choose_auto_drafter, describe_auto_table, machine_kind, read_auto_table

    meta = {"command": "mmspec bench caption", "per_family": 1, "tasks": "all", "max_new_tokens": 8, "repeats": 1}
    summary = lambda a, b, same="2/2": {"0": {"mean": {"eagle": {"S": a}, "eagle3": {"S": b}},
                                              "shapes": {"eagle": {"exact": same}, "eagle3": {"exact": "2/2"}}}}
    cpu = {"device": "cpu", "cpu": "Some CPU", "cpu_flags": ["avx2"], "dtype": "float32", "threads": 1}
    amx = {**cpu, "cpu_flags": ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], "dtype": "bfloat16"}
    gpu = {**cpu, "device": "NVIDIA H200"}
    assert [machine_kind(m) for m in (cpu, amx, gpu, None)] == ["avx2", "amx", "cuda", None]
    write_drafters_file(tmp_path, summary(2.0, 1.5), ["ar", "eagle", "eagle3"], meta, cpu)
    write_drafters_file(tmp_path, summary(1.0, 1.2), ["ar", "eagle", "eagle3"], meta, gpu)
    write_drafters_file(tmp_path, summary(2.3, 2.5), ["ar", "eagle", "eagle3"], meta, amx)
    write_drafters_file(tmp_path, summary(1.1, 1.4), ["ar", "eagle", "eagle3"], meta, gpu)  # replaces the first GPU run
    table = read_auto_table(tmp_path)
    assert table["machine"] == cpu and [machine_kind(t["machine"]) for t in table["other_machines"]] == ["amx", "cuda"]
    assert [e["speedup"] for e in table["other_machines"][1]["drafters"]] == [1.1, 1.4]
    entry, reason = choose_auto_drafter(tmp_path, ("cuda", False))
    assert entry["drafter"] == "eagle3" and "1.40x on float32, 1 thread, NVIDIA H200" in reason
    write_drafters_file(tmp_path, summary(1.9, 2.1), ["ar", "eagle", "eagle3"], meta, cpu)  # the top kind again
    table = read_auto_table(tmp_path)
    assert table["drafters"][1]["speedup"] == 2.1 and len(table["other_machines"]) == 2
    text = describe_auto_table(tmp_path)
    assert "On CPUs with AMX it picks `eagle3`: 2.50x over plain decoding at temperature 0" in text
    assert "On GPUs it picks `eagle3`: 1.40x" in text
    # a drafter whose greedy captions were not all plain decoding's is left out (the stop-78 audit: a
    # drafter stopping early would have been recorded, and chosen, as faster)
    write_drafters_file(tmp_path, summary(5.0, 2.1, same="1/2"), ["ar", "eagle", "eagle3"], meta, cpu)
    assert [e["drafter"] for e in read_auto_table(tmp_path)["drafters"]] == ["eagle3"]
    (tmp_path / "mmspec_drafters.json").write_text(json.dumps({**table, "other_machines": [{"machine": gpu}]}))
    with pytest.raises(ValueError, match='each of its "other_machines"'):
        read_auto_table(tmp_path)


def test_write_drafters_file_is_checked_before_measuring(bench_run, tmp_path, capsys):
    argv, _ = bench_run
    argv = list(argv)
    argv[argv.index("--temperatures") + 1] = "1"
    argv[argv.index("--results") + 1] = str(tmp_path / "results.json")
    assert main(argv + ["--write-drafters-file"]) == 2
    assert "needs a local model directory" in capsys.readouterr().err and not (tmp_path / "results.json").exists()


def test_docs_quote_the_shipped_auto_table():
    """docs/captioning.md says what drafter="auto" picks for the embedded captioner in the words
    describe_auto_table makes from models/smolcap/mmspec_drafters.json, so the two cannot drift."""
    from pathlib import Path

    from mmspec.hub import models_dir
    from mmspec.pipelines.captioning import describe_auto_table, read_auto_table

    table = read_auto_table(models_dir() / "smolcap")
    assert table["machine"] and table["written_by"].startswith("mmspec bench caption")
    docs = (Path(__file__).parents[1] / "docs" / "captioning.md").read_text()
    assert describe_auto_table(models_dir() / "smolcap") in " ".join(docs.split())


def test_task_filter_draws_only_those_kinds():
    from mmspec.bench.caption import bench_items
    from mmspec.train.data import make_sample

    items = bench_items(["scenes", "charts"], 3, tasks="caption,detailed")
    assert [family for family, *_ in items] == ["scenes"] * 3 + ["charts"] * 3
    assert all(make_sample(family, "test", index).kind in ("caption", "detailed") for family, index, _, _ in items)
    everything = bench_items(["scenes"], 3)
    assert [index for _, index, _, _ in everything] == [0, 1, 2]
    with pytest.raises(ValueError, match="unknown task kinds"):
        bench_items(["scenes"], 1, tasks="essay")


def test_per_token_speedup_divides_time_per_token():
    from mmspec.bench.caption import _per_token_speedup

    ar = {"all_seconds": 4.0, "all_tokens": 40}  # 0.1 s per token
    method = {"all_seconds": 1.5, "all_tokens": 30}  # 0.05 s per token, shorter captions
    assert _per_token_speedup(ar, method) == pytest.approx(2.0)


def test_text_bench_overall_table_sums_times():
    from mmspec.bench.text import overall_table

    cells = {("qa", "ar"): (2.0, 2.0, 1.0), ("qa", "eagle"): (1.0, 2.0, 3.0),
             ("math", "ar"): (6.0, 6.0, 1.0), ("math", "eagle"): (2.0, 6.0, 4.0)}
    lines = overall_table(cells, ["ar", "eagle"], ["qa", "math", "rag"], "bf16")
    assert lines[1] == "| method | qa | math | overall |"  # types without runs are left out
    assert lines[-1] == "| eagle | 2.00 / 3.00 | 3.00 / 4.00 | 2.67 |"  # overall = (2 + 6) / (1 + 2)


def test_throughput_at_several_batch_sizes(tmp_path, tmp_path_factory, capsys):
    """--batch-sizes: one pass per (temperature, batch size, method, round); every row of a batched
    pass equals the batch-size-1 pass (greedy and sampled); tables and crossover are printed."""
    checkpoint = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    results = tmp_path / "throughput.json"
    argv = ["bench", "caption", "--model", str(checkpoint), "--methods", "ar,prompt-lookup@3", "--families", "scenes,text",
            "--per-family", "2", "--repeats", "1", "--temperatures", "0,1", "--max-new-tokens", "8", "--dtype", "fp32",
            "--threads", "1", "--results", str(results), "--batch-sizes", "1,3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| batch | ar | prompt-lookup@3 |" in out and "Crossover" in out
    data = json.loads(results.read_text())
    assert len(data["throughput"]) == 2 * 2 * 2 * 2  # temperatures x batch sizes x rounds x methods
    for t in ("0", "1"):
        for method in ("ar", "prompt-lookup@3"):
            row = data["throughput_summary"][t]["3"][method]
            assert row["rows_identical"] is True and row["items_per_s"] > 0
        assert data["throughput_summary"][t]["1"]["ar"]["speedup"] == pytest.approx(1.0)
    # the same --results over other items (more per family): the runs over 4 items were resumed as
    # the 6 items' throughput; now refused in one line
    assert main([*argv[:9], "3", *argv[10:]]) == 2
    assert "holds throughput runs over other items (4 there, 6 now" in capsys.readouterr().err
    assert main(argv) == 0  # the same items: resumed


@pytest.mark.parametrize("extra,message", [(["--batch-sizes", "1,0"], "comma list of positive integers"),
                                           (["--batch-sizes", "1,4,4"], "--batch-sizes names 4 more than once"),
                                           (["--batch-sizes", "2", "--methods", "prompt-lookup"], "include ar")])
def test_bad_throughput_options_are_one_line_errors(tmp_path, tmp_path_factory, capsys, extra, message):
    checkpoint = cached_tiny_checkpoint("smolvlm", tmp_path_factory)
    argv = ["bench", "caption", "--model", str(checkpoint), "--families", "scenes", "--per-family", "1", "--dtype", "fp32",
            "--results", str(tmp_path / "x.json"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_throughput_table_feeds_auto_for_batches(tmp_path, tmp_path_factory, capsys):
    """--batch-sizes --write-drafters-file adds the "batches" table; drafter="auto" then decodes a
    batch with the fastest method measured at the largest batch size <= it (plain decoding included)."""
    import shutil

    import mmspec
    from mmspec.pipelines.captioning import choose_batch_drafter

    model_dir = tmp_path / "model"
    shutil.copytree(cached_tiny_checkpoint("smolvlm", tmp_path_factory), model_dir)
    argv = ["bench", "caption", "--model", str(model_dir), "--methods", "ar,prompt-lookup@3", "--families", "scenes,text",
            "--per-family", "2", "--repeats", "1", "--temperatures", "0", "--max-new-tokens", "8", "--dtype", "fp32",
            "--threads", "1", "--results", str(tmp_path / "throughput.json"), "--batch-sizes", "1,3", "--write-drafters-file"]
    assert main(argv) == 0
    assert "In batches it picks" in capsys.readouterr().err
    table = json.loads((model_dir / "mmspec_drafters.json").read_text())
    assert {(e["batch_size"], e["drafter"]) for e in table["batches"]} == {(1, "ar"), (1, "prompt-lookup"), (3, "ar"), (3, "prompt-lookup")}
    assert [e["drafter"] for e in table["drafters"]] == ["prompt-lookup"] and table["batches_measured"]["machine"]["threads"] == 1
    best3 = max((e for e in table["batches"] if e["batch_size"] == 3), key=lambda e: e["speedup"])
    assert choose_batch_drafter(model_dir, 2) is None  # below the smallest measured batch: the single-image choice
    assert choose_batch_drafter(model_dir, 8)[0] == best3["drafter"]
    captioner = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (24, 24, 3), dtype=np.uint8) for _ in range(3)]
    results = captioner(images, batch_size=3, max_new_tokens=4)
    assert all(r.stats.config["drafter_choice"].startswith("auto for batch size 3: highest measured throughput at batch size 3")
               for r in results)
    assert results[0].stats.config["drafter"] == best3["drafter"]
    sampled = captioner(images, batch_size=3, max_new_tokens=4, do_sample=True, seed=1)
    assert all(r.stats.config["drafter_choice"].endswith("measured at temperature 0 (no sampled batches were measured)")
               for r in sampled)
    assert sampled[0].stats.config["drafter"] == best3["drafter"]


def test_bench_drafters_are_optimized_as_the_pipeline_optimizes_its_own(bench_run, tmp_path):
    """The bench measures a drafter as `mmspec caption --drafter` runs it: its networks' linears
    few-row when the pipeline's are, as loaded with --no-optimize."""
    import mmspec
    from mmspec.api import component_modules
    from mmspec.bench.caption import drafter_for
    from mmspec.modeling.fast_linear import FewRowLinear

    checkpoint = bench_run[0][bench_run[0].index("--model") + 1]
    draft = bench_run[0][bench_run[0].index("--methods") + 1].split("spd:")[1]
    for optimize in (True, False):
        pipe = mmspec.pipeline("image-captioning", model=checkpoint, dtype="fp32", optimize=optimize)
        drafter = drafter_for(pipe, f"spd:{draft}")
        modules = [m for module in component_modules(drafter) for m in module.modules()]
        assert modules and any(isinstance(m, FewRowLinear) for m in modules) == optimize
    assert drafter_for(pipe, "ar") is None


def test_auto_picks_the_fastest_per_token_drafter_when_sampling(tmp_path, tmp_path_factory, capsys):
    """With a drafters file that measured a temperature > 0, drafter="auto" decodes greedy captions
    with the fastest entry at temperature 0 and sampled ones with the fastest per token there; a
    path in an entry (alone or as a spec's argument) is relative to the model directory."""
    import shutil

    import mmspec
    from mmspec.bench.caption import file_spec
    from mmspec.pipelines.captioning import choose_sampling_drafter
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(cached_tiny_checkpoint("smolvlm", tmp_path_factory), model_dir)
    draft = save_tiny_draft(tmp_path / "draft", vocab_size=len(AutoTokenizer.from_pretrained(model_dir)))
    assert file_spec(f"spd:{draft}", model_dir) == "spd:../draft" and file_spec("prompt-lookup", model_dir) == "prompt-lookup"
    table = {"machine": {"dtype": "float32", "threads": 1}, "sampled_temperature": 1.0, "drafters": [
        {"drafter": "prompt-lookup", "speedup": 2.0, "sampled_speedup_per_token": 0.9},
        {"drafter": "spd:../draft", "speedup": 1.0, "sampled_speedup_per_token": 1.5}]}
    (model_dir / "mmspec_drafters.json").write_text(json.dumps(table))
    assert choose_sampling_drafter(model_dir)[0] == "spd:../draft"
    captioner = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32")
    image = np.random.default_rng(0).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    greedy = captioner(image, max_new_tokens=4)
    sampled = captioner(image, max_new_tokens=4, do_sample=True, seed=0, compare_baseline=True)
    assert greedy.stats.config["drafter"] == "prompt-lookup"
    assert sampled.stats.config["drafter"] == "spd:../draft"
    assert sampled.stats.config["drafter_choice"].startswith("auto when sampling: highest measured speedup per token at temperature 1")
    assert sampled.baseline_stats.config["drafter"] == "ar" and sampled.stats.speedup is not None
    listed = captioner([image] * 3, max_new_tokens=2, do_sample=True, seed=0, batch_size=2)  # a batch of 2, then one row
    # without a batch table a sampled batch runs the sampled choice, as an image alone does: its
    # captions do not depend on their place in the list (the batch of 2 ran the greedy pick)
    assert [r.stats.config["drafter"] for r in listed] == ["spd:../draft"] * 3
    alone = captioner(image, max_new_tokens=2, do_sample=True, seed=0)
    assert [r.text for r in listed] == [alone.text] * 3
    from PIL import Image
    from mmspec.cli import main
    Image.fromarray(image).save(tmp_path / "image.png")
    for flags, header in (([], "drafter: prompt-lookup (auto:"), (["--do-sample", "--seed", "0"], "drafter: spd:../draft (auto when sampling:")):
        capsys.readouterr()
        assert main(["caption", str(tmp_path / "image.png"), "--model", str(model_dir), "--dtype", "fp32",
                     "--max-new-tokens", "2", *flags]) == 0
        assert capsys.readouterr().out.startswith(header)  # the header names what the call runs
    for n in (1, 2):
        Image.fromarray(image[::-1] if n == 1 else image[:, ::-1]).save(tmp_path / f"image{n}.png")
    (model_dir / "mmspec_drafters.json").write_text(json.dumps({**table, "batches": [  # batches of 2 measured: their pick
        {"batch_size": 2, "drafter": "prompt-lookup", "speedup": 1.2}]}))
    assert main(["caption", *[str(tmp_path / name) for name in ("image.png", "image1.png", "image2.png")], "--model", str(model_dir), "--dtype", "fp32",
                 "--max-new-tokens", "2", "--do-sample", "--seed", "0", "--batch-size", "2"]) == 0
    header = capsys.readouterr().out.splitlines()[0]  # a batch of 2, then the last image alone: both named
    assert " for batches of 2; spd:../draft (auto when sampling:" in header and ") for an image alone; float32" in header, header
    (model_dir / "mmspec_drafters.json").write_text(json.dumps(table))
    given = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32", drafter="prompt-lookup")
    assert given(image, max_new_tokens=4, do_sample=True, seed=0).stats.config["drafter"] == "prompt-lookup"  # a named drafter stays
    table["drafters"][0]["sampled_speedup_per_token"] = 2.5  # the temperature-0 pick is fastest when sampling too
    (model_dir / "mmspec_drafters.json").write_text(json.dumps(table))
    same = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32")
    assert same.sampling_drafter()[0] is same.drafter  # reused, not built a second time
    del table["drafters"][1]["sampled_speedup_per_token"], table["drafters"][0]["sampled_speedup_per_token"]
    (model_dir / "mmspec_drafters.json").write_text(json.dumps(table))
    assert choose_sampling_drafter(model_dir) is None  # nothing measured when sampling: the temperature-0 choice
    table["drafters"][1]["speedup"] = 3.0  # the greedy pick a spec with a path: named as the file writes it
    (model_dir / "mmspec_drafters.json").write_text(json.dumps(table))
    picked = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32")
    assert picked.chosen_drafter == "spd:../draft" and picked(image, max_new_tokens=4).stats.config["drafter"] == "spd:../draft"


def test_the_machine_record_names_the_cpu_model(monkeypatch):
    """Zen 4 and Zen 5 both read "AMD EPYC" with the same flags, and their speedups differ: the
    record keeps /proc/cpuinfo's family and model, and the table lines say them."""
    from mmspec import cpu
    from mmspec.bench.results import machine_info, machine_line
    from mmspec.pipelines.captioning.auto_drafter import describe_machine

    fields = cpu.parse_cpuinfo("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                               "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\nprocessor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\n")
    assert fields["cpu family"] == "26" and fields["model"] == "2" and fields["flags"] == "fpu avx2"  # (the first processor's)
    monkeypatch.setattr(cpu, "cpuinfo_fields", lambda: fields)
    machine = machine_info("bfloat16", 1)
    assert machine["cpu"] == "AMD EPYC" and machine["cpu_model"] == "family 26 model 2"  # (the first processor's)
    assert machine_line(machine).startswith("AMD EPYC, family 26 model 2 (")
    assert describe_machine(machine).startswith("bfloat16, 1 thread, AMD EPYC (family 26 model 2) with ")
    del machine["cpu_model"]  # a record written before the field: as before
    assert machine_line(machine).startswith("AMD EPYC (") and "AMD EPYC with " in describe_machine(machine)
    emulated = {**machine, "cpu_flags": ["avx2"], "emulated_from": ["avx2", "avx512f"]}  # (MMSPEC_CPU_FLAGS)
    assert "AMD EPYC with avx2, run as such on a CPU with avx2 avx512f, torch" in describe_machine(emulated)


def test_bench_caption_takes_trust_remote_code_off_by_default(tmp_path, capsys, custom_code_lm, no_terminal):
    """The audit's: ``mmspec bench caption --model DIR`` had no --trust-remote-code, so a checkpoint
    with its own code could not be measured (and its refusal told the user to pass a flag the
    command lacked). Off by default (one line), on it reaches the model's loading."""
    from mmspec.hub import remote_code_refused

    argv = ["bench", "caption", "--model", str(custom_code_lm), "--methods", "ar", "--per-family", "1",
            "--max-new-tokens", "2", "--repeats", "1", "--results", str(tmp_path / "c.json")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "[y/N]" not in captured.out + captured.err
    assert captured.err.strip().splitlines()[-1] == f"mmspec: error: {remote_code_refused(custom_code_lm)}"
    assert main([*argv, "--trust-remote-code"]) == 2  # (a text LM: loaded with its code, then refused as no VLM)
    assert "is a mmspec_custom_lm checkpoint (CustomLM) of its own code (the auto_map of its config.json provides " \
           "AutoConfig, AutoModelForCausalLM), not an image-text-to-text model" in capsys.readouterr().err.strip().splitlines()[-1]


def test_bench_times_auto_as_it_samples(tmp_path, tmp_path_factory):
    """`bench caption --methods auto` at a temperature > 0 times the drafters file's sampled choice,
    as the pipeline runs it (it timed the greedy choice there)."""
    import shutil

    import mmspec
    from mmspec.bench.caption import drafter_for
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(cached_tiny_checkpoint("smolvlm", tmp_path_factory), model_dir)
    save_tiny_draft(tmp_path / "draft", vocab_size=len(AutoTokenizer.from_pretrained(model_dir)))
    (model_dir / "mmspec_drafters.json").write_text(json.dumps({
        "machine": {"dtype": "float32", "threads": 1}, "sampled_temperature": 1.0, "drafters": [
            {"drafter": "prompt-lookup", "speedup": 2.0, "sampled_speedup_per_token": 0.9},
            {"drafter": "spd:../draft", "speedup": 1.0, "sampled_speedup_per_token": 1.5}]}))
    pipe = mmspec.pipeline("image-captioning", model=str(model_dir), dtype="fp32", drafter="ar")
    greedy, sampled = drafter_for(pipe, "auto"), drafter_for(pipe, "auto", do_sample=True)
    assert type(greedy).__name__ == "PromptLookupDrafter" and type(sampled).__name__ != "PromptLookupDrafter"
    _, name, reason = pipe.auto_choice(do_sample=True)
    assert name == "spd:../draft" and reason.startswith("auto when sampling")
