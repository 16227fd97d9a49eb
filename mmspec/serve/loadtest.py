"""``python -m mmspec.serve.loadtest``: concurrent greedy caption requests against a live server
on loopback, with batching (``--max-batch-size`` > 1) and without (1), alternated over rounds.

Starts its own server per setting (in this process, on a free loopback port), sends one request
per sample image alone (the reference answers, and the warm-up), then ``--requests`` requests at
once over the sample images, and prints one JSON line per round: wall time, requests per second,
p50 / p99 latency, the server batch sizes seen, and whether every answer equals the same request
alone. Numbers are only comparable within one run on one machine.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config import ServeConfig

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
IMAGES = ("photo.png", "scenes.png", "counting.png", "charts.png", "text.png")


def caption_body(uri: str, max_tokens: int) -> dict:
    return {"model": "mmspec-caption", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                      {"type": "text", "text": "Describe the image."}]}]}


def one_round(max_batch_size: int, requests: int, max_tokens: int, dtype: str, batch_wait_s: float = 0.01,
              drafter: str = "auto") -> dict:
    """One server with ``max_batch_size``; ``requests`` concurrent requests; the figures."""
    import httpx

    from .app import create_app
    from .background import serve_in_thread

    uris = {name: "data:image/png;base64," + base64.b64encode((SAMPLES / name).read_bytes()).decode() for name in IMAGES}
    app = create_app(ServeConfig(tasks=("caption",), dtype=dtype, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s,
                                 caption_drafter=drafter))
    with serve_in_thread(app) as base:
        url = f"{base}/v1/chat/completions"
        alone = {name: httpx.post(url, json=caption_body(uris[name], max_tokens), timeout=600).json()
                 ["choices"][0]["message"]["content"] for name in IMAGES}

        def ask(i: int) -> tuple[str, str, float, int]:
            name = IMAGES[i % len(IMAGES)]
            start = time.perf_counter()
            answer = httpx.post(url, json=caption_body(uris[name], max_tokens), timeout=600).json()
            return name, answer["choices"][0]["message"]["content"], time.perf_counter() - start, answer["mmspec"]["batch_size"]

        start = time.perf_counter()
        with ThreadPoolExecutor(requests) as pool:
            results = list(pool.map(ask, range(requests)))
        wall = time.perf_counter() - start
    latencies = sorted(r[2] for r in results)
    return {"max_batch_size": max_batch_size, "batch_wait_ms": batch_wait_s * 1000, "drafter": drafter, "requests": requests, "wall_s": round(wall, 2),
            "requests_per_s": round(requests / wall, 3), "p50_s": round(statistics.median(latencies), 2),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
            "batch_sizes": sorted({r[3] for r in results}), "identical_to_alone": all(r[1] == alone[r[0]] for r in results)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mmspec.serve.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch-sizes", default="1,8", help="max batch sizes to alternate (1: no batching)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-wait-ms", type=float, default=10.0)
    parser.add_argument("--drafter", default="auto", help="the captioner's drafter")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    for round_index in range(args.rounds):
        for size in (int(s) for s in args.batch_sizes.split(",")):
            print(json.dumps({"round": round_index, **one_round(size, args.requests, args.max_tokens, args.dtype,
                                                                  args.batch_wait_ms / 1000, args.drafter)}), flush=True)


if __name__ == "__main__":
    main()
