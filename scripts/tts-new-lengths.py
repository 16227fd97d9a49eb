"""The embedded voice on sentences it has not said before in this process, against the same
sentences said again (docs/benchmarks.md, stop 80): what a user's new sentence costs beyond a
benchmark's warmed-up one (PyTorch's oneDNN builds its kernels again for every new input length),
and the process's resident memory as ever new lengths come in.

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/tts-new-lengths.py METHOD [SENTENCES]

One thread; one warm-up call on a sentence outside the set. Then the first SENTENCES hand-written
held-out sentences twice, each pass timed whole (front end, codec LM, NAR stage and decode:
``tts(text, seed=i)``), and after each pass the resident memory and the distinct frame counts.
Prints one JSON line per pass.
"""

import json
import sys
import time

import torch

import mmspec
from mmspec.bench.tts import handwritten_texts


def resident_mb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def main(method: str, sentences: int = 40) -> None:
    torch.set_num_threads(1)
    texts = [text for _, text in handwritten_texts(sentences + 1)]
    tts = mmspec.pipeline("text-to-speech", method=method)
    tts(texts[-1], seed=0)  # (outside the set: the models' first call)
    lengths = set()
    for name in ("new sentences", "the same again"):
        audio, start = 0.0, time.perf_counter()
        for i, text in enumerate(texts[:sentences]):
            out = tts(text, seed=i)
            audio += out.audio.shape[-1] / out.sampling_rate
            lengths.add(out.codes.shape[-1])
        seconds = time.perf_counter() - start
        print(json.dumps({"method": method, "pass": name, "seconds": round(seconds, 3), "audio_s": round(audio, 1),
                          "real_time_factor": round(seconds / audio, 4), "resident_mb": resident_mb(),
                          "frame_counts": len(lengths)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
