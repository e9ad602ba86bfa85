from __future__ import annotations

import torch

from llmserve.common.basemodel import TransformerLayerInferTpl
from llmserve.common.distributed import PartialSum, add_rmsnorm
from llmserve.kernels import (
    gelu_and_mul_fwd,
    rmsnorm_forward,
    rotary_emb_copy_kv,
    silu_and_mul_fwd,
)
from llmserve.kernels.gemv import gemv_act_and_mul, takes_gemv
from llmserve.kernels.qk_rmsnorm import QKNorm
from llmserve.models.llama.infer_struct import LlamaInferStateInfo
from llmserve.quantization.weights import PackedWeight


# A gated MLP's activation of ``[gate | up]``, by `gemv_act_and_mul`'s names.
ACT_AND_MUL = {"silu": silu_and_mul_fwd, "gelu_tanh": gelu_and_mul_fwd}


class LlamaTransformerLayerInfer(TransformerLayerInferTpl):
    """RMSNorm, rotary q/k, SwiGLU MLP."""

    # The norms round as HF LlamaRMSNorm (True) or GemmaRMSNorm (False: see rmsnorm_forward).
    norm_round_first: bool = True
    mlp_act: str = "silu"    # SwiGLU (a key of ACT_AND_MUL)
    reduces_in_norm = True   # the add-norms below sum a PartialSum over the ranks themselves

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        super().__init__(layer_num, tp_rank, world_size, network_config)
        self.eps_ = network_config.rms_norm_eps

    def _att_norm(self, h: torch.Tensor, infer_state: LlamaInferStateInfo, layer_weight) -> torch.Tensor:
        return rmsnorm_forward(h, layer_weight.att_norm_weight_, self.eps_, self.norm_round_first)

    def _ffn_norm(self, h: torch.Tensor, infer_state: LlamaInferStateInfo, layer_weight) -> torch.Tensor:
        return rmsnorm_forward(h, layer_weight.ffn_norm_weight_, self.eps_, self.norm_round_first)

    def _add_att_norm(self, h: torch.Tensor, pending: torch.Tensor | PartialSum, infer_state: LlamaInferStateInfo,
                      layer_weight) -> torch.Tensor:
        return add_rmsnorm(h, pending, layer_weight.att_norm_weight_, self.eps_, self.norm_round_first)

    def _add_ffn_norm(self, h: torch.Tensor, attn_out: torch.Tensor | PartialSum, infer_state: LlamaInferStateInfo,
                      layer_weight) -> torch.Tensor:
        return add_rmsnorm(h, attn_out, layer_weight.ffn_norm_weight_, self.eps_, self.norm_round_first)

    def _store_kv(self, q: torch.Tensor, kv: torch.Tensor, infer_state: LlamaInferStateInfo, layer_weight) -> None:
        # Rotary on q (in place) and k (on its way into the cache), and the store: one launch.
        cos, sin = self._rotary_tables(infer_state)
        rotary_emb_copy_kv(q, kv, cos, sin, infer_state.mem_index, infer_state.mem_manager.kv_buffer[self.cache_layer_],
                           **self._kv_scales(infer_state), qk_norm=self._qk_norm(layer_weight))

    def _rotary_tables(self, infer_state: LlamaInferStateInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the batch's positions for this layer (Gemma 3's sliding layers: their own)."""
        return infer_state.position_cos, infer_state.position_sin

    def _qk_norm(self, layer_weight) -> QKNorm | None:
        """Per-head norms of q and k before rotary (Qwen3's, Gemma 3's), applied by the store's
        launch; Llama has none."""
        return None

    def _ffn(self, x: torch.Tensor, infer_state: LlamaInferStateInfo, layer_weight) -> torch.Tensor:
        lora = infer_state.lora
        if takes_gemv(x, layer_weight.gate_up_weight_):
            # One row (a batch-1 decode step): the gate_up GEMV computes the activation too, after
            # adding the row's adapter product to gate and up.
            row = lora.row(self.layer_num_, "gate_up", x) if lora is not None else None
            act = gemv_act_and_mul(x, layer_weight.gate_up_weight_, self.mlp_act, lora=row)
        elif lora is None and isinstance(layer_weight.gate_up_weight_, PackedWeight):
            # A quantized gate_up fuses the activation itself where it can (one row, Triton).
            act = layer_weight.gate_up_weight_.act_and_mul(x, self.mlp_act)
        else:
            act = ACT_AND_MUL[self.mlp_act](self._linear(x, layer_weight.gate_up_weight_, None, infer_state, "gate_up"))
        return self._row_parallel_linear(act, layer_weight.down_weight_, None, infer_state, "down")
