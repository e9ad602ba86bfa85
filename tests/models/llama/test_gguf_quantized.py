"""A GGUF model on the CPU with its matrices in their blocks (the quantized kernel) against the
same file dequantized at load (``dequantize=True``, the dense path): the same greedy tokens and
logits to float32 rounding, on one rank and over two tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as Q
from gguf_utils import tiny_hf_tensors, write_gguf
from parity_utils import BatchDriver, rel_err

from llmserve.common.basemodel import ModelInitParams
from llmserve.kernels import QuantizedWeight
from llmserve.kernels.quantized_linear import kernel_available
from llmserve.models.registry import get_model_class

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C compiler: the quantized kernel cannot be built")

PROMPTS = [[5, 17, 30, 2, 9], [4] * 3, list(range(10, 21))]
STEPS = 8

# Every format, every matrix; layer 1's q/k/v differ, so its fused qkv falls back to dense.
FORMATS = {
    "model.embed_tokens.weight": Q.Q4_1, "lm_head.weight": Q.Q8_0,
    **{f"model.layers.0.{name}.weight": fmt for name, fmt in [
        ("self_attn.q_proj", Q.Q4_1), ("self_attn.k_proj", Q.Q4_1), ("self_attn.v_proj", Q.Q4_1),
        ("self_attn.o_proj", Q.Q4_0), ("mlp.gate_proj", Q.Q8_0), ("mlp.up_proj", Q.Q8_0), ("mlp.down_proj", Q.Q4_1)]},
    **{f"model.layers.1.{name}.weight": fmt for name, fmt in [
        ("self_attn.q_proj", Q.Q8_0), ("self_attn.k_proj", Q.Q4_0), ("self_attn.v_proj", Q.Q4_1),
        ("self_attn.o_proj", Q.Q4_1), ("mlp.gate_proj", Q.Q4_0), ("mlp.up_proj", Q.Q4_0), ("mlp.down_proj", Q.Q8_0)]},
}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q.gguf"
    write_gguf(path, "llama", tiny_hf_tensors(np.random.default_rng(3), biases=False, untied=True), FORMATS)
    return str(path)


def load(path: str, **kw):
    params = ModelInitParams(model_path=path, device="cpu", max_total_token_num=512, max_running_requests=8, **kw)
    return get_model_class("llama")(params)


def greedy(model) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill PROMPTS as one batch, then STEPS greedy decode steps: the tokens and every step's logits."""
    driver = BatchDriver(model)
    logits = [driver.prefill(PROMPTS)]
    tokens = [logits[-1].argmax(-1).tolist()]
    for _ in range(STEPS):
        logits.append(driver.decode(tokens[-1]))
        tokens.append(logits[-1].argmax(-1).tolist())
    driver.free()
    return tokens, logits


def test_blocks_give_the_dequantized_models_tokens(gguf_path):
    blocks, dense = load(gguf_path), load(gguf_path, dequantize=True)
    layer0, layer1 = blocks.trans_layers_weight
    assert isinstance(layer0.qkv_weight_, QuantizedWeight) and layer0.qkv_weight_.qtype == "Q4_1"
    assert isinstance(layer1.qkv_weight_, torch.Tensor)          # three formats: stacked dense
    assert isinstance(layer1.gate_up_weight_, QuantizedWeight) and isinstance(blocks.pre_post_weight.wte_weight_, QuantizedWeight)
    for layer in (dense.pre_post_weight, *dense.trans_layers_weight):
        assert not any(isinstance(w, QuantizedWeight) for w in vars(layer).values())
    got_tokens, got_logits = greedy(blocks)
    want_tokens, want_logits = greedy(dense)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits):
        assert rel_err(got, want) < 1e-5


def _rank_main(rank: int, world: int, path: str, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = load(path, tp_rank=rank, world_size=world)
        # o_proj's 32 inputs cut in two are not whole blocks (dequantized); down_proj's 64 are
        assert isinstance(model.trans_layers_weight[0].down_weight_, QuantizedWeight)
        assert isinstance(model.trans_layers_weight[0].o_weight_, torch.Tensor)
        tokens, logits = greedy(model)
        if rank == 0:
            torch.save({"tokens": tokens, "logits": logits}, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_the_dequantized_models_tokens(gguf_path, tmp_path: Path):
    from llmserve.engine.worker_client import free_tcp_port

    out = str(tmp_path / "tp.pt")
    mp.start_processes(_rank_main, args=(2, gguf_path, free_tcp_port(), out), nprocs=2, start_method="spawn")
    got = torch.load(out)
    want_tokens, want_logits = greedy(load(gguf_path, dequantize=True))
    assert got["tokens"] == want_tokens
    for g, w in zip(got["logits"], want_logits):
        assert rel_err(g, w) < 1e-5
