"""Compare EAGLE heads for the embedded captioner (e.g. trained with and without the vision option,
``mmspec train drafter --vision-tokens K``) on held-out caption data.

1. Teacher-forced, over a self-distillation cache (``mmspec train drafter --data DIR``, e.g. made
   from families or a split held out of the heads' training): next-next-token top-1 (the head
   predicts f^_{t+1} from (f_t, x_{t+1}); top-1 of LMHead(f^_{t+1}) against x_{t+2}, the
   captioner's own answer token), per family (the cache's sample i is of family i mod F).
2. Decoding (``--images N``, N > 0): ``--spec`` (EAGLE-2, or EAGLE's K = 5 chains, whose tau
   depends on the head alone: EAGLE-2's greedy trees are sized by measured time) greedy on the
   first N images of each family in ``--split``, prompts as the data's: tau (mean accepted
   length), new tokens per second against plain decoding (on a shared machine the first head
   timed also pays warm-up), and whether the output equals plain decoding's (bf16: a near-tie
   may round differently; fp32 is exact).

    python scripts/vision_eagle_compare.py --data runs/vis-heldout --families math,photos --split test --images 4 HEAD_DIR [HEAD_DIR ...]
"""

import argparse
import json
import time
from pathlib import Path

import torch

from mmspec.adapters.hf import TransformersTarget, config_image_token_id
from mmspec.api import generate
from mmspec.drafters import resolve_drafter
from mmspec.modeling.heads import EagleHead
from mmspec.train.drafter import caption_families, collate, eagle_teacher_forced, load_target
from mmspec.train.selfdistill import load_chunks


def teacher_forced_top1(head, model, records, families) -> dict[str, float]:
    embed = model.get_input_embeddings().weight.detach().float()
    lm_head = model.get_output_embeddings().weight.detach().float()
    image_token = config_image_token_id(model.config)
    right, total = {f: 0 for f in families}, {f: 0 for f in families}
    with torch.no_grad():
        for family_index, family in enumerate(families):
            mine = records[family_index :: len(families)]
            for start in range(0, len(mine), 8):
                _, (predicted, _, targets) = eagle_teacher_forced(head, embed, collate(mine[start : start + 8]), image_token)
                right[family] += int(((predicted @ lm_head.T).argmax(-1) == targets).sum())
                total[family] += len(targets)
    scores = {f: round(right[f] / max(total[f], 1), 4) for f in families}
    scores["all"] = round(sum(right.values()) / max(sum(total.values()), 1), 4)
    scores["positions"] = sum(total.values())
    return scores


def decode(heads, model, processor, families, split: str, images: int, max_new_tokens: int, spec: str = "eagle2") -> dict:
    from mmspec.train.data import make_sample

    target = TransformersTarget(model)
    items = [make_sample(f, split, i) for i in range(images) for f in families]
    report = {h: {"tau": [], "seconds": 0.0, "tokens": 0, "same": 0} for h in heads}
    ar_seconds, ar_tokens = 0.0, 0
    for sample in items:
        content = [{"type": "image"}, {"type": "text", "text": sample.prompt}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = dict(processor(text=[text], images=[[sample.image]], return_tensors="pt"))
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        started = time.perf_counter()
        plain = generate(target, None, max_new_tokens=max_new_tokens, **inputs)
        ar_seconds += time.perf_counter() - started
        ar_tokens += plain.stats.new_tokens
        for head in heads:
            drafter = resolve_drafter(f"{spec}:{head}", target)
            started = time.perf_counter()
            out = generate(target, drafter, max_new_tokens=max_new_tokens, **inputs)
            row = report[head]
            row["seconds"] += time.perf_counter() - started
            row["tokens"] += out.stats.new_tokens
            row["tau"].append(out.stats.mean_accepted_length)
            row["same"] += bool(torch.equal(out.sequences, plain.sequences))
    summary = {"items": len(items), "ar_tokens_per_s": round(ar_tokens / ar_seconds, 2)}
    for head, row in report.items():
        summary[head] = {"tau": round(sum(row["tau"]) / len(row["tau"]), 3), "tokens_per_s": round(row["tokens"] / row["seconds"], 2),
                         "speedup": round((row["tokens"] / row["seconds"]) / (ar_tokens / ar_seconds), 3),
                         "identical_to_plain": f"{row['same']}/{len(items)}"}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--data", required=True, help="self-distillation cache of the held-out samples")
    parser.add_argument("--families", default=None, help="the families the cache interleaves (as its --families)")
    parser.add_argument("--sequences", type=int, default=None,
                        help="only the cache's first N sequences (a training cache's first min(64, n/8) are held out of training)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--images", type=int, default=0, help="images per family to decode with EAGLE-2 (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--spec", default="eagle2", choices=["eagle", "eagle2"],
                        help="eagle: K = 5 chains (tau depends on the head only); eagle2: trees sized by timing")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the report here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = caption_families(args.families)
    model, processor = load_target("captioner")
    records = load_chunks(Path(args.data))[: args.sequences]
    report = {"data": args.data, "sequences": len(records), "teacher_forced_top1": {}}
    for head_dir in args.heads:
        head = EagleHead.load(head_dir, model).float().eval()
        report["teacher_forced_top1"][head_dir] = teacher_forced_top1(head, model, records, families)
        print(head_dir, report["teacher_forced_top1"][head_dir], flush=True)
    if args.images:
        key = f"{args.spec}_greedy"
        report[key] = decode(args.heads, model, processor, families, args.split, args.images, args.max_new_tokens, args.spec)
        print(json.dumps(report[key], indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
