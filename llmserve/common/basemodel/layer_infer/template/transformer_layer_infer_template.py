from __future__ import annotations

from typing import Callable

import torch

from llmserve.common.basemodel.basemodel import head_dim, num_kv_heads
from llmserve.common.basemodel.model_shape import sliding_window
from llmserve.common.basemodel.infer_struct import InferStateInfo
from llmserve.common.basemodel.layer_infer.transformer_layer_infer import TransformerLayerInfer
from llmserve.common.distributed import PartialSum, all_reduce, row_parallel_gemv, tp_size
from llmserve.kernels import context_attention_fwd, decode_attention_fwd, destindex_copy_kv, linear, verify_attention_fwd


class TransformerLayerInferTpl(TransformerLayerInfer):
    """A pre-norm decoder layer, the shape Llama and BLOOM share:

        h += pending                                  # the previous layer's MLP output
        h += o_proj(attention(qkv(att_norm(h))))      # writes K/V of the new tokens first
        pending = ffn(ffn_norm(h))                    # added by the next layer (or the post layer)

    Subclasses supply the norms, ``_ffn`` and any change to q/k (rotary, in ``_store_kv``);
    ``_add_att_norm`` and ``_add_ffn_norm`` (a residual add and the norm after it) may each be
    one fused kernel. The heads of this rank are a contiguous slice, so attention itself needs
    no communication; the two row-parallel projections end in an all-reduce, which a family
    whose add-norms are `distributed.add_rmsnorm` leaves to them (``reduces_in_norm``)."""

    # Whether ``_add_att_norm`` and ``_add_ffn_norm`` (and the post layer's final add-norm) take
    # a ``PartialSum``: at tp > 1 the o and down projections then hand on their outputs unreduced,
    # and the sum over the ranks runs in one kernel with the residual add and the norm.
    reduces_in_norm: bool = False

    def __init__(self, layer_num: int, tp_rank: int, world_size: int, network_config):
        super().__init__(layer_num, tp_rank, world_size, network_config)
        self.tp_q_head_num_ = network_config.num_attention_heads // world_size
        self.tp_kv_head_num_ = num_kv_heads(network_config) // world_size
        self.head_dim_ = head_dim(network_config)
        # Attention variants, per layer: the score scale (None: head_dim ** -0.5; a family sets
        # it), the sliding window the config gives this layer (0: none; see sliding_window) and
        # score soft-capping (0: none; a family sets it). Both kernels take them as
        # specialisation flags, so the plain path is compiled as before.
        self.sm_scale_: float | None = None
        self.sliding_window_: int = sliding_window(network_config, layer_num)
        self.logit_softcap_: float = 0.0

    # -- hooks ------------------------------------------------------------------------
    def _att_norm(self, h: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        raise NotImplementedError

    def _ffn_norm(self, h: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        raise NotImplementedError

    def _ffn(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        raise NotImplementedError

    def _add_att_norm(self, h: torch.Tensor, pending: torch.Tensor, infer_state: InferStateInfo,
                      layer_weight) -> torch.Tensor:
        """``h += pending`` in place (the previous layer's output), then the attention's input
        norm of ``h``."""
        h.add_(pending)
        return self._att_norm(h, infer_state, layer_weight)

    def _add_ffn_norm(self, h: torch.Tensor, attn_out: torch.Tensor, infer_state: InferStateInfo,
                      layer_weight) -> torch.Tensor:
        """``h += attn_out`` in place, then the MLP's input norm of ``h``."""
        h.add_(attn_out)
        return self._ffn_norm(h, infer_state, layer_weight)

    def _alibi_slopes(self, layer_weight) -> torch.Tensor | None:
        return None

    def _get_qkv(self, x: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[n, Hq, D]`` and kv ``[n, 2 * Hkv, D]`` (K heads then V heads): strided views of
        one fused projection, laid out like a KV-cache slot so one scatter stores both."""
        qkv = self._linear(x, layer_weight.qkv_weight_, layer_weight.qkv_bias_, infer_state, "qkv")
        q_size = self.tp_q_head_num_ * self.head_dim_
        q = qkv[:, :q_size].view(-1, self.tp_q_head_num_, self.head_dim_)
        kv = qkv[:, q_size:].view(-1, 2 * self.tp_kv_head_num_, self.head_dim_)
        return q, kv

    def _store_kv(self, q: torch.Tensor, kv: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> None:
        """Write the new tokens' K and V (``kv``) into this layer's cache slots. A model that
        changes q and k by position (rotary) does it here, in the same kernel as the store:
        attention reads K and V from the cache only, so k need not be changed in ``kv``."""
        destindex_copy_kv(kv, infer_state.mem_index, infer_state.mem_manager.kv_buffer[self.cache_layer_],
                          **self._kv_scales(infer_state))

    def _kv_scales(self, infer_state: InferStateInfo) -> dict[str, float]:
        """This layer's KV-cache scales, as the kernels that store and read the cache take them
        (1.0 but for a float8 cache: see MemoryManager.kv_scales)."""
        k_scale, v_scale = infer_state.mem_manager.kv_scales[self.cache_layer_]
        return {"k_scale": k_scale, "v_scale": v_scale}

    def _get_o(self, o: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        return self._row_parallel_linear(o.view(-1, self.tp_q_head_num_ * self.head_dim_), layer_weight.o_weight_,
                                         layer_weight.o_bias_, infer_state, "o")

    # -- the layer --------------------------------------------------------------------
    def context_forward(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,
                        layer_weight) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layer(h, pending, infer_state, layer_weight, self._context_attention_kernel)

    def token_forward(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,
                      layer_weight) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layer(h, pending, infer_state, layer_weight, self._token_attention_kernel)

    def _layer(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo, layer_weight,
               attend: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, pending)`` in, ``(h, this layer's MLP output)`` out (see TransformerLayerInfer)."""
        attn_out = self._attention_block(h, pending, infer_state, layer_weight, attend)
        return h, self._ffn_block(h, attn_out, infer_state, layer_weight)

    def _attention_block(self, h: torch.Tensor, pending: torch.Tensor | None, infer_state: InferStateInfo,
                         layer_weight, attend: Callable) -> torch.Tensor:
        """The attention's output for the residual stream (not added yet: see ``_ffn_block``)."""
        if pending is None:  # the first layer
            x = self._att_norm(h, infer_state, layer_weight)
        else:
            x = self._add_att_norm(h, pending, infer_state, layer_weight)
        q, kv = self._get_qkv(x, infer_state, layer_weight)
        self._store_kv(q, kv, infer_state, layer_weight)
        return self._get_o(attend(q, infer_state, layer_weight), infer_state, layer_weight)

    def _ffn_block(self, h: torch.Tensor, attn_out: torch.Tensor, infer_state: InferStateInfo,
                   layer_weight) -> torch.Tensor:
        """The MLP's output, left for the next norm to add to ``h`` (after adding ``attn_out``)."""
        x = self._add_ffn_norm(h, attn_out, infer_state, layer_weight)
        return self._ffn(x, infer_state, layer_weight)

    def _context_attention_kernel(self, q: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attention = verify_attention_fwd if infer_state.is_verify else context_attention_fwd  # the same op
        attention(
            q, infer_state.mem_manager.key_buffer[self.cache_layer_], infer_state.mem_manager.value_buffer[self.cache_layer_], o,
            infer_state.req_manager.req_to_token, infer_state.b_req_idx, infer_state.b_q_start, infer_state.b_q_len,
            infer_state.b_cached_len, infer_state.max_q_len, alibi_slopes=self._alibi_slopes(layer_weight),
            sm_scale=self.sm_scale_, sliding_window=self.sliding_window_, logit_softcap=self.logit_softcap_,
            **self._kv_scales(infer_state),
        )
        return o

    def _token_attention_kernel(self, q: torch.Tensor, infer_state: InferStateInfo, layer_weight) -> torch.Tensor:
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode_attention_fwd(
            q, infer_state.mem_manager.key_buffer[self.cache_layer_], infer_state.mem_manager.value_buffer[self.cache_layer_], o,
            infer_state.req_manager.req_to_token, infer_state.b_req_idx, infer_state.b_seq_len, infer_state.max_seq_len,
            alibi_slopes=self._alibi_slopes(layer_weight), sm_scale=self.sm_scale_,
            sliding_window=self.sliding_window_, logit_softcap=self.logit_softcap_, **self._kv_scales(infer_state),
        )
        return o

    def _row_parallel_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             infer_state: InferStateInfo | None = None, lora_group: str = "") -> torch.Tensor:
        """Each rank multiplies its slice of the inputs; the sum over ranks is the full output.
        The bias is added once, after the reduction. With adapters in the batch (``infer_state.lora``),
        their products for ``lora_group`` are partial sums too (A is cut as the weight), added before
        the reduction. Without a bias, where ``reduces_in_norm``, the reduction is left to the
        add-norm that takes the output (a ``PartialSum``)."""
        if (bias is None and self._sums_in_norm() and infer_state is not None and infer_state.is_decode
                and infer_state.lora is None):
            # every row of a decode step reaches the next add-norm whole (no logit rows picked)
            pushed = row_parallel_gemv(x, weight)
            if pushed is not None:
                return pushed
        y = self._linear(x, weight, None, infer_state, lora_group)
        if bias is None:
            return self._sum_over_ranks(y)
        return all_reduce(y).add_(bias)

    def _sum_over_ranks(self, y: torch.Tensor) -> torch.Tensor | PartialSum:
        """This rank's share ``y`` of an output that goes into a residual add and a norm, summed
        over the tp ranks: left to that add-norm where ``reduces_in_norm`` (a ``PartialSum``),
        else all-reduced here."""
        return PartialSum(y) if self._sums_in_norm() else all_reduce(y)

    def _sums_in_norm(self) -> bool:
        """Whether this layer's row-parallel outputs reach their add-norm unreduced (``PartialSum``)."""
        return self.reduces_in_norm and tp_size() > 1

    def _linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, infer_state: InferStateInfo | None,
                lora_group: str) -> torch.Tensor:
        """``x @ weight^T (+ bias)``, with the batch's adapters' products for ``lora_group`` added
        where it has any (``LoraBatch.linear``)."""
        lora = infer_state.lora if infer_state is not None else None
        if lora is None:
            return linear(x, weight, bias)
        return lora.linear(self.layer_num_, lora_group, x, weight, bias)
