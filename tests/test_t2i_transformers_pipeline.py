"""The text-to-image pipeline over transformers' Janus / Emu3 / Chameleon on tiny random
checkpoints loaded by path (each with a small word-level tokenizer saved next to it): every method
runs, the lossless ones reproduce AR greedily, and an image EAGLE head trained with the shipped
recipe (``mmspec train image-drafter --model PATH``) serves LANTERN in one pipeline call."""

import json

import pytest
import torch
from test_hf_image_adapters import (
    CHAMELEON_BOI,
    EMU3_BOI,
    EMU3_GRID,
    EMU3_WRAPPER,
    JANUS_BOI,
    tiny_chameleon,
    tiny_emu3,
    tiny_janus,
)

import mmspec
from mmspec.adapters.image.chameleon import ChameleonImageTokenizer, ChameleonVQDecoder
from mmspec.cli import main
from mmspec.modeling.heads import ImageEagleConfig, ImageEagleHead
from mmspec.pipelines.text_to_image import METHODS, SETTINGS

torch.set_num_threads(1)
WORDS = ["a", "red", "green", "blue", "circle", "square", "star", "above", "below", "big", "small"]
PROMPT = "a red circle above a blue square"


def save_word_tokenizer(directory, family):
    """A word-level tokenizer whose ids fit the tiny models' vocabularies (10 + word index), ending
    the prompt as the family's processor would (Emu3's image prefix; Janus / Chameleon append their
    image-start token themselves)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 9, "<s>": 1, **{w: 10 + i for i, w in enumerate(WORDS)}}
    if family == "emu3":
        vocab.update({"[BOI]": EMU3_BOI, "[HW]": 20, "[IMG]": EMU3_WRAPPER})  # <|image start|> 3*2 <|image token|>
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    suffix = " [BOI] [HW] [IMG]" if family == "emu3" else ""
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A" + suffix, special_tokens=[
        ("<s>", 1), *([("[BOI]", EMU3_BOI), ("[HW]", 20), ("[IMG]", EMU3_WRAPPER)] if family == "emu3" else [])])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", unk_token="<unk>").save_pretrained(directory)


BUILDERS = {"janus": tiny_janus, "emu3": tiny_emu3, "chameleon": tiny_chameleon}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (target directory, draft directory)."""
    root = tmp_path_factory.mktemp("hf-t2i")
    paths = {}
    for family, build in BUILDERS.items():
        for name in ("target", "draft"):
            model = build()
            if name == "draft":
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.3 * torch.randn_like(p))  # a different (worse) model of the same family
            model.save_pretrained(root / family / name)
            generation = root / family / name / "generation_config.json"  # as a released checkpoint's (transformers
            config = json.loads(generation.read_text())  # ignores files derived "_from_model_config")
            config.pop("_from_model_config", None)
            generation.write_text(json.dumps(config))
            save_word_tokenizer(root / family / name, family)
        paths[family] = (root / family / "target", root / family / "draft")
    return paths


def make(checkpoints, family, method, tmp_path, **kwargs):
    target_dir, draft_dir = checkpoints[family]
    extra = {"grid": EMU3_GRID} if family == "emu3" else {}
    if family == "chameleon":
        model = tiny_chameleon()
        torch.manual_seed(0)
        extra["image_tokenizer"] = ChameleonImageTokenizer(model.model.vqmodel, ChameleonVQDecoder(model.config.vq_config).eval())
    settings = METHODS.resolve(method.partition(":")[0]).reads({"window": 3, "num_draft_tokens": 3, **kwargs})
    kwargs = {k: v for k, v in kwargs.items() if k not in SETTINGS}
    pipe = mmspec.pipeline("text-to-image", model=str(target_dir), method=method, draft=str(draft_dir), **settings,
                           **extra, **kwargs)
    if method.startswith(("eagle", "lantern", "gsd")) and "eagle_head" not in kwargs:
        torch.manual_seed(1)
        head = ImageEagleHead(ImageEagleConfig(dim=32, n_head=2, grid=pipe.target.grid))
        head.save(tmp_path / "head", dtype=torch.float32)
        pipe.components.eagle_head = tmp_path / "head"
    return pipe


LOSSLESS = ["spec", "sjd", "sjd-coupled:vertical", "sjd-pac", "eagle", "eagle2"]


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("method", LOSSLESS)
def test_lossless_methods_reproduce_ar_through_the_pipeline(checkpoints, family, method, tmp_path):
    pipe = make(checkpoints, family, method, tmp_path)
    if family == "emu3" and method in ("eagle2", "sjd-pac"):
        with pytest.raises(ValueError, match="not implemented for Emu3"):
            pipe(PROMPT, do_sample=False)
        return
    r = pipe(PROMPT, do_sample=False, compare_baseline=True, seed=1)
    assert torch.equal(r.tokens, r.baseline_tokens)
    assert r.images[0].size[0] > 0 and r.tokens.shape[1] == pipe.target.num_image_tokens
    assert r.stats.step_compression >= 1.0 and r.stats.config["exact"] is True
    assert r.stats.config["method"] == method.split(":")[0]  # (the method that ran; "sjd-coupled"'s drafter is "sjd")


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("method", ["lantern:eagle", "lantern++:draft", "gsd:eagle", "lantern:eagle2", "gsd:eagle2"])
def test_relaxed_methods_sample_and_report_their_bounds(checkpoints, family, method, tmp_path):
    pipe = make(checkpoints, family, method, tmp_path, delta=0.2, lam=3.0, neighbours_k=4)
    if family == "emu3" and method.endswith("eagle2"):
        return  # no trees on Emu3 (see above)
    r = pipe(PROMPT, seed=0, guidance_scale=2.0)
    config = r.stats.config
    assert config["neighbours_k"] == 4 and config["acceptance"] == method.split(":")[0] and config["exact"] is False
    assert config["method"] == method.split(":")[0]  # (the method, not its drafter, e.g. "image-eagle")
    assert config.get("delta", config.get("lam", config.get("top_m"))) in (0.2, 3.0, 50)
    assert r.tokens.max() < pipe.target.vocab_size


def test_recipe_trains_a_head_that_serves_lantern_in_one_call(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    target_dir, _ = checkpoints["janus"]
    out = tmp_path / "janus-eagle"
    code = main(["train", "image-drafter", "--model", str(target_dir), "--out", str(out), "--sequences", "4",
                 "--val-sequences", "2", "--gen-batch", "2", "--steps", "4", "--batch-size", "2", "--save-every", "2",
                 "--threads", "1", "--guidance", "2.0"])
    assert code == 0
    assert json.loads((out / "eval.json").read_text())["step"] == 4
    r = mmspec.pipeline("text-to-image", model=str(target_dir), method="lantern:eagle2", eagle_head=str(out),
                        neighbours_k=4)(PROMPT, seed=0, guidance_scale=2.0)
    assert r.stats.config["drafter"] == "image-eagle2" and r.stats.config["delta"] == 0.05
    assert len(r.images) == 1


def test_unsupported_models_and_missing_parts(checkpoints, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="not a supported text-to-image model"):
        mmspec.pipeline("text-to-image", model=str(tmp_path / "llama"))
    target_dir, _ = checkpoints["janus"]
    with pytest.raises(ValueError, match="eagle_head=DIR"):
        mmspec.pipeline("text-to-image", model=str(target_dir), method="eagle")(PROMPT)
    with pytest.raises(ValueError, match="drafter must be one of"):
        mmspec.pipeline("text-to-image", model=str(target_dir), method="lantern:medusa")
    with pytest.raises(ValueError, match="empty prompt"):
        mmspec.pipeline("text-to-image", model=str(target_dir), method="ar")("  ")


def test_a_checkpoint_without_its_vq_weights_and_a_draft_of_another_family_are_refused(checkpoints, tmp_path):
    """A Janus checkpoint lacking its VQ model's weights ran (transformers filled them at random)
    and drew images from noise; a Chameleon draft for a Janus target was a traceback after the
    target loaded, a folder without config.json a full-size random Janus: one line each, before."""
    import shutil

    from safetensors.torch import load_file, save_file

    target_dir, _ = checkpoints["janus"]
    bare = tmp_path / "janus-no-vq"
    shutil.copytree(target_dir, bare)
    weights = load_file(str(bare / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".vqmodel." not in k}, str(bare / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"janus-no-vq lacks \d+ of the model's weights \(model.vqmodel.*give the complete checkpoint"):
        mmspec.pipeline("text-to-image", model=str(bare), method="ar")
    with pytest.raises(ValueError, match="draft '.*chameleon.*' is a 'chameleon' model; the target is 'janus'"):
        mmspec.pipeline("text-to-image", model=str(target_dir), method="spec", draft=str(checkpoints["chameleon"][1]))
    (tmp_path / "no-config").mkdir()
    with pytest.raises(ValueError, match="draft '.*no-config' is no transformers checkpoint"):
        mmspec.pipeline("text-to-image", model=str(target_dir), method="spec", draft=str(tmp_path / "no-config"))


def test_a_grid_and_a_processor_that_cannot_apply_are_refused_before_loading(checkpoints, tmp_path, monkeypatch):
    """grid= was ignored by mmspec's layout and a TypeError for Janus; a processor path that does
    not load was reported as "none was found with the model"."""
    import transformers

    monkeypatch.setattr(transformers.JanusForConditionalGeneration, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
    target_dir, _ = checkpoints["janus"]
    with pytest.raises(ValueError, match="grid= sets an Emu3 model's rows and columns.*is a 'janus' model"):
        mmspec.pipeline("text-to-image", model=str(target_dir), grid=(4, 4))
    with pytest.raises(ValueError, match="this model's grid is fixed by its image tokenizer: drop grid"):
        mmspec.pipeline("text-to-image", grid=(4, 4))
    for bad in ((4,), (0, 4), (2.5, 4), "44"):
        with pytest.raises(ValueError, match=r"give \(rows, columns\), two positive integers"):
            mmspec.pipeline("text-to-image", model=str(target_dir), grid=bad)
    with pytest.raises(FileNotFoundError, match="processor='/nonexistent/proc': no such file or directory"):
        mmspec.pipeline("text-to-image", model=str(target_dir), processor="/nonexistent/proc")
    monkeypatch.undo()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="processor='.*empty' holds no processor or tokenizer transformers can load"):
        mmspec.pipeline("text-to-image", model=str(target_dir), processor=str(tmp_path / "empty"))


def test_a_chameleon_checkpoint_without_its_vqgan_decoder_is_refused_before_it_loads(checkpoints, monkeypatch):
    """Its images could not be decoded, which was found after every image (and baseline) was made."""
    import transformers

    monkeypatch.setattr(transformers.ChameleonForConditionalGeneration, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
    with pytest.raises(ValueError, match="is a Chameleon checkpoint, whose images transformers cannot decode"):
        mmspec.pipeline("text-to-image", model=str(checkpoints["chameleon"][0]), method="sjd")
    # train image-drafter's --model help listed Chameleon, which the recipe refuses so
    from mmspec.cli import build_parser

    recipe = build_parser()._subparsers._group_actions[0].choices["train"]._subparsers._group_actions[0].choices["image-drafter"]
    model_help = next(a.help for a in recipe._actions if a.dest == "model")
    assert "Janus / Emu3 path or hub id (a Chameleon checkpoint is refused" in model_help


def test_an_emu3_batch_is_refused_before_the_model_loads(checkpoints, tmp_path, monkeypatch, capsys):
    """Emu3 decodes one image at a time (its end-of-line tokens): `mmspec t2i --batch-size 2` was
    refused only after the weights had loaded; the pipeline call, before any prompt is encoded."""
    import transformers

    target_dir, _ = checkpoints["emu3"]
    with monkeypatch.context() as m:
        m.setattr(transformers.Emu3ForConditionalGeneration, "from_pretrained",
                  lambda *a, **k: pytest.fail("the weights loaded before the refusal"))
        argv = ["t2i", PROMPT, "--model", str(target_dir), "--method", "sjd", "--batch-size", "2", "--num-images", "2",
                "--out", str(tmp_path / "out")]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == ("mmspec: error: Emu3 inserts an end-of-line token into the cache after every image row, so it "
                       "decodes one image at a time; use --batch-size 1\n"), err
        assert main(["bench", "t2i", "--model", str(target_dir), "--methods", "ar", "--batch-sizes", "1,2", "--no-quality",
                     "--results", str(tmp_path / "r.json")]) == 2
        assert "--batch-sizes 1,2: Emu3 inserts an end-of-line token" in capsys.readouterr().err
    pipe = make(checkpoints, "emu3", "sjd", tmp_path)
    with pytest.raises(ValueError, match="inserts an end-of-line token .* so it decodes one image at a time; use batch_size 1"):
        pipe([PROMPT, PROMPT], batch_size=2)
