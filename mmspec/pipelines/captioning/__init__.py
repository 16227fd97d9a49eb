"""Image captioning: ``mmspec.pipeline("image-captioning")``.

- :mod:`.pipeline`: :class:`ImageCaptioningPipeline` and its output :class:`CaptionOutput`;
- :mod:`.components`: loading the VLM, its processor and a draft model; prompt helpers;
- :mod:`.methods`: drafters named by a spec, checked before anything loads;
- :mod:`.auto_drafter`: ``drafter="auto"``'s table of benchmarked drafters.
"""

from .auto_drafter import (AUTO_FALLBACK, DRAFTERS_FILE, choose_auto_drafter, choose_batch_drafter,
                           choose_sampling_drafter, describe_auto_table, describe_machine, machine_kind, measured_elsewhere,
                           read_auto_table, read_drafters_file)
from .components import (WORD_JOINER, CaptioningComponents, check_cuda_graphs, escape_image_tokens, image_token_strings,
                         load_captioning_model, load_draft_model)
from .methods import (METHODS, CaptionMethod, caption_method_class, check_drafter_name, check_tree_drafter,
                      is_caption_spec, make_caption_method)
from .pipeline import DEFAULT_PROMPT, CaptionOutput, CaptionStream, Conversation, ImageCaptioningPipeline, TextPieces, check_prompt

__all__ = ["AUTO_FALLBACK", "DEFAULT_PROMPT", "DRAFTERS_FILE", "METHODS", "WORD_JOINER", "CaptionMethod", "CaptionOutput",
           "CaptionStream", "Conversation", "TextPieces",
           "CaptioningComponents",
           "ImageCaptioningPipeline", "caption_method_class", "is_caption_spec", "make_caption_method",
           "check_cuda_graphs", "check_drafter_name", "check_tree_drafter", "check_prompt", "choose_auto_drafter", "choose_batch_drafter",
           "choose_sampling_drafter", "describe_auto_table", "describe_machine", "escape_image_tokens",
           "image_token_strings", "load_captioning_model", "load_draft_model", "machine_kind", "measured_elsewhere", "read_auto_table",
           "read_drafters_file"]
