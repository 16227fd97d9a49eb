"""Deprecated alias of :mod:`mmspec.pipelines.text_to_speech.methods`: the module moved there. Importing this name
gives that very module (its private names and monkeypatching included), with a DeprecationWarning."""

import sys
import warnings

from .text_to_speech import methods as _moved

warnings.warn("mmspec.pipelines.tts_methods moved to mmspec.pipelines.text_to_speech.methods; import from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
