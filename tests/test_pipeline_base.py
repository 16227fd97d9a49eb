"""The shared skeleton of the pipelines: one method-spec syntax, one Method base and registry, one
Pipeline base -- and a fourth task built on them in a few lines (components, methods, one
registration), whose compare_baseline and progress go through the base."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tiny_models import make_text_only_draft

import mmspec
from mmspec.pipelines import PIPELINES, Method, MethodRegistry, Pipeline, Setting, parse_spec, register_pipeline
from mmspec.pipelines.methods import MethodSpec, at_least, split_specs
from mmspec.pipelines.base import pipeline_class


# -- the spec syntax -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec, parsed", [
    ("sjd", MethodSpec("sjd", None, ())),
    ("sjd:vertical", MethodSpec("sjd", "vertical", ())),
    ("sjd:init=vertical,window=4", MethodSpec("sjd", None, (("init", "vertical"), ("window", "4")))),
    ("sjd:vertical,window=4", MethodSpec("sjd", "vertical", (("window", "4"),))),
    ("vadusa:top_k=5:num_draft_tokens=3", MethodSpec("vadusa", None, (("top_k", "5"), ("num_draft_tokens", "3")))),
    ("eagle2:/models/a,b:c", MethodSpec("eagle2", "/models/a,b:c", ())),  # a short form's value is kept whole
    ("vadusa:top_k=5,oops", MethodSpec("vadusa", None, (("top_k", "5"), ("oops", None)))),
])
def test_specs_parse_into_name_argument_and_pairs(spec, parsed):
    assert parse_spec(spec) == parsed


def test_a_list_of_specs_keeps_each_specs_pairs():
    assert split_specs("ar,vadusa:top_k=5,num_draft_tokens=3,sjd:vertical,,lantern") == [
        "ar", "vadusa:top_k=5,num_draft_tokens=3", "sjd:vertical", "lantern"]
    assert split_specs("ar,cspd/num_draft_tokens=4,cspd/draft_mode=parallel") == [  # mmspec bench t2i's own pairs
        "ar", "cspd/num_draft_tokens=4", "cspd/draft_mode=parallel"]


@pytest.mark.parametrize("spec", ["", ":x", None])
def test_an_empty_spec_is_one_line(spec):
    with pytest.raises(ValueError, match="empty method spec"):
        parse_spec(spec)


def test_every_task_takes_the_one_syntax_and_its_short_forms():
    from mmspec.pipelines.captioning import make_caption_method
    from mmspec.pipelines.text_to_image import make_method as t2i
    from mmspec.pipelines.text_to_speech import make_method as tts

    assert t2i("sjd:vertical").settings == t2i("sjd:init=vertical").settings == {"window": None, "init": "vertical"}
    assert t2i("mar-parallel:8").settings == t2i("mar-parallel:num_iter=8").settings == {"num_iter": 8}
    assert t2i("lantern:eagle2,delta=0.1").settings["drafter"] == "eagle2"
    assert tts("vadusa:top_k=5,num_draft_tokens=3").describe()["top_k"] == 5
    assert tts("vadusa:top_k=5:num_draft_tokens=3").num_draft_tokens == 3  # the older ':' separator
    for short, long in (("prompt-lookup:10", "prompt-lookup:num_draft_tokens=10"), ("layer-skip:8", "layer-skip:layers=8"),
                        ("eagle2:some/dir", "eagle2:path=some/dir")):
        assert make_caption_method(short).drafter_spec() == make_caption_method(long).drafter_spec() == short
    assert make_caption_method("none").drafter_spec() == "ar"  # an alias
    assert make_caption_method("sjd:vertical").drafter_spec() == "sjd:vertical"  # any spec drafter of mmspec.drafters


@pytest.mark.parametrize("spec, message", [
    ("layer-skip", "layer-skip needs the number of layers"),
    ("layer-skip:eight", r"layer-skip takes an integer >= 1 .*, e.g. 'layer-skip:4', got 'eight'; its settings are key=number: layers"),
    ("prompt-lookup:0", "num_draft_tokens must be an integer >= 1"),
    ("prompt-lookup:k=3", "method 'prompt-lookup' takes no setting 'k'; its settings are key=number: num_draft_tokens"),
    ("ar:3", "method 'ar' takes no ':3' argument; method 'ar' has no settings"),
])
def test_captioning_drafter_specs_are_checked_before_anything_loads(spec, message):
    from mmspec.pipelines.captioning import check_drafter_name

    with pytest.raises(ValueError, match=message) as error:
        check_drafter_name(spec)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message):  # the pipeline checks it before loading the model
        mmspec.pipeline("image-captioning", model="/nonexistent/vlm", drafter=spec)


def test_mmspec_generate_takes_the_one_spec_syntax():
    """The drafter registry reads a spec's key as its short form (``spec_argument``, the key the
    captioning methods name too): the same drafter, the same tokens; another key is one line."""
    from mmspec.drafters import DRAFTERS, split_drafter_spec
    from mmspec.pipelines.captioning.methods import caption_method_class

    for name, cls in DRAFTERS.items():  # the two tables of keys agree
        method = caption_method_class(name)
        if hasattr(cls, "from_spec") and method is not None and method.argument != "arg":
            assert method.argument == cls.spec_argument, name
    assert split_drafter_spec("layer-skip:layers=2") == split_drafter_spec("layer-skip:2") == ("layer-skip", "2")
    model = make_text_only_draft()
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 5]])
    short, long = (mmspec.generate(model, input_ids=ids, drafter=spec, max_new_tokens=6).sequences
                   for spec in ("prompt-lookup:3", "prompt-lookup:num_draft_tokens=3"))
    assert torch.equal(short, long)
    for spec, message in (("prompt-lookup:k=3", "drafter 'prompt-lookup' takes no setting 'k'; its setting is num_draft_tokens"),
                          ("prompt-lookup:abc", "prompt-lookup's num_draft_tokens must be an integer >= 1, got 'abc'"),
                          ("layer-skip:layers=x", "layer-skip's layers must be an integer >= 1, got 'x'")):
        with pytest.raises(ValueError, match=message):
            mmspec.generate(model, input_ids=ids, drafter=spec, max_new_tokens=2)


@pytest.mark.parametrize("spec", ["sjd", "sjd-coupled", "sjd-pac", "prompt-lookup"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_budget_of_one_to_three_tokens_with_training_free_drafters(spec, do_sample):
    """The loop's last token is verified without a draft (no budget left to draft): a drafter
    that carries its drafts between steps (SJD) must take that step too (``mmspec tts
    --max-seconds 0.01`` crashed there), and the tokens are plain decoding's under greedy."""
    model, ids = make_text_only_draft(), torch.tensor([[1, 5, 9, 5, 9]])
    for n in (1, 2, 3):
        out = mmspec.generate(model, input_ids=ids, drafter=spec, max_new_tokens=n, do_sample=do_sample, seed=0)
        assert out.sequences.shape == (1, ids.shape[1] + n)
        if not do_sample:
            plain = mmspec.generate(model, input_ids=ids, drafter="ar", max_new_tokens=n)
            assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_draft_tokens=0), ValueError, "num_draft_tokens must be a positive integer or None"),
    (dict(num_draft_tokens="4"), ValueError, "num_draft_tokens must be a positive integer or None .*got '4'"),
    (dict(num_draft_tokens=2.5), ValueError, "num_draft_tokens must be a positive integer or None .*got 2.5"),
    (dict(prompt=5), TypeError, r"prompt must be a string, got 5 \(int\)"),
])
def test_captioning_construction_values_are_checked_before_loading(kwargs, error, message):
    with pytest.raises(error, match=message):  # a model path that does not exist: refused before it is looked for
        mmspec.pipeline("image-captioning", model="/nonexistent/vlm", drafter="eagle", **kwargs)


@pytest.mark.parametrize("task, name", [("text-to-speech", "temperature"), ("text-to-image", "seed"),
                                        ("image-captioning", "max_new_tokens")])
def test_a_call_argument_given_to_the_pipeline_says_where_it_goes(task, name):
    with pytest.raises(ValueError, match=f"^{name} is an argument of each call, not of the pipeline: pipe = "
                                         fr"mmspec.pipeline\('{task}'\), then pipe\(..., {name}=5\)$"):
        mmspec.pipeline(task, **{name: 5})  # (a method's unknown setting, or a TypeError, before)


@pytest.mark.parametrize("eos", ["x", -5, 10**9, True, [3, "a"]])
def test_a_bad_eos_token_id_is_one_line(eos):
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id or a list of them \(0 to \d+\), got"):
        mmspec.generate(make_text_only_draft(), input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, eos_token_id=eos)


def test_text_inputs_of_another_type_are_one_line():
    """tts(None), t2i(5): one TypeError line naming the argument (it was "'NoneType' object is not iterable")."""
    for value, got in ((None, "NoneType"), (5, "int"), (["a", 3], r"a list holding int \(item 2 of 2\)")):
        with pytest.raises(TypeError, match=f"^text must be a string or a list of strings, got {got}$"):
            Pipeline.strings(value, "text")
    assert Pipeline.strings(("a", "b"), "text") == ["a", "b"] and Pipeline.strings("a", "prompt") == ["a"]


def test_a_drafters_file_path_reads_relative_to_the_model_in_either_form(tmp_path):
    from mmspec.pipelines.captioning import ImageCaptioningPipeline

    (tmp_path / "model").mkdir()
    (tmp_path / "head").mkdir()
    pipe = object.__new__(ImageCaptioningPipeline)  # no model: only the drafters file's directory
    pipe.model_dir = tmp_path / "model"
    expected = f"eagle:{tmp_path / 'model' / '../head'}"
    assert pipe._table_spec("eagle:../head") == pipe._table_spec("eagle:path=../head") == expected
    assert pipe._table_spec("prompt-lookup:10") == "prompt-lookup:10" and pipe._table_spec("ar") == "ar"


# -- the Method base and its registry --------------------------------------------------------------
SETTINGS = {
    "num_draft_tokens": Setting(int, "K", at_least(1), "an integer >= 1"),
    "mode": Setting(str, "how to draft", lambda v: v in ("fast", "slow"), "fast or slow"),
    "top_k": Setting(int, "VADUSA's tolerance", rule="topk-tolerance"),
}
METHODS = MethodRegistry("token method", example="lookup:4")


class TokenMethod(Method):
    SETTINGS = SETTINGS
    registry = METHODS


@METHODS.register
class PlainMethod(TokenMethod):
    name = "ar"
    aliases = ("plain",)
    description = "plain decoding"


@METHODS.register
class LookupMethod(TokenMethod):
    name = "lookup"
    description = "prompt lookup"
    argument = "num_draft_tokens"
    defaults = {"num_draft_tokens": 3, "mode": "fast"}

    def build_drafter(self, components):
        from mmspec.drafters import PromptLookupDrafter

        return PromptLookupDrafter(num_draft_tokens=self.settings["num_draft_tokens"])


@METHODS.register
class TolerantLookupMethod(LookupMethod):
    name = "lookup-topk"
    description = "prompt lookup under top-k tolerance"
    rule = "topk-tolerance"
    defaults = {**LookupMethod.defaults, "top_k": 3}

    def rule_kwargs(self, components):
        return {"top_k": self.settings["top_k"]}


def test_a_methods_spec_aliases_and_settings():
    assert METHODS.make("lookup:5").settings == {"num_draft_tokens": 5, "mode": "fast"}
    assert METHODS.make("lookup:mode=slow,num_draft_tokens=2").settings == {"num_draft_tokens": 2, "mode": "slow"}
    assert METHODS.make("lookup:5", num_draft_tokens=5).settings["num_draft_tokens"] == 5  # the same value twice
    with pytest.raises(ValueError, match="sets num_draft_tokens=5 and num_draft_tokens=7 is given as well"):
        METHODS.make("lookup:5", num_draft_tokens=7)  # two values: neither silently wins
    with pytest.raises(ValueError, match="sets mode='slow' and mode='fast' is given as well"):
        METHODS.make("lookup:mode=slow", mode="fast")
    assert METHODS.make("lookup:5", num_draft_tokens=None).settings["num_draft_tokens"] == 5  # None is the default
    assert isinstance(METHODS.make("plain"), PlainMethod) and list(METHODS) == ["ar", "lookup", "lookup-topk"]
    assert METHODS.make("lookup:mode=slow").spec() == "lookup:num_draft_tokens=3,mode=slow"


def test_exact_follows_the_rule():
    assert PlainMethod.exact and LookupMethod.exact and not TolerantLookupMethod.exact

    class Approximate(LookupMethod):
        name = "approx"
        description = "decodes otherwise than plain decoding"
        approximate = True

    assert not Approximate.exact


@pytest.mark.parametrize("spec, settings, message", [
    ("beam", {}, r"unknown method 'beam'; choose one of ar, lookup, lookup-topk \(e.g. 'lookup:4'\)"),
    ("lookup:depth=2", {}, r"method 'lookup' takes no setting 'depth'; its settings are key=value: num_draft_tokens, mode"),
    ("lookup:mode=medium", {}, r"mode must be fast or slow \(how to draft\), got 'medium'"),
    ("lookup:x", {}, r"lookup takes an integer >= 1 \(K\), e.g. 'lookup:3', got 'x'"),
    ("lookup:mode=x,num_draft_tokens=y", {}, r"method 'lookup:mode=x,num_draft_tokens=y': num_draft_tokens='y' is not an integer >= 1"),
    ("lookup:3,mode=slow,oops", {}, r"method 'lookup:3,mode=slow,oops': 'oops' is not key=value"),
    ("ar:3", {}, "method 'ar' takes no ':3' argument"),
    ("lookup", {"depth": 2}, "method 'lookup' takes no setting 'depth'"),
    ("lookup", {"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1"),
    ("lookup-topk:top_k=0", {}, "top_k must be"),  # the rule's own check
])
def test_bad_specs_are_one_line_naming_the_keys(spec, settings, message):
    with pytest.raises(ValueError, match=message) as error:
        METHODS.make(spec, **settings)
    assert "\n" not in str(error.value)


def test_a_setting_the_method_does_not_read_is_refused_when_given():
    """Issue 44: a setting of the table that the method does not read (window for cspd) was
    ignored; now it is one line, for every method. None means unset and passes."""

    class Reads(TokenMethod):
        name, description, defaults = "reads-mode", "test", {"mode": "fast"}

    assert Reads(num_draft_tokens=None).settings == {"mode": "fast"}
    with pytest.raises(ValueError, match=r"method 'reads-mode' takes no setting 'num_draft_tokens' \(.*\), got "
                                         r"num_draft_tokens=4; drop it .*its settings are key=value: mode"):
        Reads(num_draft_tokens=4)
    with pytest.raises(ValueError, match=r"takes no setting 'depth' \(known settings: num_draft_tokens, mode, top_k\)"):
        Reads(depth=None)
    with pytest.raises(ValueError, match="mode must be"):
        Reads(mode=3)
    assert Reads.reads({"mode": "slow", "num_draft_tokens": 4, "top_k": None}) == {"mode": "slow"}


def test_a_taken_name_or_alias_is_refused():
    class Again(TokenMethod):
        name, description = "lookup", "a second lookup"

    class AliasTaken(TokenMethod):
        name, description, aliases = "other", "another", ("plain",)

    class AliasOfName(TokenMethod):
        name, description, aliases = "other", "another", ("ar",)

    for cls, name in ((Again, "lookup"), (AliasTaken, "plain"), (AliasOfName, "ar")):
        with pytest.raises(ValueError, match=f"a token method named '{name}' is already registered"):
            METHODS.register(cls)
    assert "other" not in METHODS


def test_the_tasks_registries_refuse_taken_names():
    from mmspec.pipelines.captioning import METHODS as CAPTION
    from mmspec.pipelines.text_to_image import METHODS as T2I
    from mmspec.pipelines.text_to_speech import METHODS as TTS

    for registry, name in ((CAPTION, "eagle"), (T2I, "sjd"), (TTS, "vadusa")):
        with pytest.raises(ValueError, match="already registered"):
            registry.register(type(registry[name].__name__, (registry[name],), {}))
    with pytest.raises(ValueError, match="already registered"):
        register_pipeline(type("Again", (Pipeline,), {"task": "image-captioning"}))


# -- a fourth task: components + methods + one registration --------------------------------------------
@dataclass
class TokenComponents:
    """The task's parts: here one tiny Llama, as the core's target."""

    target: Any

    @classmethod
    def load(cls) -> "TokenComponents":
        from mmspec.adapters.hf import TransformersTarget

        return cls(TransformersTarget(make_text_only_draft(seed=0)))


@dataclass
class TokenOutput:
    tokens: torch.Tensor
    stats: Any
    baseline_tokens: torch.Tensor | None = None


class TokenContinuationPipeline(Pipeline):
    """Continue token prompts: ``mmspec.pipeline("test-token-continuation", method="lookup:4")``."""

    task = "test-token-continuation"
    methods = METHODS

    def __init__(self, method: str = "lookup", **settings: Any) -> None:
        self.method = self.make_method(method, **settings)  # checked before anything loads
        self.components = TokenComponents.load()
        self.warm_ups = 0

    def _generate(self, method: Method, prompt: list[int]):
        from mmspec.api import generate

        return generate(self.components.target, drafter=method.build_drafter(self.components), max_new_tokens=12,
                        acceptance=method.rule, rule_kwargs=method.rule_kwargs(self.components),
                        input_ids=torch.tensor([prompt]))

    def _warm_up(self, prompt):
        self.warm_ups += 1
        self._generate(self.method, prompt[:2])

    def __call__(self, prompts: list[list[int]], compare_baseline: bool = False, progress=None, batch_size: int = 1):
        self.check_batch_size(batch_size)
        report, close = self.progress_reporter(progress, len(prompts), "prompt")
        outputs = []
        for first, chunk in self.chunks(prompts, batch_size):
            for prompt in chunk:
                out, base = self.with_baseline(lambda: self._generate(self.method, prompt),
                                               (lambda: self._generate(self.make_method("ar"), prompt)) if compare_baseline else None,
                                               warm_up=lambda: self._warm_up(prompt))
                outputs.append(TokenOutput(out.sequences, out.stats, None if base is None else base.sequences))
            if report:
                report(len(outputs))
        close()
        return outputs


@pytest.fixture(scope="module")
def token_pipe():
    # the one registration, here rather than at import: a module imported by every test worker must
    # not leave a fourth task in the registry that other modules' tests list
    register_pipeline(TokenContinuationPipeline)
    try:
        yield mmspec.pipeline("test-token-continuation", method="lookup:2")
    finally:
        del PIPELINES["test-token-continuation"]


def test_a_fourth_task_is_components_methods_and_one_registration(token_pipe):
    from mmspec.pipelines import known_tasks

    assert "test-token-continuation" in known_tasks() and token_pipe.method.settings["num_draft_tokens"] == 2
    with pytest.raises(ValueError, match="num_draft_tokens must be"):
        mmspec.pipeline("test-token-continuation", method="lookup:0")


def test_compare_baseline_warms_up_once_and_matches_plain_decoding(token_pipe):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    first = token_pipe(prompts, compare_baseline=True)
    assert token_pipe.warm_ups == 1
    for output in first:
        assert torch.equal(output.tokens, output.baseline_tokens)  # greedy: the method is exact
    again = token_pipe(prompts[:1], compare_baseline=True)
    assert token_pipe.warm_ups == 1  # once per pipeline
    assert torch.equal(again[0].tokens, first[0].tokens)
    assert token_pipe(prompts[:1])[0].baseline_tokens is None


def test_progress_is_one_callable_and_true_is_a_bar(token_pipe, capsys):
    seen = []
    token_pipe([[1, 2, 3]] * 3, progress=seen.append, batch_size=2)
    assert seen == [2, 3]  # after each chunk, the units done so far
    token_pipe([[1, 2, 3]], progress=True)
    assert "1/1" in capsys.readouterr().err
    with pytest.raises(TypeError, match="progress must be a callable"):
        token_pipe([[1, 2, 3]], progress="yes")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        token_pipe([[1, 2, 3]], batch_size=0)


def test_a_pipeline_argument_given_to_a_call_says_where_it_goes(token_pipe):
    with pytest.raises(TypeError, match=r"^method is an argument of the pipeline, not of each call: pipe = mmspec.pipeline\("
                                        r"'test-token-continuation', method='ar'\), then pipe\(...\)$"):
        token_pipe([[1, 2, 3]], method="ar")  # (t2i(prompt, method="ar"): Python's "unexpected keyword argument" before)
    with pytest.raises(TypeError, match="unexpected keyword argument 'metod'"):  # another name: Python's own message
        token_pipe([[1, 2, 3]], metod="ar")


def test_the_older_registration_still_imports_on_first_use():
    from mmspec.pipelines import TASK_MODULES, pipeline_class

    with pytest.warns(DeprecationWarning, match="decorate a Pipeline subclass"):
        register_pipeline("test-older-task", "mmspec.pipelines.text_to_speech:TextToSpeechPipeline")
    try:
        assert pipeline_class("test-older-task").task == "text-to-speech"
        with pytest.raises(ValueError, match="already registered"), pytest.warns(DeprecationWarning):
            register_pipeline("test-older-task", "x:Y")
    finally:
        del TASK_MODULES["test-older-task"]
        PIPELINES.pop("test-older-task", None)


def test_the_pipelines_share_the_base():
    from mmspec.pipelines import pipeline_class
    from mmspec.pipelines.captioning import METHODS as CAPTION
    from mmspec.pipelines.text_to_image import METHODS as T2I
    from mmspec.pipelines.text_to_speech import METHODS as TTS

    for task, registry in (("image-captioning", CAPTION), ("text-to-image", T2I), ("text-to-speech", TTS)):
        cls = pipeline_class(task)
        assert issubclass(cls, Pipeline) and cls.task == task and cls.methods is registry
        assert all(issubclass(method, Method) for method in registry.values())


def test_old_module_names_are_the_new_modules():
    import importlib
    import sys

    for old, new in (("t2i_methods", "text_to_image.methods"), ("t2i_components", "text_to_image.components"),
                     ("mar_components", "text_to_image.mar_components"), ("tts_methods", "text_to_speech.methods")):
        sys.modules.pop(f"mmspec.pipelines.{old}", None)  # imported afresh: the alias runs and warns
        with pytest.warns(DeprecationWarning, match=f"moved to mmspec.pipelines.{new}"):
            module = importlib.import_module(f"mmspec.pipelines.{old}")
        assert module is importlib.import_module(f"mmspec.pipelines.{new}")


@pytest.mark.parametrize("task,inputs", [("image-captioning", "x.png"), ("text-to-image", "a red circle"),
                                         ("text-to-speech", "Hello there.")])
@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": "hot"}, r"temperature must be a number( or None)?, got 'hot' \(str\)"),
    ({"seed": "x"}, r"seed must be an integer( or None)?, got 'x' \(str\)"),
    ({"do_sample": "yes"}, r"do_sample must be True or False, got 'yes' \(str\)"),
])
def test_every_pipeline_call_checks_argument_types_before_any_model_work(task, inputs, kwargs, message):
    """Issue 44: ``temperature="hot"`` was a TypeError from the sampling code. The check runs before
    the call's body: here on a pipeline object that has loaded nothing."""
    cls = pipeline_class(task)
    bare = cls.__new__(cls)  # no components: any model work would fail with an AttributeError
    with pytest.raises(ValueError, match=message) as error:
        bare(inputs, **kwargs)
    assert "\n" not in str(error.value)


def test_construction_calls_and_stream_steps_hold_the_process_lock():
    """PIPELINE_LOCK is held (by the calling thread) while a pipeline is built, called, and makes a
    stream's next item, not while the consumer holds an item; closing a stream early runs its
    clean-up under the lock."""
    import threading

    from mmspec.pipelines.base import PIPELINE_LOCK

    seen: list[tuple[str, bool]] = []

    def held() -> bool:  # another thread cannot take it now
        free = []
        probe = threading.Thread(target=lambda: free.append(PIPELINE_LOCK.acquire(blocking=False) and not PIPELINE_LOCK.release()))
        probe.start()
        probe.join()
        return not free[0]

    class Probe(Pipeline):
        task = "test-lock-probe"

        def __init__(self) -> None:
            seen.append(("init", held()))

        def __call__(self, text: str) -> str:
            seen.append(("call", held()))
            return text

        def stream(self, text: str):
            try:
                for part in text.split():
                    seen.append(("step", held()))
                    yield part
            finally:
                seen.append(("closed", held()))

    pipe = Probe()
    assert pipe("a b") == "a b"
    chunks = pipe.stream("a b c")
    assert next(chunks) == "a"
    seen.append(("consumer", held()))
    chunks.close()
    assert seen == [("init", True), ("call", True), ("step", True), ("consumer", False), ("closed", True)]
    assert list(pipe.stream("x y")) == ["x", "y"] and not held()
