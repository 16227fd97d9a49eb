"""`python scripts/bench-few-rows.py [OUT.json]`: one bf16 linear's time (microseconds, 1 thread)
through each bf16 few-row kernel this machine runs (AMX tiles, vdpbf16ps) and F.linear, for M rows,
with the weight streamed from memory (48 weights cycled) and from cache (one weight reused)."""
import json
import sys
import time

import torch
import torch.nn.functional as F

from mmspec.bench.results import machine_info
from mmspec.modeling.fast_linear import bf16_variants, few_rows_linear

torch.set_num_threads(1)
torch.manual_seed(0)
rows = []
for shape, count in (((1536, 576), 48), ((1536, 576), 1), ((768, 256), 6)):
    weights = [torch.randn(*shape).bfloat16() for _ in range(count)]
    for m in (1, 2, 3, 4, 5, 7, 8, 12, 16, 18, 24, 32, 48, 64):
        x = torch.randn(m, shape[1]).bfloat16()
        calls = {v: (lambda w, v=v: few_rows_linear(x, w, variant=v)) for v in bf16_variants()}
        calls["F.linear"] = lambda w: F.linear(x, w)
        row = {"weight": list(shape), "weights_cycled": count, "rows": m}
        for name, call in calls.items():
            repeats = max(1, 240 // count)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(repeats):
                    for w in weights:
                        call(w)
                best = min(best, (time.perf_counter() - start) / (repeats * count) * 1e6)
            row[name] = round(best, 1)
        rows.append(row)
        print(row, flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump({"command": "python scripts/bench-few-rows.py " + sys.argv[1], "machine": machine_info("bfloat16", 1, "cpu"),
                   "rows": rows}, f, indent=1)
