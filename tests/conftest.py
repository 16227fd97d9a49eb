import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # tiny_models

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct in float32 (converted from the installed GGUF once)."""
    from mmspec.hub import load_causal_lm

    return load_causal_lm("smollm2", dtype=torch.float32)
