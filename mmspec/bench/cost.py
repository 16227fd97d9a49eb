"""``mmspec bench cost``: the verification cost curve C(n) / C(1) of a target, and where it goes.

C(n) is the median time of one target forward over n new tokens after a cached prompt
(:func:`~mmspec.core.cost.measure_verification_cost`): what verifying n - 1 draft tokens costs
against one plain decoding step. Every speculative speedup is capped by it: a step that commits
tau tokens gains at most tau / (C(n) / C(1)).

Each n is also split by part, timed by forward hooks on the model's modules (a second pass, so the
hooks' own cost never enters C(n)):

- ``attn linears``: the q / k / v / o projections (linears under an attention module);
- ``attention``: the rest of the attention modules (rotary embedding, scores, softmax, cache);
- ``mlp linears``: the other linears of the decoder layers (gate / up / down);
- ``lm head``: the output projection(s) (``lm_head``, or a codec LM's ``heads``);
- ``norms``: RMSNorm / LayerNorm modules;
- ``vision``: a VLM's vision tower and connector (zero after the prefill);
- ``other``: the rest of the timed forward: the adapter and framework overhead (masks, position
  ids, cache bookkeeping, the Python between modules) and the hooks' own cost.

A hybrid recurrent target (Qwen3.5, LFM2: :mod:`mmspec.adapters.recurrent`) also gets what its
rollback costs (:func:`measure_recurrent`): the same forward on transformers' own cache, which
keeps no history and cannot roll back (C(n) minus it is the cost of keeping the states), and the
time of the rollback to each kept length m < n of a forward over n (a replay of m positions of the
recurrent layers), against C(n).

Runs ``--variants plain,optimized`` side by side in one process: the same model as loaded and
after :func:`mmspec.optimize` (few-row linears; the outputs' equality is tested in
tests/test_optimize.py). Results go to ``--results`` (JSON, with the machine) and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..cli.args import add_trust_remote_code_arg
from ..core.cache import crop_cache
from ..core.cost import measure_verification_cost
from ..hub import dtype_name
from ..modeling.hf_compat import cache_kwargs
from ..cli.output import write_text
from .results import add_threads_arg, machine_info, machine_line, save_results

PARTS = ("attn linears", "attention", "mlp linears", "lm head", "norms", "vision", "other")
MODELS = ("captioner", "smollm2", "t2i")
VARIANTS = ("plain", "optimized")
_VISION = ("vision", "connector", "multi_modal_projector", "visual")
_ATTENTION = ("attn", "attention")
_HEADS = ("lm_head", "heads")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="captioner",
                        help=f"{' | '.join(MODELS)} (embedded), or a causal LM's path / hub id")
    add_trust_remote_code_arg(parser, "a causal LM's")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where fast, else fp32) | bf16 | fp32")
    add_threads_arg(parser)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (the curve is timed with the device "
                        "synchronised; the per-part split is CPU-only)")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16,24,32,48,64", help="comma list of n (new tokens)")
    parser.add_argument("--variants", default="plain,optimized", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per row count (their median)")
    parser.add_argument("--no-parts", action="store_true", help="skip the per-part breakdown")
    parser.add_argument("--results", default="bench-out/cost.json", help="JSON results file")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")


def check(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The sizes and variants (each once, plain first), checked before anything loads."""
    try:
        sizes = [int(n) for n in args.sizes.split(",") if n]
    except ValueError:
        raise ValueError(f"--sizes must be a comma list of positive integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be a comma list of positive integers, got {args.sizes!r}")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"--variants must be a comma list of {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be a positive integer, got {args.repeats}")
    # plain before optimized whatever the order given: optimize() changes the model in place, so a
    # "plain" measured after it timed the optimized linears under the plain label
    return sorted(set([1, *sizes])), [v for v in VARIANTS if v in variants]


def load_target(name: str, dtype: str, device: str = "cpu", trust_remote_code: bool = False):
    """-> (target, model inputs of its prompt or None for random context, the module to optimise);
    ``trust_remote_code``: for a causal LM's path or hub id (:func:`mmspec.hub.load_causal_lm`)."""
    if name == "captioner":
        from ..pipelines.captioning import ImageCaptioningPipeline
        from ..train.data import FAMILIES, make_sample

        pipe = ImageCaptioningPipeline(model=None, drafter="ar", device=device, dtype=dtype, optimize=False)
        sample = make_sample(FAMILIES[0], "test", 0)  # a test-split item of the captioner's data
        inputs = pipe.preprocess(sample.image, sample.prompt)
        return pipe.target, inputs, pipe.model
    if name == "t2i":
        from ..pipelines.text_to_image import TextToImagePipeline

        pipe = TextToImagePipeline(model=None, method="ar", device=device, dtype=dtype, optimize=False)
        inputs = {**pipe.prompt_inputs("a red circle above a blue square"), "guidance_scale": 3.0}
        return pipe.target, inputs, pipe.target.model
    from ..adapters.hf import TransformersTarget
    from ..hub import load_causal_lm, resolve_dtype

    model, _ = load_causal_lm(name, dtype=resolve_dtype(dtype, device), device=device, trust_remote_code=trust_remote_code)
    return TransformersTarget(model), None, model


def part_of(name: str, module: nn.Module) -> str | None:
    """The part a module's own time belongs to (None: its children say)."""
    *outer, last = name.lower().split(".")
    vision = [any(key in component for key in _VISION) for component in (*outer, last)]
    if any(vision):  # the vision tower's root holds all of its time
        return "vision" if not any(vision[:-1]) else None
    if isinstance(module, nn.Linear):
        if last in _HEADS:
            return "lm head"
        return "attn linears" if any(key in component for component in outer for key in _ATTENTION) else "mlp linears"
    if "norm" in type(module).__name__.lower():
        return "norms"
    if any(key in last for key in _ATTENTION) and any(True for _ in module.children()):
        return "attention"
    return None


@contextmanager
def part_timer(model: nn.Module):
    """Forward hooks that add each classified module's time (minus the classified modules inside
    it) to its part -> the dict {part: seconds} they fill."""
    totals = dict.fromkeys(PARTS, 0.0)
    stack: list[list] = []  # [part, start, time of classified children]
    handles = []

    def pre(part):
        def hook(module, args):
            stack.append([part, time.perf_counter(), 0.0])
        return hook

    def post(module, args, output):
        part, start, inner = stack.pop()
        spent = time.perf_counter() - start
        totals[part] += spent - inner
        if stack:
            stack[-1][2] += spent

    for name, module in model.named_modules():
        part = part_of(name, module)
        if part is not None:
            handles += [module.register_forward_pre_hook(pre(part)), module.register_forward_hook(post)]
    try:
        yield totals
    finally:
        for handle in handles:
            handle.remove()


def measure_parts(target, model: nn.Module, sizes: list[int], model_inputs, repeats: int) -> dict[int, dict[str, float]]:
    """{n: {part: median seconds}} of one forward over n new tokens (the rest of the forward's
    time is "other"). Where the adapter projects several tokens' hidden states itself
    (:meth:`TransformersTarget._project`, outside the head module), that projection is timed
    alone on the same shapes and moved from "other" to "lm head"."""
    high = min(20000, target.vocab_size)
    if model_inputs is None:
        model_inputs = {"input_ids": torch.randint(0, high, (1, 200), generator=torch.Generator().manual_seed(0))}
    out = {}
    with torch.inference_mode():
        state, _ = target.prefill(model_inputs)
        context = state.cache_length
        for n in sizes:
            tokens = torch.randint(0, high, (1, n), generator=torch.Generator().manual_seed(n))
            samples = []
            for _ in range(repeats + 1):
                with part_timer(model) as totals:
                    started = time.perf_counter()
                    target.forward(state, tokens)
                    total = time.perf_counter() - started
                crop_cache(state.cache, context)
                if totals["lm head"] == 0 and getattr(target, "own_lm_head", False):
                    head = model.get_output_embeddings()
                    hidden = torch.randn(1, n, head.weight.shape[1], dtype=head.weight.dtype)
                    started = time.perf_counter()
                    target._project(head, hidden)
                    totals["lm head"] = time.perf_counter() - started
                samples.append({**totals, "other": total - sum(v for k, v in totals.items() if k != "other")})
            out[n] = {part: statistics.median(s[part] for s in samples[1:]) for part in PARTS}
    return out


def measure_recurrent(target, model: nn.Module, sizes: list[int], model_inputs, repeats: int) -> dict:
    """What a hybrid target's rollback costs, per verification size n (median seconds), measured in
    turns on deep copies of one prefilled sequence (copied outside the timing; a rollback settles,
    so every forward starts from a copy):

    - ``kept``: ``target.forward`` over n new tokens as decoding runs it (the recurrent layers
      record their history, the layers' inputs are kept);
    - ``bare``: the same ``target.forward`` on the cache transformers builds (``make_cache``: its
      own recurrent layers, which keep no history and cannot roll back): kept / bare - 1 is what
      keeping the states costs;
    - ``rollback``: {m: time of ``crop_cache`` back to m of the n positions} for m = 1, n // 2 and
      n - 1 (a replay of m positions; m = n, a fully accepted chain, and m = 0 restore references).
    """
    import copy

    from ..core.cache import SequenceState, make_cache

    high = min(20000, target.vocab_size)
    if model_inputs is None:
        model_inputs = {"input_ids": torch.randint(0, high, (1, 200), generator=torch.Generator().manual_seed(0))}
    model_inputs = {k: (v.to(target.device) if isinstance(v, torch.Tensor) else v) for k, v in model_inputs.items()}
    kept, bare, rollback = {}, {}, {}
    with torch.inference_mode():
        prefilled, _ = target.prefill(model_inputs)
        context = prefilled.cache_length
        plain = make_cache(model.config)
        model(**model_inputs, **cache_kwargs(model, plain), use_cache=True, logits_to_keep=1)
        for n in sizes:
            tokens = torch.randint(0, high, (1, n), generator=torch.Generator().manual_seed(n)).to(target.device)
            lengths = sorted({1, n // 2, n - 1} - {0, n}) or [n]
            times = {"kept": [], "bare": [], **{m: [] for m in lengths}}
            for _ in range(repeats + 1):
                for m in lengths:
                    state = copy.copy(prefilled)
                    state.cache = copy.deepcopy(prefilled.cache)
                    started = time.perf_counter()
                    target.forward(state, tokens)
                    times["kept"].append(time.perf_counter() - started)
                    started = time.perf_counter()
                    crop_cache(state.cache, context + m)
                    times[m].append(time.perf_counter() - started)
                    other = SequenceState(prefilled.tokens, copy.deepcopy(plain), prefilled.prompt_length)
                    started = time.perf_counter()
                    target.forward(other, tokens)
                    times["bare"].append(time.perf_counter() - started)
            skip = len(lengths)  # the first round warms up
            kept[n], bare[n] = statistics.median(times["kept"][skip:]), statistics.median(times["bare"][skip:])
            rollback[n] = {m: statistics.median(times[m][1:]) for m in lengths if m < n}
    return {"kept": kept, "bare": bare, "rollback": rollback}


#: what a results file's machine record must share with this run to be this run's curve
_SAME_MACHINE = ("cpu", "cpu_model", "cpu_flags", "device", "threads", "attention", "layers", "torch", "transformers",
                 "emulated_from")


def saved_results(args: argparse.Namespace, sizes: list[int], variants: list[str]) -> dict | None:
    """The results at ``--results`` when they are this command's, complete: the same model, sizes,
    repeats, dtype and machine, every variant asked for (with its parts unless ``--no-parts``); None
    when there is no file or it lacks a variant (a run cut short: measured again). A file of other
    settings, or not a cost results file, is refused in one ValueError line (a rerun measured again
    and overwrote it).

    Raises:
        ValueError: the file is of other settings, or not a cost results file.
    """
    import json

    from ..cli.dataset import changed_settings
    from ..hub import resolve_dtype

    path = Path(args.results)
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise ValueError(f"{path} is not a results file ({error.__class__.__name__}); pass another --results file") from None
    if not isinstance(results, dict) or not isinstance(results.get("meta"), dict) or not isinstance(results.get("variants"), dict):
        raise ValueError(f"{path} is not a results file of mmspec bench cost; pass another --results file")
    meta, machine = results["meta"], results["meta"].get("machine", {})
    now = machine_info("-", args.threads, args.device)
    recorded = {"model": meta.get("model"), "sizes": meta.get("sizes"), "repeats": meta.get("repeats"),
                **{key: machine.get(key) for key in _SAME_MACHINE}}
    wanted = {"model": args.model, "sizes": sizes, "repeats": args.repeats, **{key: now.get(key) for key in _SAME_MACHINE}}
    if args.dtype != "auto":  # (auto: the model's own choice, known once it loads; a file records what it ran)
        recorded["dtype"], wanted["dtype"] = machine.get("dtype"), dtype_name(resolve_dtype(args.dtype, args.device))
    shown = changed_settings(recorded, wanted)
    if shown:
        raise ValueError(f"{path} holds a cost curve of other settings ({shown}); pass another --results file (a rerun "
                         "of the same command writes its tables again from its complete file, measuring nothing)")
    parts = not args.no_parts and now["device"] == "cpu"
    missing = [v for v in variants if v not in results["variants"] or (parts and "parts_ms" not in results["variants"][v])]
    return None if missing else results  # (a run cut short: measured again, as a whole)


def run(args: argparse.Namespace) -> int:
    from ..modeling.fast_linear import optimize

    sizes, variants = check(args)
    saved = saved_results(args, sizes, variants)  # before anything loads
    if saved is not None:
        return write_tables(args, {**saved, "variants": {v: saved["variants"][v] for v in variants}})
    target, inputs, model = load_target(args.model, args.dtype, args.device, args.trust_remote_code)
    dtype = dtype_name(next(model.parameters()).dtype)
    lean = getattr(target, "lean", False) and getattr(target, "lean_decoder", None) is not None
    results = {"meta": {"model": args.model, "sizes": sizes, "repeats": args.repeats, "lean": lean, "order": "turns",
                        "machine": machine_info(dtype, args.threads, args.device)}, "variants": {}}
    for variant in variants:  # plain first: optimize() changes the model in place
        if variant == "optimized":
            optimize(model)
        curve = measure_verification_cost(target, sizes, repeats=args.repeats, model_inputs=inputs)
        record = {"ms": {str(n): t * 1000 for n, t in curve.items()}}
        if not args.no_parts and target.device.type == "cpu":
            parts = measure_parts(target, model, list(curve), inputs, args.repeats)
            record["parts_ms"] = {str(n): {p: t * 1000 for p, t in v.items()} for n, v in parts.items()}
        if getattr(target, "recurrent", False):
            costs = measure_recurrent(target, model, list(curve), inputs, args.repeats)
            record["kept_ms"] = {str(n): t * 1000 for n, t in costs["kept"].items()}
            record["bare_ms"] = {str(n): t * 1000 for n, t in costs["bare"].items()}
            record["rollback_ms"] = {str(n): {str(m): t * 1000 for m, t in v.items()} for n, v in costs["rollback"].items()}
        results["variants"][variant] = record
        save_results(Path(args.results), results)
    return write_tables(args, results)


def write_tables(args: argparse.Namespace, results: dict) -> int:
    """Print the table of ``results`` and write it to ``--markdown``."""
    table = markdown_table(results)
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        write_text(args.markdown, table + "\n")
    return 0


def markdown_table(results: dict) -> str:
    meta = results["meta"]
    m = meta["machine"]
    lines = [f"Verification cost curve of `{meta['model']}` ({m['dtype']}, {m['threads']} thread(s), {machine_line(m)}, "
             f"torch {m['torch']}; median of {meta['repeats']}"
             + (", the sizes in turns each round)" if meta.get("order") == "turns" else ", one size after another)")]
    if meta.get("lean"):
        lines.append("The steps run through the lean forward (mmspec.modeling.lean), which calls no attention module: "
                     "the attention's arithmetic (RoPE, SDPA, the cache update) is counted in `other`.")
    for variant, record in results["variants"].items():
        ms = record["ms"]
        c1 = ms["1"]
        lines += ["", f"**{variant}** (C(1) = {c1:.1f} ms)", "",
                  "| n | C(n) ms | C(n)/C(1) | " + " | ".join(PARTS) + " |",
                  "|---|---|---|" + "---|" * len(PARTS)]
        for n, t in ms.items():
            parts = record.get("parts_ms", {}).get(n)
            cells = [f"{parts[p]:.1f}" for p in PARTS] if parts else ["-"] * len(PARTS)
            lines.append(f"| {n} | {t:.1f} | {t / c1:.2f} | " + " | ".join(cells) + " |")
        if "rollback_ms" in record:
            lines += ["", f"**{variant}**, recurrent state (adapters/recurrent.py), in turns on copies of one prefilled "
                      "sequence: `kept` = the forward as decoding runs it (history recorded, layer inputs kept), `bare` = "
                      "the same forward on transformers' own recurrent cache layers (no history, no rollback); keeping = "
                      "kept / bare - 1; rollback = crop_cache to m of the n positions (a replay of m positions; m = 1, "
                      "n // 2, n - 1) and the worst m's share of `kept`", "",
                      "| n | kept ms | bare ms | keeping | rollback ms (m: ms) | worst rollback / kept |",
                      "|---|---|---|---|---|---|"]
            for n in ms:
                k, b = record["kept_ms"][n], record["bare_ms"][n]
                back = record["rollback_ms"].get(n, {})
                worst = max(back.values(), default=0.0)
                lines.append(f"| {n} | {k:.2f} | {b:.2f} | {k / b - 1:+.1%} | "
                             + (", ".join(f"{m}: {v:.2f}" for m, v in back.items()) or "-") + f" | {worst / k:.1%} |")
    if {"plain", "optimized"} <= set(results["variants"]):
        plain, fast = results["variants"]["plain"]["ms"], results["variants"]["optimized"]["ms"]
        lines += ["", "optimized / plain: " + ", ".join(f"n={n} {fast[n] / plain[n]:.2f}" for n in plain if n in fast)]
    return "\n".join(lines)
