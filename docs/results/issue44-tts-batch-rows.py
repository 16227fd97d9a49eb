"""Batch tts speed and row equality: python bench_batch.py METHOD [DTYPE]; prints one JSON line."""
import json, sys, time, torch, mmspec
torch.set_num_threads(1)
method = sys.argv[1]; dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
texts = ["There are seven blue squares.", "Put the small blue circle near the box.", "Hi there.",
         "A red star above two green rings.", "The yellow triangle is left of the cube.", "Four pink hearts.",
         "Move the big green square to the right.", "Is the circle red or blue?"]
tts = mmspec.pipeline("text-to-speech", method=method, dtype=dtype)
tts(texts[:4], seed=0, batch_size=4)  # warm-up
times, cpu = [], []
for _ in range(3):
    t, c = time.perf_counter(), time.process_time(); batch = tts(texts, seed=0, batch_size=4)
    times.append(time.perf_counter() - t); cpu.append(time.process_time() - c)
alone = [tts(x, seed=0) for x in texts]
same = [bool(torch.equal(a.codes, b.codes)) for a, b in zip(alone, batch)]
print(json.dumps({"method": method, "config": tts.run_config(), "batch4_wall_s": [round(t, 3) for t in times], "batch4_cpu_s": [round(t, 3) for t in cpu],
                  "audio_s": round(sum(b.stats.seconds for b in batch), 2), "rows_equal_batch1": same}))
