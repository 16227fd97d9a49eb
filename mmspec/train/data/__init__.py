"""Seeded, reproducible caption / VQA data for training a small captioner.

Six families mirror six VLM benchmarks: ``scenes`` (SEED), ``counting`` (MMT), ``text``
(OCRBench), ``charts`` (ChartQA), ``math`` (MathVista) and ``photos`` (ScienceQA / MMT real
images).  Splits are disjoint by construction; see :mod:`mmspec.train.data.core`.
"""

from .api import FAMILIES, make_sample, iter_split, write_split
from .core import KINDS, SPLITS, Sample

__all__ = ["FAMILIES", "KINDS", "SPLITS", "Sample", "make_sample", "iter_split", "write_split"]
