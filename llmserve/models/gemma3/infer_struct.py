from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.models.llama.infer_struct import LlamaInferStateInfo


@dataclass
class Gemma3InferStateInfo(LlamaInferStateInfo):
    """Llama's rotary tables for the global layers, and a second pair for the sliding (local)
    layers, which rotate with their own base (``rope_local_base_freq``: 10k against 1M) and
    without the global layers' rope scaling."""

    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None

    def init_some_extra_state(self, model) -> None:
        super().init_some_extra_state(model)
        self.local_cos, self.local_sin = model.local_rotary_emb.cos_sin(self.position_ids, self.max_seq_len)
