"""Compute kernels: each op is a Triton kernel with a plain-torch twin, picked by `backend`."""

from .add_rmsnorm import add_rmsnorm_forward
from .apply_penalty import apply_penalty
from .backend import get_backend, set_backend, use_triton
from .context_attention import context_attention_fwd
from .decode_attention import decode_attention_fwd
from .destindex_copy_kv import destindex_copy_kv
from .gelu_and_mul import gelu_and_mul_fwd
from .layernorm import layernorm_forward
from .qk_rmsnorm import qk_rmsnorm_
from .quantized_linear import QuantizedWeight, embedding, linear
from .rmsnorm import rmsnorm_forward
from .rotary_emb import rotary_emb_fwd
from .rotary_emb_copy_kv import rotary_emb_copy_kv
from .silu_and_mul import silu_and_mul_fwd
from .verify_attention import verify_attention_fwd

__all__ = [
    "add_rmsnorm_forward",
    "apply_penalty",
    "context_attention_fwd",
    "decode_attention_fwd",
    "destindex_copy_kv",
    "gelu_and_mul_fwd",
    "get_backend",
    "QuantizedWeight",
    "embedding",
    "layernorm_forward",
    "linear",
    "qk_rmsnorm_",
    "rmsnorm_forward",
    "rotary_emb_copy_kv",
    "rotary_emb_fwd",
    "set_backend",
    "silu_and_mul_fwd",
    "use_triton",
    "verify_attention_fwd",
]
