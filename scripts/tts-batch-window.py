"""Coupled SJD's window against the batch size (docs/benchmarks.md, stop 82): the 40 hand-written
held-out sentences said as one list, ``tts(texts, batch_size=B)``, by plain decoding and by
``sjd-coupled`` with each window given, interleaved, two timed rounds after a warm-up round per
batch size; whole calls (front end, codec LM, NAR stage and decode).

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/tts-batch-window.py SIZES [WINDOWS]

SIZES and WINDOWS: comma lists (e.g. ``1,2,4,8`` and ``12,24``; WINDOWS defaults to ``12,24``).
Prints one line per batch size: each pipeline's two times (s) and each window's total against
the first window's.
"""

import sys
import time

import torch

import mmspec
from mmspec.bench.tts import handwritten_texts


def main() -> None:
    torch.set_num_threads(1)
    sizes = [int(x) for x in sys.argv[1].split(",")]
    windows = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "12,24").split(",")]
    texts = [t for _, t in handwritten_texts(40)]
    pipes = {"ar": mmspec.pipeline("text-to-speech", method="ar"),
             **{f"sjd-coupled/{w}": mmspec.pipeline("text-to-speech", method="sjd-coupled", num_draft_tokens=w)
                for w in windows}}
    for size in sizes:
        for pipe in pipes.values():
            pipe(texts, batch_size=size, seed=0)
        times = {name: [] for name in pipes}
        for _ in range(2):
            for name, pipe in pipes.items():
                start = time.perf_counter()
                pipe(texts, batch_size=size, seed=0)
                times[name].append(round(time.perf_counter() - start, 2))
        first = sum(times[f"sjd-coupled/{windows[0]}"])
        against = {w: round(sum(times[f"sjd-coupled/{w}"]) / first, 3) for w in windows[1:]}
        print(f"batch {size}: {times}; against {windows[0]} codes: {against}", flush=True)


if __name__ == "__main__":
    main()
