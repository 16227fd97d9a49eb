"""transformers' discrete-token text-to-image models behind the image-target interface.

Three families (transformers >= 5), one module each, each a
:class:`~mmspec.adapters.image_gen.GuidedImageTarget` whose logits are over the **image codebook
only** (index = VQ code id, ``vocab_size`` = codebook size), so the core and the SJD drafters sample
codes directly; the adapter maps codes to the model's input tokens. ``mmspec.generate(target, ...)``
then returns ``sequences`` = [conditional prompt ids (with the image-start token the adapter appends
for Janus and Chameleon), generated VQ codes]; the codes feed the family's
:class:`~mmspec.adapters.image_gen.ImageTokenizer` (:func:`image_tokenizer_for`). With
``hidden_layer`` the targets return the last layer's hidden states (the image head's input).

========== ============================================ ==========================================
family     conditional / unconditional prompt           image tokens
========== ============================================ ==========================================
Janus      ``input_ids`` (+ the image-start token, as    generation embeddings + aligner in,
           the processor's generation mode adds); the    ``generation_head`` out (Janus'
           uncond half replaces every token but BOS and  ``generate(generation_mode="image")``)
           image-start by PAD, as Janus' ``generate``
Emu3       ``input_ids`` ending with the image prefix    text-vocabulary visual tokens
           ``<|image start|>{h}*{w}<|image token|>``     (``vocabulary_mapping``); the
           (``Emu3Processor(...,                         end-of-line token after every row is
           return_for_image_generation=True)``); uncond  inserted by the adapter
           = ``negative_input_ids`` (a negative prompt
           in the same format, as Emu3's official
           example) or by default [BOS] + the image
           prefix (the empty prompt)
Chameleon  ``input_ids`` (+ ``<racm3:break>``, the       text-vocabulary ``IMGIMG*`` tokens
(Anole)    begin-image token, as Chameleon's             (``vocabulary_mapping``)
           ``ImageDecoder`` appends); uncond =
           [BOS, begin-image], as Chameleon's
           official in-batch CFG
========== ============================================ ==========================================

Modules: :mod:`~mmspec.adapters.image.common` (the shared target machinery, prompt padding),
:mod:`~mmspec.adapters.image.janus`, :mod:`~mmspec.adapters.image.emu3` (end-of-line tokens, no
tree verification), :mod:`~mmspec.adapters.image.chameleon` (the VQGAN decoder transformers
omits; text-only prompts). Families are registered by name in :data:`IMAGE_FAMILIES`.
"""

from __future__ import annotations

from ..image_gen import GuidedImageTarget
from . import chameleon, emu3, janus
from .common import ImageFamily

#: name -> family; :func:`image_target_for` and :func:`image_tokenizer_for` accept their models.
IMAGE_FAMILIES: dict[str, ImageFamily] = {"janus": janus.FAMILY, "emu3": emu3.FAMILY, "chameleon": chameleon.FAMILY}

#: the supported families, for messages.
SUPPORTED_FAMILIES = tuple(family.description for family in IMAGE_FAMILIES.values())


def image_family(model) -> ImageFamily:
    """The family of a transformers text-to-image model or of its VQ model.

    Raises:
        ValueError: for a model outside :data:`SUPPORTED_FAMILIES`.
    """
    for family in IMAGE_FAMILIES.values():
        if family.matches(model):
            return family
    raise ValueError(f"{type(model).__name__} is not a supported text-to-image model; supported: "
                     f"{', '.join(SUPPORTED_FAMILIES)}")


def image_target_for(model, **kwargs) -> GuidedImageTarget:
    """The image target of a transformers text-to-image model (keyword arguments go to the family's
    target: ``grid`` for Emu3, token-id overrides for Janus and Chameleon).

    Raises:
        ValueError: for a model outside :data:`SUPPORTED_FAMILIES`, or its bare VQ model.
    """
    family = image_family(model)
    if not hasattr(model, "lm_head"):  # a bare VQ model
        raise ValueError(f"{type(model).__name__} is a VQ model; build the target from the full generator "
                         f"({', '.join(SUPPORTED_FAMILIES)})")
    return family.target(model, **kwargs)


def image_tokenizer_for(model, **kwargs):
    """The :class:`~mmspec.adapters.image_gen.ImageTokenizer` of a transformers text-to-image model
    or of its VQ model (``grid`` for Emu3, ``decoder`` for Chameleon).

    Raises:
        ValueError: for a model outside :data:`SUPPORTED_FAMILIES`.
    """
    family = image_family(model)
    vq = model.model.vqmodel if hasattr(model, "lm_head") else model
    return family.tokenizer(vq, **kwargs)
