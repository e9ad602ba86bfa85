"""LLaVA's image side: the CLIP vision tower and the multimodal projector, replicated on every
tensor-parallel rank (a few percent of a 7B model's weights, run once per image)."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, CLIPVisionModel

from llmserve.common.basemodel import WeightSpec
from llmserve.common.basemodel.layer_weights.base_layer_weight import BaseLayerWeight

VISION_PREFIX = "vision_tower."
PROJECTOR_PREFIX = "multi_modal_projector."


class LlavaVisionWeight(BaseLayerWeight):
    """transformers' ``CLIPVisionModel`` holding the checkpoint's tower weights (no random init:
    it is built on the meta device and the loaded tensors are assigned), cut after the deepest
    layer ``vision_feature_layer`` reads, plus the projector's two linears."""

    def __init__(self, tp_rank: int, world_size: int, data_type: torch.dtype, llava_config, device: torch.device):
        super().__init__(tp_rank, world_size, data_type, llava_config, device)
        vision_config: CLIPVisionConfig = llava_config.vision_config
        if vision_config.model_type != "clip_vision_model":
            raise ValueError(f"llava: vision tower {vision_config.model_type!r} is not supported (only CLIP)")
        vision_config._attn_implementation = "sdpa"
        with torch.device("meta"):
            self.tower_ = CLIPVisionModel(vision_config)
        self._tower_keys = list(self.tower_.state_dict())
        bias = bool(getattr(llava_config, "multimodal_projector_bias", True))
        self._projector_specs = {
            f"proj_{part}_{kind}": WeightSpec(f"{PROJECTOR_PREFIX}{part}.{kind}", required=kind == "weight" or bias)
            for part in ("linear_1", "linear_2") for kind in ("weight", "bias")
        }

    def weight_specs(self) -> dict[str, WeightSpec]:
        return {**{f"tower.{k}": WeightSpec(VISION_PREFIX + k) for k in self._tower_keys}, **self._projector_specs}

    @property
    def vision_model(self) -> torch.nn.Module:
        """The module holding embeddings / encoder (transformers before 5 nested it one deeper)."""
        return getattr(self.tower_, "vision_model", self.tower_)

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        tower_state = {k.removeprefix("tower."): v for k, v in w.items() if k.startswith("tower.")}
        self.tower_.load_state_dict(tower_state, assign=True, strict=True)
        emb = self.vision_model.embeddings
        # a non-persistent buffer: not in the checkpoint, still on the meta device
        emb.register_buffer("position_ids", torch.arange(emb.num_positions, device=self.device_).unsqueeze(0),
                            persistent=False)
        self.tower_.eval()
        self.proj_1_weight_ = w["proj_linear_1_weight"]
        self.proj_1_bias_ = w.get("proj_linear_1_bias")
        self.proj_2_weight_ = w["proj_linear_2_weight"]
        self.proj_2_bias_ = w.get("proj_linear_2_bias")
