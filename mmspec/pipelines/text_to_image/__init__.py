"""Text-to-image: ``mmspec.pipeline("text-to-image", method=...)``.

- :mod:`.pipeline`: :class:`TextToImagePipeline`, its output and stats;
- :mod:`.components`: :class:`T2IComponents` (discrete image tokens) and the loaders of mmspec's
  layout and transformers' Janus / Emu3 / Chameleon; :mod:`.mar_components`: :class:`MARComponents`
  (continuous tokens); :mod:`.prompts`: what both share;
- :mod:`.methods`: the methods, one class each, registered by name in :data:`METHODS`.
"""

from .components import MAR_FILE, MODEL_FILE, T2IComponents, default_t2i_dir
from .mar_components import MARComponents, check_continuous_sampling, default_mar_dir
from .methods import METHODS, PROPOSERS, SETTINGS, RelaxedMethod, Setting, T2IMethod, check_settings, make_method, register_method
from .pipeline import TextToImageOutput, TextToImagePipeline, TextToImageStats, check_call_arguments
from .prompts import check_prompt, shared_text_encoder

__all__ = ["MAR_FILE", "METHODS", "MODEL_FILE", "PROPOSERS", "SETTINGS", "MARComponents", "RelaxedMethod", "Setting",
           "T2IComponents", "T2IMethod", "TextToImageOutput", "TextToImagePipeline", "TextToImageStats",
           "check_call_arguments", "check_continuous_sampling", "check_prompt", "check_settings", "default_mar_dir",
           "default_t2i_dir", "make_method", "register_method", "shared_text_encoder"]
