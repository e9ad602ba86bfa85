"""The Llama layer's fused kernels (rotary + KV store in one launch; each residual add inside the
next norm; at one row, the gate_up GEMV and the activation in one launch) against the same model
run through the plain ops, with the Triton kernels: logits
bitwise equal, over prefill, a chunk with every row's logits, and decode steps. On CPU the
kernels run in Triton's interpreter."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig
from triton.runtime.interpreter import InterpretedFunction

from parity_utils import TEST_DEVICE, BatchDriver, build_tiny_hf_model, load_ours, random_prompts

from llmserve.common.basemodel import PostLayerInferTpl, TransformerLayerInferTpl
from llmserve.kernels import backend, destindex_copy_kv, rotary_emb_fwd
from llmserve.kernels.rmsnorm import _rmsnorm_kernel

LAYERS = 2
VOCAB = 256
# The interpreter rounds fp32 -> bf16 by truncation where torch rounds to nearest, so there a
# fused add (in the kernel) and a torch add differ in bf16; compiled Triton rounds to nearest.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if TEST_DEVICE == "cuda" else [])

# On a CUDA machine the kernels are compiled (tests/conftest.py sets TRITON_INTERPRET only without
# CUDA), so they run here only with LLMSERVE_TEST_DEVICE=cuda.
pytestmark = pytest.mark.skipif(TEST_DEVICE == "cpu" and not isinstance(_rmsnorm_kernel, InterpretedFunction),
                                reason="Triton kernels on CPU need the interpreter; set LLMSERVE_TEST_DEVICE=cuda")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-fused")
    build_tiny_hf_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                    max_position_embeddings=256), path)
    return path


@pytest.fixture
def triton_backend():
    backend.set_backend("triton")
    yield
    backend.set_backend(None)


def unfuse(model) -> None:
    """The layers' plain path: rotary, then the store (two launches); each residual add apart
    from the norm after it (the templates' defaults)."""
    for layer in model.layers_infer:
        def store_kv(q, kv, infer_state, layer_weight, _layer=layer):
            rotary_emb_fwd(q, kv[:, : _layer.tp_kv_head_num_], infer_state.position_cos, infer_state.position_sin)
            destindex_copy_kv(kv, infer_state.mem_index, infer_state.mem_manager.kv_buffer[_layer.layer_num_])
        layer._store_kv = store_kv
        layer._add_att_norm = TransformerLayerInferTpl._add_att_norm.__get__(layer)
    model.post_infer._add_norm = PostLayerInferTpl._add_norm.__get__(model.post_infer)


def run(model) -> list[torch.Tensor]:
    driver = BatchDriver(model)
    logits = [driver.prefill(random_prompts([5, 9, 1], VOCAB))]
    logits.append(driver.extend([[1, 2, 3], [4], [5, 6]], return_all_logits=True))
    logits.append(driver.extend([[7, 8], [9, 10, 11], [12]]))  # the post layer picks the last rows
    logits.append(driver.decode(logits[-1].argmax(-1).tolist()))
    driver.free()
    return logits


def count_launches(monkeypatch) -> Counter:
    """Calls of each Triton op the layers may use (their dispatchers look the names up per call)."""
    calls: Counter = Counter()
    for module, name in [("rmsnorm", "rmsnorm_forward_triton"), ("add_rmsnorm", "add_rmsnorm_forward_triton"),
                         ("rotary_emb", "rotary_emb_fwd_triton"), ("destindex_copy_kv", "destindex_copy_kv_triton"),
                         ("rotary_emb_copy_kv", "rotary_emb_copy_kv_triton")]:
        # import_module: llmserve.kernels.destindex_copy_kv as an attribute is the function, not the module
        mod = importlib.import_module(f"llmserve.kernels.{module}")

        def counted(*args, _fn=getattr(mod, name), _name=name, **kwargs):
            calls[_name.removesuffix("_triton")] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_layers_are_the_plain_path_bitwise(model_dir, triton_backend, monkeypatch, dtype):
    plain = load_ours(model_dir, dtype=dtype, max_running_requests=4)
    unfuse(plain)
    want = run(plain)
    calls = count_launches(monkeypatch)
    got = run(load_ours(model_dir, dtype=dtype, max_running_requests=4))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: {(g != w).sum().item()} logits differ"
    # The fused ops ran: per forward, one plain norm (the first layer's: nothing to add yet), and
    # each layer's rotary and store in one launch.
    forwards = len(got)
    assert calls == Counter(rmsnorm_forward=forwards, add_rmsnorm_forward=2 * LAYERS * forwards,
                            rotary_emb_copy_kv=LAYERS * forwards)


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_one_row_gate_up_and_activation_is_the_plain_path_bitwise(model_dir, triton_backend, monkeypatch, dtype):
    """A batch-1 decode step's MLP runs gemv_act_and_mul (one launch), bitwise what the GEMV and
    silu_and_mul give; a half-precision row, as `takes_gemv` asks."""
    from llmserve.kernels import gemv
    from llmserve.models.llama.layer_infer import transformer_layer_infer

    def one_request(model) -> list[torch.Tensor]:
        driver = BatchDriver(model)
        logits = [driver.prefill(random_prompts([6], VOCAB, seed=4))]
        for _ in range(2):
            logits.append(driver.decode(logits[-1].argmax(-1).tolist()))
        driver.free()
        return logits

    fused_calls = []
    fused_op = gemv.gemv_act_and_mul
    monkeypatch.setattr(transformer_layer_infer, "gemv_act_and_mul",
                        lambda *a, **k: fused_calls.append(a[0].shape) or fused_op(*a, **k))
    got = one_request(load_ours(model_dir, dtype=dtype, max_running_requests=4))
    assert len(fused_calls) == 2 * LAYERS  # the two decode steps; the prefill's rows go the plain way
    monkeypatch.setattr(transformer_layer_infer, "takes_gemv", lambda x, w: False)
    want = one_request(load_ours(model_dir, dtype=dtype, max_running_requests=4))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {step}: {(g != w).sum().item()} logits differ"
