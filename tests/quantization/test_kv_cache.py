"""``--kv-cache-dtype fp8``: the pool in float8 holds more tokens in the same bytes, a checkpoint's
KV-cache scales are read (compressed-tensors' ``kv_cache_scheme``, as llm-compressor writes it),
what cannot run is refused at load, and the server runs it (its /info and start-up line, and its
greedy tokens those of the same model in-process). The kernels' own tests are in tests/kernels/;
the accuracy on real weights in test_accuracy."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from llmserve.common.basemodel.basemodel import DEFAULT_CPU_KV_TOKENS
from llmserve.common.errors import ModelLoadError
from llmserve.common.mem_manager import kv_bytes_per_token
from parity_utils import BatchDriver, build_tiny_hf_model, load_ours
from serving_utils import ServerProcess

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512)
KV_ONLY = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
           "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv")
    build_tiny_hf_model(LlamaConfig(**TINY), path)
    return path


def with_scales(src, dst, quantization_config: dict, scales: dict[str, torch.Tensor]):
    """A copy of the checkpoint ``src`` with KV-cache scale tensors and a quantization_config."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    save_file({**load_file(dst / "model.safetensors"), **scales}, str(dst / "model.safetensors"))
    return dst


def cpu_model(path, **kw):
    return load_ours(path, device="cpu", dtype=kw.pop("dtype", torch.float32), **kw)


def test_the_pool_holds_twice_a_bf16_pools_tokens_in_its_bytes(tiny_dir):
    """Sized from bytes (the GPU's free memory; the CPU's default in the model's dtype's bytes)."""
    pools = {kv: cpu_model(tiny_dir, dtype=torch.bfloat16, kv_cache_dtype=kv, max_total_token_num=None)
             for kv in ("auto", "fp8")}
    assert pools["auto"].max_total_token_num == DEFAULT_CPU_KV_TOKENS
    assert pools["fp8"].max_total_token_num == 2 * DEFAULT_CPU_KV_TOKENS
    (a, f) = (m.mem_manager for m in pools.values())
    assert f.kv_buffer[0].dtype == torch.float8_e4m3fn
    assert sum(t.nbytes for t in f.kv_buffer) == sum(t.nbytes for t in a.kv_buffer)
    assert kv_bytes_per_token(32, 8, 128, torch.bfloat16) == 2 * kv_bytes_per_token(32, 8, 128, torch.float8_e4m3fn)


def test_a_checkpoints_scales_are_read(tiny_dir, tmp_path):
    """Both names llm-compressor has written them under; a scale per head becomes their largest.
    Without --kv-cache-dtype fp8 the scales are read past and the cache is the model's dtype."""
    path = with_scales(tiny_dir, tmp_path / "ckpt", KV_ONLY, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125]),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.0625, 0.75]),
    })
    model = cpu_model(path, kv_cache_dtype="fp8")
    assert model.mem_manager.kv_scales == [(0.5, 0.25), (0.125, 0.75)]
    assert model.kv_cache_description == "fp8_e4m3 (the checkpoint's scales)"
    assert model.quantization.description.startswith("compressed-tensors: dense weights")
    plain = cpu_model(path)
    assert plain.mem_manager.kv_scales == [(1.0, 1.0)] * 2 and plain.kv_cache_description == "float32"
    # the scales are used: the same prompt's logits move with them, and stay near the plain model's
    prompt = [[5, 17, 99, 3, 42, 7, 200, 11]]
    got, want = (BatchDriver(m).prefill(prompt, return_all_logits=True) for m in (model, plain))
    unscaled = BatchDriver(cpu_model(tiny_dir, kv_cache_dtype="fp8")).prefill(prompt, return_all_logits=True)
    assert not torch.equal(got, unscaled)
    torch.testing.assert_close(got, want, atol=0.5, rtol=0.1)


@pytest.mark.parametrize("scheme, scales, flag, message", [
    ({**KV_ONLY, "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, {}, "fp8",
     "kv_cache_scheme is int 8-bit per tensor"),
    (KV_ONLY, {"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, "fp8", "scales must be positive"),
    (KV_ONLY, {}, "fp8_e5m2", "unknown --kv-cache-dtype 'fp8_e5m2'"),
], ids=["int8-scheme", "zero-scale", "e5m2"])
def test_what_cannot_run_is_refused_at_load(tiny_dir, tmp_path, scheme, scales, flag, message):
    path = with_scales(tiny_dir, tmp_path / "ckpt", scheme, scales)
    with pytest.raises(ModelLoadError, match=message):
        cpu_model(path, kv_cache_dtype=flag)


# -- the server --------------------------------------------------------------------------------------
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--kv-cache-dtype", "fp8") as server:
        yield server


def greedy_in_process(model, prompt: list[int]) -> list[int]:
    driver = BatchDriver(model)
    try:
        out = [int(driver.prefill([prompt])[-1].argmax())]
        while len(out) < MAX_NEW:
            out.append(int(driver.decode([out[-1]])[-1].argmax()))
    finally:
        driver.free()
    return out


def test_the_server_runs_the_fp8_cache(server, tiny_llama_dir):
    info = httpx.get(server.url + "/info").json()
    assert info["kv_cache_dtype"] == "fp8_e4m3 (scales 1.0: the checkpoint has none)"
    tokens = 4 * DEFAULT_CPU_KV_TOKENS      # float32's bytes on the CPU, in float8
    assert info["kv_cache_tokens"] == tokens and f"KV cache {tokens} tokens in fp8_e4m3" in server.output()
    fp8, plain = (cpu_model(tiny_llama_dir, kv_cache_dtype=kv) for kv in ("fp8", "auto"))
    agree = total = 0
    for text in PROMPTS:
        r = httpx.post(server.url + "/generate", timeout=120, json={"inputs": text, "parameters": {
            "max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prompt, served = [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]]
        assert served == greedy_in_process(fp8, prompt)      # the server's cache is the float8 one
        unquantized = greedy_in_process(plain, prompt)
        same = next((i for i, (a, b) in enumerate(zip(served, unquantized)) if a != b), MAX_NEW)
        agree, total = agree + same, total + MAX_NEW
    print(f"\ngreedy tokens through the server with --kv-cache-dtype fp8: {agree} of {total} the unquantized "
          "cache's before the first difference")
