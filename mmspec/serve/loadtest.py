"""``python -m mmspec.serve.loadtest``: load and fault runs of ``mmspec serve`` on loopback.

**Load.** One server in this process on a free loopback port per max batch size
(``--batch-sizes 1,8``: 1 is no batching); each first answers every distinct request once alone
(the reference answers, and the warm-up that loads its pipelines); then, the servers taking turns
over ``--rounds``, ``--clients`` concurrent clients send ``--requests`` requests, mixing the tasks
of ``--tasks`` in turn (greedy captions of the sample images, seeded images and speech). One JSON
line per round and server, then a Markdown table: wall time, requests per
second, p50 / p99 latency (overall and per task), the server batch sizes seen, how many requests
were lost (no 200 answer) and how many garbled (an answer other than the same request's alone).

**Faults** (``--faults``): a streaming client killed (SIGKILL) while its request decodes and
another killed after its first chunk, the server answering the same request unchanged after each;
then ``mmspec serve`` as a subprocess, killed (SIGKILL) with a request in flight and restarted on
the same port, answering that request as before.

Numbers compare only within one run on one machine (docs/benchmarks.md, "Serving").
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from .config import TASKS, ServeConfig

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
IMAGES = ("photo.png", "scenes.png", "counting.png", "charts.png", "text.png")
PROMPTS = ("a red circle above a blue square", "a green triangle", "two yellow stars", "a blue square")
TEXTS = ("It is half past four.", "There are seven squares.", "The red circle is above.", "It is raining.")
#: short task -> the endpoint its requests go to
PATHS = {"caption": "/v1/chat/completions", "t2i": "/v1/images/generations", "tts": "/v1/audio/speech"}


# -- requests ----------------------------------------------------------------------------------------

def data_uri(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((SAMPLES / name).read_bytes()).decode()


def caption_body(image: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    """A greedy chat request: sample image ``image`` and a question."""
    return {"model": "mmspec-caption", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}},
                                                      {"type": "text", "text": "Describe the image."}]}]}


def image_body(prompt: str, seed: int = 0) -> dict[str, Any]:
    return {"model": "mmspec-t2i", "prompt": prompt, "n": 1, "seed": seed, "response_format": "b64_json"}


def speech_body(text: str, max_seconds: float, seed: int = 0) -> dict[str, Any]:
    return {"model": "mmspec-tts", "input": text, "voice": "alloy", "response_format": "pcm", "seed": seed,
            "max_seconds": max_seconds}


@dataclass(frozen=True)
class Job:
    """One request of a load run: its task, endpoint and JSON body."""

    task: str
    path: str
    body_json: str  # the body, serialised (hashable: the key of the reference answers)


def mixed_jobs(count: int, tasks: Sequence[str], max_tokens: int, max_seconds: float) -> list[Job]:
    """``count`` requests, the tasks in turn, each task cycling through its sample inputs."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown or list(tasks)}; mix some of: {', '.join(TASKS)}")
    jobs = []
    for i in range(count):
        task, turn = tasks[i % len(tasks)], i // len(tasks)
        body = (caption_body(IMAGES[turn % len(IMAGES)], max_tokens) if task == "caption" else
                image_body(PROMPTS[turn % len(PROMPTS)]) if task == "t2i" else
                speech_body(TEXTS[turn % len(TEXTS)], max_seconds))
        jobs.append(Job(task, PATHS[task], json.dumps(body)))
    return jobs


@dataclass
class Answer:
    """What one request got: the comparable answer (caption text, PNG base64, PCM bytes) or the error."""

    job: Job
    latency_s: float
    answer: Any = None
    batch_size: int = 0
    error: str | None = None


def send(base: str, job: Job, key: str | None = None, timeout: float = 600) -> Answer:
    """Send ``job``; never raises (a failure is the Answer's ``error``)."""
    import httpx

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    start = time.perf_counter()
    try:
        response = httpx.post(base + job.path, content=job.body_json, headers=headers, timeout=timeout)
    except httpx.HTTPError as error:
        return Answer(job, time.perf_counter() - start, error=f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - start
    if response.status_code != 200:
        return Answer(job, latency, error=f"{response.status_code}: {response.text[:200]}")
    if job.task == "tts":
        stats = json.loads(response.headers["x-mmspec-stats"])
        return Answer(job, latency, response.content, stats["batch_size"])
    data = response.json()
    answer = data["choices"][0]["message"]["content"] if job.task == "caption" else data["data"][0]["b64_json"]
    return Answer(job, latency, answer, data["mmspec"]["batch_size"])


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q`` of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def references(base: str, jobs: Sequence[Job], key: str | None = None) -> dict[str, Any]:
    """Every distinct request sent once, alone, in turn: body -> its answer. Raises RuntimeError on a failure."""
    answers = {}
    for job in jobs:
        if job.body_json not in answers:
            answer = send(base, job, key)
            if answer.error is not None:
                raise RuntimeError(f"the reference {job.task} request failed: {answer.error}")
            answers[job.body_json] = answer.answer
    return answers


def run_load(base: str, jobs: Sequence[Job], clients: int, reference: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    """``clients`` threads send ``jobs`` (each takes the next one when its last is answered).

    Returns:
        requests, lost (no 200 answer), garbled (an answer other than ``reference``), wall_s,
        requests_per_s, p50_s, p99_s (over all requests), per task: n, p50_s, p99_s and the batch
        sizes seen; ``errors``: up to three of the failures' messages.
    """
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda job: send(base, job, key), jobs))
    wall = time.perf_counter() - start
    lost = [a for a in answers if a.error is not None]
    garbled = [a for a in answers if a.error is None and a.answer != reference[a.job.body_json]]
    latencies = [a.latency_s for a in answers]
    per_task = {}
    for task in dict.fromkeys(job.task for job in jobs):
        mine = [a for a in answers if a.job.task == task]
        per_task[task] = {"n": len(mine), "p50_s": round(percentile([a.latency_s for a in mine], 0.5), 3),
                          "p99_s": round(percentile([a.latency_s for a in mine], 0.99), 3),
                          "batch_sizes": sorted({a.batch_size for a in mine if a.error is None})}
    return {"requests": len(jobs), "clients": clients, "lost": len(lost), "garbled": len(garbled), "wall_s": round(wall, 3),
            "requests_per_s": round(len(jobs) / wall, 3), "p50_s": round(percentile(latencies, 0.5), 3),
            "p99_s": round(percentile(latencies, 0.99), 3), "tasks": per_task,
            "errors": [a.error for a in lost[:3]]}


def load_rounds(batch_sizes: Sequence[int], tasks: Sequence[str], clients: int, requests: int, rounds: int,
                max_tokens: int = 16, max_seconds: float = 1.0, dtype: str = "float32",
                batch_wait_s: float = 0.01) -> Iterator[dict[str, Any]]:
    """One in-process server per max batch size, all started first; each sends every distinct
    request alone (its reference answers, and the warm-up that loads its pipelines); then ``rounds``
    rounds, the servers taking turns, each a :func:`run_load`. Yields one row per (round, size).

    The servers stay up for the whole run, so their pipelines load once; an idle one costs nothing.
    ``references_agree`` says whether the servers' lone answers were the same.
    """
    from contextlib import ExitStack

    from .app import create_app
    from .background import serve_in_thread

    jobs = mixed_jobs(requests, tasks, max_tokens, max_seconds)
    with ExitStack() as stack:
        bases, references_of = {}, {}
        for size in batch_sizes:
            config = ServeConfig(tasks=tuple(dict.fromkeys(tasks)), dtype=dtype, max_batch_size=size,
                                 batch_wait_s=batch_wait_s, max_queue=max(64, requests), max_speech_seconds=max(max_seconds, 1.0))
            bases[size] = stack.enter_context(serve_in_thread(create_app(config)))
            references_of[size] = references(bases[size], jobs)
        agree = all(answers == references_of[batch_sizes[0]] for answers in references_of.values())
        for round_index in range(rounds):
            for size in batch_sizes:
                yield {"round": round_index, "max_batch_size": size, "batch_wait_ms": batch_wait_s * 1000,
                       **run_load(bases[size], jobs, clients, references_of[size]), "references_agree": agree}


# -- faults ------------------------------------------------------------------------------------------

#: a streaming client in its own process: prints "headers" once the response has begun and "chunk"
#: after its first body chunk, then waits to be killed
STREAM_CLIENT = r"""
import json, sys, time
import httpx
url, key = sys.argv[1], sys.argv[2]
headers = {"Authorization": "Bearer " + key} if key else {}
with httpx.stream("POST", url, json=json.loads(sys.stdin.readline()), headers=headers, timeout=600) as response:
    print("headers", response.status_code, flush=True)
    for chunk in response.iter_raw():
        print("chunk", len(chunk), flush=True)
        break
    time.sleep(600)
"""


def kill_streaming_client(base: str, body: dict[str, Any], at: str, key: str | None = None, timeout: float = 300) -> float:
    """Start a streaming client process for ``body``; SIGKILL it once it has printed ``at``
    ("headers": while its request decodes; "chunk": mid-stream). Returns the seconds until the kill.
    Raises RuntimeError when the client ends or says something else first."""
    if at not in ("headers", "chunk"):
        raise ValueError(f"at must be 'headers' or 'chunk', got {at!r}")
    start = time.perf_counter()
    client = subprocess.Popen([sys.executable, "-c", STREAM_CLIENT, base + "/v1/chat/completions", key or ""],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, client.kill)
    timer.start()
    try:
        client.stdin.write(json.dumps(body) + "\n")
        client.stdin.flush()
        while True:
            line = client.stdout.readline()
            if not line:
                raise RuntimeError(f"the streaming client ended (exit {client.wait()}) before {at!r}")
            if line.startswith("headers") and not line.startswith("headers 200"):
                raise RuntimeError(f"the streaming request was refused: {line.strip()}")
            if line.startswith(at):
                break
        client.send_signal(signal.SIGKILL)
        client.wait()
        return time.perf_counter() - start
    finally:
        timer.cancel()
        if client.poll() is None:
            client.kill()
            client.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, args: Sequence[str], timeout: float = 300) -> subprocess.Popen:
    """``mmspec serve --port port ARGS`` as a subprocess, returned once ``/health`` answers.
    Raises RuntimeError when it exits or does not answer within ``timeout``."""
    import httpx

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "mmspec", "serve", "--port", str(port), "--log-level", "warning", *args],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mmspec serve exited with {server.returncode}: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.kill()
    server.wait()
    raise RuntimeError(f"mmspec serve did not answer on port {port} within {timeout:g} s")


def kill_and_restart_server(args: Sequence[str], job: Job, timeout: float = 300) -> dict[str, Any]:
    """``mmspec serve ARGS`` on a free port: ``job`` answered; ``job`` sent again and the server
    SIGKILLed while it runs; restarted on the same port; ``job`` answered again.

    Returns:
        port, the in-flight request's fate ("closed, no answer", "connection reset, no answer", or
        "answered before the kill: STATUS" when it was faster than the kill), the
        seconds each start took, and whether the answer after the restart equals the one before.
    Raises:
        RuntimeError: a start failed, or an answer other than the in-flight one failed.
    """
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    server = start_server(port, args, timeout)
    try:
        first_start_s = time.perf_counter() - start
        before = send(base, job)
        if before.error is not None:
            raise RuntimeError(f"the first request failed: {before.error}")
        # the same request again, over a raw socket so that the kill comes right after its last byte
        # went out (the server is reading or decoding it): the client must see the connection end
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            body = job.body_json.encode()
            conn.sendall(f"POST {job.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.02)
            server.send_signal(signal.SIGKILL)
            server.wait()
            try:
                received = conn.recv(65536)  # the kill ends the connection at once: never a hang (timeout 60 s)
                status = received.split(b"\r\n")[0].decode(errors="replace")
                in_flight = f"answered before the kill: {status}" if received else "closed, no answer"
            except ConnectionResetError:
                in_flight = "connection reset, no answer"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    start = time.perf_counter()
    server = start_server(port, args, timeout)
    try:
        restart_s = time.perf_counter() - start
        after = send(base, job)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if after.error is not None:
        raise RuntimeError(f"the request after the restart failed: {after.error}")
    return {"port": port, "in_flight": in_flight, "first_start_s": round(first_start_s, 2),
            "restart_s": round(restart_s, 2), "same_answer_after_restart": after.answer == before.answer}


def fault_run(max_tokens: int = 16, max_seconds: float = 1.0, dtype: str = "float32") -> dict[str, Any]:
    """The fault scenarios of the module docstring; one dict of what happened."""
    from .app import create_app
    from .background import serve_in_thread

    import httpx

    body = caption_body("photo.png", max_tokens, stream=True)
    job = Job("caption", PATHS["caption"], json.dumps({**body, "stream": False}))
    result: dict[str, Any] = {}
    with serve_in_thread(create_app(ServeConfig(tasks=("caption",), dtype=dtype))) as base:
        alone = send(base, job)
        for at in ("headers", "chunk"):
            killed_after = kill_streaming_client(base, body, at)
            again = send(base, job)
            result[f"client_killed_at_{at}"] = {"after_s": round(killed_after, 2), "next_answer_same": again.answer == alone.answer,
                                                "health": httpx.get(base + "/health").json()["status"]}
    speech = Job("tts", PATHS["tts"], json.dumps(speech_body(TEXTS[0], max_seconds)))
    result["server_killed"] = kill_and_restart_server(["--tasks", "tts", "--dtype", dtype, "--threads", "1"], speech)
    return result


# -- the command ---------------------------------------------------------------------------------------

def table(rows: Sequence[dict[str, Any]]) -> str:
    """The load rounds as a Markdown table (docs/benchmarks.md)."""
    tasks = list(rows[0]["tasks"]) if rows else []
    head = ["max batch", "round", "requests/s", "p50 (s)", "p99 (s)", *[f"{t} p50 / p99 (s)" for t in tasks],
            "batch sizes", "lost", "garbled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["max_batch_size"], row["round"], row["requests_per_s"], row["p50_s"], row["p99_s"],
                 *[f"{row['tasks'][t]['p50_s']} / {row['tasks'][t]['p99_s']}" for t in tasks],
                 "; ".join(f"{t} {','.join(map(str, row['tasks'][t]['batch_sizes']))}" for t in tasks),
                 row["lost"], row["garbled"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmspec.serve.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="caption,t2i,tts", help="the tasks mixed, in turn (default: all three)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--requests", type=int, default=48, help="requests per round (default: 48)")
    parser.add_argument("--batch-sizes", default="1,8", help="max batch sizes to alternate (1: no batching)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="caption tokens per request")
    parser.add_argument("--max-seconds", type=float, default=1.0, help="speech seconds per request")
    parser.add_argument("--dtype", default="float32", help="float32: greedy batch rows bit-equal to single requests")
    parser.add_argument("--batch-wait-ms", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--faults", action="store_true", help="also kill clients and the server (see above)")
    parser.add_argument("--no-load", action="store_true", help="skip the load rounds (with --faults: faults only)")
    args = parser.parse_args(argv)
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
        mixed_jobs(1, tasks, args.max_tokens, args.max_seconds)
        if min(sizes) < 1 or args.clients < 1 or args.requests < 1 or args.rounds < 1:
            raise ValueError("--batch-sizes, --clients, --requests and --rounds must be positive")
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    rows = []
    if not args.no_load:
        for row in load_rounds(sizes, tasks, args.clients, args.requests, args.rounds, args.max_tokens, args.max_seconds,
                               args.dtype, args.batch_wait_ms / 1000):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rows:
        print(table(rows), flush=True)
    if args.faults:
        print(json.dumps({"faults": fault_run(args.max_tokens, args.max_seconds, args.dtype)}), flush=True)
    return 1 if any(row["lost"] or row["garbled"] or not row["references_agree"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
