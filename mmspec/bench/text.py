"""``mmspec bench text``: training-free drafters on a real causal LM (SmolLM2-135M-Instruct).

Protocol (docs/benchmarks.md, "How a figure is measured"): every method runs on the same prompts, same model, same
dtype and threads, in one process; the methods are interleaved (A B C ... A B C ...) over
``--repeats`` rounds after a warm-up round, and each figure is the median over rounds. Speedups are
ratios of those medians: against our own AR loop (same cache, same sampling path) and against
transformers' ``generate`` AR. transformers' own prompt lookup and early exit run in the same
rounds. Results are checkpointed to a JSON file after every measurement, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..api import generate
from ..core.cost import measure_verification_cost
from ..cli.args import add_trust_remote_code_arg, number_list
from ..cli.output import write_text
from .results import (add_threads_arg, command_line, load_results, machine_info, machine_line, run_settings,
                      save_results)
from ..drafters.prompt_lookup import PromptLookupDrafter
from ..hub import load_causal_lm, resolve_dtype
from ..api import chat_inputs

ARTICLE = (
    "The city council met on Tuesday evening to discuss the new public library. After two hours of "
    "debate, the members agreed to build the library next to the central park, where the old bus "
    "station used to stand. The building will have three floors, a children's reading room, a small "
    "cafe and a roof garden. Construction is expected to start in the spring and to take about "
    "eighteen months. The mayor said that the library would be open seven days a week and that "
    "entry would remain free for everyone."
)
RECIPE = (
    "To make the soup, wash two carrots, one onion and three potatoes. Cut the vegetables into small "
    "pieces and put them in a large pot with a litre of water. Add a pinch of salt and bring the water "
    "to the boil. Let the soup cook for twenty minutes, then blend it until it is smooth and serve it "
    "hot with a slice of bread."
)

#: prompt type -> prompts. Summaries and rewrites copy from the prompt; QA and scenes mostly do not.
PROMPTS: dict[str, list[str]] = {
    "summarise": [
        f"{ARTICLE}\n\nSummarize the text above in two sentences.",
        f"{RECIPE}\n\nSummarize these instructions briefly.",
    ],
    "rewrite": [
        f"Rewrite the following text in the past tense, keeping every detail:\n\n{RECIPE}",
        f"Repeat the following text exactly, word for word:\n\n{ARTICLE}",
    ],
    "qa": [
        "What is the capital of France, and what is it famous for?",
        "Explain how plants make food from sunlight.",
    ],
    "conversation": [
        "Hi! I'm planning a weekend trip to the mountains with two friends. What should we pack?",
        "I just adopted a kitten. How can I help her feel at home during the first week?",
    ],
    "math": [
        "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step.",
        "Tom has 24 apples. He gives a third of them to Anna and half of the rest to Ben. How many apples does Tom have left? Show your work.",
    ],
    "rag": [
        f"Context: {ARTICLE}\n\nUsing only the context, answer: where will the library be built, and when will construction start?",
        f"Context: {RECIPE}\n\nUsing only the context, answer: how long does the soup cook, and what is it served with?",
    ],
    "scene": [
        "Describe a scene containing these objects in one paragraph: a red bicycle leaning on a white "
        "fence, a black cat sleeping on a blue chair, two green trees, and a yellow kite in the sky.",
        "Write a short description of a kitchen with: a wooden table, four chairs, a bowl of oranges, "
        "a silver kettle on the stove, and a window looking out on a garden.",
    ],
}

DEFAULT_METHODS = "ar,prompt-lookup,layer-skip:8,layer-skip:16,layer-skip:24,hf-ar,hf-prompt-lookup,hf-early-exit:16"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="a causal LM: smollm2 (the installed SmolLM2-135M-Instruct), a directory or a hub id")
    add_trust_remote_code_arg(parser)
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma list of the dtypes to measure in")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help="comma list: ar, prompt-lookup[:K], prompt-lookup-as-hf, layer-skip:N, hf-ar, hf-prompt-lookup, hf-early-exit:N")
    parser.add_argument("--prompt-types", default=",".join(PROMPTS), help="comma list of the prompt kinds")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds after the warm-up; each time is their median")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="K for our drafters (default: each drafter's own)")
    add_threads_arg(parser)
    parser.add_argument("--cost-curve", default="1,2,4,8,16,32,64", help="n values of the verification cost curve ('' to skip)")
    parser.add_argument("--results", default="bench-out/text.json", help="JSON checkpoint / results file")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--json", action="store_true", help="print the results JSON instead of tables")


def _hf_generate(model, inputs: dict, method: str, max_new_tokens: int):
    """transformers' own generate with the equivalent option; returns (sequences, seconds)."""
    options: dict = {}
    if method == "hf-prompt-lookup":
        options["prompt_lookup_num_tokens"] = 10
    elif method.startswith("hf-early-exit:"):
        options["assistant_early_exit"] = int(method.split(":")[1])
    elif method != "hf-ar":
        raise ValueError(f"unknown transformers method {method!r}")
    started = time.perf_counter()
    with torch.inference_mode():
        sequences = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **options)
    return sequences, time.perf_counter() - started


#: our prompt lookup with transformers' policy (K = 10, 2/1-grams, earliest occurrence): the same drafter
SAME_AS_HF = "prompt-lookup-as-hf"


def check_method(method: str) -> None:
    """A ``--methods`` item checked before the model loads (one ValueError line)."""
    if method in ("ar", "hf-ar", "hf-prompt-lookup", SAME_AS_HF):
        return
    if method.startswith("hf-early-exit:"):
        number_list(method.partition(":")[2], "hf-early-exit's layer count")
        return
    from ..pipelines.captioning.methods import check_drafter_name

    unknown = ValueError(f"unknown --methods item {method!r}; use ar, prompt-lookup[:K], prompt-lookup-as-hf, layer-skip:N, "
                         "hf-ar, hf-prompt-lookup or hf-early-exit:N")
    try:
        if check_drafter_name(method, auto=False) is not None:  # a draft model directory: not a benchmark method here
            raise unknown
    except (ValueError, FileNotFoundError) as error:  # ("auto" passed the check, then failed after the model loaded)
        raise unknown if error is not unknown and "unknown drafter" in str(error) else error from None


def build_drafters(model, methods: list[str], num_draft_tokens: int | None) -> dict:
    """Our ``methods``' drafters for ``model``, built once a dtype: one the model cannot take (a
    trained head not shipped for it, a layer count past its depth) is refused in one line before
    anything is measured (it failed after the cost curve and the other methods' first runs), and
    no run's whole-call time (S_hf's) holds a head's load from disk, which transformers' ``generate``
    on its loaded model does not pay. A drafter restarts on every generation (``Drafter.start``), as
    the captioning benchmark reuses its drafters.

    Returns:
        {method: Drafter} for each method but ``ar``, ``prompt-lookup-as-hf`` and transformers' own.
    """
    from ..adapters.hf import TransformersTarget
    from ..drafters import resolve_drafter

    target = TransformersTarget(model)
    return {method: resolve_drafter(method, target, num_draft_tokens) for method in methods
            if not method.startswith("hf-") and method not in ("ar", SAME_AS_HF)}


def run_once(model, inputs: dict, method: str, max_new_tokens: int, drafter=None) -> dict:
    """One measured generation of ``method``; ``drafter``: its drafter from :func:`build_drafters`."""
    if method.startswith("hf-"):
        sequences, seconds = _hf_generate(model, inputs, method, max_new_tokens)
        return {"seconds": seconds, "sequence": sequences[0].tolist(), "tau": None, "acceptance": None}
    if method == SAME_AS_HF:
        drafter = PromptLookupDrafter(10, max_ngram=2, prefer="earliest")
    started = time.perf_counter()
    out = generate(model, drafter=drafter, max_new_tokens=max_new_tokens, **inputs)
    call = time.perf_counter() - started  # (the whole call, its checks and set-up too: what transformers' is timed as)
    return {
        "seconds": out.stats.wall_time_s,
        "call_seconds": call,
        "sequence": out.sequences[0].tolist(),
        "tau": out.stats.mean_accepted_length,
        "acceptance": out.stats.acceptance_rate,
        "config": out.stats.config,
    }


def verification_cost_curve(model, sizes: list[int], context: int = 200, repeats: int = 7) -> dict[str, float]:
    """Median time of one target forward over n new tokens after ``context`` cached tokens, in ms
    (str keys: the same after a JSON round trip)."""
    from ..adapters.hf import TransformersTarget

    curve = measure_verification_cost(TransformersTarget(model), sizes, context, repeats)
    return {str(n): seconds * 1000 for n, seconds in curve.items()}


def run(args) -> int:
    prompt_types = args.prompt_types.split(",")
    unknown = [t for t in prompt_types if t not in PROMPTS]
    if unknown:
        raise ValueError(f"unknown --prompt-types {', '.join(unknown)}; use some of {', '.join(PROMPTS)}")
    sizes = number_list(args.cost_curve, "--cost-curve") if args.cost_curve else None
    for method in args.methods.split(","):
        check_method(method)
    results_path = Path(args.results)
    results = load_results(results_path, "text", {"model": args.model, "max_new_tokens": args.max_new_tokens,
                                                  "cost_curve": args.cost_curve, **run_settings(args),
                                                  "optimize": False})  # (the models run as loaded: no mmspec.optimize)
    results.setdefault("runs", {})
    results["meta"] = {
        "model": args.model, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "threads": args.threads, "machine": machine_info(args.dtypes, args.threads),
        "torch": torch.__version__, "command": command_line("text", args, ("model", "dtypes", "methods", "prompt_types", "max_new_tokens",
                                                "num_draft_tokens", "repeats", "threads")),
    }
    methods = args.methods.split(",")
    for dtype_name in args.dtypes.split(","):
        model, tokenizer = load_causal_lm(args.model, dtype=resolve_dtype(dtype_name), trust_remote_code=args.trust_remote_code)
        cases = [(ptype, i, chat_inputs(tokenizer, text)) for ptype in prompt_types for i, text in enumerate(PROMPTS[ptype])]
        drafters = build_drafters(model, methods, args.num_draft_tokens)  # before the cost curve and any measurement
        if args.cost_curve:
            key = f"cost_curve/{dtype_name}"
            if key not in results:
                results[key] = verification_cost_curve(model, sizes)
                save_results(results_path, results)
        for ptype, index, inputs in cases:
            warm = f"{dtype_name}/{ptype}/{index}"
            for round_index in range(args.repeats + 1):  # round 0 is the warm-up
                for method in methods:
                    key = f"{warm}/{method}/{round_index}"
                    if key in results["runs"]:
                        continue
                    record = run_once(model, inputs, method, args.max_new_tokens, drafters.get(method))
                    record["prompt_length"] = inputs["input_ids"].shape[1]
                    results["runs"][key] = record
                    save_results(results_path, results)
                    print(f"{key}: {record['seconds']:.2f}s", file=sys.stderr if args.json else sys.stdout, flush=True)
        del model
    tables = render_tables(results, methods, prompt_types, args.dtypes.split(","), args.repeats)
    if args.markdown:
        write_text(args.markdown, tables)
    print(json.dumps({key: results[key] for key in ("suite", "settings", "meta", "runs") if key in results}, indent=2)
          if args.json else tables)
    return 0



def render_tables(results: dict, methods: list[str], prompt_types: list[str], dtypes: list[str], repeats: int) -> str:
    """Markdown: per dtype, per prompt type, median seconds / speedups / tau / exactness."""
    runs = results["runs"]
    machine = results["meta"]["machine"]
    lines = [f"{results['meta']['model']}, {results['meta']['threads']} thread(s), "
             + (f"{machine_line(machine)}, torch {machine['torch']}" if isinstance(machine, dict) else str(machine))]
    for dtype_name in dtypes:
        curve = results.get(f"cost_curve/{dtype_name}")
        if curve:
            base = curve["1"]
            row = " | ".join(f"{float(v) / base:.2f}" for v in curve.values())
            lines += [f"\n**Verification cost curve, {dtype_name}** (forward over n new tokens after 200 cached, "
                      f"relative to n=1 = {base:.1f} ms)\n",
                      "| n | " + " | ".join(curve) + " |", "|---" * (len(curve) + 1) + "|", f"| cost | {row} |"]
        lines += [
            f"\n**{dtype_name}**: median wall time over {repeats} interleaved rounds; S = speedup over our AR loop; "
            "S_hf = speedup over transformers' `generate` AR (whole calls on both sides); tau = tokens per verification step; "
            "exact = runs whose tokens equal our AR output.\n",
            "| prompt type | method | time (s) | S | S_hf | tau | accept | exact |",
            "|---|---|---|---|---|---|---|---|",
        ]
        cells: dict[tuple[str, str], tuple[float, float, float | None]] = {}
        for ptype in prompt_types:
            for method in methods:
                per_prompt = []
                for index in range(len(PROMPTS[ptype])):
                    keys = [f"{dtype_name}/{ptype}/{index}/{method}/{r}" for r in range(1, repeats + 1)]
                    base_keys = [f"{dtype_name}/{ptype}/{index}/ar/{r}" for r in range(1, repeats + 1)]
                    hf_keys = [f"{dtype_name}/{ptype}/{index}/hf-ar/{r}" for r in range(1, repeats + 1)]
                    if not all(k in runs for k in keys + base_keys):
                        continue
                    med = statistics.median(runs[k]["seconds"] for k in keys)
                    base = statistics.median(runs[k]["seconds"] for k in base_keys)
                    hf = statistics.median(runs[k]["seconds"] for k in hf_keys) if all(k in runs for k in hf_keys) else None
                    call = statistics.median(runs[k].get("call_seconds", runs[k]["seconds"]) for k in keys)
                    exact = [runs[k]["sequence"] == runs[b]["sequence"] for k, b in zip(keys, base_keys)]
                    per_prompt.append((med, base, hf, runs[keys[0]]["tau"], runs[keys[0]]["acceptance"], exact, call))
                if not per_prompt:
                    continue
                time_s = sum(p[0] for p in per_prompt)
                speedup = sum(p[1] for p in per_prompt) / time_s
                hf_total = [p[2] for p in per_prompt]
                s_hf = f"{sum(hf_total) / sum(p[6] for p in per_prompt):.2f}" if None not in hf_total else "-"  # (whole calls)
                taus = [p[3] for p in per_prompt if p[3] is not None]
                accepts = [p[4] for p in per_prompt if p[4] is not None]
                tau = f"{statistics.mean(taus):.2f}" if taus else "-"
                accept = f"{statistics.mean(accepts):.0%}" if accepts else "-"
                exact = sum(sum(p[5]) for p in per_prompt)
                total = sum(len(p[5]) for p in per_prompt)
                lines.append(f"| {ptype} | {method} | {time_s:.2f} | {speedup:.2f} | {s_hf} | {tau} | {accept} | {exact}/{total} |")
                cells[ptype, method] = (time_s, sum(p[1] for p in per_prompt), statistics.mean(taus) if taus else None)
        lines += overall_table(cells, methods, prompt_types, dtype_name)
    return "\n".join(lines) + "\n"


def overall_table(cells: dict, methods: list[str], prompt_types: list[str], dtype_name: str) -> list[str]:
    """The seeds' LLM-table layout: one row per method, S / tau per prompt type and overall
    (S overall = AR's summed median time over the method's, over every prompt).

    Args:
        cells: {(prompt type, method): (method seconds, AR seconds, mean tau or None)}.
    """
    types = [t for t in prompt_types if any((t, m) in cells for m in methods)]
    lines = [f"\n**{dtype_name}, overall** (cell = S / tau; overall S = summed AR time over summed method time)\n",
             "| method | " + " | ".join(types) + " | overall |", "|---" * (len(types) + 2) + "|"]
    for method in methods:
        row, spent, base = [], 0.0, 0.0
        for ptype in types:
            if (ptype, method) not in cells:
                row.append("-")
                continue
            seconds, ar_seconds, tau = cells[ptype, method]
            spent, base = spent + seconds, base + ar_seconds
            row.append(f"{ar_seconds / seconds:.2f}" + (f" / {tau:.2f}" if tau is not None else ""))
        if spent:
            lines.append(f"| {method} | " + " | ".join(row) + f" | {base / spent:.2f} |")
    return lines
