"""Image input on the front end's side (the HTTP process, the offline ``LLM``): decoding an image
with Pillow, preprocessing it with the model's own HF image processor into the pixel values the
vision tower takes, and expanding each ``<image>`` placeholder of a tokenized prompt to the
number of tokens its features fill. NumPy arrays only (``return_tensors="np"``): the pixel values
travel pickled to the engine core and the workers, and no torch is needed on this side."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmserve.common.errors import ModelLoadError
from llmserve.sampling_params import InvalidRequest

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

# The placeholder a prompt marks each image with (LLaVA's tokenizers, HF processors, TGI, vLLM).
IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 1                    # per request
    max_bytes: int = 20 * 2**20            # an encoded image
    max_pixels: int = 4096 * 4096          # width x height once decoded (a decompression bomb stops here)


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """An encoded image (jpg / png / webp / anything Pillow reads) as RGB; ``InvalidRequest`` if it
    is too large or not an image."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise InvalidRequest("image", f"an image may have at most {limits.max_bytes} bytes; got {len(data)}")
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_pixels:
            raise InvalidRequest("image", f"an image may have at most {limits.max_pixels} pixels; "
                                          f"got {image.width}x{image.height}")
        image.load()   # decodes now: a truncated or corrupt file fails here, not in the processor
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest("image", f"the image could not be decoded: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


class ImageProcessor:
    """The model directory's own HF image processor (``preprocessor_config.json``)."""

    def __init__(self, model_path: str):
        from transformers import AutoImageProcessor

        try:
            self._processor: Any = AutoImageProcessor.from_pretrained(model_path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the image processor of {model_path}: {str(e).splitlines()[0]}") from e

    def __call__(self, images: list[Image.Image]) -> list[np.ndarray]:
        """Each image's pixel values, [3, H, W] float32."""
        if not images:
            return []
        return list(self._processor(images=images, return_tensors="np")["pixel_values"])


def expand_image_tokens(prompt_token_ids: list[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """The prompt with each placeholder token repeated to its image's number of features (as HF's
    LLaVA processor does to the text): the prompt the model runs, whose length every limit is
    checked against."""
    out: list[int] = []
    for t in prompt_token_ids:
        if t == image_token_id:
            out.extend([t] * tokens_per_image)
        else:
            out.append(t)
    return out
