"""Every registry refuses a taken name in one line, and leaves the registered entry in place (the
registries not covered where their kind is tested: tree budgets, text front ends, fused layouts)."""

import pytest

from mmspec.adapters.audio.phonemes import PHONEMIZERS, register_phonemizer
from mmspec.drafters.tree_budget import BUDGETS, TreeBudget, register_budget
from mmspec.modeling.fused import LAYOUTS, register_layout
from mmspec.modeling.llamagen import TransformerBlock


def test_a_taken_tree_budget_name_is_refused():
    before = BUDGETS["timed"]
    with pytest.raises(ValueError, match="a tree budget named 'timed' is already registered"):
        @register_budget("timed")
        class Again(TreeBudget):
            pass
    with pytest.raises(ValueError, match="already registered"):
        @register_budget("auto")  # reserved: drafter="eagle2" with budget "auto" picks one
        class Auto(TreeBudget):
            pass
    assert BUDGETS["timed"] is before and "auto" not in BUDGETS


def test_a_taken_text_front_end_name_is_refused():
    before = PHONEMIZERS["characters"]
    with pytest.raises(ValueError, match="a text front end named 'characters' is already registered"):
        register_phonemizer("characters")(lambda: None)
    assert PHONEMIZERS["characters"] is before


def test_a_second_fused_layout_for_a_class_is_refused():
    before = LAYOUTS[TransformerBlock]
    with pytest.raises(ValueError, match="layout for TransformerBlock is already registered"):
        register_layout(TransformerBlock)(lambda layer: None)
    assert LAYOUTS[TransformerBlock] is before
