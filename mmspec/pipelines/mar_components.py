"""Deprecated alias of :mod:`mmspec.pipelines.text_to_image.mar_components`: the module moved there. Importing this name
gives that very module (its private names and monkeypatching included), with a DeprecationWarning."""

import sys
import warnings

from .text_to_image import mar_components as _moved

warnings.warn("mmspec.pipelines.mar_components moved to mmspec.pipelines.text_to_image.mar_components; import from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
