"""`python scripts/bench-attention.py`: the batch-invariant attention kernel's time (microseconds,
one thread, best of 5 x 200 calls) for each build this machine runs (AVX2, AVX-512), over n query
rows and L cached keys: batch 2 (guidance's two rows), 4 heads of 64 (the embedded text-to-image
generator's and the voice's layers), float32, a chain after the cache (no mask)."""
import time

import torch

from mmspec.modeling.attention import few_rows_attention
from mmspec.modeling.fast_linear import cpu_flags

torch.manual_seed(0)
torch.set_num_threads(1)
builds = ["avx2"] + (["avx512"] if "avx512f" in cpu_flags() else [])
batch, heads, dim = 2, 4, 64
for n in (1, 3, 5, 9):
    for length in (100, 300):
        q, k, v = torch.randn(batch, heads, n, dim), torch.randn(batch, heads, length, dim), torch.randn(batch, heads, length, dim)
        row = {"queries": n, "keys": length}
        for build in builds:
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(200):
                    few_rows_attention(q, k, v, None, dim**-0.5, variant=build)
                best = min(best, (time.perf_counter() - start) / 200)
            row[build] = round(best * 1e6, 1)
        print(row, flush=True)
