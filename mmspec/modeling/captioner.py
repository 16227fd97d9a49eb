"""The embedded default captioner: SmolVLM architecture around the real SmolLM2-135M-Instruct.

Architecture (transformers' ``SmolVLMForConditionalGeneration``, the class of the real SmolVLM):
  vision encoder (SigLIP-style ViT, trained here from scratch) on 128x128 images, 16x16 patches
  -> 64 patch features -> pixel-shuffle connector (scale 2) -> 16 image tokens of width 576
  -> the frozen, real SmolLM2-135M-Instruct decoder and LM head.
Only the vision encoder and the connector are trained and shipped (``models/smolcap``); the model
is assembled at load time from them and the installed SmolLM2 weights. The processor is the real
``SmolVLMProcessor`` (no image splitting), so a user's SmolVLM checkpoint takes the same path.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..hub import models_dir, no_models_note

IMAGE_SIZE = 128
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 16 tokens per image
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")
VISION = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=6,
              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
WEIGHTS_FILE = "vision_connector.safetensors"

#: SmolLM2's ChatML without its default system prompt; image parts become "<image>", which the
#: processor expands into the 18-token image block.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def default_captioner_dir() -> Path:
    return models_dir() / "smolcap"


def build_processor():
    """SmolVLMProcessor over SmolLM2's tokenizer plus the three image tokens."""
    from transformers import AutoTokenizer, SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    from ..hub import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    image_processor = SmolVLMImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    return SmolVLMProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def build_captioner(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", weights: str | Path | None = None):
    """Assemble (model, processor): SmolLM2's weights + the vision encoder/connector.

    Args:
        weights: safetensors file with ``model.vision_model.*`` and ``model.connector.*`` tensors;
            None leaves them randomly initialised (the start of training).
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, SmolVLMConfig, SmolVLMForConditionalGeneration

    from ..hub import smollm2_checkpoint

    processor = build_processor()
    tokenizer = processor.tokenizer
    text_config = AutoConfig.from_pretrained(smollm2_checkpoint())
    text_config.vocab_size = len(tokenizer)
    config = SmolVLMConfig(
        text_config=text_config.to_dict(),
        vision_config=VISION,
        scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Build on the meta device (no time spent initialising the 135M decoder weights that are
    # loaded next), then materialise and initialise only the parts SmolLM2 does not provide.
    with torch.device("meta"):
        model = SmolVLMForConditionalGeneration(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # the untrained vision encoder starts from the same weights every time
    for part in (model.model.vision_model, model.model.connector):
        part.apply(model._init_weights)
    text_model = model.model.text_model
    text_model.rotary_emb = type(text_model.rotary_emb)(text_model.config)  # rebuild its meta buffers

    text_state = load_file(str(smollm2_checkpoint() / "model.safetensors"))
    embed = text_state.pop("model.embed_tokens.weight")
    text_state.pop("lm_head.weight", None)  # tied to the embeddings
    # New rows (the image tokens) start at the mean embedding; <image> rows are replaced by image
    # features anyway, the other two only mark the image block.
    extra = embed.mean(0, keepdim=True).expand(len(tokenizer) - embed.shape[0], -1)
    text_state = {k.removeprefix("model."): v for k, v in text_state.items()}
    text_state["embed_tokens.weight"] = torch.cat([embed, extra])
    text_model.load_state_dict(text_state, strict=True)
    model.tie_weights()
    if weights is not None:
        from safetensors import safe_open

        from .lora import SCALE_KEY, merge_lora_state

        trained = load_file(str(weights))
        adapters = {k: trained.pop(k) for k in [k for k in trained if ".lora_" in k]}
        unexpected = [k for k in trained if not k.startswith(TRAINED_PREFIXES)]
        if unexpected:
            raise ValueError(f"{weights}: unexpected tensors {unexpected[:3]}")
        missing = model.load_state_dict(trained, strict=False).missing_keys
        untrained = [k for k in missing if k.startswith(TRAINED_PREFIXES)]
        if untrained:
            raise ValueError(f"{weights}: missing tensors {untrained[:3]}")
        if adapters:  # merged into the fp32 decoder weights before the cast to ``dtype``
            with safe_open(str(weights), "pt") as handle:
                scale = float((handle.metadata() or {})[SCALE_KEY])
            merge_lora_state(model, adapters, scale)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.to(device=device, dtype=dtype).eval(), processor


TRAINED_PREFIXES = ("model.vision_model.", "model.connector.")


def trained_state(model) -> dict[str, torch.Tensor]:
    """The tensors the captioner ships: vision encoder, connector and the decoder's LoRA adapters
    (if it has any, :mod:`mmspec.modeling.lora`)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k.startswith(TRAINED_PREFIXES) or ".lora_" in k}


def save_trained(model, path: str | Path) -> None:
    """Write :func:`trained_state` as safetensors (the LoRA scale in the metadata)."""
    from .lora import SCALE_KEY, lora_scale
    from .persistence import save_tensors

    scale = lora_scale(model)
    save_tensors(trained_state(model), path, metadata=None if scale is None else {SCALE_KEY: repr(scale)})


def is_captioner_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder of the embedded captioner's kind: its trained tensors
    (``vision_connector.safetensors``, what ``mmspec train captioner --out DIR`` writes) and no
    transformers ``config.json`` (the decoder is SmolLM2's own)."""
    folder = Path(path).expanduser()
    return (folder / WEIGHTS_FILE).is_file() and not (folder / "config.json").is_file()


def load_default_captioner(device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                           directory: str | os.PathLike | None = None):
    """The embedded captioner from ``models/smolcap`` (or another folder of its kind,
    :func:`is_captioner_dir`: a captioner trained with ``mmspec train captioner``) -> (model, processor)."""
    weights = Path(directory or default_captioner_dir()).expanduser() / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(no_models_note() or (
            f"the embedded captioner's weights are missing ({weights}); train them with "
            "`mmspec train captioner` or pass model=<a SmolVLM/LLaVA checkpoint path>"))
    return build_captioner(dtype=dtype, device=device, weights=weights)
