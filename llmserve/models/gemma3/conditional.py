"""Gemma 3 4B / 12B / 27B checkpoints (``Gemma3ForConditionalGeneration``, ``model_type``
``gemma3``): their text decoder, served as ``gemma3_text``. Images are not supported: the vision
tower's and projector's tensors are skipped at load, and the model reports no image token, so a
request with an image is refused as for any text-only model."""

from __future__ import annotations

import torch

from llmserve.common.basemodel.basemodel import hf_config_from_dict
from llmserve.models.gemma3.model import Gemma3TpPartModel
from llmserve.models.llava.model import replace_prefix

# The checkpoint's names for the decoder -> the text model's: transformers 5 saves
# ``model.language_model.*`` and a bare ``lm_head`` (tied, so usually absent); checkpoints saved
# before 4.52 ``language_model.model.*`` and ``language_model.lm_head``.
_TEXT_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


class Gemma3ConditionalTpPartModel(Gemma3TpPartModel):
    """``Gemma3TpPartModel`` on the checkpoint's ``text_config``."""

    def _init_config(self) -> None:
        super()._init_config()
        text = self.network_config_.text_config
        # a sub-config object shared with the outer config: rebuilt on its own
        self.network_config_ = hf_config_from_dict({**text.to_dict(), "model_type": text.model_type})

    @property
    def model_type(self) -> str:
        return "gemma3"

    def _rename_hf_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        renamed = {}
        for name, tensor in weights.items():
            text_name = replace_prefix(name, _TEXT_RENAMES)
            if text_name != name or name.startswith("lm_head."):
                renamed[text_name] = tensor
        return renamed
