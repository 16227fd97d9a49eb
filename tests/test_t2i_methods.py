"""Text-to-image methods as registered classes, and the checks that run before any model loads
(no model is loaded here: every bad value must be refused before the model path is even read)."""

from types import SimpleNamespace

import pytest
import torch

import mmspec
from mmspec.cli import main
from mmspec.modeling.fast_linear import OptimizesOnLoad
from mmspec.pipelines.text_to_image.methods import METHODS, SETTINGS, T2IMethod, make_method, register_method
from mmspec.pipelines.text_to_image import check_call_arguments

MISSING = "/nonexistent/t2i-model"  # loading it would fail with "not a text-to-image model directory"


def test_methods_hold_their_defaults_and_arguments():
    assert make_method("sjd").settings == {"window": None, "init": "random"}  # None: by the machine, below
    assert make_method("sjd-coupled:vertical").settings == {"window": None, "init": "vertical"}
    # the default method starts new window positions one row up; the paper's SJD and SJD-PAC at random
    assert make_method("sjd-coupled").settings == {"window": None, "init": "vertical"}
    assert make_method("sjd-coupled:random").settings["init"] == make_method("sjd-pac").settings["init"] == "random"
    with pytest.raises(ValueError, match="sets init='vertical' and init='horizontal' is given as well"):
        make_method("sjd:vertical", init="horizontal")  # (--method sjd:vertical --init horizontal)
    with pytest.raises(ValueError, match="sets window=4 and window=6 is given as well"):
        make_method("sjd:window=4", window=6)  # (--method sjd:window=4 --window 6)
    assert make_method("sjd-pac", pac_depth=2).settings == {"window": None, "init": "random", "pac_branches": 2,
                                                            "pac_depth": 2}  # None: 8, at most the image's tokens
    lantern = make_method("lantern:eagle2", window=None, delta=0.2)  # None: a setting not given
    assert lantern.settings == {"drafter": "eagle2", "num_draft_tokens": None, "neighbours_k": 100, "delta": 0.2}
    assert lantern.rule == "lantern" and not lantern.exact and make_method("eagle2").exact
    assert make_method("ar").build_drafter(None) is None and make_method("ar").rule_kwargs(None) is None


@pytest.mark.parametrize("device, linears, dtype, fma, window", [
    ("cpu", "c (fp32 avx512 packed) + onednn prompts", torch.float32, True, 6),  # (an AMX CPU's float32 too)
    ("cpu", "c (fp32 avx512 packed, bf16 amx packed)", torch.bfloat16, True, 8),
    ("cpu", "c (bf16 avx512bf16 packed) + onednn prompts", torch.bfloat16, True, 6),  # (Intel: FMA sums)
    ("cpu", "c (bf16 avx512bf16 packed) + onednn prompts", torch.bfloat16, False, 2),  # (AMD: vdpbf16ps)
    ("cpu", "c (fp32 avx2) + onednn prompts", torch.float32, True, 2), ("cpu", "as loaded", torch.float32, True, 2),
    ("cuda", "as loaded", torch.float32, True, 8)])
def test_sjds_window_follows_the_generators_kernel(monkeypatch, device, linears, dtype, fma, window):
    """L = 8 on GPUs and AMX tiles, 6 on the medium kernels (float32 AVX-512, bf16 through FMA sums),
    2 where a verification's rows are dear (AVX2, vdpbf16ps sums); a given window always wins, and
    SJD-PAC keeps 8 (its tree's room)."""
    from mmspec.modeling import fast_linear

    monkeypatch.setattr(fast_linear, "bf16_fma_sums", lambda: fma)
    components = SimpleNamespace(device=torch.device(device), linears=linears, dtype=dtype)
    components.verification_width = OptimizesOnLoad.verification_width.fget(components)
    for spec in ("sjd", "sjd-coupled", "sjd:random"):
        assert make_method(spec).build_drafter(components).num_draft_tokens == window
    assert make_method("sjd-coupled:window=5").build_drafter(components).num_draft_tokens == 5
    components.target = SimpleNamespace(num_image_tokens=256)
    assert make_method("sjd-pac").build_drafter(components).num_draft_tokens == 8


def test_sjd_pacs_default_window_fits_a_small_image():
    """SJD-PAC's default window (8) on a model of fewer image tokens: cut to them, as sjd runs
    there, not refused as "window=8 is wider than the image's 4 tokens" (a window never given);
    a given window is still refused, and a tree that cannot fit the cut window is named so."""
    components = SimpleNamespace(device=torch.device("cpu"), linears="as loaded", dtype=torch.float32,
                                 verification_width="narrow", continuous=False,
                                 target=SimpleNamespace(num_image_tokens=4))
    method = make_method("sjd-pac")
    method.check_components(components)
    assert method.build_drafter(components).num_draft_tokens == 4 and method.run_settings(components)["window"] == 4
    with pytest.raises(ValueError, match="window=8 is wider than the image's 4 tokens; use at most 4"):
        make_method("sjd-pac", window=8).check_components(components)
    with pytest.raises(ValueError, match=r"does not fit window 4 \(the default, cut to the image's 4 tokens\): use "
                                         r"pac_depth <= 1$"):
        make_method("sjd-pac", pac_depth=2).check_components(components)


def test_relaxed_defaults_come_from_the_rules():
    from mmspec.core.rules import RULES

    for spec, bound in (("lantern", "delta"), ("lantern++", "lam"), ("gsd", "top_m")):
        assert make_method(spec).settings[bound] == getattr(RULES[spec].Params(), bound)
    assert make_method("gsd:eagle2").settings["drafter"] == "eagle2"  # GSD verifies trees too


def test_a_rule_without_tree_form_refuses_tree_drafters():
    from mmspec.core.rules import RULES, AcceptanceRule, GsdParams, GsdRule, register_rule
    from mmspec.pipelines.text_to_image.methods import RelaxedMethod

    @register_rule
    class LinearGsd(GsdRule):
        name = "test-linear-gsd"
        verify_tree = AcceptanceRule.verify_tree  # the base class's: no tree form

    try:
        assert not LinearGsd.supports_tree() and LinearGsd.Params is GsdParams

        class LinearMethod(RelaxedMethod):
            name = rule = "test-linear-gsd"
            description = "a test method"
            bound = "top_m"

        assert LinearMethod("eagle").settings["top_m"] == 50
        with pytest.raises(ValueError, match="verifies linear drafts only; use drafter='eagle' or 'draft'"):
            LinearMethod("eagle2")
    finally:
        del RULES["test-linear-gsd"]


@pytest.mark.parametrize("spec, settings, message", [
    ("lantern", {"delta": float("nan")}, "delta must be a finite number >= 0"),
    ("lantern", {"delta": 1.5}, "delta must be a finite number >= 0 and <= 1"),
    ("lantern++", {"lam": float("nan")}, "lam must be a finite number >= 1"),
    ("lantern++", {"lam": float("inf")}, "lam must be a finite number >= 1"),
    ("sjd", {"window": 0}, "window must be an integer >= 1"),
    ("lantern", {"neighbours_k": 0}, "neighbours_k must be an integer >= 1"),
    ("sjd", {"window": 2.5}, "window must be an integer"),
    ("gsd", {"top_m": 0}, "top_m must be an integer >= 1"),
    ("lantern:medusa", {}, "drafter must be one of draft, eagle, eagle2"),
    ("sjd:diagonal", {}, "init must be one of random, horizontal, vertical"),
    ("eagle:x", {}, "takes no ':x' argument"),
    ("diffusion", {}, "unknown method"),
    ("sjd", {"windows": 4}, "method 'sjd' takes no setting 'windows' \\(known settings: window, "),
])
def test_bad_settings_are_one_clear_error(spec, settings, message):
    with pytest.raises(ValueError, match=message):
        make_method(spec, **settings)


def test_the_pipeline_checks_settings_before_loading_the_model():
    for settings in ({"num_draft_tokens": 0}, {"delta": float("nan")}, {"neighbours_k": 0}):
        with pytest.raises(ValueError, match="must be"):
            mmspec.pipeline("text-to-image", model=MISSING, method="lantern", **settings)
    with pytest.raises(FileNotFoundError):  # good settings: the model path is read
        mmspec.pipeline("text-to-image", model=MISSING, method="lantern", neighbours_k=4)


@pytest.mark.parametrize("method,settings,message", [
    ("cspd", {"window": 4}, r"method 'cspd' takes no setting 'window' \(SJD's window L\), got window=4"),
    ("ar", {"num_draft_tokens": 3}, "method 'ar' takes no setting 'num_draft_tokens'"),
    ("sjd", {"num_iter": 8}, "method 'sjd' takes no setting 'num_iter'"),
    ("mar-parallel", {"num_iter": 0}, "num_iter must be an integer >= 1"),
    ("mar-parallel:0", {}, "num_iter must be an integer >= 1"),
    ("cspd", {"prefill_fraction": 1.0}, r"prefill_fraction must be a number in \[0, 1\)"),
])
def test_settings_a_method_does_not_use_or_cannot_take_are_refused(method, settings, message):
    """Issue 44: ``window`` with cspd was silently ignored; ``num_iter`` 0 must not fall back to 16."""
    with pytest.raises(ValueError, match=message) as error:
        mmspec.pipeline("text-to-image", model=MISSING, method=method, **settings)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("guidance", [float("nan"), float("inf"), 0.5])
def test_guidance_scale_must_be_finite(guidance):
    with pytest.raises(ValueError, match="guidance_scale must be a number from 1 to 1000"):
        check_call_arguments(guidance)


@pytest.mark.parametrize("argv, message", [
    (["--guidance-scale", "nan"], "--guidance-scale must be a finite number, got nan"),
    (["--guidance-scale", "inf"], "--guidance-scale must be a finite number, got inf"),
    (["--method", "lantern", "--delta", "nan"], "delta must be a finite number"),
    (["--method", "lantern++", "--lam", "nan"], "lam must be a finite number"),
    (["--window", "0"], "--window must be at least 1, got 0"),
    (["--method", "lantern", "--neighbours-k", "0"], "--neighbours-k must be at least 1, got 0"),
    (["--threads", "-1"], "--threads must be"),
    (["--num-images", "0"], "--num-images must be at least 1, got 0"),
    (["--temperature", "0"], "temperature must be > 0"),
])
def test_cli_refuses_bad_numbers_before_loading(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["t2i", "a red circle", "--model", MISSING, "--out", str(out), *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("mmspec: error:") and message in error and "\n" not in error
    assert not out.exists()  # nothing was written (a NaN guidance scale used to write a grey image)


def test_cli_checks_the_output_directory_first(tmp_path, capsys):
    taken = tmp_path / "taken.png"
    taken.write_bytes(b"not a directory")
    for out in (taken, taken / "sub"):
        assert main(["t2i", "a red circle", "--model", MISSING, "--out", str(out)]) == 2
        assert "--out" in capsys.readouterr().err
    assert taken.read_bytes() == b"not a directory"


def test_cli_has_an_option_per_setting():
    from mmspec.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["t2i", "x", "--pac-branches", "3", "--top-m", "7", "--drafter", "draft"])
    assert (args.pac_branches, args.top_m, args.drafter, args.window) == (3, 7, "draft", None)
    assert set(SETTINGS) <= set(vars(args))


def test_adding_a_method_is_one_class_and_its_registration():
    @register_method
    class Twice(T2IMethod):
        name = "test-twice"
        description = "a test method"
        defaults = {"num_draft_tokens": 2}

    try:
        method = make_method("test-twice", num_draft_tokens=5)
        assert isinstance(method, Twice) and method.settings == {"num_draft_tokens": 5}
        from mmspec.cli import build_parser

        help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["t2i"].format_help().split())  # unwrapped
        assert "test-twice (a test method)" in help_text
        with pytest.raises(ValueError, match="already registered"):
            register_method(Twice)
    finally:
        del METHODS["test-twice"]
