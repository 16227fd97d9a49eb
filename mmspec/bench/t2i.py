"""``mmspec bench t2i``: text-to-image methods against AR, side by side, on a fixed prompt set.

Prompts: the first caption of the first ``--prompts`` scenes of the **test** split of
:mod:`mmspec.train.t2i_data` (object combinations the training split never draws); their rendered
scenes are the reference set of the Frechet distance. Protocol (docs/benchmarks.md, "How a figure is measured"):
one process, a warm-up generation, then for every prompt and round each method in turn with the
same seed (prompt index + 1000 * round); per method the sums of wall times give the latency
speedup S = sum(AR time) / sum(method time); step compression = image tokens / target forwards.
Quality (the project's own metric CLIP, :mod:`mmspec.metrics.image_quality`): the prompt score
of each method's images and the Frechet CLIP distance between its images and the reference
renders; AR's own round-to-round spread is the noise level. Results are checkpointed after every
measurement (rerun to resume).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..hub import dtype_name
from ..pipelines.text_to_image.components import T2IComponents
from ..pipelines.methods import parse_spec
from ..pipelines.text_to_image.methods import METHODS, SETTINGS, T2IMethod, make_method
from ..pipelines.text_to_image.pipeline import check_batches
from ..cli.output import write_output, write_text
from ..cli.args import add_trust_remote_code_arg
from .results import (add_device_args, add_threads_arg, check_meta, load_results, machine_info, machine_line, method_specs,
                      save_results)
from .throughput import parse_batch_sizes, throughput_tables

#: the benchmark's draft length K where neither --num-draft-tokens nor a method's spec gives one
DRAFT_TOKENS = 4

DEFAULT_METHODS = "ar,spec,sjd:random,sjd:horizontal,sjd:vertical,sjd-coupled:random,sjd-coupled:vertical"
#: a continuous-token (MAR) model's: one token per step, MAR's own parallel decoding, CSpD
MAR_METHODS = ("ar,mar-parallel:8,mar-parallel:16,mar-parallel:32,cspd/num_draft_tokens=4,"
               "cspd/num_draft_tokens=4/draft_mode=parallel,cspd-tempered/num_draft_tokens=4,"
               "cspd-tempered/num_draft_tokens=4/draft_mode=parallel,cspd-self/num_draft_tokens=4,cspd-self/num_draft_tokens=8")


def is_mar(model) -> bool:
    """Whether ``model`` names a continuous-token (MAR) model: "mar" or a directory with mar.json."""
    from ..pipelines.text_to_image.components import MAR_FILE

    return model == "mar" or (model is not None and (Path(model).expanduser() / MAR_FILE).is_file())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="text-to-image model directory (default: the embedded models/t2i; "
                        "'mar': the embedded continuous-token model)")
    add_trust_remote_code_arg(parser, "a transformers model's")
    parser.add_argument("--methods", default=None,
                        help=f"comma list (default: {DEFAULT_METHODS}; for a MAR: {MAR_METHODS}): "
                             "ar, spec, sjd[:init], sjd-coupled[:init], eagle, eagle2, and the relaxed "
                             "lantern|lantern++|gsd[:draft|eagle|eagle2] with optional /k=K/delta=D/lam=L/top_m=M "
                             "(e.g. lantern:eagle/k=300/delta=0.2), sjd-pac[:init] with optional /branches=B/depth=D; for a MAR: "
                             "mar-parallel:N, cspd with optional /num_draft_tokens=K/prefill_fraction=F")
    parser.add_argument("--prompts", type=int, default=12,
                        help="how many of the held-out test split's prompts (a count; `mmspec t2i --prompts FILE` draws a file's)")
    parser.add_argument("--rounds", type=int, default=2, help="times every prompt is drawn per method (the times summed)")
    parser.add_argument("--guidance-scale", type=float, default=3.0, help="classifier-free guidance g >= 1")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the image tokens")
    parser.add_argument("--top-k", type=int, default=None, help="default: the full codebook")
    parser.add_argument("--window", type=int, default=None,
                        help="SJD's window L (default: the method's, as the pipeline runs it; before stop 77 this "
                             "benchmark ran 16)")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help=f"a chain's draft length K, or EAGLE-2's tree depth (default: {DRAFT_TOKENS} for every method "
                             "that reads it and whose spec sets none, e.g. spec:num_draft_tokens=6)")
    parser.add_argument("--delta", type=float, default=None,
                        help="LANTERN's TV bound (default: the method's; before stop 77 this benchmark ran 0.1)")
    parser.add_argument("--lam", type=float, default=None, help="LANTERN++'s ratio bound (default: the method's)")
    parser.add_argument("--neighbours-k", type=int, default=None,
                        help="codebook neighbours per code, LANTERN's k (default: the method's)")
    add_threads_arg(parser)
    parser.add_argument("--dtype", default="float32", help="the generator's weights: float32 | bfloat16 | auto (not MAR)")
    parser.add_argument("--batch-sizes", default=None, metavar="1,4,16",
                        help="measure throughput instead: the prompts decoded B at a time, per batch size (items/s, "
                             "tokens/s, crossover; no quality scores); see mmspec.bench.throughput")
    add_device_args(parser)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="verify through CUDA graphs (the embedded LlamaGen-style layout on --device cuda, batch size 1)")
    parser.add_argument("--results", default="bench-out/t2i.json", help="JSON checkpoint / results file (a rerun resumes it)")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    parser.add_argument("--plot", default=None, help="write the speed / quality trade-off (speedup vs FD) as a PNG")
    parser.add_argument("--no-quality", action="store_true", help="skip the metric-CLIP scores")


def bench_prompts(n: int, size: int = 64) -> tuple[list[str], torch.Tensor]:
    """The benchmark prompts (test split) and their reference renders (uint8 [n, 3, size, size])."""
    from ..train.t2i_data import scene_pool

    images, captions = scene_pool("test", max(n, 500), size=size)
    return [c[0] for c in captions[:n]], images[:n]


def run(args: argparse.Namespace) -> int:
    if args.plot and (args.no_quality or args.batch_sizes):
        raise ValueError(f"--plot draws speedup against the Frechet CLIP distance, which {'--no-quality' if args.no_quality else '--batch-sizes'} "
                         "does not measure; drop one of them")
    if not args.temperature > 0:  # (sampled: it failed after the model loaded, naming do_sample=False)
        raise ValueError(f"--temperature must be > 0, got {args.temperature:g}: the text-to-image methods sample")
    from ..hub import require_modules

    require_modules(("open_clip",) if not args.no_quality else (), "the Frechet CLIP distance (--no-quality skips it)",
                    "pip install 'mmspec[image]'")
    require_modules(("matplotlib",) if args.plot else (), "--plot", "pip install 'mmspec[bench]'")
    if args.prompts < 2 and not args.no_quality and not args.batch_sizes:
        raise ValueError(f"--prompts {args.prompts}: the Frechet CLIP distance compares sets of at least 2 images; give "
                         "--prompts 2 or more, or --no-quality")
    listed = args.methods if args.methods is not None else (MAR_METHODS if is_mar(args.model) else DEFAULT_METHODS)
    specs = method_specs(listed, "ar,sjd")
    methods = {spec: configure(spec, args) for spec in specs}  # every spec checked before the model loads
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    if batch_sizes and "ar" not in methods:
        raise ValueError("--batch-sizes compares every method with ar at each batch size: include ar in --methods")
    if batch_sizes and max(batch_sizes) > 1:  # (Emu3, SJD-PAC's trees: refused before the model loads; sjd-pac was
        # refused after it, naming captioning's drafters)
        reason = T2IComponents.batch_size_one_reason(args.model, args.trust_remote_code)
        if reason:
            raise ValueError(f"--batch-sizes {args.batch_sizes}: {reason}, so it decodes one image at a time; use --batch-sizes 1")
        for method in methods.values():
            check_batches(method, args.prompts, max(batch_sizes), "--batch-sizes")
    path = Path(args.results)
    results = load_results(path, "t2i", {"model": args.model, "dtype": args.dtype})  # before the model loads
    components = T2IComponents.from_pretrained(args.model, device=args.device, optimize=args.optimize, dtype=args.dtype,
                                               cuda_graphs=args.cuda_graphs, trust_remote_code=args.trust_remote_code)
    for method in methods.values():
        method.check_components(components)
    prompts, references = bench_prompts(args.prompts, size=components.image_size)
    meta = {"threads": args.threads, "guidance_scale": args.guidance_scale, "temperature": args.temperature,
            "top_k": args.top_k, "window": args.window, "num_draft_tokens": args.num_draft_tokens or DRAFT_TOKENS,
            "delta": args.delta, "lam": args.lam, "neighbours_k": args.neighbours_k, "prompts": args.prompts, "rounds": args.rounds,
            "machine": machine_info(dtype_name(components.dtype), args.threads, args.device),
            "linears": components.linears, "cuda_graphs": args.cuda_graphs}
    check_meta(path, results, meta)
    results["meta"] = meta
    runs = results.setdefault("runs", {})
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, guidance_scale=args.guidance_scale)
    prompt_inputs = [components.prompt_inputs(p) for p in prompts]
    n = components.target.num_image_tokens
    if batch_sizes:
        return run_throughput(args, results, path, components, methods, prompt_inputs, batch_sizes)
    with torch.inference_mode():
        for method in [make_method("ar"), *methods.values()]:  # warm-up: every method's models and drafter once
            method.generate(components, prompt_inputs[0], 0, max_new_tokens=min(32, n), **sampling)
        for round_ in range(args.rounds):
            for i, model_inputs in enumerate(prompt_inputs):
                for spec, method in methods.items():
                    key = f"{spec}|{i}|{round_}"
                    if key in runs:
                        continue
                    out = method.generate(components, model_inputs, i + 1000 * round_, **sampling)
                    s = out.stats
                    runs[key] = {"time": s.wall_time_s, "tokens": s.new_tokens, "forwards": s.target_forwards,
                                 "tau": s.mean_accepted_length, "draft_forwards": s.draft_forwards,
                                 "grid": out.sequences[0, -n:].tolist()}
                    save_results(path, results)
                print(f"round {round_} prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    summary = summarise(results, methods, prompts, references, components, quality=not args.no_quality)
    results["summary"] = summary
    save_results(path, results)
    table = markdown_table(summary, meta)
    print(table)
    if args.markdown:
        write_text(args.markdown, table + "\n")
    if args.plot:
        plot_tradeoff(summary, args.plot)
    return 0


def run_throughput(args, results: dict, path: Path, components, methods: dict, prompt_inputs: list, batch_sizes: list[int]) -> int:
    """``--batch-sizes``: :mod:`mmspec.bench.throughput` over the prompts (each row one prompt,
    guided, sampled at the benchmark's temperature and top-k), each batch decoded by the method's
    ``generate_batch`` (every row with the pass's seed): token models, MAR models and MAR's own
    parallel decoding alike."""
    options = {spec: {"drafter": method.build_drafter(components)} for spec, method in methods.items()}
    settings = {f"{args.temperature:g}": dict(do_sample=True, temperature=args.temperature, top_k=args.top_k,
                                              guidance_scale=args.guidance_scale)}
    meta = {"model": args.model or "embedded text-to-image model (models/t2i)", **results["meta"]}

    def decode(spec: str, batch: list, seed: int, **sampling):
        return methods[spec].generate_batch(components, batch, [seed] * len(batch), **sampling)

    _, table = throughput_tables(components.target, prompt_inputs, options, batch_sizes, settings, args.rounds,
                                 components.target.num_image_tokens, results, path, meta, decode=decode)
    print(table)
    if args.markdown:
        write_text(args.markdown, table + "\n")
    return 0


def plot_tradeoff(summary: dict, path: str) -> None:
    """Latency speedup (x) against Frechet CLIP distance (y, lower is better) per method, with AR's
    round-to-round FD range as the noise band."""
    try:
        import matplotlib
    except ImportError as error:
        from ..hub import MissingDependencyError

        raise MissingDependencyError("--plot needs matplotlib: pip install 'mmspec[bench]'") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {m: r for m, r in summary.items() if r.get("speedup") and "fd" in r}
    figure, axes = plt.subplots(figsize=(7, 4.5))
    if "ar" in rows:
        low, high = min(rows["ar"]["fd_rounds"]), max(rows["ar"]["fd_rounds"])
        axes.axhspan(low, high, color="0.85", label="AR, FD range over rounds")
    for method, row in rows.items():
        lossy = not row["exact"]
        axes.scatter(row["speedup"], row["fd"], marker="o" if lossy else "s", color="tab:red" if lossy else "tab:blue")
        axes.annotate(method, (row["speedup"], row["fd"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes.set_xlabel("latency speedup over AR (side by side)")
    axes.set_ylabel("Frechet CLIP distance to references (lower is better)")
    axes.set_title("Text-to-image: speed vs quality (squares exact, dots relaxed)")
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    try:
        write_output(path, lambda tmp: figure.savefig(tmp, dpi=120))
    finally:
        plt.close(figure)


#: short keys of a method spec's settings -> their names in SETTINGS (any name of SETTINGS works too)
SPEC_KEYS = {"k": "neighbours_k", "branches": "pac_branches", "depth": "pac_depth"}


#: the run-wide settings of the command line, with the benchmark's defaults (each method of the run
#: takes those it reads; a spec's own /key=value pairs are checked strictly)
RUN_SETTINGS = ("window", "num_draft_tokens", "neighbours_k", "delta", "lam")


def configure(spec: str, args: argparse.Namespace) -> T2IMethod:
    """A method spec "name[:arg][/key=value...]" -> the method. Keys: k, delta, lam, top_m (relaxed
    rules), branches, depth (sjd-pac), or any setting's name (a key the method does not read is
    refused); unset ones take the command line's --window, --num-draft-tokens, --neighbours-k,
    --delta and --lam where the method reads them, else the method's defaults."""
    method, *pairs = spec.split("/")
    run_wide = {name: getattr(args, name) for name in RUN_SETTINGS}
    parsed = parse_spec(method)
    cls = METHODS.resolve(parsed.name)
    own = {key for key, _ in parsed.pairs} | ({cls.argument} if parsed.argument else set())
    if run_wide["num_draft_tokens"] is None and "num_draft_tokens" not in own:  # the benchmark's K, not given
        run_wide["num_draft_tokens"] = DRAFT_TOKENS  # (a spec's own num_draft_tokens=K is no second value)
    settings = cls.reads(run_wide)
    for pair in pairs:
        key, _, value = pair.partition("=")
        name = SPEC_KEYS.get(key, key)
        if name not in SETTINGS:
            raise ValueError(f"unknown setting {key!r} in {spec!r}; use k, delta, lam, top_m (relaxed), branches, "
                             "depth (sjd-pac), num_draft_tokens, prefill_fraction (cspd)")
        try:
            settings[name] = SETTINGS[name].kind(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} in {spec!r} is not a valid {SETTINGS[name].kind.__name__}") from None
    return make_method(method, **settings)


def summarise(results: dict, methods: dict[str, T2IMethod], prompts: list[str], references: torch.Tensor,
              components: T2IComponents, quality: bool) -> dict:
    """Per method spec: time, step compression, tau, speedup over AR, whether it is exact, and with
    ``quality`` the Frechet CLIP distance and prompt score per round."""
    runs, rounds = results["runs"], results["meta"]["rounds"]
    ar_time = sum(runs[f"ar|{i}|{r}"]["time"] for i in range(len(prompts)) for r in range(rounds)) if "ar" in methods else None
    metric = None
    if quality:
        from ..metrics.image_quality import frechet_clip_distance, load_metric_clip, prompt_score

        metric = load_metric_clip()
    summary = {}
    for spec, method in methods.items():
        cells = [runs[f"{spec}|{i}|{r}"] for r in range(rounds) for i in range(len(prompts))]
        time_ = sum(c["time"] for c in cells)
        row = {"time_s": time_, "step_compression": sum(c["tokens"] for c in cells) / sum(c["forwards"] for c in cells),
               "tau": sum(c["tau"] for c in cells) / len(cells), "speedup": ar_time / time_ if ar_time else None,
               "exact": method.exact, "settings": method.run_settings(components)}  # (SJD's window: the one it ran)
        if metric is not None:
            per_round_fd, per_round_score = [], []
            for r in range(rounds):
                grids = torch.tensor([runs[f"{spec}|{i}|{r}"]["grid"] for i in range(len(prompts))])
                images = components.decode(grids)
                per_round_fd.append(frechet_clip_distance(images, references, model=metric))
                per_round_score.append(prompt_score(images, prompts, model=metric))
            row.update(fd=sum(per_round_fd) / rounds, fd_rounds=per_round_fd,
                       prompt_score=sum(per_round_score) / rounds, prompt_score_rounds=per_round_score)
        summary[spec] = row
    return summary


def markdown_table(summary: dict, meta: dict) -> str:
    window = meta["window"] or "the method's"
    lines = [f"{meta['prompts']} prompts x {meta['rounds']} rounds, CFG {meta['guidance_scale']}, temperature "
             f"{meta['temperature']}, top-k {meta['top_k'] or 'all'}, SJD window {window}, draft K {meta['num_draft_tokens']}, {meta['threads']} thread(s)"
             + (", CUDA graphs" if meta.get("cuda_graphs") else "") + (f", {meta['machine']['dtype']}, {machine_line(meta['machine'])}" if "machine" in meta else ""), "",
             "| method | exact | step compression | latency speedup | tau | FD (per round) | prompt score (per round) |",
             "|---|---|---|---|---|---|---|"]
    for method, row in summary.items():
        fd = f"{row['fd']:.3f} ({', '.join(f'{v:.3f}' for v in row['fd_rounds'])})" if "fd" in row else "-"
        score = (f"{row['prompt_score']:.1f} ({', '.join(f'{v:.1f}' for v in row['prompt_score_rounds'])})"
                 if "prompt_score" in row else "-")
        speedup = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
        exact = {True: "yes", False: "no (relaxed)"}.get(row.get("exact"), "?")  # (the method's rule: samples p exactly, or not)
        lines.append(f"| {method} | {exact} | {row['step_compression']:.2f}x | {speedup} | {row['tau']:.2f} | {fd} | {score} |")
    return "\n".join(lines)
