"""``mmspec bench chain-stop``: an EAGLE / EAGLE-3 chain's draft length K and confidence stop,
measured on this machine for a captioning VLM or a causal LM, the fastest written beside the head.

A chain drafter (:class:`~mmspec.drafters.eagle.EagleDrafter`) may end a chain early, once the
running confidence P_i = prod_{j <= i} q_j(x_j) of its draws falls below a threshold
(:func:`mmspec.core.draft.chain_stops`). Whether one more row is worth verifying depends on what a
verified row costs on this machine (the target's C(n): nearly flat on AMX tiles, rising on
AVX-512 vectors) and on how well the head's confidences foretell acceptance, so the grid of
(K, stop) is measured rather than modelled: every setting side by side with plain decoding in one
process, on ``--data`` (use images the reported figures are not measured on: the validation
split), rounds interleaved after a warm-up round, the median of the rounds per item. A setting's
speed S = the sum of AR's median times over the sum of its own; at temperature 0 its outputs are
checked identical to AR's; at temperature > 0 (sampled outputs differ in length) S is per token:
AR's seconds per token over the setting's, over every round. ``--write`` saves the fastest in the
head's ``chain_settings.json`` (the part for the model's dtype and the kind measured: ``greedy``
at temperature 0, ``sampled`` otherwise; :func:`mmspec.drafters.shipped.chain_settings`) with the
table it was chosen from. ``--data`` rows
with images tune a VLM's head (``--model``: the embedded captioner by default, loaded as the
captioning pipeline loads it); rows of prompts alone a causal LM's (``--model``: SmolLM2 by
default, its linears optimized as ``mmspec generate`` does), each prompt in its chat template.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ..api import chat_inputs, generate, optimize_components
from ..cli.output import write_text
from ..drafters.eagle import EagleDrafter
from ..drafters.shipped import CHAIN_SETTINGS_FILE, chain_settings, check_stop_below
from ..hub import dtype_name, load_causal_lm
from .caption import data_items, drafter_for, parse_method
from ..cli.args import add_trust_remote_code_arg
from .results import add_device_args, command_line, load_results, machine_info, machine_line, save_results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="VLM or causal LM directory or hub id (default: the embedded captioner for --data with images, "
                             "else smollm2)")
    add_trust_remote_code_arg(parser)
    parser.add_argument("--drafter", default="eagle3", help="the chain drafter: eagle, eagle3, eagle:DIR or eagle3:DIR")
    parser.add_argument("--data", required=True,
                        help="a JSONL of {image?, prompt, group?} to tune on (e.g. `mmspec train caption-data --split validation`; "
                             "prompts alone for a causal LM)")
    parser.add_argument("--families", default=None, help="comma list of --data's groups (default: all)")
    parser.add_argument("--per-family", type=int, default=2, help="first rows per group")
    parser.add_argument("--lengths", default="5,6,7,8", help="comma list of K, the most tokens a chain drafts")
    parser.add_argument("--stops", default="0,0.1,0.2,0.3,0.4,0.5", help="comma list of stop thresholds in [0, 1) (0: no stop)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy chains; > 0: sampled ones, per token")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens of a caption")
    parser.add_argument("--repeats", type=int, default=2, help="measured rounds after the warm-up round")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where fast, else fp32) | bf16 | fp32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_device_args(parser)
    parser.add_argument("--results", default="bench-out/chain-stop.json", help="JSON checkpoint / results file")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--write", action="store_true",
                        help=f"save the fastest setting in the head directory's {CHAIN_SETTINGS_FILE}, which the drafter reads")


def parse_grid(lengths: str, stops: str) -> list[tuple[int, float]]:
    """``--lengths`` and ``--stops`` -> every (K, stop), checked (one ValueError line)."""
    try:
        ks = [int(k) for k in lengths.split(",")]
        thresholds = [float(s) for s in stops.split(",")]
    except ValueError:
        raise ValueError(f"--lengths {lengths!r} / --stops {stops!r}: give comma lists of integers / numbers, e.g. "
                         "--lengths 6,7 --stops 0,0.3") from None
    if min(ks) < 1:
        raise ValueError(f"--lengths {lengths}: every K must be >= 1")
    for stop in thresholds:
        check_stop_below(stop, "--stops")
    return [(k, stop) for k in ks for stop in thresholds]


def configure(drafter: EagleDrafter, setting: tuple[int, float], sampled: bool) -> None:
    """Give the drafter one (K, stop) of the grid for generations of the kind measured."""
    k, stop = setting
    if sampled:
        drafter.num_draft_tokens, drafter.sampled_stop_below = k, stop
    else:
        drafter.greedy_draft_tokens, drafter.stop_below = k, stop


def current_setting(drafter: EagleDrafter, sampled: bool) -> tuple[int, float]:
    """The drafter's (K, stop) as loaded, for generations of that kind."""
    if sampled:
        return drafter.num_draft_tokens, drafter.sampled_stop_below
    return drafter.greedy_draft_tokens or drafter.num_draft_tokens, drafter.stop_below


def setting_name(setting: tuple[int, float] | None) -> str:
    return "ar" if setting is None else f"K={setting[0]},stop={setting[1]:g}"


def summarise(runs: dict, items: list, settings: list, repeats: int, sampled: bool) -> dict[str, dict]:
    """Per setting: S against AR (whole calls; per token when sampled), tau, whether every output
    equals AR's (greedy)."""
    def measured(setting, item):
        return [runs[f"{item}/{setting_name(setting)}/{r}"] for r in range(1, repeats + 1)]

    keys = [f"{group}/{index}" for group, index, *_ in items]
    ar = {item: measured(None, item) for item in keys}
    table = {}
    for setting in settings:
        rows = {item: measured(setting, item) for item in keys}
        if sampled:
            per_token = [sum(r["seconds"] for rs in runs_.values() for r in rs) / max(1, sum(r["tokens"] for rs in runs_.values() for r in rs))
                         for runs_ in (ar, rows)]
            speedup = per_token[0] / per_token[1]
        else:
            speedup = (sum(statistics.median(r["seconds"] for r in ar[i]) for i in keys)
                       / sum(statistics.median(r["seconds"] for r in rows[i]) for i in keys))
        steps = sum(r["steps"] for rs in rows.values() for r in rs)
        table[setting_name(setting)] = {
            "num_draft_tokens": setting[0], "stop_below": setting[1], "speedup": round(speedup, 3),
            "tau": round(sum(r["tokens"] for rs in rows.values() for r in rs) / max(1, steps), 2),
            "identical_to_ar": None if sampled else all(r["output"] == a["output"] for i in keys for r, a in zip(rows[i], ar[i])),
        }
    return table


def markdown(table: dict, settings: list, best: str, current: str, meta: dict) -> str:
    ks = sorted({k for k, _ in settings})
    stops = sorted({s for _, s in settings})
    kind = "per token, sampled at T = {:g}".format(meta["temperature"]) if meta["temperature"] > 0 else "whole call, greedy"
    lines = [f"Chain settings of `{meta['drafter']}` ({meta['head']}), S over plain decoding ({kind}; cell = S / tau; "
             f"**best**, _as loaded_), {meta['items']} items of {meta['data']}, median of {meta['repeats']} interleaved rounds. "
             f"{meta['machine'].get('dtype', 'dtype not recorded')}, {meta['machine'].get('threads', '?')} thread(s), "
             f"{machine_line(meta['machine'])}", "",
             "| K \\ stop | " + " | ".join(f"{s:g}" for s in stops) + " |", "|---|" + "---|" * len(stops)]
    for k in ks:
        cells = []
        for s in stops:
            name = setting_name((k, s))
            cell = table.get(name)
            text = "" if cell is None else f"{cell['speedup']:.2f} / {cell['tau']:.2f}" + ("" if cell["identical_to_ar"] in (None, True) else " (differs)")
            cells.append(f"**{text}**" if name == best else f"_{text}_" if name == current and text else text)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_settings(head: Path, best: dict, meta: dict, table: dict) -> Path:
    """Merge the fastest setting into the head's chain_settings.json (its part for the dtype and
    kind measured)."""
    path = head / CHAIN_SETTINGS_FILE
    chain_settings(head)  # (an existing file must be valid before it is merged into)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    dtype, part = meta["machine"]["dtype"], "sampled" if meta["temperature"] > 0 else "greedy"
    saved.setdefault(dtype, {})[part] = {"num_draft_tokens": best["num_draft_tokens"], "stop_below": best["stop_below"]}
    saved.setdefault("measured", {}).setdefault(dtype, {})[part] = {
        **{k: meta[k] for k in ("command", "data", "items", "temperature", "machine")}, "speedup": best["speedup"], "grid": table}
    path.write_text(json.dumps(saved, indent=1) + "\n")
    return path


def load(args, prompts_only: bool, spec: str, k: int | None):
    """(target, the chain drafter of ``spec`` with K = ``k``, item -> model inputs, stop ids or None,
    dtype, tokenizer): the captioning pipeline's target over ``--model`` (images), or a causal LM's (prompts)."""
    from ..adapters.hf import TransformersTarget
    from ..drafters import resolve_drafter
    from ..pipelines.captioning import ImageCaptioningPipeline

    if not prompts_only:
        pipe = ImageCaptioningPipeline(model=args.model, drafter="ar", device=args.device, dtype=args.dtype,
                                       trust_remote_code=args.trust_remote_code)
        return pipe.target, drafter_for(pipe, args.drafter), pipe.preprocess, pipe.eos_token_ids, pipe.dtype, pipe.tokenizer
    model, tokenizer = load_causal_lm(args.model or "smollm2", dtype=args.dtype, device=args.device,
                                      trust_remote_code=args.trust_remote_code)
    optimize_components(model)
    target = TransformersTarget(model)
    drafter = resolve_drafter(spec, target, k)
    optimize_components(drafter)
    return target, drafter, lambda image, prompt: chat_inputs(tokenizer, prompt), None, model.dtype, tokenizer


def run(args) -> int:
    settings = parse_grid(args.lengths, args.stops)
    spec, k = parse_method(args.drafter)
    if spec.partition(":")[0] not in ("eagle", "eagle3"):
        raise ValueError(f"--drafter {args.drafter}: name an EAGLE or EAGLE-3 chain drafter (eagle, eagle3, eagle:DIR, eagle3:DIR)")
    if args.temperature < 0:  # (--repeats, --max-new-tokens: the command line's checks)
        raise ValueError(f"--temperature must be >= 0, got {args.temperature:g}")
    items = data_items(args.data, args.families, args.per_family, images=None)  # (checked before the model loads)
    prompts_only = items[0][2] is None
    target, drafter, model_inputs, eos, dtype, _ = load(args, prompts_only, spec, k)
    drafter: EagleDrafter
    head = Path(type(drafter).head_path(target, spec.partition(":")[2] or None))
    sampled = args.temperature > 0
    current = current_setting(drafter, sampled)
    if current not in settings:
        settings.append(current)
    results_path = Path(args.results)
    results = load_results(results_path, "chain-stop", {"head": str(head), "temperature": args.temperature, "data": args.data,
                                                        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype})
    meta = {"drafter": args.drafter, "head": str(head), "data": args.data, "items": len(items), "temperature": args.temperature,
            "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
            "command": command_line("chain-stop", args, ("model", "drafter", "data", "families", "per_family", "lengths", "stops",
                                                         "temperature", "max_new_tokens", "repeats", "dtype", "threads")),
            "machine": machine_info(dtype_name(dtype), args.threads, args.device)}
    results["meta"] = meta
    runs = results.setdefault("runs", {})
    for group, index, image, prompt in items:
        inputs = model_inputs(image, prompt)
        for round_index in range(args.repeats + 1):  # round 0 is the warm-up
            for setting in [None, *settings]:
                key = f"{group}/{index}/{setting_name(setting)}/{round_index}"
                if key in runs:
                    continue
                if setting is not None:
                    configure(drafter, setting, sampled)
                out = generate(target, drafter=None if setting is None else drafter, max_new_tokens=args.max_new_tokens,
                               do_sample=sampled, temperature=args.temperature or 1.0, seed=1000 * index + round_index,
                               eos_token_id=eos, **inputs)
                new = out.sequences[0, inputs["input_ids"].shape[1]:]
                runs[key] = {"seconds": out.stats.wall_time_s, "tokens": len(new), "steps": out.stats.verify_steps,
                             "output": new.tolist()}
                save_results(results_path, results)
        print(f"{group}/{index} measured", file=sys.stderr, flush=True)
    table = summarise(runs, items, settings, args.repeats, sampled)
    best = max(table, key=lambda name: table[name]["speedup"])
    results["table"], results["best"] = table, best
    save_results(results_path, results)
    text = markdown(table, settings, best, setting_name(current), meta)
    print(text)
    print(f"fastest: {best} ({table[best]['speedup']:.2f}x; as loaded {setting_name(current)}: "
          f"{table[setting_name(current)]['speedup']:.2f}x)")
    if args.markdown:
        write_text(args.markdown, text)
    if args.write:
        print(f"wrote {write_settings(head, table[best], meta, table)}")
    return 0
