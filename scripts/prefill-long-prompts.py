"""Prefill time of prompts longer than the fused layers take in one call (docs/benchmarks.md, stop 66):
the embedded captioner with a 60-word question (about 100 prompt rows with its 16 image tokens) over
the first test images, in each dtype named, and SmolLM2-135M-Instruct over a 260-token text prompt.
One thread; the median of the timed calls (the first call of each input is a warm-up).

    taskset -c 1 python scripts/prefill-long-prompts.py [DTYPES] [IMAGES] [REPEATS]

DTYPES: comma list of the captioner's dtypes (default "auto,fp32"); IMAGES: test images (default 6;
`mmspec train caption-data --out runs/caption-test --per-group 12 --split test` writes them);
REPEATS: timed calls per input (default 2). Prints one JSON line: milliseconds per prefill, the
prompt rows, and the machine.
"""

import json
import statistics
import sys
from pathlib import Path

import torch
from PIL import Image

import mmspec
from mmspec.bench.results import machine_info
from mmspec.hub import load_causal_lm

QUESTION = ("Look at this picture very carefully and then describe, in complete sentences, every object you can see, "
            "its colour, its shape, its size compared with the other objects, where it sits in the picture, whether it "
            "touches anything else, and what the background looks like, and finally say what the picture as a whole shows.")
DATA = Path("runs/caption-test")


def median_prefill(call, inputs, repeats: int) -> float:
    times = []
    for item in inputs:
        for run in range(repeats + 1):
            stats = call(item).stats
            if run:
                times.append(stats.prefill_time_s)
    return round(statistics.median(times) * 1e3, 2)


def main(dtypes: str = "auto,fp32", images: int = 6, repeats: int = 2) -> None:
    images, repeats = int(images), int(repeats)
    if images < 1 or repeats < 1:
        raise ValueError(f"IMAGES and REPEATS must be positive integers, got {images} and {repeats}")
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (DATA / "data.jsonl").read_text().splitlines()][:images]
    pictures = [Image.open(DATA / row["image"]).convert("RGB") for row in rows]
    result = {}
    for dtype in dtypes.split(","):
        cap = mmspec.pipeline("image-captioning", drafter="ar", dtype=dtype)
        rows_of = cap.processor(text=cap.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], add_generation_prompt=True),
            images=[pictures[0]], return_tensors="pt")["input_ids"].shape[1]
        result[f"captioner {dtype} ({rows_of} rows)"] = median_prefill(
            lambda image: cap(image, prompt=QUESTION, max_new_tokens=1, temperature=0), pictures, repeats)
    model, tokenizer = load_causal_lm("smollm2")
    mmspec.optimize(model)
    ids = tokenizer(" ".join([QUESTION] * 4), return_tensors="pt")
    name = f"smollm2 {str(next(model.parameters()).dtype)[6:]} ({ids['input_ids'].shape[1]} rows)"
    result[name] = median_prefill(lambda _: mmspec.generate(model, max_new_tokens=1, **ids), [None], 3 * repeats)
    print(json.dumps({"prefill_ms": result, "machine": machine_info("auto", 1)}))


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except (ValueError, FileNotFoundError) as error:  # a bad dtype or count, no test images: one line
        print(f"prefill-long-prompts: {error}", file=sys.stderr)
        sys.exit(2)
