"""The text-to-image pipeline and CLI on a tiny random model directory (VQ tokenizer + LlamaGen-style
generator + draft; the text encoder is the installed SmolLM2's first layers)."""

import json
import shutil

import numpy as np
from PIL import Image

import pytest
import torch

import mmspec
from mmspec.cli import main
from mmspec.modeling.heads import ImageEagleConfig, ImageEagleHead
from mmspec.modeling.llamagen import LlamaGenConfig, LlamaGenModel
from mmspec.modeling.vq import VQConfig, VQTokenizer
from mmspec.pipelines.text_to_image import METHODS, make_method


def own(method, **settings):
    """The settings of ``settings`` that ``method`` (a spec) reads: a method refuses the others."""
    return METHODS.resolve(method.partition(":")[0]).reads(settings)

pytestmark = pytest.mark.slow  # loads the real SmolLM2 weights (text encoder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("t2i")
    torch.manual_seed(0)
    vq = VQTokenizer(VQConfig(codebook_size=16, ch=32, encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 2], num_res_blocks=1,
                              z_channels=8, image_size=8))  # 4 x 4 tokens
    vq.save(root / "vq")
    for name, dim in (("gen", 64), ("draft", 32)):
        config = LlamaGenConfig(dim=dim, n_layer=2, n_head=2, vocab_size=16, cls_token_num=6, caption_dim=576, block_size=16,
                                multiple_of=32, rope_prefix="identity")
        LlamaGenModel(config).save(root / name, dtype=torch.float32)
    ImageEagleHead(ImageEagleConfig(dim=64, n_head=2, grid=(4, 4))).save(root / "eagle", dtype=torch.float32)
    (root / "gen" / "t2i.json").write_text(json.dumps({"vq": "../vq", "draft": "../draft", "eagle": "../eagle",
                                                       "text_encoder_layers": 2}))
    return root / "gen"


@pytest.mark.parametrize("method", ["sjd", "sjd:vertical", "sjd-coupled", "sjd-pac", "spec", "eagle", "eagle2"])
def test_greedy_methods_reproduce_ar_images(model_dir, method):
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method=method, **own(method, window=4, num_draft_tokens=3))
    r = pipe("a red circle above a blue square", do_sample=False, compare_baseline=True, num_images=2, seed=3)
    assert len(r.images) == 2 and r.images[0].size == (8, 8)
    assert torch.equal(r.tokens, r.baseline_tokens)
    assert r.stats.tokens == 32 and r.stats.speedup > 0 and r.stats.step_compression >= 1.0
    assert r.accepted_map.shape == (2, 4, 4) and int(r.accepted_map[0, 0, 0]) == 0


def test_sampling_reports_its_speed(model_dir):
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method="sjd-coupled:horizontal", window=4)
    r = pipe("a green star", seed=0, guidance_scale=3.0)
    assert r.baseline_images is None and r.stats.speedup is None
    assert r.stats.config["coupled"] and r.stats.config["init"] == "horizontal"
    assert r.stats.target_forwards <= 16 and json.dumps(r.stats.to_dict())
    encoded = json.loads(json.dumps(r.to_dict()))  # images as PNG data URIs, tensors as lists
    assert encoded["tokens"] == r.tokens.tolist() and encoded["baseline_images"] is None
    import base64
    import io

    from PIL import Image

    header, data = encoded["images"][0].split(",", 1)
    assert header == "data:image/png;base64"
    decoded = Image.open(io.BytesIO(base64.b64decode(data)))
    assert decoded.size == r.images[0].size and decoded.tobytes() == r.images[0].convert(decoded.mode).tobytes()
    assert set(r.stats.keys()) == set(encoded["stats"]) and "tau" in r.stats.keys()


@pytest.mark.parametrize("call, message", [
    (lambda p: p(""), "empty prompt"),
    (lambda p: p(["a circle", " "]), "prompt 2 of 2: empty prompt"),  # (which item: stop 78)
    (lambda p: p("a circle", guidance_scale=0.5), "guidance_scale must be a number from 1 to 1000"),
    (lambda p: p("a circle", guidance_scale=float("nan")), "guidance_scale must be a number from 1 to 1000"),
    (lambda p: p("a circle", guidance_scale=float("inf")), "guidance_scale must be a number from 1 to 1000"),
    (lambda p: p("a circle", guidance_scale=1e38), "guidance_scale must be a number from 1 to 1000"),  # (NaN probabilities)
    (lambda p: p("a circle", num_images=0), "num_images must be an integer from 1 to 10000"),
    (lambda p: p("a circle", num_images=10**9), "num_images must be an integer from 1 to 10000"),  # (filled the memory)
])
def test_bad_inputs(model_dir, call, message):
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method="sjd")
    with pytest.raises(ValueError, match=message):
        call(pipe)


def test_bad_models_and_methods(model_dir, tmp_path):
    with pytest.raises(ValueError, match="'smollm2' is mmspec's built-in text model"):  # (was a hub connection error)
        mmspec.pipeline("text-to-image", model="smollm2")
    with pytest.raises(ValueError, match="unknown method"):
        mmspec.pipeline("text-to-image", model=model_dir, method="diffusion")
    with pytest.raises(ValueError, match="init must be one of"):
        mmspec.pipeline("text-to-image", model=model_dir, method="sjd:diagonal")
    tokens = mmspec.pipeline("text-to-image", model=model_dir, method="ar").components.target.num_image_tokens
    with pytest.raises(ValueError, match=f"window=100000 is wider than the image's {tokens} tokens; use at most {tokens}"):
        mmspec.pipeline("text-to-image", model=model_dir, method="sjd", window=100000)  # (it ran, 15x slower)
    (tmp_path / "t2i.json").write_text("{}")
    with pytest.raises(ValueError, match="no image tokenizer"):
        mmspec.pipeline("text-to-image", model=tmp_path)
    with pytest.raises(FileNotFoundError, match="not a text-to-image model directory"):
        mmspec.pipeline("text-to-image", model=tmp_path / "missing")


def test_cli_writes_images_grid_and_acceptance_map(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["t2i", "a red circle", "--model", str(model_dir), "--method", "sjd:vertical", "--window", "4",
                 "--out", str(out), "--compare-baseline", "--greedy", "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    assert record["identical_to_baseline"] and record["stats"]["tokens"] == 16
    for name in ("image-0.png", "baseline-0.png", "acceptance-0.png", "grid.png"):
        assert (out / name).is_file()
    assert main(["t2i", "  ", "--model", str(model_dir), "--out", str(out)]) == 2


def test_cli_draws_a_prompts_file_and_resumes(model_dir, tmp_path, capsys):
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("a red circle\n\na blue star\nthree green squares\n")
    args = ["t2i", "--prompts", str(prompts), "--model", str(model_dir), "--out", str(out), "--greedy", "--no-progress"]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["a red circle", "a blue star", "three green squares"]
    assert all((out / f"{r['id']}-0.png").is_file() and r["stats"]["tokens"] == 16 for r in records)
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text(lines[0] + lines[1][:10])  # killed while writing the second
    capsys.readouterr()
    assert main(args) == 0 and "3 of 3 prompts done; this run drew 2" in capsys.readouterr().out
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["images"] for r in again] == [r["images"] for r in records]
    assert main(["t2i", "a red circle", "--prompts", str(prompts), "--model", str(model_dir)]) == 2
    assert "not both" in capsys.readouterr().err
    # a resume with another seed, or after the prompts file changed, is refused before the model loads
    assert main([*args, "--seed", "5"]) == 2
    assert "holds rows made with other settings (seed 0 there, 5 now)" in capsys.readouterr().err
    prompts.write_text("a red circle\na green star\nthree green squares\n")
    assert main(args) == 2
    assert "row 000001 was made for prompt 'a blue star', but that input is now 'a green star'" in capsys.readouterr().err
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    assert main(["t2i", "--prompts", str(latin), "--model", str(model_dir), "--out", str(tmp_path / "o2")]) == 2
    assert "it is not UTF-8 text; save it as UTF-8" in capsys.readouterr().err


def test_a_prompts_file_resume_with_another_draft_or_head_is_refused(model_dir, tmp_path, capsys):
    """docs/text-to-image.md: a resume of --prompts is refused with another --eagle-head, --draft or
    --processor; they were not among the recorded settings, so such a resume kept the rows drawn
    with the model's own head and drew nothing."""
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("a red circle\n")
    args = ["t2i", "--prompts", str(prompts), "--model", str(model_dir), "--out", str(out), "--greedy", "--no-progress",
            "--method", "eagle"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--eagle-head", str(model_dir.parent / "draft")]) == 2
    assert "holds rows made with other settings (eagle_head None there, " in capsys.readouterr().err
    assert main(args) == 0 and "this run drew 0" in capsys.readouterr().out  # the same settings: resumed


@pytest.mark.parametrize("method, said", [
    ("spec", "method 'spec' drafts with a draft generator (a smaller model of the same family), which a transformers "
             "model does not bring: pass --draft PATH"),
    ("eagle2", "method 'eagle2' drafts with an image EAGLE head (mmspec train image-drafter --model ...), which a "
               "transformers model does not bring: pass --eagle-head DIR"),
    ("lantern", "pass --eagle-head DIR or --draft PATH"),
])
def test_cli_refuses_a_transformers_model_without_the_methods_drafter_before_it_loads(tmp_path, capsys, method, said):
    """``mmspec t2i --model JANUS --method spec`` without --draft loaded the model, then said "pass
    draft=..." (the Python keyword); now one line naming the option, before anything loads (the
    "model" here is a bare config.json, which would not load)."""
    (tmp_path / "janus").mkdir()
    (tmp_path / "janus" / "config.json").write_text("{}")
    assert main(["t2i", "a red circle", "--model", str(tmp_path / "janus"), "--method", method,
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err


def test_a_refused_prompt_fails_its_row_only_in_a_batch(model_dir, tmp_path, capsys, monkeypatch):
    """``--prompts FILE --batch-size 4``: a prompt the pipeline refused (a model whose context it
    does not fit) failed every prompt of its batch, each record carrying its error; now its own row
    fails and its batch-mates are drawn, as without a batch."""
    from mmspec.pipelines.text_to_image.pipeline import TextToImagePipeline

    original = TextToImagePipeline.prompt_inputs

    def refusing(self, prompt):
        if prompt == "a blue star":
            raise ValueError("the prompt does not fit the model's context")
        return original(self, prompt)

    monkeypatch.setattr(TextToImagePipeline, "prompt_inputs", refusing)
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("a red circle\na blue star\nthree green squares\n")
    assert main(["t2i", "--prompts", str(prompts), "--model", str(model_dir), "--out", str(out), "--greedy",
                 "--no-progress", "--batch-size", "4"]) == 2
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert ["error" in r for r in records] == [False, True, False]
    assert "the prompt does not fit the model's context" in records[1]["error"]
    alone = tmp_path / "alone"
    main(["t2i", "three green squares", "--model", str(model_dir), "--out", str(alone), "--greedy", "--no-progress"])
    assert (out / "000002-0.png").read_bytes() == (alone / "image-0.png").read_bytes()
    assert "1 of 3 rows failed" in capsys.readouterr().err


def test_two_processes_give_the_one_process_prompts_file(model_dir, tmp_path, free_port):
    """accelerate launch shards the prompts over 2 CPU processes (gloo) and gathers one results file
    in prompt order: the same records and images as one process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue star\nthree green squares\na yellow moon\n")
    args = lambda out: ["t2i", "--prompts", str(prompts), "--model", str(model_dir), "--out", str(out), "--seed", "3",
                        "--no-progress", "--threads", "1"]
    assert main(args(tmp_path / "one")) == 0
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port),
                           "-m", "mmspec", *args(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [[json.loads(line) for line in (tmp_path / run / "results.jsonl").read_text().splitlines()] for run in ("one", "two")]
    assert [r["prompt"] for r in records[1]] == ["a red circle", "a blue star", "three green squares", "a yellow moon"]
    names = [[(r["id"], r["prompt"], [Path(i).name for i in r["images"]]) for r in run] for run in records]
    assert names[0] == names[1]
    for r in records[0]:
        for image in r["images"]:
            name = Path(image).name
            assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert not list((tmp_path / "two").glob("results.jsonl.rank-*"))


def test_relaxed_methods_report_their_bounds(model_dir):
    exact = mmspec.pipeline("text-to-image", model=model_dir, method="lantern", delta=0.0, neighbours_k=4, num_draft_tokens=3)
    r = exact("a red circle", do_sample=False, compare_baseline=True, seed=1)
    assert torch.equal(r.tokens, r.baseline_tokens)  # delta = 0: greedy LANTERN is greedy decoding
    assert r.stats.config["acceptance"] == "lantern" and r.stats.config["delta"] == 0.0 and r.stats.config["neighbours_k"] == 4
    for method, key in (("lantern", "delta"), ("lantern++", "lam"), ("gsd", "top_m"), ("lantern:draft", "delta"),
                        ("lantern++:eagle2", "lam")):
        pipe = mmspec.pipeline("text-to-image", model=model_dir, method=method, neighbours_k=4, num_draft_tokens=3)
        stats = pipe("a red circle", seed=2).stats
        assert stats.config["acceptance"] == method.split(":")[0] and key in stats.config and stats.tokens == 16
        drafter = {"lantern:draft": "draft-model", "lantern++:eagle2": "image-eagle2"}.get(method, "image-eagle")
        assert stats.config["drafter"] == drafter  # the model's EAGLE head unless told otherwise
    with pytest.raises(ValueError, match="delta must be a finite number >= 0"):
        mmspec.pipeline("text-to-image", model=model_dir, method="lantern", delta=-1)


def test_bench_method_settings(model_dir):
    from argparse import Namespace

    from mmspec.bench.t2i import configure
    from mmspec.pipelines.text_to_image.components import T2IComponents

    args = Namespace(window=16, num_draft_tokens=4, neighbours_k=None, delta=0.1, lam=None)
    method = configure("lantern:eagle2/k=7/delta=0.3", args)
    assert method.settings == {"drafter": "eagle2", "num_draft_tokens": 4, "neighbours_k": 7, "delta": 0.3}
    components = T2IComponents.from_pretrained(model_dir)
    stats = method.generate(components, components.prompt_inputs("a red circle"), 0, do_sample=True,
                            guidance_scale=2.0).stats
    assert stats.config["neighbours_k"] == 7 and stats.config["delta"] == 0.3 and stats.config["drafter"] == "image-eagle2"
    assert configure("lantern++", args).settings["lam"] == 10.0  # unset: the method's default
    assert configure("sjd:vertical", args).settings == {"window": 16, "init": "vertical"}  # the command line's window
    assert configure("sjd-pac/branches=3/depth=2", args).settings["pac_branches"] == 3
    with pytest.raises(ValueError, match="unknown setting"):
        configure("lantern/x=1", args)
    with pytest.raises(ValueError, match="k='many' in 'lantern/k=many' is not a valid int"):
        configure("lantern/k=many", args)
    with pytest.raises(ValueError, match="delta must be a finite number"):
        configure("lantern/delta=nan", args)
    # --num-draft-tokens not given: the benchmark's K = 4, unless the spec sets its own (it was refused:
    # "sets num_draft_tokens=6 and num_draft_tokens=4 is given as well", a 4 the user never gave)
    from mmspec.cli import build_parser

    unset = build_parser().parse_args(["bench", "t2i"])  # the command line's defaults
    assert configure("spec", unset).settings == {"num_draft_tokens": 4}
    assert configure("spec:num_draft_tokens=6", unset).settings == {"num_draft_tokens": 6}
    assert configure("eagle2:num_draft_tokens=6", unset).settings["num_draft_tokens"] == 6
    with pytest.raises(ValueError, match="sets num_draft_tokens=6 and num_draft_tokens=4 is given as well"):
        configure("spec:num_draft_tokens=6", args)  # given on the command line too: two values, refused


def test_pipeline_on_shared_components(model_dir):
    """The pipeline over components loaded once (as the bench and the recipe share them): same
    seed, same images as a pipeline that loads the model itself."""
    from mmspec.pipelines.text_to_image.components import T2IComponents

    components = T2IComponents.from_pretrained(model_dir)
    shared = mmspec.pipeline("text-to-image", components=components, method="sjd", window=4)
    own = mmspec.pipeline("text-to-image", model=model_dir, method="sjd", window=4)
    assert shared.target is components.target
    assert torch.equal(shared("a green star", seed=5).tokens, own("a green star", seed=5).tokens)
    with pytest.raises(ValueError, match="either model=... or components=..."):
        mmspec.pipeline("text-to-image", model=model_dir, components=components)


def test_bench_runs_methods_on_shared_components(model_dir, tmp_path, capsys):
    results = tmp_path / "t2i.json"
    code = main(["bench", "t2i", "--model", str(model_dir), "--methods", "ar,sjd:vertical,lantern:draft/k=4",
                 "--prompts", "2", "--rounds", "1", "--window", "4", "--threads", "1", "--no-quality",
                 "--results", str(results)])
    assert code == 0
    summary = json.loads(results.read_text())["summary"]
    assert summary["ar"]["exact"] and not summary["lantern:draft/k=4"]["exact"]
    assert summary["sjd:vertical"]["speedup"] > 0 and "| lantern:draft/k=4 |" in capsys.readouterr().out
    assert summary["sjd:vertical"]["settings"]["window"] == 4
    # without --window / --delta: the methods' own defaults, as the pipeline runs them (the bench ran 16 / 0.1)
    assert main(["bench", "t2i", "--model", str(model_dir), "--methods", "ar,sjd,lantern:draft", "--prompts", "1",
                 "--rounds", "1", "--threads", "1", "--no-quality", "--results", str(tmp_path / "defaults.json")]) == 0
    settings = {spec: row["settings"] for spec, row in json.loads((tmp_path / "defaults.json").read_text())["summary"].items()}
    width = mmspec.pipeline("text-to-image", model=model_dir).components.verification_width
    assert settings["sjd"]["window"] == {"narrow": 2, "medium": 6}.get(width, 8)  # (by the machine: JacobiMethod.windows)
    assert settings["lantern:draft"]["delta"] == make_method("lantern:draft").settings["delta"] == 0.05
    assert main(["bench", "t2i", "--model", str(model_dir), "--methods", "ar,lantern/delta=nan",
                 "--results", str(tmp_path / "other.json")]) == 2  # refused before the model loads


@pytest.mark.parametrize("method", ["ar", "sjd", "eagle", "eagle2", "lantern"])
def test_batched_images_equal_batch_one(model_dir, method):
    """batch_size=3 over 4 images (seeds s..s+3): the tokens of batch size 1, sampled with guidance
    (EAGLE-2 drafts its chain in a batch, other random numbers: compared greedy, where both are AR's)."""
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method=method,
                           **own(method, window=4, num_draft_tokens=3, neighbours_k=4))
    sample = method != "eagle2"
    one = pipe("a red circle above a blue square", num_images=4, seed=5, do_sample=sample)
    batched = pipe("a red circle above a blue square", num_images=4, seed=5, batch_size=3, compare_baseline=True, do_sample=sample)
    assert torch.equal(one.tokens, batched.tokens) and batched.accepted_map.shape == (4, 4, 4)
    assert [r["config"]["batch_size"] for r in batched.stats.per_image] == [3, 3, 3, 1]
    assert batched.stats.speedup > 0 and batched.baseline_tokens.shape == one.tokens.shape
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        pipe("a circle", batch_size=0)


def test_bench_throughput_and_cli_batch_size(model_dir, tmp_path, capsys):
    results = tmp_path / "t2i-throughput.json"
    assert main(["bench", "t2i", "--model", str(model_dir), "--methods", "ar,sjd,lantern", "--prompts", "3", "--rounds", "1",
                 "--window", "4", "--threads", "1", "--batch-sizes", "1,3", "--results", str(results)]) == 0
    assert "| batch | ar | sjd | lantern |" in capsys.readouterr().out
    summary = json.loads(results.read_text())["throughput_summary"]["1"]
    assert all(summary["3"][m]["rows_identical"] for m in ("ar", "sjd", "lantern"))
    assert main(["bench", "t2i", "--model", str(model_dir), "--methods", "ar,sjd-pac", "--batch-sizes", "2",
                 "--results", str(tmp_path / "pac.json")]) == 2
    assert "method 'sjd-pac' decodes one image at a time; for --batch-sizes > 1 use" in capsys.readouterr().err
    out = tmp_path / "cli"
    assert main(["t2i", "a green star", "--model", str(model_dir), "--num-images", "3", "--batch-size", "2",
                 "--out", str(out), "--json"]) == 0
    assert len(list(out.glob("*.png"))) >= 3


def test_a_list_of_prompts_in_batches(model_dir, tmp_path, capsys):
    """A list of prompts gives one output per prompt, the same images at batch size 1 and 4 (rows
    of different prompts decoded together); the prompts file does the same with --batch-size."""
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method="sjd", window=4)
    prompts = ["a red circle", "a blue star", "three green squares"]
    one = pipe(prompts, num_images=2, seed=1)
    batched = pipe(prompts, num_images=2, seed=1, batch_size=4)
    assert len(one) == len(batched) == 3
    for a, b, prompt in zip(one, batched, prompts):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, pipe(prompt, num_images=2, seed=1).tokens)
    # image i of a call is the image of seed + i alone, to the pixel (each image decoded alone)
    alone = pipe(prompts[0], seed=2)
    assert torch.equal(one[0].tokens[1], alone.tokens[0]) and one[0].images[1].tobytes() == alone.images[0].tobytes()
    assert batched[0].images[1].tobytes() == alone.images[0].tobytes()
    with pytest.raises(ValueError, match="no prompts"):
        pipe([])
    file, out = tmp_path / "prompts.txt", tmp_path / "out"
    file.write_text("\n".join(prompts) + "\n")
    for folder, extra in ((out / "one", []), (out / "batched", ["--batch-size", "2"])):
        assert main(["t2i", "--prompts", str(file), "--model", str(model_dir), "--out", str(folder), "--no-progress",
                     "--method", "sjd", "--window", "4", *extra]) == 0
    capsys.readouterr()
    grids = [[json.loads(line)["stats"]["tokens"] for line in (out / name / "results.jsonl").read_text().splitlines()]
             for name in ("one", "batched")]
    assert grids[0] == grids[1] == [16, 16, 16]
    pixels = [[np.asarray(Image.open(out / name / f"{i:06d}-0.png")) for i in range(3)] for name in ("one", "batched")]
    assert all(np.array_equal(a, b) for a, b in zip(*pixels))


@pytest.mark.parametrize("method", ["sjd", "spec", "eagle2"])
def test_bfloat16_generator_stays_exact_in_its_dtype(model_dir, method):
    """dtype="bfloat16": the generator and draft load in bf16, greedy methods give the bf16 AR image,
    and the stats say the dtype."""
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method=method, dtype="bfloat16",
                           **own(method, window=4, num_draft_tokens=3))
    assert next(pipe.components.generator.parameters()).dtype == torch.bfloat16
    r = pipe("a red circle above a blue square", do_sample=False, compare_baseline=True, seed=3)
    assert torch.equal(r.tokens, r.baseline_tokens) and r.stats.config["dtype"] == "bfloat16"
    default = mmspec.pipeline("text-to-image", model=model_dir, method=method, **own(method, window=4, num_draft_tokens=3))
    assert default("a circle", do_sample=False).stats.config["dtype"] == "float32"


def test_bad_dtypes_are_refused_before_loading(model_dir):
    with pytest.raises(ValueError, match="unknown dtype"):
        mmspec.pipeline("text-to-image", model=model_dir, dtype="int8")
    with pytest.raises(ValueError, match=r"MAR models run in float32 only; drop dtype='bfloat16' \(--dtype bfloat16;"):
        mmspec.pipeline("text-to-image", model="mar", method="ar", dtype="bfloat16")


def test_the_api_refuses_what_the_cli_refuses_and_records_the_seed(tmp_path):
    """From the text-to-image audit: sampling options under do_sample=False, a seed whose last
    image's seed + i passes 2**63 - 1, and mar-parallel with more steps than tokens are one line,
    not ignored; seed=None's seed is in stats.config["seed"], and repeats the images."""
    t2i = mmspec.pipeline("text-to-image", method="ar")
    for kwargs, message in (({"do_sample": False, "top_k": 5}, "top_k applies only when sampling"),
                            ({"do_sample": False, "temperature": 0.5}, "temperature applies only when sampling"),
                            ({"seed": 2**63 - 1, "num_images": 2}, "image i takes seed \\+ i")):
        with pytest.raises(ValueError, match=message):
            t2i("a red circle", **kwargs)
    first = t2i("a red circle", seed=None)
    again = t2i("a red circle", seed=first.stats.config["seed"])
    assert torch.equal(first.tokens, again.tokens)
    with pytest.raises(ValueError, match="mar-parallel:1000 is more steps than the image's 64 tokens"):
        mmspec.pipeline("text-to-image", model="mar", method="mar-parallel:1000", dtype="auto")("a red circle")


def test_a_run_replaces_an_earlier_runs_images_in_its_folder(tmp_path, capsys):
    from mmspec.cli import main

    out = tmp_path / "st"
    assert main(["t2i", "a green triangle", "--num-images", "2", "--compare-baseline", "--out", str(out), "--no-progress"]) == 0
    assert main(["t2i", "a red square", "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["acceptance-0.png", "grid.png", "image-0.png"]
    assert "removed 4 images an earlier run left there" in capsys.readouterr().out


def test_the_image_drafter_recipe_links_its_head_into_the_targets_manifest(model_dir, tmp_path, monkeypatch, capsys):
    """The stop-78 audit: following the cards (train t2i, then train image-drafter), --method eagle
    said "pass eagle_head=DIR": nothing named the trained head in the target's t2i.json."""
    from mmspec.cli import main

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "gen"
    shutil.copytree(model_dir, target)
    manifest = {"vq": str(model_dir.parent / "vq"), "draft": str(model_dir.parent / "draft"), "text_encoder_layers": 2}
    (target / "t2i.json").write_text(json.dumps(manifest))
    out = tmp_path / "eagle"
    assert main(["train", "image-drafter", "--model", str(target), "--out", str(out), "--sequences", "4", "--val-sequences",
                 "2", "--gen-batch", "2", "--steps", "2", "--batch-size", "2", "--save-every", "2", "--threads", "1"]) == 0
    assert json.loads((target / "t2i.json").read_text())["eagle"] == "../eagle"
    said = capsys.readouterr()
    assert "linked the head into" in said.out
    assert "shorten the prompt" not in said.err  # (the h5 audit: the scenes' own long descriptions, cut knowingly)
    r = mmspec.pipeline("text-to-image", model=target, method="eagle")("a red circle", seed=0)
    assert r.stats.config["drafter"] == "image-eagle"


def test_the_image_drafter_recipe_encodes_its_long_descriptions_with_warn_cut_off(model_dir):
    """The recipe's prompt function passes ``warn_cut=False`` (as train t2i does), rather than
    filtering the warning by its text around the call (a reworded warning would have leaked)."""
    import warnings

    from mmspec.train.image_drafter import _setup

    long = " ".join(["a red circle above a blue square"] * 12)
    _, prompt_inputs, own, _ = _setup(str(model_dir), None, False, torch.device("cpu"))
    assert own is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = prompt_inputs(long)["caption"]
    pipe = mmspec.pipeline("text-to-image", model=model_dir, method="ar")
    with pytest.warns(UserWarning, match="shorten the prompt"):
        loud = pipe.components.prompt_inputs(long)["caption"]
    assert torch.equal(quiet, loud)
