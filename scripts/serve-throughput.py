"""16 concurrent greedy caption requests against an in-process ``mmspec serve`` app, without and
with batching, alternated: wall time and the process's CPU time of the concurrent phase only.

Usage (from a checkout; it uses ``samples/``)::

    taskset -c 0,1 python scripts/serve-throughput.py --batch-sizes 1,16,8 --rounds 3

Each setting gets a fresh server (pipeline loaded, then the five sample images asked alone: the
reference answers and the warm-up); then ``--requests`` requests at once over the five images. One
JSON line per round and setting: wall and CPU seconds, requests per second and per CPU-second, and
whether every answer equals the same request alone. CPU time (``time.process_time``: the server's
work, the client threads' small share included) is less sensitive than wall time to other jobs
sharing the machine. The requests are those of ``python -m mmspec.serve.loadtest``.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from mmspec.serve import ServeConfig, create_app
from mmspec.serve.background import serve_in_thread
from mmspec.serve.loadtest import IMAGES, caption_body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for round_index in range(args.rounds):
        for size in (int(s) for s in args.batch_sizes.split(",")):
            config = ServeConfig(tasks=("caption",), dtype="float32", max_batch_size=size, batch_wait_s=0.01)
            with serve_in_thread(create_app(config)) as base:
                url = base + "/v1/chat/completions"
                ask_one = lambda name: httpx.post(url, json=caption_body(name, args.max_tokens),  # noqa: E731
                                                  timeout=600).json()["choices"][0]["message"]["content"]
                alone = {name: ask_one(name) for name in IMAGES}
                cpu, wall = time.process_time(), time.perf_counter()
                with ThreadPoolExecutor(args.requests) as pool:
                    same = list(pool.map(lambda i: ask_one(IMAGES[i % len(IMAGES)]) == alone[IMAGES[i % len(IMAGES)]],
                                         range(args.requests)))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(json.dumps({"round": round_index, "max_batch_size": size, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                              "requests_per_s": round(args.requests / wall, 3),
                              "requests_per_cpu_s": round(args.requests / cpu, 3), "identical_to_alone": all(same)}), flush=True)


if __name__ == "__main__":
    main()
