import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # tiny_models

import pytest
import torch

#: torch threads per test process: the cores shared out over pytest-xdist's workers (one each when
#: -n auto gives a worker per core), at most 2 (the tiny models gain nothing from more)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, torch.get_num_threads(), (os.cpu_count() or 1) // WORKERS))
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A CLI run in this process sets torch's thread count (``--threads``): the next test starts with
    what it started with, whatever the order of the tests."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def free_port():
    """A TCP port free on this machine now (for a test that starts a process group: two xdist workers
    must not pick the same fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct in float32 (converted from the installed GGUF once)."""
    from mmspec.hub import load_causal_lm

    return load_causal_lm("smollm2", dtype=torch.float32)
