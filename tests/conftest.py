import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # tiny_models

#: threads per test process: the cores shared out over pytest-xdist's workers (one each when -n auto
#: gives a worker per core), at most 2 (the tiny models gain nothing from more); under xdist the
#: OpenMP / BLAS pools too (set before torch and numpy load), so two workers do not oversubscribe
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = max(1, min(2, CORES // WORKERS))
if WORKERS > 1:
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, str(THREADS))

import pytest
import torch

torch.set_num_threads(min(THREADS, torch.get_num_threads()))


# ---- pytest-xdist (``-n auto``; ``--dist loadgroup --no-loadscope-reorder`` in pyproject's addopts) -----
#: modules whose tests are long Monte-Carlo runs and whose module fixtures are cheap (a tiny model, an
#: enumerated joint): their tests are spread over the workers one by one
SPREAD = {"test_distribution", "test_t2i_core", "test_delay_pattern", "test_codec_lm", "test_tree", "test_family_distribution"}
#: the longest modules, handed out first in this order (longest first, by stop 83's --durations), so
#: no long unit (a module of one group: its tests in a row on one worker) starts last
FIRST = ["test_family_distribution", "test_codec_lm", "test_distribution", "test_serve_load", "test_serve",
         "test_embedded_captioner", "test_tree", "test_t2i_core", "test_bench_vllm", "test_text_to_image_pipeline",
         "test_captioning_pipeline", "test_serve_browser", "test_hybrid", "test_delay_pattern", "test_speech_metrics",
         "test_tts_pipeline", "test_smollm2", "test_captioner_model", "test_bench_cost", "test_caption_dataset", "test_dia",
         "test_continuous"]
#: session fixtures whose users form one group (one worker loads the model, once)
SHARED_SESSION = {"smollm2"}


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per CPU this process may run on, logical ones included (xdist's own
    count takes physical cores where psutil is installed, which can be 1 on a 2-vCPU machine), at
    most 8 (each worker holds its own models)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


def _xdist_group(item) -> str | None:
    """The group (one worker, in order) of a test: the shared session fixture it uses, else its module
    when it uses a module-scoped fixture of the tests (built once per worker that runs it); None:
    the test runs on any worker."""
    module = item.module.__name__
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is None:
        return None
    scopes = {name: defs[-1].scope for name, defs in fixtures.name2fixturedefs.items()
              if Path(str(defs[-1].func.__code__.co_filename)).parent == Path(__file__).parent}
    shared = sorted(name for name in scopes if name in SHARED_SESSION)
    if shared:
        return "+".join(shared)
    if module in SPREAD or not any(scope in ("module", "session") for scope in scopes.values()):
        return None
    return module


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the tests run in file order, as collected
    group_of = {}
    for item in items:
        group_of[item.nodeid] = _xdist_group(item)
    # a module's tests follow its group: every test of a module that shares a session fixture joins it
    module_group = {}
    for item in items:
        group = group_of[item.nodeid]
        if group in SHARED_SESSION or (group and "+" in group):
            module_group[item.module.__name__] = group
    for item in items:
        group = module_group.get(item.module.__name__, group_of[item.nodeid])
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(FIRST)))  # stable: file order within a module


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A CLI run in this process sets torch's thread count (``--threads``): the next test starts with
    what it started with, whatever the order of the tests."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _transformers_logs_to_this_tests_stderr():
    """transformers' log handler keeps the stderr it was made with: made during a test that captured
    stderr (capsys), it wrote into that test's closed stream ever after ("--- Logging error ---" and a
    traceback in a later test's output, which a test of one-line errors then failed on, depending on
    the order of the tests). Each test points it at its own stderr."""
    logging_module = sys.modules.get("transformers.utils.logging")
    handler = getattr(logging_module, "_default_handler", None)
    if handler is not None:  # (as transformers makes it: its stream and, bound apart, its flush)
        handler.stream, handler.flush = sys.stderr, sys.stderr.flush  # (not setStream: it flushes the old one)
    yield


@pytest.fixture
def free_port():
    """A TCP port free on this machine now (for a test that starts a process group: two xdist workers
    must not pick the same fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct in float32 (converted from the installed GGUF once)."""
    from mmspec.hub import load_causal_lm

    return load_causal_lm("smollm2", dtype=torch.float32)


@pytest.fixture(scope="session")
def custom_code_lm(tmp_path_factory) -> Path:
    """A tiny text LM whose config.json names its own Python code (``auto_map``: a LlamaForCausalLM
    subclass in custom_lm.py), as a hub checkpoint with custom modelling code does: loaded only with
    trust_remote_code (``--trust-remote-code``)."""
    import json

    from test_train_any_target import save_text_target, smollm2_tokenizer
    from tiny_checkpoints import save_tiny_draft
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("custom-code-lm")
    tokenizer = smollm2_tokenizer()
    save_tiny_draft(folder, len(tokenizer), seed=3)
    save_text_target(folder, LlamaForCausalLM.from_pretrained(folder), tokenizer)
    (folder / "custom_lm.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'mmspec_custom_lm'\n\n\n"
        "class CustomLM(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mmspec_custom_lm", architectures=["CustomLM"],
                  auto_map={"AutoConfig": "custom_lm.CustomConfig", "AutoModelForCausalLM": "custom_lm.CustomLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def no_terminal(monkeypatch):
    """stdin at its end, as in CI: transformers' [y/N] question about a checkpoint's own code (asked
    when trust_remote_code is None) reads nothing there instead of waiting on the terminal."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))


@pytest.fixture
def debian_text_sources(tmp_path, monkeypatch):
    """Stand-ins for Debian's fortunes-min and wamerican, which the open corpus' ``fortunes`` and
    ``words`` sources read (they are refused where missing): tests of the corpus and its users run
    the same on a machine with or without the packages."""
    from mmspec.train.data import open_text

    fortunes = tmp_path / "debian-fortunes"
    fortunes.mkdir()
    (fortunes / "fortunes").write_text("\n%\n".join(f"The old clock in room {i} struck nine again." for i in range(90)) + "\n")
    words = tmp_path / "debian-american-english"
    words.write_text("\n".join(f"{a}{b}{c}" for a in "bcdfg" for b in "aeiou" for c in "lmnprst") + "\n")
    monkeypatch.setattr(open_text, "FORTUNES", fortunes)
    monkeypatch.setattr(open_text, "WORDS", words)
