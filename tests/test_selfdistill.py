"""Instructions for the text self-distillation data."""

import pytest

from mmspec.bench.text import PROMPTS
from mmspec.train.selfdistill import text_prompts


def test_task_prompts_are_seeded_varied_and_disjoint_from_the_benchmark():
    prompts = text_prompts(400, prompt_set="tasks")
    assert prompts == text_prompts(400, prompt_set="tasks")
    assert len(set(prompts)) > 360
    assert any(p.startswith("Context:") for p in prompts) and any(p.startswith("Rewrite") for p in prompts)
    bench = {p for group in PROMPTS.values() for p in group}
    assert not bench & set(prompts + text_prompts(400))
    with pytest.raises(ValueError, match="unknown prompt set"):
        text_prompts(1, prompt_set="poems")
