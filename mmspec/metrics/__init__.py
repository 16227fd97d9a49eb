"""Quality metrics measured with the project's own metric models (see :mod:`.image_quality`).

These are trained on the project's rendered scenes, not Inception / OpenAI CLIP: their numbers are
not comparable to published FID / CLIP-score, only to each other under the same metric model and
the same set sizes.
"""

from .image_quality import (
    MetricCLIP,
    frechet_clip_distance,
    frechet_distance,
    frechet_distance_from_statistics,
    load_metric_clip,
    prompt_score,
    prompt_scores,
)

__all__ = [
    "MetricCLIP",
    "frechet_clip_distance",
    "frechet_distance",
    "frechet_distance_from_statistics",
    "load_metric_clip",
    "prompt_score",
    "prompt_scores",
]
