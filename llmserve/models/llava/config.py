"""What the front end needs to know of a LLaVA checkpoint's images, read from its config alone
(no torch): which token id stands for an image and how many of them each image becomes."""

from __future__ import annotations

from dataclasses import dataclass

MULTIMODAL_MODEL_TYPES = frozenset({"llava"})


@dataclass(frozen=True)
class ImageTokenSpec:
    token_id: int          # the `<image>` placeholder (config.image_token_index)
    tokens_per_image: int  # placeholders one image is expanded to: one per feature the projector emits


def image_token_spec(raw_config: dict) -> ImageTokenSpec | None:
    """The checkpoint's image placeholder and count; None for a text-only model.

    The count is the vision tower's sequence length, (image_size // patch_size) ** 2 patches plus
    the CLS token, less the CLS token under the "default" feature-select strategy (which drops
    it); it does not depend on the image's own size (the processor resizes every image)."""
    if raw_config.get("model_type") not in MULTIMODAL_MODEL_TYPES:
        return None
    from transformers import AutoConfig

    # transformers' config class fills the defaults a saved config.json leaves out
    cfg = AutoConfig.for_model(**raw_config)
    vision = cfg.vision_config
    num = (vision.image_size // vision.patch_size) ** 2 + 1
    if cfg.vision_feature_select_strategy == "default":
        num -= 1
    return ImageTokenSpec(token_id=cfg.image_token_index, tokens_per_image=num)
