"""`python scripts/ab-few-rows.py A.so B.so`: two builds of the C kernel library side by side (e.g. the
committed linear_bf16.c and a change of it, each built once by mmspec.modeling.fast_linear.build
into ~/.cache/mmspec/kernels), their bf16 few-row linear alternated in one process, one thread:
microseconds per call (best of 6 alternations) for 1-8 rows, weights cycled from memory or reused
from cache. Prints one line per weight shape, "M<rows> A/B"; checks the two give the same bits."""
import ctypes
import sys
import time

import torch

torch.manual_seed(0)
libs = [ctypes.CDLL(path).few_rows_linear_bf16 for path in sys.argv[1:3]]


def call(function, x, w, y):
    function(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()), None, ctypes.c_void_p(y.data_ptr()),
             ctypes.c_int64(x.shape[0]), ctypes.c_int64(w.shape[0]), ctypes.c_int64(w.shape[1]), ctypes.c_int(1))


for (n, k), count in (((1536, 576), 48), ((1536, 576), 1), ((768, 256), 6), ((576, 576), 30)):
    weights = [torch.randn(n, k).bfloat16() for _ in range(count)]
    line = f"{n}x{k}, {count} weight(s) cycled:"
    for m in range(1, 9):
        x = torch.randn(m, k).bfloat16()
        outs = [torch.empty(m, n, dtype=torch.bfloat16) for _ in libs]
        for function, y in zip(libs, outs):
            call(function, x, weights[0], y)
        if not torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)):
            sys.exit(f"the two builds differ at {m} rows of {n}x{k}")
        best = [float("inf")] * len(libs)
        repeats = max(1, 240 // count)
        for _ in range(6):
            for i, function in enumerate(libs):
                start = time.perf_counter()
                for _ in range(repeats):
                    for w in weights:
                        call(function, x, w, outs[i])
                best[i] = min(best[i], (time.perf_counter() - start) / (repeats * count) * 1e6)
        line += f"  M{m} {best[0]:.1f}/{best[1]:.1f}"
    print(line, flush=True)
