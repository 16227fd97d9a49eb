"""Text-to-speech with codec-token LMs: ``mmspec.pipeline("text-to-speech", method=...)``.

- :mod:`.pipeline`: :class:`TextToSpeechPipeline`, its output, stats and stream chunks
  (:class:`TextToSpeechChunk`), and :data:`PAUSE_SECONDS`;
- :mod:`.components`: :class:`TTSComponents` (code-stream target, codec, text front end, draft
  codec LM, Medusa / EAGLE heads, NAR stage) and their loaders;
- :mod:`.methods`: the methods, one class each, registered by name in :data:`METHODS`.
"""

from .components import DEFAULT_VOICE, EMBEDDED_VOICES, MANIFEST, TTSComponents, load_nar_stage, load_tts_codec
from .methods import METHODS, TTSMethod, make_method, register_method
from .pipeline import PAUSE_SECONDS, TextToSpeechChunk, TextToSpeechOutput, TextToSpeechPipeline, TextToSpeechStats

__all__ = ["DEFAULT_VOICE", "EMBEDDED_VOICES", "MANIFEST", "METHODS", "PAUSE_SECONDS", "TTSComponents", "TTSMethod",
           "TextToSpeechChunk", "TextToSpeechOutput",
           "TextToSpeechPipeline", "TextToSpeechStats", "load_nar_stage", "load_tts_codec", "make_method",
           "register_method"]
