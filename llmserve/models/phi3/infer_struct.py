from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.models.llama.infer_struct import LlamaInferStateInfo


@dataclass
class Phi3InferStateInfo(LlamaInferStateInfo):
    """Llama's state, with LongRoPE's choice made per request: a request longer than the original
    context (cached + new tokens) rotates its new tokens with the long factors, as HF does for
    one sequence. (HF decides per batch, from its longest sequence; per request keeps a request's
    output independent of what it is batched with.)

    The choice is by the length so far, so it equals HF's for a prompt prefilled in one piece and
    for every decode step. Two cases differ from HF's one-piece prefill, because the KV cache keeps
    keys as they were rotated: a prompt chunked across the original context rotates its first
    chunks with the short factors (as HF does when fed the same chunks), and a prefix-cache hit
    reuses keys rotated with whichever factors the request that wrote them used. Matching HF there
    needs each request's prompt length in the step (long from the first chunk when the prompt is
    long), and the factor set in the prefix cache's key."""

    def init_some_extra_state(self, model) -> None:
        if model.rotary_emb.long_after is None:
            return super().init_some_extra_state(model)
        if self.is_decode:
            token_seq_len = self.b_seq_len
        else:
            # each new token's request: the last request starting at or before its row
            rows = torch.arange(self.total_token_num, device=self.b_q_start.device, dtype=torch.int64)
            req = (torch.searchsorted(self.b_q_start.long(), rows, right=True) - 1).clamp_(min=0)
            token_seq_len = self.b_seq_len[req]
        self.position_cos, self.position_sin = model.rotary_emb.cos_sin(self.position_ids, self.max_seq_len, token_seq_len)
