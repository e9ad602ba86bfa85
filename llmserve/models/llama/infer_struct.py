from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.common.basemodel import InferStateInfo


@dataclass
class LlamaInferStateInfo(InferStateInfo):
    position_cos: torch.Tensor | None = None   # [total_token_num, head_dim // 2] float32
    position_sin: torch.Tensor | None = None

    def init_some_extra_state(self, model) -> None:
        # one lookup per forward, shared by every layer
        self.position_cos, self.position_sin = model.rotary_emb.cos_sin(self.position_ids, self.max_seq_len)
