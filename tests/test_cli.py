"""The mmspec command: help, errors without tracebacks, JSON output."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmspec.cli import main


def test_help_as_module_and_console_script():
    console_script = str(Path(sys.executable).parent / "mmspec")  # installed beside this interpreter
    for command in ([sys.executable, "-m", "mmspec", "--help"], [console_script, "--help"]):
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        assert "generate" in done.stdout and "bench" in done.stdout


def test_version(capsys):
    import torch

    import mmspec

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"mmspec {mmspec.__version__} (Python ") and torch.__version__ in out


def test_empty_prompt_is_a_clear_error(capsys):
    assert main(["generate", "   ", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "prompt is empty" in err and "Traceback" not in err


def test_unknown_drafter_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--drafter", "layer-skip:99", "--dtype", "fp32"]) == 2
    assert "layer-skip needs 1 <= N < 30" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_with_baseline(capsys):
    code = main(["generate", "Repeat exactly: the red fox sleeps under the old oak tree.", "--dtype", "fp32",
                 "--max-new-tokens", "12", "--compare-baseline", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical_to_baseline"] is True
    assert result["stats"]["speedup"] > 0 and result["stats"]["method"] == "prompt-lookup"
    assert result["text"] == result["baseline_text"] and result["text"]


@pytest.mark.slow
def test_generate_reads_a_drafter_spec_in_either_form(capsys):
    """``prompt-lookup:num_draft_tokens=4`` is ``prompt-lookup:4`` (the one spec syntax), as in captioning."""
    outputs = []
    for spec in ("prompt-lookup:4", "prompt-lookup:num_draft_tokens=4"):
        assert main(["generate", "Repeat exactly: the red fox sleeps.", "--dtype", "fp32", "--max-new-tokens", "8",
                     "--drafter", spec, "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["text"] == outputs[1]["text"] and outputs[1]["stats"]["config"]["num_draft_tokens"] == 4


def test_a_draft_length_given_twice_is_refused_before_loading(capsys):
    """``prompt-lookup:3`` with ``--num-draft-tokens 5`` ran with 3, the 5 dropped without a word."""
    for spec in ("prompt-lookup:3", "prompt-lookup:num_draft_tokens=3"):
        assert main(["generate", "hi", "--model", "/nonexistent-model", "--drafter", spec, "--num-draft-tokens", "5"]) == 2
        assert "the draft length is given twice" in capsys.readouterr().err  # (before the missing model is found)
    from mmspec.drafters import check_draft_length_use, resolve_drafter

    check_draft_length_use("prompt-lookup:5", 5)  # (the same value twice: accepted)

    with pytest.raises(ValueError, match="the draft length is given twice: drafter='prompt-lookup:3' and num_draft_tokens=5"):
        resolve_drafter("prompt-lookup:3", None, 5)


def test_unknown_drafter_name_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--drafter", "nonsense", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "unknown drafter 'nonsense'" in err and "Traceback" not in err


NO_GPU = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "hi", "--device", "bogus"], "unknown device 'bogus'"),
        pytest.param(["generate", "hi", "--device", "cuda"], "device 'cuda' is not available", marks=NO_GPU),
        (["caption", "missing.png", "--device", "bogus"], "unknown device 'bogus'"),
        pytest.param(["caption", "missing.png", "--device", "cuda:0"], "not available", marks=NO_GPU),
        (["t2i", "a red circle", "--device", "bogus"], "unknown device 'bogus'"),
        pytest.param(["t2i", "a red circle", "--device", "cuda"], "not available", marks=NO_GPU),
        pytest.param(["t2i", "a red circle", "--cuda-graphs", "--device", "cpu"], "cuda_graphs needs a CUDA device"),
        (["train", "t2i", "--device", "bogus"], "unknown device 'bogus'"),
        pytest.param(["train", "tts", "--device", "cuda"], "device 'cuda' is not available", marks=NO_GPU),
        (["t2i", "a red circle", "--threads", "-1"], "--threads must be at least 1"),
        (["bench", "caption", "--threads", "0"], "--threads must be at least 1"),
        (["bench", "text", "--threads", "-1"], "--threads must be at least 1"),
        (["train", "drafter", "--threads", "0"], "--threads must be at least 1"),
        (["train", "tts-drafter", "--kind", "eagle", "--steps", "-1"], "--steps must be at least 1"),
        (["train", "tts-drafter", "--kind", "eagle", "--ffn", "0"], "--ffn must be at least 1"),
        (["train", "tts-drafter", "--kind", "eagle", "--kl-weight", "nan"], "--kl-weight must be a finite number, got nan"),
        (["train", "tts-drafter", "--kind", "eagle", "--ttt", "0"], "--ttt must be at least 1"),
        (["train", "tts-drafter", "--ttt", "3"], "--ttt and --init train an EAGLE head: add --kind eagle"),
        (["train", "tts-drafter", "--kl-weight", "1.0"], "--kl-weight sets an EAGLE head: add --kind eagle"),
        (["train", "tts-drafter", "--ffn", "128", "--kl-weight", "1"], "--kl-weight, --ffn set an EAGLE head"),
        (["train", "tts-drafter", "--kind", "eagle", "--heads", "4"], "--heads sets the number of Medusa heads"),
        # (given at their defaults too: they were accepted, silently unused)
        (["train", "tts-drafter", "--kind", "eagle", "--heads", "3"], "--heads sets the number of Medusa heads"),
        (["train", "tts-drafter", "--kl-weight", "0.1"], "--kl-weight sets an EAGLE head: add --kind eagle"),
        (["train", "tts-drafter", "--kind", "medusa", "--ttt", "1"], "--ttt and --init train an EAGLE head"),
        (["train", "tts-drafter", "--kind", "eagle", "--eval", "/nonexistent"], "no tts-self-data shards there"),
        (["train", "tts-drafter", "--kind", "eagle", "--init", "/nonexistent"], "no EAGLE head there"),
        (["train", "tts-self-data", "--temperature", "1,0"], "--temperature must be a comma list of positive numbers"),
        (["train", "tts-self-data", "--sentences", "8", "--shard-size", "4", "--shards", "1:5"], "--shards must be a:b"),
        (["train", "tts-self-data", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["bench", "tts", "--dtype", "int4"], "unknown dtype 'int4'"),
        (["bench", "t2i", "--no-quality", "--plot", "x.png"], "--plot draws speedup against the Frechet CLIP distance, which --no-quality"),
        (["bench", "t2i", "--batch-sizes", "1,2", "--plot", "x.png"], "which --batch-sizes does not measure"),
        (["run", "caption-embedded", "samples/photo.png", "--out", "x"], "prints the captions and writes no file; drop --out"),
        # the text-to-image audit: what the method and the model's kind decide, before the model loads
        (["t2i", "x", "--method", "sjd:window=4,window=5"], "method 'sjd:window=4,window=5' sets window twice, to 4 and 5"),
        (["t2i", "x", "--method", "sjd", "--eagle-head", "/nonexistent"], "--eagle-head: method 'sjd' drafts without an image EAGLE head"),
        (["t2i", "x", "--method", "sjd", "--draft", "/nonexistent"], "--draft: method 'sjd' drafts without a draft generator"),
        (["t2i", "x", "--method", "eagle", "--eagle-head", "/nonexistent"], "eagle_head='/nonexistent': no such file or directory"),
        (["t2i", "x", "--processor", "foo"], "--processor is for transformers models"),
        (["t2i", "x", "--method", "gsd", "--greedy"], "acceptance='gsd' needs do_sample=True"),
        (["t2i", "x", "--method", "sjd-pac", "--batch-size", "2", "--num-images", "2"], "method 'sjd-pac' decodes one image at a time"),
        (["t2i", "x", "--model", "mar", "--method", "cspd", "--top-k", "5"], "a continuous-token (MAR) model has none"),
        (["t2i", "x", "--seed", str(2**63 - 1), "--num-images", "2"], "use a seed of at most 9223372036854775806"),
        (["t2i", "x", "--method", "sjd-pac", "--pac-branches", "9"], "does not fit window 8: use pac_branches <= 8"),
        (["t2i", "x", "--method", "sjd-pac", "--pac-depth", "20"], "does not fit window 8: use pac_depth <= 2"),
        (["t2i", "x", "--method", "sjd-pac", "--pac-branches", "1"], "pac_branches=1 is one candidate per position: no tree"),
        (["bench", "t2i", "--methods", "ar,sjd-pac", "--batch-sizes", "1,2", "--no-quality"],
         "method 'sjd-pac' decodes one image at a time; for --batch-sizes > 1 use"),
        (["t2i", "x", "--out", "new.png"], "names an image file; give a folder (--out new)"),
        (["bench", "tts", "--greedy", "--temperature", "0.5"], "--temperature applies only when sampling"),
        (["train", "tts", "--save-every", "0"], "--save-every must be at least 1"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["caption", "missing.png", "--max-new-tokens", "-2"], "--max-new-tokens must be at least 1"),
        (["generate", "hi", "--do-sample", "--temperature", "0"], "temperature must be > 0"),
        (["generate", "hi", "--num-draft-tokens", "0"], "--num-draft-tokens must be at least 1"),
        # issue 44: output files that cannot be made (as root /proc passed the permission check), a
        # setting the method does not use or cannot take, --retry-errors without an output file
        (["tts", "Hello there.", "--out", "/proc/x.wav"], "--out /proc/x.wav: cannot create files in /proc"),
        (["tts", "Hello there.", "--out", "/dev/full"], "--out /dev/full is not a regular file"),
        (["t2i", "a red circle", "--out", "/proc/t2i"], "--out /proc/t2i: cannot create files in /proc"),
        (["caption", "missing.png", "--out", "/proc/x.jsonl"], "--out /proc/x.jsonl: cannot create files in /proc"),
        (["bench", "tts", "--results", "/proc/r.json"], "--results /proc/r.json: cannot create files in /proc"),
        (["t2i", "a red circle", "--method", "cspd", "--window", "4"],
         "method 'cspd' takes no setting 'window' (SJD's window L), got window=4"),
        (["t2i", "a red circle", "--method", "mar-parallel", "--num-iter", "0"], "num_iter must be an integer >= 1"),
        (["t2i", "a red circle", "--method", "mar-parallel:0"], "num_iter must be an integer >= 1"),
        (["t2i", "a red circle", "--method", "sjd:num_iter=8"], "method 'sjd' takes no setting 'num_iter'"),
        (["tts", "Hello there.", "--method", "ar", "--num-draft-tokens", "4"],
         "method 'ar' takes no setting 'num_draft_tokens'"),
        (["tts", "Hello there.", "--method", "sjd", "--delta", "0.1"],
         "--delta sets delta, which method 'sjd' does not read; use it with lantern"),
        (["tts", "Hello there.", "--accept-top-k", "3"], "--accept-top-k sets top_k, which method 'sjd-coupled' does not read"),
        (["tts", "Hello there.", "--method", "vadusa:top_k=5", "--accept-top-k", "3"],
         "--method vadusa:top_k=5 sets top_k and --accept-top-k 3 sets it too; give it once"),
        (["t2i", "a red circle", "--method", "sjd:window=4", "--window", "6"],
         "method 'sjd:window=4' sets window=4 and window=6 is given as well; give window once"),
        (["caption", "missing.png", "--retry-errors"], "--retry-errors redoes the failed rows of an output file"),
        (["t2i", "a red circle", "--retry-errors"], "--retry-errors redoes the failed rows of --prompts"),
        (["caption", "missing.png", "--drafter", "ar", "--num-draft-tokens", "4"],
         "num_draft_tokens=4 is a drafter's draft length, but drafter='ar' is plain decoding"),
        (["generate", "hi", "--drafter", "ar", "--num-draft-tokens", "4"], "drafter='ar' is plain decoding"),
        # the sampling options without --do-sample, a seed beyond 64 bits, a spec's bad value, a missing model path
        (["generate", "hi", "--temperature", "0.3"], "--temperature applies only when sampling; add --do-sample"),
        (["caption", "missing.png", "--top-k", "5", "--top-p", "0.5"], "--top-k, --top-p apply only when sampling"),
        (["generate", "hi", "--do-sample", "--seed", str(2**70)], "--seed must be between 0 and 2**63 - 1"),
        (["tts", "Hello there.", "--seed", "-1"], "--seed must be between 0 and 2**63 - 1"),
        (["generate", "hi", "--drafter", "prompt-lookup:abc"], "prompt-lookup takes an integer >= 1"),
        (["generate", "hi", "--drafter", "layer-skip:k=3"], "method 'layer-skip' takes no setting 'k'"),
        (["generate", "hi", "--drafter", "auto"], "unknown drafter 'auto' here: it picks by measured speed for image captioning only"),
        (["generate", "hi", "--drafter", "image-eagle"], "drafter 'image-eagle' drafts the image tokens of a text-to-image model"),
        (["caption", "missing.png", "--drafter", "image-eagle2"], "drafter 'image-eagle2' drafts the image tokens"),
        (["generate", "hi", "--drafter", "/nonexistent/draft"], "draft model directory not found: /nonexistent/draft"),
        # a misspelt head kind before its directory: the kind is named, not "directory not found" (the drafter audit)
        (["generate", "hi", "--drafter", "eagle4:heads/x"], "unknown drafter 'eagle4'; use one of"),
        (["caption", "missing.png", "--drafter", "Eagle3:heads/x"], "unknown drafter 'Eagle3'; use 'auto', one of"),
        (["generate", "hi", "--model", "/nonexistent/lm"], "model directory not found: /nonexistent/lm"),
        (["tts", "Hello there.", "--greedy", "--temperature", "2"], "--temperature applies only when sampling; drop it or --greedy"),
        (["tts", "Hello there.", "--greedy", "--temperature", "2", "--top-k", "3"],
         "--temperature, --top-k apply only when sampling; drop them or --greedy"),
        (["t2i", "a red circle", "--greedy", "--top-k", "5"], "--top-k applies only when sampling; drop it or --greedy"),
        (["t2i", "a red circle", "--top-k", "-5"], "--top-k must be at least 0, got -5"),  # (stop 86: was "top_k must be >= 0")
        (["caption", "missing.png", "--do-sample", "--top-p", "1.5"], "--top-p must lie in (0, 1], got 1.5"),
        (["t2i", "a red circle", "--greedy", "--temperature", "1"], "--temperature applies only when sampling"),
        (["t2i", "a red circle", "--temperature", "0"], "--temperature must be > 0, got 0.0; for greedy decoding pass --greedy"),
        (["tts", "Hello there.", "--temperature", "0"], "--temperature must be > 0, got 0.0; for greedy decoding pass --greedy"),
        (["caption", "missing.png", "--do-sample", "--temperature", "0"], "for greedy decoding leave out --do-sample"),
        (["tts", "Hello there.", "--out", "x.mp3"], "--out x.mp3: the audio is written as WAV; give a file name ending in .wav"),
        (["tts", "Hello there.", "--out", ""], "--out is empty; give a file name"),
        (["tts", "-f", "samples"], "cannot read samples: it is a directory"),
        (["caption", "https://example.com/x.png"], "https://example.com/x.png is a URL; mmspec reads no URLs"),
        (["t2i", "a red circle", "--method", "cspd"], "method 'cspd' does not work with a discrete-token model"),
        (["t2i", "a red circle", "--method", "mar-parallel"], "or use it with a continuous-token model: model=\"mar\" (mmspec t2i --model mar)"),
        # a model of the other task: said so, not the hub's "couldn't connect" or transformers' "Unrecognized model"
        (["caption", "samples/photo.png", "--model", "smollm2"], "'smollm2' is mmspec's built-in text model"),
        (["generate", "hi", "--model", "models/smolcap"], "holds no transformers causal LM (no config.json naming a "
                                                          "model_type); an image model"),
        (["caption", ""], "the image path is empty; give an image file"),
        (["caption", "samples/photo.png", "--drafter", "docs"], "docs holds no draft model (no config.json)"),
        # a folder that is no checkpoint, or a file, as --model: not transformers' "Unrecognized processing class" / "Repo id must be"
        (["caption", "samples/photo.png", "--model", "docs"], "'docs' holds no model (no config.json); give a VLM checkpoint"),
        (["caption", "samples/photo.png", "--model", "samples/photo.png"], "samples/photo.png is a file, not a model directory"),
        (["generate", "hi", "--model", "README.md"], "README.md is a file, not a model directory"),
    ],
)
def test_bad_options_are_one_line_before_anything_loads(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmspec: error: ") and message in err and err.count("\n") == 1, err


def test_bench_output_files_are_checked_before_the_benchmark(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", "caption", "--markdown", str(blocker / "tables.md")]) == 2
    assert f"{blocker} is a file, not a directory" in capsys.readouterr().err
    assert main(["bench", "text", "--results", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err


def test_bad_generate_arguments_fail_before_the_model_loads(capsys, monkeypatch):
    import mmspec.cli.generate as generate_cli

    monkeypatch.setattr(generate_cli, "load_causal_lm", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["generate", "hi", "--drafter", "nonsense"]) == 2
    assert "unknown drafter 'nonsense'" in capsys.readouterr().err
    assert main(["generate", "  ", "--drafter", "ar"]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert main(["generate", "hi", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("variable,value,match", [("MMSPEC_ATTENTION", "flash", "name one of c, sdpa"),
                                                  ("MMSPEC_FUSED", "yes", "set 1"),
                                                  ("MMSPEC_BF16_KERNEL", "sse", "MMSPEC_BF16_KERNEL='sse'"),
                                                  ("MMSPEC_CPU_FLAGS", "avx2,no_such_flag", "names flags this CPU lacks (no_such_flag)")])
def test_bad_kernel_environment_is_one_line_before_loading(monkeypatch, capsys, variable, value, match):
    from mmspec.modeling.attention import attention_backend
    from mmspec.modeling.fast_linear import bf16_kernel_available, bf16_variants, cpu_flags
    from mmspec.modeling.fused import fused_enabled

    if variable == "MMSPEC_BF16_KERNEL" and not bf16_kernel_available():
        pytest.skip("without AVX512-BF16 no bf16 kernel is chosen")
    caches = (attention_backend, fused_enabled, bf16_variants, cpu_flags)
    monkeypatch.setenv(variable, value)
    for cache in caches:
        cache.cache_clear()
    try:  # a missing image: it would fail later, so the environment is checked first
        assert main(["caption", "no-such-image.png"]) == 2
    finally:
        monkeypatch.delenv(variable)
        for cache in caches:
            cache.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


def test_a_preset_with_a_wrong_call_type_is_one_line(tmp_path, capsys):
    """Issue 44: ``temperature = "hot"`` in a preset's [call] table was a TypeError from the sampling
    code at the first call; now ``mmspec run`` refuses it before loading, naming file, key and type."""
    preset = tmp_path / "hot.toml"
    preset.write_text('task = "text-to-speech"\n[init]\nmethod = "ar"\n[call]\ntemperature = "hot"\n')
    assert main(["run", str(preset), "Hello there.", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"mmspec: error: preset hot ({preset}): [call] temperature must be a number or None, "
                   "got 'hot' (str)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, where", [(["tts", "Hi.", "--outt", "x.wav"], "mmspec tts --help"),
                                         (["caption", "x.png", "--num-draft-tokens", "abc"], "mmspec caption --help"),
                                         (["bench", "tts", "--bogus"], "mmspec bench tts --help")])
def test_a_misspelt_flag_or_bad_value_is_one_line(argv, where, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("mmspec: error: ") and err.count("\n") == 1 and f"(see {where})" in err, err


def test_mmspec_help_lists_every_command_without_loading_pytorch():
    """`mmspec --help` and an unknown command import no command's module (PyTorch took ~5 s of a
    `--help` on a slow VM); the list is each module's own parser's, and a command builds in full."""
    import argparse

    from mmspec.cli import COMMANDS, build_parser

    def commands(parser):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {choice.dest: choice.help for choice in action._choices_actions}, action.choices

    listed, full = commands(build_parser()), commands(build_parser(None))
    assert listed[0] == full[0] == {name: text for name, (_, text) in COMMANDS.items()}
    assert build_parser("tts").parse_args(["tts", "x"]).method == build_parser().parse_args(["tts", "x"]).method
    script = ("import sys\nfrom mmspec.cli import main\nfor argv in (['--help'], ['bogus'], []):\n    try:\n"
              "        main(argv)\n    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip().splitlines()[-1] == "False" and "tts" in run.stdout and "invalid choice: 'bogus'" in run.stderr


def test_every_commands_defaults_pass_the_shared_number_checks():
    """The shared rules (mmspec.cli.args: counts >= 1, rates > 0, fractions in [0, 1), nothing NaN)
    hold for every subcommand's own defaults, so a rule never refuses a command as shipped."""
    import argparse
    import math

    from mmspec.cli import args as rules
    from mmspec.cli import build_parser

    def options(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, f"{path} {name}")
            else:
                yield path, action.dest, action.default

    seen = set()
    for path, dest, default in options(build_parser(), "mmspec"):
        for value in default if isinstance(default, list) else [default]:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert math.isfinite(value), (path, dest)
                for names, holds, _ in rules.RANGE_RULES:
                    if dest in names:
                        seen.add(dest)
                        assert holds(value), (path, dest, value)
    assert {"steps", "lr", "warmup", "cfg_dropout", "weight_decay"} <= seen


@pytest.mark.parametrize("argv, message", [
    (["bench", "t2i", "--guidance-scale", "nan"], "--guidance-scale must be a finite number, got nan"),
    (["train", "captioner", "--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["train", "captioner", "--lr", "0"], "--lr must be a positive number, got 0.0"),
    (["train", "captioner", "--lora-rank", "-2"], "--lora-rank must be at least 0, got -2"),
    (["train", "vq", "--codebook-size", "0"], "--codebook-size must be at least 1, got 0"),
    (["train", "vq", "--ch-mult", "1", "0"], "--ch-mult must be at least 1, got 0"),
    (["bench", "t2i", "--prompts", "0"], "--prompts must be at least 1, got 0"),
    (["train", "t2i", "--cfg-dropout", "2"], "--cfg-dropout must lie in [0, 1), got 2.0"),
    (["train", "captioner", "--time-limit", "-1"], "--time-limit must be a positive number"),
    (["train", "captioner", "--init", "/nonexistent.safetensors"],  # (the h5 audit: "No such file or directory", after the build)
     "--init /nonexistent.safetensors: no such file; give the vision_connector.safetensors a captioner run wrote"),
    (["train", "captioner", "--lora-rank", "4", "--reader-layers", "4"], "--lora-rank is for the full decoder (stage 2)"),
    (["train", "caption-draft", "--samples", "8"], "--samples must be more than 512"),
    (["train", "caption-draft", "--self-distill", "/nonexistent"], "/nonexistent holds no self-distillation chunks"),
    (["train", "caption-draft", "--init", "/nonexistent"], "--init /nonexistent: no draft model there"),
    (["train", "drafter", "--target", "captioner", "--sequences", "2"], "--sequences must be at least 8"),
    (["train", "drafter", "--target", "captioner", "--extra-data", "/nonexistent"], "holds no self-distillation chunks"),
    (["train", "drafter", "--target", "smollm2", "--sample-temperature", "1"], "the smollm2 recipe's answers are greedy"),
    (["train", "drafter", "--target", "smollm2", "--dtype", "float32", "--log-every", "5"],  # (ignored before: the recipe's own)
     "--dtype, --log-every apply to a target given by its path or hub id"),
    (["bench", "text", "--methods", "ar,hf-early-exit:x"], "hf-early-exit's layer count must be a comma list of integers"),
    (["bench", "text", "--cost-curve", "0,-1"], "--cost-curve must be a comma list of integers >= 1"),
    (["bench", "text", "--prompt-types", "nope"], "unknown --prompt-types nope"),
    (["bench", "caption", "--temperatures", "-1"], "--temperatures must be a comma list of numbers >= 0"),
    (["bench", "caption", "--methods", "eagle"], "--methods eagle: include ar, the plain decoding every speedup"),
    (["bench", "caption", "--methods", "ar,eagle@x"], "the draft length after '@' must be a positive integer"),
    (["bench", "caption", "--methods", "ar,egle"], "unknown drafter 'egle'"),
    (["bench", "caption", "--families", "foo"], "unknown families ['foo']"),
    (["bench", "tts", "--temperature", "0"], "--temperature must be > 0, got 0.0; for greedy decoding pass --greedy"),
    (["bench", "t2i", "--guidance-scale", "-3"], "--guidance-scale must be >= 1 (1: no guidance), got -3.0"),
    (["bench", "t2i", "--methods", ""], "--methods '' names no method; give a comma list"),
    (["bench", "t2i", "--methods", " , "], "--methods ' , ' names no method; give a comma list"),
    (["bench", "tts", "--methods", ""], "--methods '' names no method; give a comma list"),
    (["train", "open-text", "--out", "/tmp"], "--out /tmp is a directory; give a file name"),
    (["train", "vq", "--image-size", "7"], "--image-size must be a multiple of 8"),
])
def test_training_and_bench_numbers_are_checked_before_anything_runs(argv, message, capsys, tmp_path):
    out = [] if "--out" in argv else ["--results", str(tmp_path / "r.json")] if argv[0] == "bench" else ["--out", str(tmp_path / "out")]
    assert main([*argv, *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmspec: error: ") and message in err and err.count("\n") == 1, err


def test_a_bench_results_file_resumes_only_its_own_suite_and_settings(tmp_path):
    from mmspec.bench.results import load_results, save_results

    path = tmp_path / "r.json"
    results = load_results(path, "text", {"model": "smollm2", "max_new_tokens": 8})
    results["runs"] = {"ar/fp32": [1.0]}
    save_results(path, results)
    assert load_results(path, "text", {"model": "smollm2", "max_new_tokens": 8})["runs"] == {"ar/fp32": [1.0]}
    for suite, settings, message in (
            ("caption", {"model": "smollm2"}, "holds results of mmspec bench text, not caption"),
            ("text", {"model": "smollm2", "max_new_tokens": 32}, r"holds runs of other settings \(max_new_tokens 8 there, 32 now\)")):
        with pytest.raises(ValueError, match=message):
            load_results(path, suite, settings)
    path.write_text("not json")
    with pytest.raises(ValueError, match="is not a results file"):
        load_results(path, "text", {})


def test_a_complete_tts_or_t2i_results_file_derives_its_tables_after_a_later_commit(tmp_path):
    """bench tts / t2i compared their whole record, the git commit included: after any commit a
    rerun of a complete file was refused ("holds results of other settings", naming nothing)."""
    from mmspec.bench.results import check_meta

    meta = {"rounds": 1, "temperature": 1.0, "machine": {"cpu": "x", "layers": "fused", "commit": "abc1234"}, "linears": "c"}
    check_meta(tmp_path / "r.json", {}, meta)  # (nothing recorded yet)
    check_meta(tmp_path / "r.json", {"meta": meta}, {**meta, "machine": {**meta["machine"], "commit": "def5678-dirty"}})
    with pytest.raises(ValueError, match=r"other settings \(temperature 1.0 there, 0.7 now\); rerun with those"):
        check_meta(tmp_path / "r.json", {"meta": meta}, {**meta, "temperature": 0.7})
    with pytest.raises(ValueError, match="measured on another machine or kernels"):
        check_meta(tmp_path / "r.json", {"meta": meta}, {**meta, "machine": {**meta["machine"], "layers": "modules"}})


def test_a_bench_resume_under_other_attention_or_layer_kernels_is_refused(tmp_path, monkeypatch):
    """``MMSPEC_FUSED=0`` (or ``MMSPEC_ATTENTION=sdpa``) on a resume of ``bench text`` / ``caption``
    mixed the modules' times into the fused layers' medians, and the file then named only the
    last run's kernels; bench text records that it runs its models as loaded."""
    import argparse

    from mmspec.bench import text
    from mmspec.bench.results import load_results, run_settings, save_results

    from mmspec.modeling import fused as fused_module

    args = argparse.Namespace(threads=1)
    monkeypatch.setattr(fused_module, "fused_enabled", lambda: True)  # (read once a process from MMSPEC_FUSED)
    fused = run_settings(args)
    path = tmp_path / "r.json"
    save_results(path, load_results(path, "text", {"model": "m", **fused}))
    monkeypatch.setattr(fused_module, "fused_enabled", lambda: False)  # MMSPEC_FUSED=0
    with pytest.raises(ValueError, match=r"other settings \(layers 'fused' there, 'modules' now\)"):
        load_results(path, "text", {"model": "m", **run_settings(args)})
    old = {"model": "m", **{k: v for k, v in fused.items() if k not in ("attention", "layers")}}
    save_results(path, {"suite": "text", "settings": old, "runs": {}})  # a file from before they were recorded
    load_results(path, "text", {"model": "m", **run_settings(args)})
    seen = {}

    def stop(path, suite, settings):
        seen.update(settings)
        raise KeyboardInterrupt  # (before any model loads)

    monkeypatch.setattr(text, "load_results", stop)
    parser = argparse.ArgumentParser()
    text.add_arguments(parser)
    with pytest.raises(KeyboardInterrupt):
        text.run(parser.parse_args(["--results", str(tmp_path / "t.json"), "--threads", "1"]))
    assert seen["optimize"] is False and seen["layers"] == "modules"  # the models run as loaded, no mmspec.optimize


def test_a_checkpoint_of_the_other_kind_is_named_in_one_line(tmp_path_factory, tmp_path, capsys):
    """A text LM given to caption, a VLM given to generate: what the checkpoint is and the command that
    takes it, not transformers' list of every class its Auto class loads (~2,000 characters)."""
    from tiny_checkpoints import cached_tiny_checkpoint, save_tiny_draft

    vlm = cached_tiny_checkpoint("qwen2_vl", tmp_path_factory)
    text = save_tiny_draft(tmp_path / "lm", 64)
    capsys.readouterr()  # (transformers' notes on the tiny configs)
    assert main(["generate", "hi", "--model", str(vlm)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a qwen2_vl checkpoint (Qwen2VLForConditionalGeneration), not a causal LM" in err
    assert f"a VLM goes through mmspec caption --model {vlm}" in err
    assert main(["caption", "samples/photo.png", "--model", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a llama checkpoint (LlamaForCausalLM), not an image-text-to-text model" in err
    # weights that do not match the config (another model's config.json beside them): one line, not
    # transformers' 57-line RuntimeError (the stop-74 audit)
    config = json.loads((text / "config.json").read_text())
    (text / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 2}))
    for item in vlm.glob("*token*"):  # (a tokenizer beside it: one without is refused before the weights load)
        (text / item.name).write_bytes(item.read_bytes())
    for argv in (["generate", "hi", "--model", str(text)], ["caption", "samples/photo.png", "--model", str(vlm)]):
        if argv[0] == "caption":
            vlm_config = json.loads((vlm / "config.json").read_text())
            (tmp_path / "vlm").mkdir()
            for item in vlm.iterdir():
                (tmp_path / "vlm" / item.name).write_bytes(item.read_bytes())
            text_config = vlm_config.get("text_config", vlm_config)
            text_config["vocab_size"] = text_config.get("vocab_size", 64) * 2
            (tmp_path / "vlm" / "config.json").write_text(json.dumps(vlm_config))
            argv[-1] = str(tmp_path / "vlm")
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # (after transformers' own load report)
        assert last.startswith("mmspec: error: ") and "its weights do not match its config.json" in last
        assert "Traceback" not in err


def test_a_damaged_weights_file_is_one_line(tmp_path_factory, tmp_path, capsys):
    """A safetensors file cut short (an interrupted download or copy) was safetensors' traceback and
    exit 1 for caption --model, caption --drafter DIR, spd:DIR and generate --model (the h2 audit)."""
    from tiny_checkpoints import cached_tiny_checkpoint, save_tiny_draft

    whole, vlm = cached_tiny_checkpoint("qwen2_vl", tmp_path_factory), tmp_path / "vlm"
    shutil.copytree(whole, vlm)
    lm = save_tiny_draft(tmp_path / "lm", 64)
    for item in vlm.glob("*token*"):  # (a tokenizer beside it: one without is refused before the weights load)
        (lm / item.name).write_bytes(item.read_bytes())
    for directory in (vlm, lm):
        weights = directory / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    photo = str(Path(__file__).resolve().parents[1] / "samples" / "photo.png")
    for argv in (["caption", photo, "--model", str(vlm)], ["generate", "hi", "--model", str(lm)],
                 ["caption", photo, "--model", str(whole), "--drafter", str(lm)],
                 ["caption", photo, "--model", str(whole), "--drafter", f"spd:{lm}"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("mmspec: error: ") and "a weights file cannot be read" in last, err
        assert "download or copy the checkpoint again" in last and "Traceback" not in err


def test_generate_says_why_a_sampled_output_differs_from_plain_decodings(tmp_path, capsys):
    """As ``mmspec caption`` does: a sampled run's differing output is the draws, not an error."""
    from test_train_any_target import save_text_target, smollm2_tokenizer
    from tiny_checkpoints import save_tiny_draft
    from transformers import LlamaForCausalLM

    from mmspec.cli.output import difference_note

    tokenizer = smollm2_tokenizer()
    save_tiny_draft(tmp_path / "lm", len(tokenizer), seed=3)
    target = save_text_target(tmp_path / "lm", LlamaForCausalLM.from_pretrained(tmp_path / "lm"), tokenizer)
    draft = save_tiny_draft(tmp_path / "draft", len(tokenizer), seed=4)  # (a random target: prompt lookup finds nothing)
    note = difference_note(True, False)
    for seed in range(8):
        assert main(["generate", "Name three colours.", "--model", str(target), "--drafter", str(draft), "--do-sample",
                     "--seed", str(seed), "--compare-baseline", "--dtype", "fp32", "--max-new-tokens", "12"]) == 0
        out = capsys.readouterr().out
        assert (note in out) == ("output DIFFERENT from plain decoding" in out)
        if note in out:
            break
    else:
        pytest.fail("no sampled run differed from plain decoding's draws")
    assert difference_note(False, False) is None and "half precision" in difference_note(False, True)


def test_generate_without_a_chat_template_asks_for_raw(tmp_path, capsys):
    """A tokenizer without a chat template had the prompt fed as plain text, unsaid, although the
    prompt's help says it is wrapped in the template unless --raw."""
    from test_train_any_target import save_text_target, smollm2_tokenizer
    from tiny_checkpoints import save_tiny_draft
    from transformers import LlamaForCausalLM

    tokenizer = smollm2_tokenizer()
    save_tiny_draft(tmp_path / "lm", len(tokenizer), seed=3)
    tokenizer.chat_template = None
    target = save_text_target(tmp_path / "lm", LlamaForCausalLM.from_pretrained(tmp_path / "lm"), tokenizer)
    argv = ["generate", "hello", "--model", str(target), "--dtype", "fp32", "--max-new-tokens", "2", "--no-optimize"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"mmspec: error: the tokenizer of {target} has no chat template to wrap the "
                                            "prompt in; pass --raw to feed it as plain text (a base model), or add the "
                                            "model's template to its directory (chat_template.jinja)")
    assert main([*argv, "--raw"]) == 0


def test_bench_text_refuses_a_drafter_the_model_cannot_take_before_measuring(tmp_path, capsys, monkeypatch):
    """``--methods ar,eagle`` on a model without a shipped EAGLE head failed after the cost curve
    and AR's first runs (the drafter was built only in its first run)."""
    from test_train_any_target import save_text_target, smollm2_tokenizer
    from tiny_checkpoints import save_tiny_draft
    from transformers import LlamaForCausalLM

    from mmspec.bench import text

    tokenizer = smollm2_tokenizer()
    save_tiny_draft(tmp_path / "lm", len(tokenizer), seed=3)
    target = save_text_target(tmp_path / "lm", LlamaForCausalLM.from_pretrained(tmp_path / "lm"), tokenizer)
    monkeypatch.setattr(text, "verification_cost_curve", lambda *a: pytest.fail("measured the cost curve"))
    monkeypatch.setattr(text, "run_once", lambda *a: pytest.fail("measured a run"))
    capsys.readouterr()
    assert main(["bench", "text", "--model", str(target), "--dtypes", "fp32", "--methods", "ar,prompt-lookup,eagle",
                 "--prompt-types", "qa", "--max-new-tokens", "2", "--repeats", "1", "--threads", "1",
                 "--results", str(tmp_path / "t.json")]) == 2
    assert "no trained eagle drafter ships for LlamaForCausalLM" in capsys.readouterr().err


def test_bench_text_builds_each_drafter_once(tmp_path, capsys, monkeypatch):
    """Each run built its drafter from its name inside the timed whole call (S_hf's), loading a
    trained head from disk every time; now every run of a method gets the one built before."""
    from test_train_any_target import save_text_target, smollm2_tokenizer
    from tiny_checkpoints import save_tiny_draft
    from transformers import LlamaForCausalLM

    from mmspec.bench import text
    from mmspec.drafters import Drafter

    tokenizer = smollm2_tokenizer()
    save_tiny_draft(tmp_path / "lm", len(tokenizer), seed=3)
    target = save_text_target(tmp_path / "lm", LlamaForCausalLM.from_pretrained(tmp_path / "lm"), tokenizer)
    seen = []
    real = text.generate
    monkeypatch.setattr(text, "generate", lambda model, drafter=None, **kw: seen.append(drafter) or real(model, drafter=drafter, **kw))
    assert main(["bench", "text", "--model", str(target), "--dtypes", "fp32", "--methods", "ar,prompt-lookup:3",
                 "--prompt-types", "qa", "--max-new-tokens", "2", "--repeats", "1", "--threads", "1", "--cost-curve", "",
                 "--results", str(tmp_path / "t.json")]) == 0
    drafters = [d for d in seen if d is not None]
    assert len(seen) == 8 and len(drafters) == 4  # 2 prompts x 2 rounds x 2 methods
    assert isinstance(drafters[0], Drafter) and all(d is drafters[0] for d in drafters)


def test_an_interrupt_that_a_library_turns_into_another_error_is_still_one_line(monkeypatch, capsys):
    """Ctrl-C while numpy loaded inside transformers' lazy import surfaced as its ModuleNotFoundError,
    a 90-line traceback with exit 1 (the stop-77 audit); the command's handlers know the signal came."""
    import os
    import signal

    import mmspec.cli.generate as generate_cli

    def interrupted_inside_a_library(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise ModuleNotFoundError("Could not import module 'SmolVLMForConditionalGeneration'") from None
        return 0

    monkeypatch.setattr(generate_cli, "run_generate_command", interrupted_inside_a_library)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as a run from a terminal starts)
    try:
        assert main(["generate", "hi"]) == 130
        assert capsys.readouterr().err == "mmspec: interrupted; nothing was saved\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (given back)
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_command_started_with_sigint_ignored_keeps_ignoring_it(monkeypatch, capsys):
    """A shell without job control starts `mmspec ... &` with SIGINT ignored (Ctrl-C is for the
    script in the foreground): the command leaves it ignored, and restores it so, where it had put
    its own handler over it (the tests ran in such a process and found SIG_IGN where they expected
    Python's handler)."""
    import os
    import signal

    import mmspec.cli.generate as generate_cli

    def interrupted(args):
        os.kill(os.getpid(), signal.SIGINT)  # (ignored: the command goes on)
        print("done")
        return 0

    monkeypatch.setattr(generate_cli, "run_generate_command", interrupted)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["generate", "hi"]) == 0
        assert capsys.readouterr().out == "done\n"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_options_are_not_abbreviated_and_every_help_says_its_default(capsys):
    """The stop-78 CLI audit: `bench caption --batch-size 4` ran as --batch-sizes (throughput mode),
    `t2i --prompt X` read X as a --prompts file; 97 options' helps gave no default."""
    from mmspec.bench.text import check_method
    from mmspec.cli import build_parser
    from mmspec.cli.export import export_dtype

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "caption", "--batch-size", "4"])
    assert exit_.value.code == 2 and "unrecognized arguments: --batch-size 4" in capsys.readouterr().err
    parser = build_parser()
    tts = parser._subparsers._group_actions[0].choices["tts"]
    shown = tts.format_help()
    assert "(default: 20.0)" in shown and "the same seed gives the same audio (default: 0)" in shown
    for method in ("auto", "bogus"):  # ("auto" passed, then failed after the model loaded)
        with pytest.raises(ValueError, match=f"unknown --methods item '{method}'"):
            check_method(method)
    assert export_dtype("bf16") == export_dtype("bfloat16") and export_dtype("fp32") is not None
    assert main(["generate", "hi", "--drafter", ""]) == 2  # (was "error:  holds no draft model": an empty name)
    assert "mmspec: error: the drafter is empty; give one of [" in capsys.readouterr().err
    with pytest.raises(ValueError, match="an export is bfloat16"):
        export_dtype("auto")


def test_every_option_of_the_using_commands_says_what_it_does():
    """generate, caption, t2i, tts, bench, serve and export: each option's help says more than its
    default (stop 85: 44 said only "(default: X)" or nothing, e.g. `bench t2i --prompts`, a count
    where `t2i --prompts` takes a file). The training recipes' hyperparameters are left to their docs."""
    import argparse
    import re

    from mmspec.cli import build_parser

    def options(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from options(sub, [*path, name])
            elif action.option_strings and action.dest != "help":
                yield path, action

    bare = [f"{' '.join(path)} {action.option_strings[-1]}" for path, action in options(build_parser(), ["mmspec"])
            if path[1:2] != ["train"] and re.fullmatch(r"(\(default: %\(default\)s\))?", (action.help or "").strip())]
    assert not bare, bare


def test_threads_are_set_once_before_the_command_runs(monkeypatch, capsys):
    """mmspec.cli.main applies every command's --threads (a training command's default too) before
    its handler runs; a command without --threads given leaves PyTorch's count alone."""
    import torch

    applied = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    code = main(["train", "tts-drafter", "--kind", "eagle", "--threads", "3", "--eval", "/nonexistent"])
    assert code == 2 and "no tts-self-data shards there" in capsys.readouterr().err and applied == [3]  # (the handler refused)
    assert main(["train", "tts-drafter", "--kind", "eagle", "--eval", "/nonexistent"]) == 2 and len(applied) == 2  # its default
    assert main(["tts", "hello", "--max-seconds", "-1"]) == 2 and len(applied) == 2  # (refused by check_args: nothing set)


def test_generate_refuses_a_draft_of_a_larger_vocabulary_before_either_model_loads(capsys, monkeypatch, tmp_path):
    """The audit's: refused only once both models had loaded; now from their config.json files."""
    from transformers import LlamaConfig

    import mmspec.cli.generate as generate_cli
    from mmspec.drafters.model import config_vocab_size
    from mmspec.hub import resolve_checkpoint

    target_vocab = config_vocab_size(resolve_checkpoint("smollm2"))
    assert target_vocab is not None
    LlamaConfig(vocab_size=target_vocab + 7, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path / "draft")
    monkeypatch.setattr(generate_cli, "load_causal_lm", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["generate", "hi", "--drafter", str(tmp_path / "draft")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"mmspec: error: the draft's vocabulary ({target_vocab + 7}) is larger than the target's "
                           f"({target_vocab}); the draft must share the target's tokenizer")


def test_generate_and_bench_text_take_trust_remote_code_off_by_default(tmp_path, capsys, custom_code_lm, no_terminal):
    """The audit's: ``mmspec generate`` (and ``load_causal_lm``) had no --trust-remote-code although
    ``mmspec caption`` / ``t2i`` and the pipelines take it: a checkpoint with its own code could not
    be loaded (transformers asked on the terminal, then refused in four lines naming only the Python
    argument). Now off by default with one line naming the flag; on, the model and a draft model
    directory load with their code."""
    from test_train_any_target import save_text_target, smollm2_tokenizer
    from tiny_checkpoints import save_tiny_draft
    from transformers import LlamaForCausalLM

    custom = custom_code_lm
    tokenizer = smollm2_tokenizer()
    plain = save_tiny_draft(tmp_path / "plain", len(tokenizer), seed=4)
    save_text_target(plain, LlamaForCausalLM.from_pretrained(plain), tokenizer)
    refusal = (f"mmspec: error: '{custom}' holds its own Python code (the auto_map of its config.json), which runs only "
               "when allowed: read that code, then pass --trust-remote-code (trust_remote_code=True in Python)")
    common = ["--max-new-tokens", "2", "--dtype", "fp32", "--no-optimize", "--drafter"]
    capsys.readouterr()
    for model, drafter in ((custom, "prompt-lookup"), (plain, str(custom))):
        argv = ["generate", "hi", "--model", str(model), *common, drafter]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == refusal and "[y/N]" not in err, err
        assert main([*argv, "--trust-remote-code"]) == 0, capsys.readouterr().err
        capsys.readouterr()
    bench = ["bench", "text", "--model", str(custom), "--dtypes", "fp32", "--methods", "ar", "--prompt-types", "qa",
             "--max-new-tokens", "2", "--repeats", "1", "--threads", "1", "--cost-curve", "", "--results",
             str(tmp_path / "t.json")]
    assert main(bench) == 2 and capsys.readouterr().err.strip().splitlines()[-1] == refusal
    assert main([*bench, "--trust-remote-code"]) == 0
    # (the command the results file records reruns it: with the flag, which it dropped before)
    assert json.loads((tmp_path / "t.json").read_text())["meta"]["command"].endswith(" --trust-remote-code")


def test_t2i_and_the_benchmarks_take_trust_remote_code_off_by_default(tmp_path, capsys, custom_code_lm, no_terminal):
    """The audit's: ``mmspec t2i --model DIR`` of a checkpoint with its own code refused in
    transformers' four lines (naming only the Python argument); ``bench t2i``, ``bench cost`` and
    ``bench chain-stop`` load a model by path but took no --trust-remote-code. Now each refuses in
    the one line naming the flag, and with it loads the model's code (then, the tiny text LM being
    no text-to-image model and no shipped drafter's, the next one-line refusal)."""
    import mmspec
    from mmspec.hub import remote_code_refused

    refusal = f"mmspec: error: {remote_code_refused(custom_code_lm)}"
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    unsupported = f"{custom_code_lm} is a 'mmspec_custom_lm' model, not a supported text-to-image model"
    for argv, allowed in (
        (["t2i", "a cat", "--model", str(custom_code_lm), "--out", str(tmp_path / "images")], unsupported),
        (["bench", "t2i", "--model", str(custom_code_lm), "--methods", "ar", "--prompts", "2", "--no-quality",
          "--results", str(tmp_path / "t2i.json")], unsupported),
        (["bench", "chain-stop", "--model", str(custom_code_lm), "--data", str(data), "--results",
          str(tmp_path / "chain.json")], "no trained eagle3 drafter ships for CustomLM"),
        (["bench", "cost", "--model", str(custom_code_lm), "--sizes", "1", "--variants", "plain", "--repeats", "1",
          "--no-parts", "--dtype", "fp32", "--results", str(tmp_path / "cost.json")], None),
    ):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert "[y/N]" not in captured.out + captured.err and captured.err.strip().splitlines()[-1] == refusal, captured
        code = main([*argv, "--trust-remote-code"])
        err = capsys.readouterr().err
        assert (code == 0 and allowed is None) or (code == 2 and allowed in err.strip().splitlines()[-1]), err
    with pytest.raises(ValueError) as raised:
        mmspec.pipeline("text-to-image", model=str(custom_code_lm))
    assert str(raised.value) == str(remote_code_refused(custom_code_lm))


def test_eval_captioner_makes_the_folders_of_its_out(tmp_path, monkeypatch, capsys):
    """Every command that writes files makes the missing folders of its --out (caption, t2i, tts,
    run, export, bench, the training recipes); ``mmspec train eval-captioner --out new/eval.json``
    wrote with a bare write_text and failed after the whole evaluation (FileNotFoundError, the
    report lost). The evaluation itself is stubbed: only the writing is under test."""
    from mmspec.train import eval_captioner

    weights = tmp_path / "smolcap.safetensors"
    weights.write_bytes(b"")
    monkeypatch.setattr("mmspec.hub.require_modules", lambda *args, **kwargs: None)
    monkeypatch.setattr(eval_captioner, "build_captioner", lambda **kwargs: (None, None))
    monkeypatch.setattr(eval_captioner, "evaluate", lambda *args: {"families": {}, "text_questions": []})
    out = tmp_path / "new" / "deeper" / "eval.json"
    assert main(["train", "eval-captioner", "--weights", str(weights), "--out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["command"].startswith("mmspec train eval-captioner")
