"""benchmarks/quantized_serving.py's ceiling: the KV bytes a token, as /info names the cache's dtype
(its end-to-end run starts a server per format: a CPU smoke command is in its docstring)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from quantized_serving import kv_bytes_per_token  # noqa: E402


@pytest.mark.parametrize(("kv_dtype", "element"), [("bfloat16", 2), ("float32", 4),
                                                   ("fp8_e4m3 (scales 1.0: the checkpoint has none)", 1)])
def test_kv_bytes_a_token_count_k_and_v_of_every_layer(tmp_path, kv_dtype, element):
    # Llama-3-8B's attention: 32 layers, 8 KV heads of 128 (head_dim from hidden / heads)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                                                      "num_key_value_heads": 8, "hidden_size": 4096}))
    assert kv_bytes_per_token(str(tmp_path), kv_dtype) == 2 * 32 * 8 * 128 * element
