"""Time to first audio of ``tts.stream`` against the whole paragraph's time (docs/speech.md,
"Streaming"): the embedded voice, one thread, the same paragraph said RUNS times in one process.

    OMP_NUM_THREADS=1 python scripts/tts-first-audio.py [METHOD] [RUNS] [START:ITERATIONS]

(the last: the codec's Griffin-Lim start and iterations instead of its own, e.g. random:32, what
the voice's codec decoded with before stop 79)

Prints one JSON line per run: first_s (the first chunk's ``elapsed_s``), total_s, every chunk's
ready time, the audio's seconds, the real-time factor, ``tts(text)``'s time (one generation of the
whole paragraph) and whether the streamed chunks joined equal ``tts(text, split="sentences")``.
"""

import json
import sys
import time

import torch

import mmspec
from mmspec.modeling.mel_codec import with_decoding

TEXT = ("The train leaves at 7:30 in the morning. Please remember to bring your passport and boarding pass! "
        "Would you like a window seat or an aisle seat?")


def main(method: str = "ar", runs: int = 5, decode: str | None = None) -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    tts = mmspec.pipeline("text-to-speech", method=method)
    if decode:
        codec = tts.components.codec
        codec.config = with_decoding(codec.config, decode)
    print(f"loaded in {time.perf_counter() - start:.2f} s; dtype {tts.components.dtype}", flush=True)
    for run in range(runs):
        start = time.perf_counter()
        chunks = list(tts.stream(TEXT, seed=0))
        total = time.perf_counter() - start
        seconds = sum(c.audio.shape[-1] for c in chunks) / tts.sampling_rate
        start = time.perf_counter()
        tts(TEXT, seed=0)
        whole = time.perf_counter() - start
        same = torch.equal(torch.cat([c.audio for c in chunks], -1), tts(TEXT, seed=0, split="sentences").audio)
        print(json.dumps({"run": run, "first_s": round(chunks[0].elapsed_s, 3), "total_s": round(total, 3),
                          "ready_s": [round(c.elapsed_s, 3) for c in chunks], "audio_s": round(seconds, 2),
                          "rtf": round(total / seconds, 3), "call_whole_s": round(whole, 3), "stream_equals_call": same}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ar", int(sys.argv[2]) if len(sys.argv) > 2 else 5,
         sys.argv[3] if len(sys.argv) > 3 else None)
