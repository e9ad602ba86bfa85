"""LLaVA (``LlavaForConditionalGeneration``): a Llama-family decoder whose prompt carries images,
each as a run of placeholder tokens whose input embeddings are the image's CLIP features through
a GELU projector. The decoder is ``LlamaTpPartModel``'s, on the checkpoint's text config; the
image side (``LlavaVisionWeight``) is replicated on every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.activations import ACT2FN

from llmserve.common.basemodel.basemodel import hf_config_from_dict
from llmserve.models.llama.model import LlamaTpPartModel
from llmserve.models.llava.layer_infer.pre_layer_infer import LlavaPreLayerInfer
from llmserve.models.llava.layer_weights.vision_weight import PROJECTOR_PREFIX, VISION_PREFIX, LlavaVisionWeight

# The checkpoint's names for the decoder -> the Llama model's. Current transformers saves
# ``model.language_model.*`` / ``model.vision_tower.*`` / ``model.multi_modal_projector.*`` and a
# bare ``lm_head``; checkpoints saved before 4.52 (llava-hf's) ``language_model.model.*`` and
# ``language_model.lm_head``, with the image side at the top level.
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", VISION_PREFIX),
    ("model.multi_modal_projector.", PROJECTOR_PREFIX),
)
# Older checkpoints also nest the CLIP tower's tensors one level deeper than transformers 5's
# CLIPVisionModel does.
_OLD_TOWER_PREFIX = VISION_PREFIX + "vision_model."


class LlavaTpPartModel(LlamaTpPartModel):
    pre_layer_infer_class = LlavaPreLayerInfer

    # The worker runs the vision tower on at most this many images at once (a step's new images
    # in slices): the activations the KV cache leaves room for are those of such a batch.
    max_images_per_encode: int = 16

    def _init_config(self) -> None:
        super()._init_config()
        # The Llama layers read the text config; the LLaVA one keeps the image side's settings.
        self.llava_config_ = self.network_config_
        text = self.llava_config_.text_config
        # a sub-config object shared with llava_config_: copy before adjusting it
        self.network_config_ = hf_config_from_dict({**text.to_dict(), "model_type": text.model_type})
        if getattr(self.llava_config_, "tie_word_embeddings", False):
            self.network_config_.tie_word_embeddings = True
        self.image_token_id: int = self.llava_config_.image_token_index
        self._feature_layers = self._resolve_feature_layers()

    @property
    def model_type(self) -> str:
        return "llava"

    def _resolve_feature_layers(self) -> list[int]:
        """``vision_feature_layer`` (one index or a list, concatenated) as non-negative indices
        into the tower's hidden states, of which there are num_hidden_layers + 1 (the first is
        the embeddings')."""
        layers = self.llava_config_.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        n = self.llava_config_.vision_config.num_hidden_layers + 1
        resolved = [i if i >= 0 else n + i for i in layers]
        if not all(0 <= i < n for i in resolved):
            raise ValueError(f"llava: vision_feature_layer {layers} out of range for {n - 1} layers")
        strategy = self.llava_config_.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"llava: vision_feature_select_strategy {strategy!r} is not supported")
        return resolved

    def _rename_hf_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        renamed = {}
        for name, tensor in weights.items():
            name = replace_prefix(replace_prefix(name, _RENAMES), [(_OLD_TOWER_PREFIX, VISION_PREFIX)])
            renamed[name] = tensor
        return renamed

    def _init_extra_weights(self, tp_rank, world_size, data_type, network_config, device) -> list:
        return [LlavaVisionWeight(tp_rank, world_size, data_type, self.llava_config_, device)]

    def _init_custom(self) -> None:
        super()._init_custom()
        vision: LlavaVisionWeight = self.extra_weights[0]
        self.vision_weight = vision
        # Layers past the deepest one read are never needed: drop them (LLaVA-1.5 reads the
        # second-to-last layer, so this saves one of the 24 layers' compute).
        encoder = vision.vision_model.encoder
        encoder.layers = encoder.layers[: max(self._feature_layers)]
        self._projector_act = ACT2FN[self.llava_config_.projector_hidden_act]

    def _activation_reserve_bytes(self) -> int:
        """The vision tower's peak on a batch of ``max_images_per_encode`` images, kept out of the
        KV cache (the decoder's own activations come out of ``mem_fraction``'s headroom, as for
        text models). It holds every layer's hidden states (``output_hidden_states``: the
        feature layer is read from them), and within one layer the MLP's intermediate, q/k/v and
        the attention's score matrix (eager attention's worst case; SDPA's kernels need less),
        with the projector's output on top. An estimate from shapes, not a measurement: 2x it
        for the allocator's slack. For LLaVA-1.5-7B in fp16 (ViT-L/14-336: 577 tokens, 23 layers
        used) it is ~1.8 GiB."""
        v = self.llava_config_.vision_config
        n = self.max_images_per_encode
        seq = (v.image_size // v.patch_size) ** 2 + 1
        per_image = (
            (v.num_hidden_layers + 1) * seq * v.hidden_size                  # the hidden states kept
            + seq * (4 * v.hidden_size + v.intermediate_size)                 # q, k, v, out; MLP intermediate
            + v.num_attention_heads * seq * seq                               # attention scores
            + 2 * seq * self.network_config_.hidden_size                      # projector
        )
        return 2 * n * per_image * self.data_type.itemsize

    @property
    def tokens_per_image(self) -> int:
        cfg = self.llava_config_.vision_config
        num = (cfg.image_size // cfg.patch_size) ** 2 + 1
        return num - 1 if self.llava_config_.vision_feature_select_strategy == "default" else num

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n_images, 3, H, W] (the image processor's output) -> [n_images, tokens_per_image,
        hidden]: the embeddings each image's placeholder tokens take, in the model's dtype."""
        w = self.vision_weight
        pixels = pixel_values.to(self.device, self.data_type)
        hidden = w.tower_(pixel_values=pixels, output_hidden_states=True).hidden_states
        features = [hidden[i] for i in self._feature_layers]
        if self.llava_config_.vision_feature_select_strategy == "default":
            features = [f[:, 1:] for f in features]   # drop the CLS token
        x = torch.cat(features, dim=-1)
        x = torch.nn.functional.linear(x, w.proj_1_weight_, w.proj_1_bias_)
        x = self._projector_act(x)
        return torch.nn.functional.linear(x, w.proj_2_weight_, w.proj_2_bias_)


def replace_prefix(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """``name`` with the first matching ``old`` prefix of ``renames`` replaced by its ``new``."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name
