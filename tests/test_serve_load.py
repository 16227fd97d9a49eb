"""Load and faults against a live ``mmspec serve`` on loopback (small, bounded versions of
``python -m mmspec.serve.loadtest``; docs/serving.md): concurrent clients mixing the three tasks
with none lost and none garbled; streaming clients killed (SIGKILL) while decoding and mid-stream;
the server killed with a request in flight and restarted on the same port; every bad request of the
fault list answered 4xx in OpenAI's error shape, with the server up after all of them.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import time
import zlib

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from mmspec.serve import ServeConfig, create_app  # noqa: E402
from mmspec.serve.background import serve_in_thread  # noqa: E402
from mmspec.serve.inputs import MAX_IMAGE_PIXELS  # noqa: E402
from mmspec.serve.loadtest import (  # noqa: E402
    PATHS, TEXTS, Job, caption_body, kill_and_restart_server, kill_streaming_client, mixed_jobs, percentile, references,
    run_load, send, speech_body)

KEY = "load-key"
MAX_BODY = 1_000_000


@pytest.fixture(scope="module")
def live():
    """All three tasks, fp32 (greedy batch rows bit-equal to single requests), batches of up to 4.
    A batch's first request waits 0.3 s for company: on a loaded 2-core CI machine six client
    threads' requests arrived more than 50 ms apart, and no two of a task met (CI, stop 70)."""
    config = ServeConfig(dtype="float32", max_batch_size=4, batch_wait_s=0.3, api_key=KEY, max_body_bytes=MAX_BODY,
                         max_speech_seconds=1.0)
    with serve_in_thread(create_app(config)) as base:
        yield base


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 0.2), percentile([7.0], 0.99)) == (3.0, 5.0, 1.0, 7.0)


def test_mixed_tasks_under_load_none_lost_none_garbled(live):
    """6 clients at once, 2 requests of each task: every one answered 200 with its answer alone."""
    jobs = mixed_jobs(6, ("caption", "t2i", "tts"), max_tokens=4, max_seconds=0.5)
    assert [job.task for job in jobs[:3]] == ["caption", "t2i", "tts"] and len({job.body_json for job in jobs}) == 6
    reference = references(live, jobs, KEY)
    result = run_load(live, jobs, clients=6, reference=reference, key=KEY)
    assert (result["lost"], result["garbled"]) == (0, 0), result
    assert result["requests"] == 6 and 0 < result["p50_s"] <= result["p99_s"] <= result["wall_s"]
    assert max(max(task["batch_sizes"]) for task in result["tasks"].values()) >= 2, result  # batched for real


@pytest.mark.parametrize("at", ["headers", "chunk"])
def test_streaming_client_killed_server_keeps_serving(live, at):
    """A streaming client SIGKILLed while its request decodes ("headers") or after its first chunk:
    the server stays up and answers the same request whole, unchanged."""
    body = caption_body("scenes.png", 4)
    job = Job("caption", PATHS["caption"], json.dumps(body))
    alone = send(live, job, KEY)
    assert alone.error is None and alone.answer
    kill_streaming_client(live, {**body, "stream": True}, at, KEY)
    again = send(live, job, KEY)
    assert again.error is None and again.answer == alone.answer
    assert httpx.get(live + "/health").json()["status"] == "ok"


def test_server_killed_and_restarted_on_the_same_port():
    """``mmspec serve`` in a subprocess, SIGKILLed with a request in flight: the client gets an
    error, not a hang; restarted on the same port it answers the request as before."""
    job = Job("tts", PATHS["tts"], json.dumps(speech_body(TEXTS[1], 0.5)))
    result = kill_and_restart_server(["--tasks", "tts", "--dtype", "float32", "--threads", "1"], job, timeout=120)
    assert result["same_answer_after_restart"] is True, result
    assert result["in_flight"].endswith("no answer"), result  # half a second of speech takes longer than 20 ms


# -- the fault list ------------------------------------------------------------------------------------

def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` (a valid signature and IHDR; one empty IDAT)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def chat_with(url: str | None = None, **fields) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}] if url else []
    return {"model": "mmspec-caption", "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "Hi"}]}],
            **fields}


def tiny_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    return buffer.getvalue()


GOOD_URI = "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
HUGE_URI = "data:image/png;base64," + base64.b64encode(png_header(MAX_IMAGE_PIXELS // 1000 + 1, 1000)).decode()
CHAT, IMAGES, SPEECH = PATHS["caption"], PATHS["t2i"], PATHS["tts"]

#: (path, body: JSON-able or bytes, status, code or None)
FAULTS = [
    # malformed JSON and not-an-object
    (CHAT, b'{"model": "mmspec-caption", "messages": [', 400, "invalid_json"),
    (IMAGES, b"", 400, "invalid_json"),
    (SPEECH, b"\xff\xfe not utf-8", 400, "invalid_json"),
    (CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),  # nesting deeper than the parser goes
    (IMAGES, b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400, "invalid_json"),  # past Python's 4300 digits
    (IMAGES, b'"a red circle"', 400, "invalid_json"),
    # wrong-typed fields, each endpoint
    (CHAT, chat_with(GOOD_URI, stream="yes"), 400, "invalid_type"),
    (CHAT, chat_with(GOOD_URI, seed=1.5), 400, "invalid_type"),
    (CHAT, chat_with(GOOD_URI, temperature=float("nan")), 400, "invalid_value"),
    (CHAT, chat_with(GOOD_URI, mmspec={"compare_baseline": "yes"}), 400, "invalid_type"),
    (CHAT, {"model": "mmspec-caption", "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type"),
    (CHAT, {"model": "mmspec-caption", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
     400, "invalid_type"),
    (CHAT, {"model": 7, "messages": []}, 400, "invalid_type"),
    (IMAGES, {"prompt": ["a", "b"]}, 400, "invalid_type"),
    (IMAGES, {"prompt": "a", "n": "2"}, 400, "invalid_type"),
    (SPEECH, {"model": "mmspec-tts", "input": 5, "voice": "alloy"}, 400, "invalid_type"),
    (SPEECH, {"model": "mmspec-tts", "input": "Hi.", "voice": ["alloy"]}, 400, "invalid_type"),
    (SPEECH, {"model": "mmspec-tts", "input": "Hi.", "voice": "alloy", "stream": 1}, 400, "invalid_type"),
    # images that are not images
    (CHAT, chat_with("data:text/plain;base64," + base64.b64encode(b"hello").decode()), 400, "invalid_image"),
    (CHAT, chat_with("data:image/png;base64," + base64.b64encode(b"GIF89a not really").decode()), 400, "invalid_image"),
    (CHAT, chat_with("data:image/png;base64," + base64.b64encode(png_header(4, 4)[:30]).decode()), 400, "invalid_image"),
    (CHAT, chat_with("data:image/png," + "x" * 10), 400, "invalid_image"),
    # oversized: image, prompt, speech input, tokens, body
    (CHAT, chat_with(HUGE_URI), 400, "image_too_large"),
    (IMAGES, {"prompt": "x" * 4001}, 400, "too_long"),
    (SPEECH, {"model": "mmspec-tts", "input": "x" * 4001, "voice": "alloy"}, 400, "too_long"),
    (CHAT, chat_with(GOOD_URI, max_tokens=513), 400, "invalid_value"),
    (IMAGES, {"prompt": "a", "n": 5}, 400, "invalid_value"),
    (SPEECH, {"model": "mmspec-tts", "input": "x" * (MAX_BODY + 10), "voice": "alloy"}, 413, "body_too_large"),
]


def test_every_fault_is_a_4xx_in_openai_shape_and_the_server_stays_up(live):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    seen = []
    for path, body, status, code in FAULTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN goes out as NaN, as some clients send it
        response = httpx.post(live + path, content=content, headers=headers, timeout=60)
        seen.append((path, content[:60], response.status_code))
        assert response.status_code == status, (path, content[:80], response.text[:300])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and "\n" not in error["message"]
        assert code is None or error["code"] == code, (path, content[:80], error)
    assert len(seen) == len(FAULTS)
    # bad API keys: wrong, missing, another scheme, empty
    for auth in ("Bearer wrong", None, f"Basic {KEY}", "Bearer", f"Bearer {KEY}x"):
        response = httpx.post(live + IMAGES, json={"prompt": "a"}, headers={"Authorization": auth} if auth else {})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    # no such route, wrong method: 404 / 405, same shape
    for response, status in ((httpx.get(live + "/v1/nothing"), 404), (httpx.get(live + CHAT), 405)):
        assert response.status_code == status and response.json()["error"]["message"]


def test_raw_socket_faults_and_the_server_stays_up(live):
    """What no well-behaved client sends: a chunked body past the limit (no Content-Length), a
    Content-Length that lies, bytes that are not HTTP. Then a real request is answered."""
    port = int(live.rsplit(":", 1)[1])

    def exchange(raw: bytes, read: bool = True) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(raw)
            if not read:
                return b""
            conn.shutdown(socket.SHUT_WR)
            received = b""
            while chunk := conn.recv(65536):
                received += chunk
            return received

    head = f"POST {SPEECH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    piece = b"x" * 200_000
    chunked = b"".join(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" for _ in range(6)) + b"0\r\n\r\n"
    answer = exchange(head.encode() + b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert answer.startswith(b"HTTP/1.1 413") and b'"body_too_large"' in answer, answer[:300]
    exchange(head.encode() + b"Content-Length: 1000\r\n\r\n" + b'{"model": "mmspec-tts"', read=False)  # then hangs up
    assert exchange(b"\x16\x03\x01 this is not http\r\n\r\n").startswith(b"HTTP/1.1 400")
    time.sleep(0.2)
    good = send(live, Job("tts", SPEECH, json.dumps(speech_body(TEXTS[0], 0.5))), KEY)
    assert good.error is None and len(good.answer) > 0
    assert httpx.get(live + "/health").json()["status"] == "ok"
