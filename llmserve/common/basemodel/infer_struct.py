"""The per-forward state passed from layer to layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmserve.kernels.verify_attention import VERIFY_MAX_Q_LEN

if TYPE_CHECKING:
    from llmserve.common.basemodel.basemodel import TpPartBaseModel
    from llmserve.common.mem_manager import MemoryManager, ReqManager
    from llmserve.lora.pool import LoraBatch


@dataclass
class InputEmbeds:
    """Embeddings that replace some new tokens' vocabulary rows in one forward (LLaVA writes each
    image's features at its placeholder tokens)."""

    rows: torch.Tensor     # [n] int64 on the device: indices among the step's packed new tokens
    embeds: torch.Tensor   # [n, hidden] on the device, in the model's dtype


@dataclass
class InferStateInfo:
    """One forward over a batch in which request i brings ``b_q_len[i]`` new tokens on top of
    ``b_cached_len[i]`` tokens already in the KV cache.

    Prefill is ``cached == 0``, decode is ``new == 1``, and prefix-cache hits, chunked prefill
    and speculative verification are the general case; all of them share this one structure.
    New tokens of all requests are packed back to back (no padding): request i's rows are
    ``b_q_start[i] : b_q_start[i] + b_q_len[i]``.
    """

    batch_size: int
    total_token_num: int          # new tokens in this forward
    is_decode: bool               # every request brings exactly one new token
    b_req_idx: torch.Tensor       # [bs] int32, rows of req_to_token
    b_q_start: torch.Tensor       # [bs] int32
    b_q_len: torch.Tensor         # [bs] int32
    b_cached_len: torch.Tensor    # [bs] int32
    b_seq_len: torch.Tensor       # [bs] int32, cached + new
    max_q_len: int
    max_seq_len: int
    position_ids: torch.Tensor    # [total_token_num] int64
    mem_index: torch.Tensor       # [total_token_num] int32, KV slots of the new tokens
    mem_manager: MemoryManager
    req_manager: ReqManager
    # The rows of the new tokens whose logits the post layer computes; None: all of them.
    logit_rows: torch.Tensor | None = None
    # New tokens whose input embeddings are given rather than looked up (an image's placeholder
    # tokens); None: every row comes from the vocabulary. Written by a model's pre layer.
    input_embeds: InputEmbeds | None = None
    # The requests' LoRA adapters, which the wrapped projections add; None: no request of the
    # batch has one (or the model serves none), and the layers run as without LoRA.
    lora: LoraBatch | None = None

    @property
    def is_verify(self) -> bool:
        """Not decode, and every request brings at most VERIFY_MAX_Q_LEN new tokens: a speculative
        verify step's 1 + K (or a step of short prompts, which is the same work). Its attention
        takes the split-K verify kernel (kernels/verify_attention), which cuts each request's
        context over programs as decode does; the context kernel walks it in one program a query
        block, which at batch 1 cost about 1 ms a step more than a decode step's attention."""
        return not self.is_decode and self.max_q_len <= VERIFY_MAX_Q_LEN

    def init_some_extra_state(self, model: TpPartBaseModel) -> None:
        """Hook for model-specific per-forward state (e.g. rotary cos/sin for the positions)."""
