"""Throughput at several batch sizes (``mmspec bench caption --batch-sizes 1,4,16``).

The benchmark's items are decoded B at a time (:func:`mmspec.api.generate_rows`; the last batch
may be smaller) by plain AR decoding and by each method. One measurement is one pass over all
items: its wall time gives items/s and tokens/s. Methods are interleaved within each round, after a
warm-up round (round 0), and the median over rounds is kept. Every row of a pass uses the same
seed (``1000 + round``), so each row equals its batch-1 output, greedy or sampled; the summary
checks this against the B = 1 pass of the same method and round (``rows_identical``).

Speedup at B = AR's median pass time at B over the method's: where it falls below 1 the batch is
past the method's crossover, because the rows' verification forwards fill the hardware that
drafting was using for free at B = 1.
"""

from __future__ import annotations

import copy
import statistics
import sys
from typing import Any, Callable

import torch

from ..api import generate_rows
from ..core.batch import row_drafter
from .results import machine_line, save_results


def parse_batch_sizes(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; ValueError saying what to pass otherwise."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes takes a comma list of positive integers (e.g. 1,4,16), got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes takes a comma list of positive integers (e.g. 1,4,16), got {text!r}")
    if twice := sorted({size for size in sizes if sizes.count(size) > 1}):  # (each was measured again, its table row doubled)
        raise ValueError(f"--batch-sizes names {', '.join(map(str, twice))} more than once ({text!r}); give each size once")
    return sizes


def measure_throughput(
    decode: Callable[..., Any],
    rows: list[dict[str, Any]],
    methods: list[str],
    batch_sizes: list[int],
    settings: dict[str, dict[str, Any]],
    repeats: int,
    runs: dict[str, dict],
    save: Callable[[], None],
) -> None:
    """Fill ``runs`` (resumable: keys already there are skipped) with one pass per
    "setting/B/method/round": {"seconds", "tokens", "items", "steps", "tokens_per_row"}; ``save`` after each.

    Args:
        decode: ``decode(method, batch, seed, **sampling)`` -> the GenerateOutput of the rows
            ``batch`` decoded together (``sequences`` [B, ...] with each row's new tokens last,
            ``stats`` the batch's totals, ``row_stats``).
        settings: label (e.g. the temperature) -> the sampling arguments every method runs with.
    """
    for label, sampling in settings.items():
        for size in batch_sizes:
            for round_index in range(repeats + 1):
                for method in methods:
                    key = f"{label}/{size}/{method}/{round_index}"
                    if key in runs:
                        continue
                    seconds, tokens, steps, per_row = 0.0, 0, 0, []
                    for start in range(0, len(rows), size):
                        out = decode(method, rows[start : start + size], 1000 + round_index, **sampling)
                        seconds += out.stats.wall_time_s
                        tokens += out.stats.new_tokens
                        steps += out.stats.verify_steps
                        width = out.sequences.shape[1] - max(s.new_tokens for s in out.row_stats)
                        per_row += [out.sequences[b, width : width + s.new_tokens].tolist() for b, s in enumerate(out.row_stats)]
                    runs[key] = {"seconds": seconds, "tokens": tokens, "items": len(rows), "steps": steps, "tokens_per_row": per_row}
                    save()
                    print(f"{key}: {seconds:.2f}s, {len(rows) / seconds:.2f} items/s, {tokens / seconds:.1f} tok/s",
                          file=sys.stderr, flush=True)


def items_digest(rows: list[dict[str, Any]]) -> str:
    """A short fingerprint of the measured rows' inputs (every tensor's name, dtype, shape and bytes)."""
    import hashlib

    digest = hashlib.sha256()
    for row in rows:
        for name in sorted(row):
            value = row[name]
            if isinstance(value, torch.Tensor):
                flat = value.detach().cpu().contiguous().reshape(-1)
                digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
                digest.update(flat.view(torch.uint8).numpy().tobytes())
            else:
                digest.update(f"{name}:{value!r}".encode())
    return digest.hexdigest()[:16]


def check_same_items(results: dict, rows: list[dict[str, Any]], path) -> None:
    """Refuse to resume throughput runs measured over other items (another --per-family, --prompts,
    --sentences, or an edited --data): a pass's key names its batch size, not its items, so they
    would pass for this run's; record this run's items for the next resume."""
    held, mine = results.get("throughput_items"), {"count": len(rows), "digest": items_digest(rows)}
    if results.get("throughput") and isinstance(held, dict) and held != mine:
        raise ValueError(f"{path} holds throughput runs over other items ({held.get('count')} there, {len(rows)} now"
                         f"{'' if held.get('count') != len(rows) else ', their inputs changed'}); pass another --results file")
    results["throughput_items"] = mine


def throughput_tables(target, rows: list[dict[str, Any]], methods: dict[str, dict[str, Any]], batch_sizes: list[int],
                      settings: dict[str, dict[str, Any]], repeats: int, max_new_tokens: int, results: dict, path,
                      meta: dict, decode: Callable[..., Any] | None = None) -> tuple[dict, str]:
    """A benchmark's ``--batch-sizes`` run: check every method's drafter can run in a batch (one
    error line before anything is measured), :func:`measure_throughput` into ``results["throughput"]``
    (saved to ``path`` after each pass), then the summary (stored as ``results["throughput_summary"]``)
    and its Markdown tables (:func:`render_throughput` with ``meta``).

    ``methods``: name -> :func:`~mmspec.api.generate_rows` arguments (drafter, acceptance,
    rule_kwargs), run on ``target`` with ``max_new_tokens``; or, with ``decode`` (as
    :func:`measure_throughput` takes it), whatever it reads."""
    for options in methods.values():
        if options.get("drafter") is not None:
            row_drafter(copy.copy(options["drafter"]))
    if decode is None:
        def decode(method: str, batch: list, seed: int, **sampling):
            return generate_rows(target, batch, max_new_tokens=max_new_tokens, seed=seed, **methods[method], **sampling)
    runs = results.setdefault("throughput", {})
    check_same_items(results, rows, path)
    measure_throughput(decode, rows, list(methods), batch_sizes, settings, repeats, runs, lambda: save_results(path, results))
    summary = summarise_throughput(runs, list(methods), batch_sizes, list(settings), repeats)
    results["throughput_summary"] = summary
    save_results(path, results)
    return summary, render_throughput(summary, list(methods), meta)


def summarise_throughput(runs: dict[str, dict], methods: list[str], batch_sizes: list[int], labels: list[str],
                         repeats: int) -> dict:
    """{setting: {B: {method: {"items_per_s", "tokens_per_s", "tau", "speedup" (over AR at B),
    "over_ar_batch_1", "rows_identical" (every row's tokens equal to the B = 1 pass of the same
    method and round, or None where B = 1 is not measured)}}}} from the medians over rounds 1.."""
    summary: dict = {}
    for t in labels:
        for size in batch_sizes:
            def passes(method: str, b: int = size) -> list[dict]:
                return [runs[k] for r in range(1, repeats + 1) if (k := f"{t}/{b}/{method}/{r}") in runs]

            ar = passes("ar")
            ar_one = passes("ar", 1) if 1 in batch_sizes else []
            for method in methods:
                done = passes(method)
                if not done:
                    continue
                seconds = statistics.median(p["seconds"] for p in done)
                row = {"items_per_s": done[0]["items"] / seconds, "tokens_per_s": statistics.median(p["tokens"] / p["seconds"] for p in done),
                       "tau": sum(p["tokens"] - p["items"] for p in done) / max(1, sum(p["steps"] for p in done)),
                       "speedup": statistics.median(p["seconds"] for p in ar) / seconds if ar else None,
                       "over_ar_batch_1": statistics.median(p["seconds"] for p in ar_one) / seconds if ar_one else None,
                       "rows_identical": None}
                if size != 1 and 1 in batch_sizes:
                    one = passes(method, 1)
                    row["rows_identical"] = all(_same_rows(a["tokens_per_row"], b["tokens_per_row"]) for a, b in zip(done, one)) if one else None
                summary.setdefault(t, {}).setdefault(str(size), {})[method] = row
    return summary


def _same_rows(a: list, b: list) -> bool:
    """Token rows equal: ids exactly; continuous tokens (lists of floats) within 1e-3, as a wider
    forward rounds differently."""
    if a == b:
        return True
    continuous = bool(a) and bool(a[0]) and isinstance(a[0][0], list)
    return continuous and len(a) == len(b) and all(
        len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-3, atol=1e-3) for x, y in zip(a, b))


def crossover(summary_at_t: dict, method: str) -> int | None:
    """The smallest measured batch size at which ``method`` is no faster than AR (None: faster at all)."""
    for size, rows in sorted(summary_at_t.items(), key=lambda item: int(item[0])):
        speedup = rows.get(method, {}).get("speedup")
        if speedup is not None and speedup <= 1.0:
            return int(size)
    return None


def render_throughput(summary: dict, methods: list[str], meta: dict, label: str = "Temperature") -> str:
    """Markdown tables: per setting (``label`` and its value), batch size x method -> items/s, tokens/s, speedup over AR
    at the same batch size, and the crossover batch size per method."""
    machine = meta.get("machine", {})
    lines = [f"Throughput, {meta.get('model')}; {machine_line(machine)}, "
             f"{machine.get('threads')} thread(s), {machine.get('dtype')}, linears {meta.get('linears')}.", ""]
    for t, by_size in summary.items():
        lines += [f"{label} {t}: items/s, tokens/s and speedup over AR at the same batch size "
                  "(in brackets: over AR at batch size 1).", "",
                  "| batch | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for size, rows in sorted(by_size.items(), key=lambda item: int(item[0])):
            cells = []
            for method in methods:
                r = rows.get(method)
                if r is None:
                    cells.append("-")
                    continue
                cell = f"{r['items_per_s']:.2f} it/s, {r['tokens_per_s']:.0f} tok/s"
                if r["speedup"] is not None and method != "ar":
                    cell += f", {r['speedup']:.2f}x"
                if r["over_ar_batch_1"] is not None:
                    cell += f" ({r['over_ar_batch_1']:.2f}x)"
                if r["rows_identical"] is False:
                    cell += " [rows differ from B=1]"
                cells.append(cell)
            lines.append(f"| {size} | " + " | ".join(cells) + " |")
        found = {m: crossover(by_size, m) for m in methods if m != "ar"}
        lines += ["", "Crossover (smallest batch size where the method is no faster than AR): "
                  + ", ".join(f"{m}: {c if c is not None else 'beyond ' + str(max(int(s) for s in by_size))}" for m, c in found.items()), ""]
    return "\n".join(lines)
