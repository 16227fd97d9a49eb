"""Drafter training data for any supported target: ``mmspec train drafter --target PATH_OR_HUB_ID --data DATA``.

DATA is one of
- a JSONL file, one ``{"image"?: path relative to the file, "prompt": str, "response"?: str}`` a line;
- a folder of images (every image under it, sorted; prompt = ``--prompt``, default "Describe the image.");
- a ``datasets`` dataset saved with ``save_to_disk`` (a ``Dataset`` folder, or a ``DatasetDict``
  folder: its ``train`` split, else its first), or parquet files (one file, a folder holding them,
  or a glob such as ``"data/train-*.parquet"``), with the columns ``prompt`` and optionally
  ``image`` (a path relative to the dataset folder / the parquet file, or ``datasets``' ``Image``
  feature, i.e. {bytes, path}) and ``response``. Both are read with ``pyarrow`` (what ``datasets``
  stores them with), so the ``datasets`` package itself is not needed.

Bad rows are skipped and counted, never silently: an unreadable JSON line or dataset row (one whose
prompt or response is no string counts as one), an
empty prompt, a JSONL row with a field like ``image`` or ``response`` but none named so (``img``,
``images``, ``respone``), an image file that does not exist, an image that cannot be decoded, an image given
to a text-only target, a data file (parquet / Arrow) that cannot be read or has no ``prompt``
column (counted once, the other files still read). The counts are printed, each reason naming its
first :data:`SHOWN` rows or files (``empty prompt (part-0.parquet rows 3, 7)``, ``missing image
(lines 2, 9)``), and kept with the data shards, so a resumed run prints them too. Only a DATA with
no usable row at all is refused.

Without a ``response`` the target writes it itself (self-distillation): its own plain decoding of
the prompt (greedy, or sampled at ``--sample-temperature`` with a per-row seed), ``--gen-batch``
rows at a time where the family decodes batches (:func:`mmspec.api.generate_rows`; one row at a
time where :attr:`TransformersTarget.batch_size_one_reason` says it cannot). Then each sequence
``prompt + response`` is run once through the target (:meth:`TransformersTarget.prefill` with
``hidden_layer=-1``, the very features the drafters read at generation time) and stored as a
record ``{"ids" [L], "learn" [L] (the response positions), "features" [L, H] bf16, "shallow"
[L, H] bf16 (Kangaroo only)}``, ``--shard-size`` examples per shard file in the data cache
(``OUT/data`` by default), so an interrupted run makes only the shards it lacks. EAGLE-3 stores
the concatenated states of the head's three target layers as "features" [L, 3 H] instead
(``feature_layer``: the ``hidden_states`` indices, the head's ``aux_layers``). Under
``accelerate launch`` process r makes the shards s with s % n == r.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..adapters.hf import VLM_FAMILIES, TransformersTarget
from ..core import words
from ..pipelines.captioning import DEFAULT_PROMPT
from ..pipelines.captioning.components import escape_image_tokens, image_token_strings, no_chat_template

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MANIFEST = "manifest.json"


@dataclass
class Example:
    """One training row: the prompt, the image (a file, or a dataset's encoded bytes or PIL image), the
    response (None: self-distil), its group (an optional label, e.g. an image family, that
    ``--hold-out-groups`` holds out of training)."""

    prompt: str
    image: Any = None
    response: str | None = None
    group: str | None = None
    source: str | None = None  # where the row is, for the skip summary: "line 3", "part-0.parquet row 2", an image's path


#: how many rows / files a skip reason names before "..."
SHOWN = 5
#: the skip reasons that count whole data files, not rows
FILE_REASONS = ("unreadable data file", "data file without a 'prompt' column")


def _count(skipped: dict[str, int], reason: str) -> None:
    skipped[reason] = skipped.get(reason, 0) + 1


def _note(where: dict[str, list[str]], reason: str, place: str | None) -> None:
    """Keep ``place`` (a row's or file's location) under ``reason``, the first ``SHOWN + 1`` of each
    (one past those shown, so that the summary knows to end with "...")."""
    if place is not None and len(places := where.setdefault(reason, [])) <= SHOWN:
        places.append(place)


def name_places(skipped: dict[str, int], where: dict[str, list[str]]) -> dict[str, int]:
    """``skipped`` with each reason that has places in ``where`` renamed to name its first
    :data:`SHOWN` ones, e.g. "missing image (part-0.parquet row 3; part-1.parquet row 1, ...)"
    (the rows of one file joined: "part-0.parquet rows 3, 7"; a JSONL's: "lines 2, 9")."""
    named = {}
    for reason, n in skipped.items():
        places = where.get(reason, [])[: SHOWN + 1]
        if not places:
            named[reason] = n
            continue
        grouped: list[tuple[str, list[str]]] = []  # (the file and unit, "part-0.parquet row" / "line", its numbers) in order
        for place in places[:SHOWN]:
            file, _, number = place.rpartition(" ")
            if not (number.isdigit() and (file == "line" or file.endswith(" row"))):
                grouped.append((place, []))
            elif grouped and grouped[-1][0] == file and grouped[-1][1]:
                grouped[-1][1].append(number)
            else:
                grouped.append((file, [number]))
        shown = "; ".join(f"{file}{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}" if numbers else file
                          for file, numbers in grouped)
        named[f"{reason} ({shown}{', ...' if n > SHOWN else ''})"] = n
    return named


def read_examples(data: str | os.PathLike, default_prompt: str = DEFAULT_PROMPT, prompt_given: bool = True,
                  bare_images: str = "give --prompt to train on every image under the folder"
                  ) -> tuple[list[Example], dict[str, int]]:
    """DATA (module doc) -> (the usable examples in order, {reason: rows skipped}). ``prompt_given``
    False (no ``--prompt``): an image folder that holds a JSONL file at its top is refused, as
    ``mmspec train caption-data``'s output folder is (its rows' prompts, answers and groups would
    be dropped for ``default_prompt`` on every image without a word); ``bare_images`` ends that
    line with how the command takes the bare images instead.

    Raises:
        ValueError: DATA does not exist, is of no known form, holds no usable row, lacks a
            ``prompt`` column, or is a dataset / parquet form while ``pyarrow`` is not installed.
    """
    path = Path(data)
    skipped: dict[str, int] = {}
    is_glob = any(c in str(data) for c in "*?[") and not path.exists()
    if not is_glob and not path.exists():
        raise ValueError(f"--data {data}: no such file or folder (give a JSONL file, an image folder, a saved dataset or parquet files)")
    tables = _dataset_files(str(data), path, is_glob)
    if tables is not None:
        examples = _read_tables(*tables, skipped, str(data) if is_glob or path.is_file() else None)
    elif path.is_dir():
        beside = sorted(p.name for p in path.glob("*.jsonl"))
        if beside and not prompt_given:
            raise ValueError(f"--data {data} is read as a folder of images, each with the prompt {default_prompt!r}, but it "
                             f"holds {beside[0]}: pass --data {path / beside[0]} to use its rows, or {bare_images}")
        images = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        examples = [Example(default_prompt, image, source=str(image)) for image in images]
    elif path.suffix.lower() in (".jsonl", ".json"):
        examples = _read_jsonl(path, skipped)
    else:
        raise ValueError(f"--data {data}: give a .jsonl file, a folder of images, a saved datasets dataset (save_to_disk) "
                         "or parquet files")
    if not examples:
        columns = ("; the columns are prompt, image (optional), response (optional)"
                   if any(reason.startswith(FILE_REASONS[1]) for reason in skipped) else "")
        raise ValueError(f"--data {data} holds no usable row (skipped: {format_skipped(skipped) or 'none found'}){columns}")
    return examples, skipped


def _read_jsonl(path: Path, skipped: dict[str, int]) -> list[Example]:
    """A JSONL file's usable rows (UTF-8, a leading byte-order mark read past); each skipped row
    counted under its reason with its line numbers ("unreadable line (lines 3, 7)")."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise ValueError(f"--data {path} is not UTF-8 text (line {line}); save it as UTF-8") from None
    if text.lstrip().startswith("["):  # one JSON array (a .json dataset file): every line of it read as unreadable
        try:
            whole = json.loads(text)
        except ValueError:
            whole = None
        if isinstance(whole, list):
            raise ValueError(f"--data {path} is one JSON array, not JSON Lines: write one {{\"prompt\": ...}} object a line "
                             "(python -c \"import json, sys; [print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]\" "
                             f"{path} > {path.with_suffix('.jsonl')})")
    examples, where = [], {}
    missing: list[tuple[Path, bool]] = []  # (the images not found, as looked for, and whether given absolute: the reason names the first)
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        reasons = dict(skipped)
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("prompt", ""), str) or not isinstance(row.get("response"), (str, type(None))):
            _count(skipped, "unreadable line")  # (a response of another type was taken as none: the target's answer trained)
        elif "prompt" not in row:
            _count(skipped, "row without a prompt")
        elif (field := _misspelt_field(row)) is not None:
            _count(skipped, f"row with a field like {field!r} but none named so")
        else:
            example = _checked(row["prompt"], row.get("image"), row.get("response"), path.parent, skipped, row.get("group"),
                               missing)
            if example is not None:
                example.source = f"line {number}"
                examples.append(example)
        for reason in skipped:
            if skipped[reason] != reasons.get(reason, 0):
                where.setdefault(reason, []).append(number)
    for reason, numbers in where.items():  # (the counts stay; the reason names where)
        shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
        if reason == "missing image":  # (a path relative to the working folder reads as missing: say where it looked)
            shown += f"; no file {missing[0][0]}" + ("" if missing[0][1] else ": an image path is relative to the JSONL file's folder")
        skipped[f"{reason} (line{'s' if len(numbers) > 1 else ''} {shown})"] = skipped.pop(reason)
    return examples


#: the optional fields whose absence changes what a row is: without an image a text-only row, without
#: a response one the target answers itself
OPTIONAL_FIELDS = ("image", "response")


def _misspelt_field(row: dict[str, Any]) -> str | None:
    """The optional field that ``row`` lacks while it holds a key like it (``img``, ``images``,
    ``Image``, ``image_path``, ``respone``): a misspelling, which read as a row without the field
    would train on the prompt alone, or on the target's answer instead of the row's, without a word."""
    import difflib

    others = [key.lower() for key in row if key not in ("prompt", "group", *OPTIONAL_FIELDS)]
    for field in OPTIONAL_FIELDS:
        if field not in row and any(key.startswith(field) or difflib.SequenceMatcher(None, field, key).ratio() >= 0.7
                                    for key in others):
            return field
    return None


def _checked(prompt: str, image: Any, response: Any, root: Path, skipped: dict[str, int], group: Any = None,
             missing: list[Path] | None = None) -> Example | None:
    """A row's fields -> its Example, or None (counted in ``skipped``). ``image``: None, a path
    relative to ``root``, encoded bytes, or ``datasets``' {"bytes", "path"}; ``group``: a label
    (a string, or an integer read as its digits; anything else counts as none); ``missing`` collects the image paths not found
    (each with whether it was given as an absolute path)."""
    if not prompt.strip():
        _count(skipped, "empty prompt")
        return None
    if isinstance(image, dict):  # datasets' Image feature: the encoded file, or only its path
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str):
        given, image = image, root / image
        if not image.is_file():
            _count(skipped, "missing image")
            if missing is not None:
                missing.append((image, Path(given).is_absolute()))
            return None
    elif image is not None and not isinstance(image, bytes):
        _count(skipped, "unreadable row")
        return None
    if response is not None and (not isinstance(response, str) or not response.strip()):
        response = None  # an empty response is written by the target
    if isinstance(group, int) and not isinstance(group, bool):  # ({"group": 3}: the label "3", as --hold-out-groups 3 names it)
        group = str(group)
    return Example(prompt, image, response, group if isinstance(group, str) and group else None)


def _dataset_files(data: str, path: Path, is_glob: bool) -> tuple[str, list[Path], Path | None] | None:
    """("parquet" | "arrow", the files, the root image paths are relative to (None: each file's
    folder)) for DATA in a datasets form, None for the other forms."""
    if is_glob:
        import glob

        files = sorted(Path(f) for f in glob.glob(data, recursive=True) if f.endswith(".parquet"))
        if not files:
            raise ValueError(f"--data {data} matches no .parquet file")
        return "parquet", files, None
    if path.is_file():
        return ("parquet", [path], None) if path.suffix == ".parquet" else None
    if (path / "dataset_dict.json").is_file():  # a DatasetDict: its train split, else its first
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
        if not splits:
            raise ValueError(f"--data {data}: its dataset_dict.json lists no split")
        return _dataset_files(data, path / ("train" if "train" in splits else splits[0]), False)
    if (path / "state.json").is_file():  # a Dataset saved with save_to_disk: Arrow stream files
        state = json.loads((path / "state.json").read_text())
        return "arrow", [path / f["filename"] for f in state.get("_data_files", [])], path
    files = sorted(path.rglob("*.parquet"))
    return ("parquet", files, path) if files else None


def _read_tables(kind: str, files: list[Path], root: Path | None, skipped: dict[str, int], given: str | None = None
                 ) -> list[Example]:
    """The rows of parquet / Arrow-stream ``files`` (columns prompt, image?, response?) -> examples;
    a file that cannot be read ("unreadable data file") or has no ``prompt`` column is counted and
    the rest are read; each reason names its first rows ("part-0.parquet row 3") or files. ``given``:
    the --data of a single file or a glob (the files are named as found), else the files are named
    relative to ``root``."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("this --data is a saved dataset / parquet files: install pyarrow (pip install pyarrow, or "
                         "mmspec[data]) or export the rows as JSONL") from None
    examples, where, read = [], {}, dict(skipped)
    for file in files:
        name = str(file.relative_to(root)) if root is not None and given is None and file.is_relative_to(root) else str(file)
        try:
            if kind == "parquet":
                table = pq.read_table(file)
            else:
                with pa.memory_map(str(file)) as source:
                    table = pa.ipc.open_stream(source).read_all()
        except (OSError, ValueError, pa.ArrowException):
            _count(skipped, FILE_REASONS[0])
            _note(where, FILE_REASONS[0], name)
            continue
        if "prompt" not in table.column_names:  # (one file of many written another way: the others still train)
            _count(skipped, FILE_REASONS[1])
            _note(where, FILE_REASONS[1], f"{name}, columns {', '.join(table.column_names) or 'none'}")
            continue
        columns = [c for c in ("prompt", "image", "response", "group") if c in table.column_names]
        for number, row in enumerate(table.select(columns).to_pylist(), 1):
            before = dict(skipped)
            prompt = row["prompt"]
            if not isinstance(prompt, (str, type(None))) or not isinstance(row.get("response"), (str, type(None))):
                _count(skipped, "unreadable row")
            else:
                example = _checked(prompt or "", row.get("image"), row.get("response"), root or file.parent, skipped,
                                   row.get("group"))
                if example is not None:
                    example.source = f"{name} row {number}"
                    examples.append(example)
            for reason in skipped:
                if skipped[reason] != before.get(reason, 0):
                    _note(where, reason, f"{name} row {number}")
    named = name_places({r: n for r, n in skipped.items() if r not in read}, where)
    skipped.clear()
    skipped.update({**read, **named})
    return examples


def format_skipped(skipped: dict[str, int]) -> str:
    """{reason: n} -> "2 empty prompts (lines 3, 7), 1 missing image (line 9)", the reasons in order
    (:func:`plural_reason` where n is not 1)."""
    return ", ".join(f"{n} {reason if n == 1 else plural_reason(reason)}" for reason, n in sorted(skipped.items()))


def plural_reason(reason: str) -> str:
    """A skip reason for several rows or files: its first noun in the plural, before the places
    it names ("image given to a text-only target" -> "images given ...", "unreadable data file
    (a.parquet)" -> "unreadable data files (a.parquet)")."""
    head, bracket, places = reason.partition(" (")
    return re.sub(r"\b(prompt|image|response|file|line|row)\b(?!-)", r"\1s", head, count=1) + bracket + places


def skipped_total(skipped: dict[str, int]) -> str:
    """How many rows (and whole data files) ``skipped`` counts: "1 row", "3 rows and 1 data file"."""
    files = sum(n for reason, n in skipped.items() if reason.startswith(FILE_REASONS))
    rows = sum(skipped.values()) - files
    parts = [words.count(rows, "row")] if rows or not files else []
    if files:
        parts.append(words.count(files, "data file"))
    return " and ".join(parts)


def split_held_out(count: int, fraction: float, seed: int = 0, groups: list[str | None] | None = None,
                   held_groups: set[str] = frozenset()) -> tuple[list[int], list[int]]:
    """Indices 0..count-1 -> (train, held_out), both sorted: with ``held_groups``, the rows whose
    ``groups[i]`` is one of them are held out (whole groups the head never sees); otherwise
    ``round(fraction * count)`` rows (at least one when fraction > 0 and count > 1) chosen by a
    seeded permutation."""
    if held_groups:
        held = [i for i in range(count) if groups[i] in held_groups]
        return [i for i in range(count) if groups[i] not in held_groups], held
    held = min(count - 1, max(1 if fraction > 0 else 0, round(fraction * count)))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[held:]), sorted(order[:held])


# ------------------------------------------------------------------------------------------- target
def target_source(name: str) -> str:
    """``--target``'s checkpoint: a built-in name's directory, a local directory or a hub id;
    ValueError (one line) for a path that does not exist (rather than the hub's refusal of it as a
    repo id)."""
    from ..hub import check_model_path, resolve_checkpoint

    try:
        return check_model_path(resolve_checkpoint(name))
    except FileNotFoundError:
        raise ValueError(f"--target {name}: no such directory; give a checkpoint directory or a hub id in the local "
                         "cache") from None


def target_identity(name: str) -> str:
    """``--target`` as the data cache records it (the features it stores are this target's): a local
    checkpoint's absolute path, else the name or hub id as given."""
    from ..hub import resolve_checkpoint

    source = Path(resolve_checkpoint(name)).expanduser() if name != "captioner" else None
    return str(source.resolve()) if source is not None and source.exists() else name


def load_target(name: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
    """A local checkpoint or hub id -> (model, processor or tokenizer, is_vlm): a VLM of
    :data:`VLM_FAMILIES` with its processor, any other decoder-only causal LM with its tokenizer;
    ``captioner``: the embedded default captioner. ``trust_remote_code``: passed to transformers'
    ``from_pretrained`` (``mmspec train drafter --trust-remote-code``); off, a checkpoint with its
    own code is refused in one ValueError line."""
    from transformers import AutoConfig

    from ..hub import is_remote_code_refusal, load_causal_lm, remote_code_refused

    if name == "captioner":  # the embedded default captioner (a SmolVLM around SmolLM2-135M)
        from ..modeling.captioner import load_default_captioner

        model, processor = load_default_captioner(device=device, dtype=dtype)
        return model.eval(), processor, True
    source = target_source(name)
    try:
        model_type = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code).model_type
    except (OSError, ValueError) as error:  # (never trust_remote_code=None: transformers would ask [y/N] on the terminal)
        if is_remote_code_refusal(error):
            raise remote_code_refused(name) from None
        raise ValueError(f"--target {name}: cannot load its config ({str(error).splitlines()[0]}); give a checkpoint "
                         "directory or a hub id in the local cache") from None
    if model_type in VLM_FAMILIES:
        from ..pipelines.captioning.components import load_captioning_model

        model, processor = load_captioning_model(source, device, dtype, trust_remote_code)
        return model, processor, True
    model, tokenizer = load_causal_lm(source, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    return model, tokenizer, False


def open_image(example: Example):
    """An example's image (a file, encoded bytes or a PIL image) as an RGB PIL image.

    Raises:
        ValueError: "unreadable image" (a file or bytes PIL cannot decode).
    """
    from PIL import Image

    try:
        if isinstance(example.image, Image.Image):
            return example.image.convert("RGB")
        return Image.open(io.BytesIO(example.image) if isinstance(example.image, bytes) else example.image).convert("RGB")
    except (OSError, ValueError):
        raise ValueError("unreadable image") from None


def prompt_inputs(model, processor, is_vlm: bool, example: Example) -> dict[str, torch.Tensor]:
    """One example's prompt -> the target's batch-1 model inputs (the chat template's user turn,
    with the image first for a VLM; pixel tensors in the model's dtype).

    Raises:
        ValueError: the image cannot be read, or an image was given to a text-only target.
    """
    from ..api import chat_inputs

    if not is_vlm:
        if example.image is not None:
            raise ValueError("image given to a text-only target")
        return chat_inputs(processor, example.prompt)
    if getattr(processor, "chat_template", None) is None:
        raise ValueError(no_chat_template(model.name_or_path))
    text = escape_image_tokens(example.prompt, image_token_strings(processor, getattr(model.config, "image_token_id", None)))
    content = [{"type": "text", "text": text}]
    images = None
    if example.image is not None:
        images = [open_image(example)]
        content.insert(0, {"type": "image"})
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=[chat], images=images, return_tensors="pt") if images else processor(text=[chat], return_tensors="pt")
    return {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def with_response(inputs: dict[str, torch.Tensor], response: torch.Tensor, target: TransformersTarget | None = None
                  ) -> dict[str, torch.Tensor]:
    """Batch-1 prompt inputs with ``response`` [n] appended to input_ids (attention_mask: ones;
    other [1, L] inputs such as token_type_ids: zeros, text; the family's other per-token inputs,
    e.g. Mllama's ``cross_attention_mask``, as ``target.family.extend_inputs`` extends them)."""
    length = inputs["input_ids"].shape[1]
    out = dict(inputs)
    if target is not None:
        out.update(target.family.extend_inputs(inputs, len(response)))
    for name, value in inputs.items():
        if value.dim() == 2 and value.shape == (1, length) and not value.is_floating_point():
            tail = response[None].to(value) if name == "input_ids" else (
                torch.ones if name == "attention_mask" else torch.zeros)(1, len(response), dtype=value.dtype)
            out[name] = torch.cat([value, tail], dim=1)
    return out


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def response_ids(target: TransformersTarget, processor, text: str) -> torch.Tensor:
    """A given response's token ids [n], closed with the target's first stop token."""
    ids = tokenizer_of(processor)(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    eos = target.eos_token_ids
    return torch.cat([ids, torch.tensor(eos[:1], dtype=torch.long)])


def self_distil(target: TransformersTarget, rows: list[dict[str, torch.Tensor]], seeds: list[int], max_new_tokens: int,
                temperature: float, batch: int) -> list[torch.Tensor]:
    """The target's own responses [n_b] to ``rows`` (batch-1 prompt inputs): plain decoding,
    greedy (temperature 0) or sampled with row b's seed ``seeds[b]``; ``batch`` rows at a time
    where the target decodes batches."""
    from ..api import generate, generate_rows

    sampling = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0)
    if target.batch_size_one_reason:  # (a family whose rows cannot share a batch): one sequence at a time
        return [generate(target, None, max_new_tokens, seed=seed, **sampling, **row).sequences[0, row["input_ids"].shape[1]:].cpu()
                for row, seed in zip(rows, seeds)]
    batch = max(1, batch)
    answers: list[torch.Tensor] = [None] * len(rows)  # type: ignore[list-item]
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]

        def keep(result, start=start):
            answers[start + result.index] = result.tokens[0, result.prompt_length :].cpu()

        generate_rows(target, part, None, max_new_tokens, seed=seeds[start : start + batch], on_row_done=keep, **sampling)
    return answers


def features(target: TransformersTarget, full: dict[str, torch.Tensor], prompt_length: int, shallow_layer: int | None,
             feature_layer: int | tuple[int, ...] = -1) -> dict[str, torch.Tensor]:
    """``prompt + response`` teacher-forced through the target -> a training record; its
    "features" are the target's ``hidden_layer=feature_layer`` states (-1: the last [L, H]; a
    tuple: those entries concatenated [L, k H], EAGLE-3's)."""
    ids = full["input_ids"][0]
    learn = torch.zeros(len(ids), dtype=torch.bool)
    learn[prompt_length:] = True
    with torch.inference_mode():
        _, out = target.prefill(full, hidden_layer=feature_layer)
        record = {"ids": ids.cpu(), "learn": learn, "features": out.hidden_states[0].to("cpu", torch.bfloat16)}
        if shallow_layer is not None:
            _, out = target.prefill(full, hidden_layer=shallow_layer)
            record["shallow"] = out.hidden_states[0].to("cpu", torch.bfloat16)
    return record


def make_shard(target, model, processor, is_vlm: bool, examples: list[Example], first: int, args, shallow_layer: int | None,
               progress=None, feature_layer: int | tuple[int, ...] = -1) -> dict[str, Any]:
    """Shard of ``examples`` (indices ``first``..), ``--gen-batch`` rows at a time (encoded, the
    ones without a response answered together, teacher-forced; ``progress.step`` per group) ->
    {"records": [...] each with its "index", "skipped": {reason: n}, "where": {reason: [the first
    rows' sources]}}."""
    skipped: dict[str, int] = {}
    where: dict[str, list[str]] = {}
    records = []

    def skip(reason: str, index: int) -> None:
        _count(skipped, reason)
        _note(where, reason, examples[index - first].source)

    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or float("inf")
    for start in range(0, len(examples), args.gen_batch):
        group = {}
        for index in range(first + start, first + min(start + args.gen_batch, len(examples))):
            try:
                inputs = prompt_inputs(model, processor, is_vlm, examples[index - first])
            except ValueError as error:
                skip(str(error), index)
                continue
            if inputs["input_ids"].shape[1] >= context:
                skip("prompt longer than the context", index)
                continue
            group[index] = inputs
        todo = [i for i in group if examples[i - first].response is None]
        answers = dict(zip(todo, self_distil(target, [group[i] for i in todo], [args.seed + i for i in todo],
                                              args.max_new_tokens, args.sample_temperature, args.gen_batch))) if todo else {}
        for index, prompt in group.items():
            example = examples[index - first]
            answer = answers[index] if example.response is None else response_ids(target, processor, example.response)
            if len(answer) == 0:
                skip("empty response", index)
                continue
            if prompt["input_ids"].shape[1] + len(answer) > context:
                skip("response past the context", index)
                continue
            record = features(target, with_response(prompt, answer, target), prompt["input_ids"].shape[1], shallow_layer, feature_layer)
            record["index"] = torch.tensor(index)
            records.append(record)
        if progress is not None:
            progress.step(count=min(args.gen_batch, len(examples) - start))
    return {"records": records, "skipped": skipped, "where": where}


def cache_settings(args, examples: list[Example]) -> dict[str, Any]:
    """The data cache's settings known before the target loads (its manifest adds the model's dtype
    and the layers whose states it stores)."""
    return {"data": str(Path(args.data).resolve()), "examples": len(examples), "max_new_tokens": args.max_new_tokens,
            "sample_temperature": args.sample_temperature, "seed": args.seed, "shard_size": args.shard_size,
            "target": target_identity(args.target)}


def check_cache(data_dir: Path, settings: dict[str, Any], whole: bool = False) -> None:
    """A data cache made with other settings refused in one line. ``whole``: ``settings`` is the
    whole manifest (else only its keys are compared: the check before the target loads)."""
    path = data_dir / MANIFEST
    if not path.exists():
        return
    from ..cli.dataset import changed_settings

    saved = json.loads(path.read_text())
    saved.setdefault("target", settings["target"])  # (a cache made before the target was recorded: taken as this one's)
    if not settings.get("sample_temperature") and not saved.get("sample_temperature"):
        # greedy answers draw nothing: another --seed (a second head's initialisation and batches)
        # reuses the data rather than making it again
        saved, settings = ({k: v for k, v in d.items() if k != "seed"} for d in (saved, settings))
    if (saved != settings) if whole else any(saved.get(key) != value for key, value in settings.items()):
        shown = changed_settings(saved, settings) or "its manifest differs"
        raise ValueError(f"the data cache {data_dir} was made with other settings ({shown}; {path}); delete it or pass "
                         "another --cache")


def prepare_shards(target, model, processor, is_vlm: bool, examples: list[Example], data_dir: Path, args,
                   shallow_layer: int | None, process, feature_layer: int | tuple[int, ...] = -1
                   ) -> tuple[list[dict[str, torch.Tensor]], dict[str, int]]:
    """Make the shards this process lacks (module doc), wait for the others, load all ->
    (records in example order, {reason, naming its first rows: rows skipped while encoding}). ``feature_layer``: the
    states stored as "features" (:func:`features`)."""
    from ..cli.dataset import Progress

    manifest = {**cache_settings(args, examples), "shallow_layer": shallow_layer, "dtype": str(model.dtype)}
    if feature_layer != -1:  # (EAGLE-3's layers; the key is absent for the last layer, as in caches made before it)
        manifest["feature_layer"] = list(feature_layer) if isinstance(feature_layer, tuple) else feature_layer
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / MANIFEST
    check_cache(data_dir, manifest, whole=True)
    process.wait()
    if process.rank == 0:
        path.write_text(json.dumps(manifest, indent=1))
    count = (len(examples) + args.shard_size - 1) // args.shard_size
    mine = [s for s in range(count) if s % process.world == process.rank and not (data_dir / f"shard-{s:05d}.pt").exists()]
    rows = sum(len(examples[s * args.shard_size : (s + 1) * args.shard_size]) for s in mine)
    progress = Progress(rows, always=True, unit="row", show=process.rank == 0 and bool(mine))
    for shard in mine:
        first = shard * args.shard_size
        made = make_shard(target, model, processor, is_vlm, examples[first : first + args.shard_size], first, args, shallow_layer,
                          progress, feature_layer)
        tmp = data_dir / f"shard-{shard:05d}.tmp"
        torch.save(made, tmp)
        tmp.replace(data_dir / f"shard-{shard:05d}.pt")
    progress.close()
    process.wait()
    records, skipped, where = [], {}, {}
    for shard in range(count):
        made = torch.load(data_dir / f"shard-{shard:05d}.pt", weights_only=True)
        records += made["records"]
        for reason, n in made["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
        for reason, places in made.get("where", {}).items():  # (a shard made before the places were kept has none)
            for place in places:
                _note(where, reason, place)
    return records, name_places(skipped, where)


def discard_cache(data_dir: Path) -> None:
    """Remove a data cache whose shards hold no usable row (its shards and manifest; the folder
    too when nothing else is left in it): kept, it would answer a corrected rerun (the images
    repaired in place, another --target) with the same empty shards or "made with other settings;
    delete it"."""
    for shard in data_dir.glob("shard-*.pt"):
        shard.unlink(missing_ok=True)
    (data_dir / MANIFEST).unlink(missing_ok=True)
    if data_dir.is_dir() and not any(data_dir.iterdir()):
        data_dir.rmdir()
