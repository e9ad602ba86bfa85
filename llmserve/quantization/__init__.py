"""Quantized weights: which format a checkpoint is in (its config.json's ``quantization_config``, or
the ``--quantization`` flag), which of its tensors belong to which linear layer, and the weight
classes those become (`weights.py`), which `kernels.linear` runs.

Supported (names as vLLM's ``--quantization`` and the configs' ``quant_method`` spell them):

- ``compressed-tensors`` FP8 (``float-quantized`` / ``naive-quantized``): per-tensor or per-channel
  weight scales, static per-tensor or dynamic per-token activations, or 128 x 128 blocks;
- ``fp8``: checkpoints with ``weight_block_size`` (``weight_scale_inv``), or per-tensor
  ``weight_scale`` (+ ``input_scale``); and, on a bf16/fp16 checkpoint, quantization at load
  (per-channel weight scales, dynamic per-token activations);
- ``awq``: 4-bit, GEMM layout, zero points; ``gptq``: 4-bit, ``desc_act`` false.

Modules: `config` (which format a model is in), `formats` (a format's checkpoint tensors -> a
weight), `weights` (the weight classes), `kv_cache` (``--kv-cache-dtype fp8``: a float8 KV cache's
dtype and scales). This file imports nothing heavy: the command line reads
the choices from it.
"""

QUANTIZATION_CHOICES = ("fp8", "compressed-tensors", "awq", "gptq")

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""``--kv-cache-dtype`` (vLLM's flag): auto, the model's dtype; fp8 (= fp8_e4m3), float8 e4m3 with a
per-tensor scale for each layer's K and V (`kv_cache`)."""
