"""The vLLM side of ``mmspec bench vllm``, run by path with the interpreter of an environment that
has vLLM (``--vllm-python``); it imports nothing of mmspec, whose own environment may hold another
torch.

    python vllm_worker.py WORK --draft-tokens K --repeats R --out FILE

reads ``WORK/target`` (the target's decoder as a causal LM checkpoint), ``WORK/head`` (the
EAGLE-3 head in vLLM's layout; unused with K = 0) and ``WORK/items.json`` (each item's prompt ids
and, for a VLM, ``embeds-I.pt``: the decoder's input embeddings [L, H] with the image features in
place, given to vLLM as a mixed prompt: token ids where ``is_token_ids``, the embedding rows
elsewhere), decodes each item greedily (plain decoding with K = 0, else EAGLE-3 chains of K
tokens), a warm-up round then R timed rounds, and writes per item the tokens, each round's seconds
(``LLM.generate`` of that one prompt, prefill included) and the verification steps and accepted
drafts that vLLM's spec-decode counters added.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run by path, this file's folder leads sys.path, and its neighbour vllm.py (``mmspec bench vllm``)
# would shadow the vllm package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


def counters(llm) -> dict[str, int]:
    """vLLM's spec-decode totals so far (the engine's Prometheus counters)."""
    return {m.name: int(m.value) for m in llm.get_metrics() if m.name in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--draft-tokens", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    work = Path(args.work)
    meta = json.loads((work / "items.json").read_text())
    spec = None if args.draft_tokens == 0 else {
        "method": "eagle3", "model": str(work / "head"), "num_speculative_tokens": args.draft_tokens}
    embeds = any(item["embeds"] for item in meta["items"])
    llm = LLM(model=str(work / "target"), dtype=args.dtype, speculative_config=spec, max_model_len=meta["max_model_len"],
              enforce_eager=True, seed=0, disable_log_stats=False, enable_prompt_embeds=embeds,
              enable_prefix_caching=False)  # every round prefills its prompt, as mmspec's do
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, stop_token_ids=meta["eos_token_ids"])
    results = []
    for index, item in enumerate(meta["items"]):
        prompt = {"prompt_token_ids": item["ids"]}
        if item["embeds"]:
            prompt.update(prompt_embeds=torch.load(work / item["embeds"], weights_only=True),
                          prompt_is_token_ids=item["is_token_ids"])
        seconds = []
        for round_index in range(args.repeats + 1):  # round 0 warms up
            before, start = counters(llm), time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            elapsed, after = time.perf_counter() - start, counters(llm)
            if round_index:
                seconds.append(elapsed)
        tokens = list(out[0].outputs[0].token_ids)
        results.append({"tokens": tokens, "seconds": seconds,
                        "steps": after.get(COUNTERS[0], 0) - before.get(COUNTERS[0], 0),
                        "accepted": after.get(COUNTERS[1], 0) - before.get(COUNTERS[1], 0)})
        print(f"vllm K={args.draft_tokens} item {index}: {len(tokens)} tokens, {min(seconds):.3f}s", flush=True)
    import vllm

    Path(args.out).write_text(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__, "items": results}))


if __name__ == "__main__":
    main()
