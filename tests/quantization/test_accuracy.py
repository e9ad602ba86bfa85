"""Accuracy of each format on real weights: the embedded SmolLM2-135M (its GGUF dequantized to an HF
float32 directory), written in each format as its publishers write it, scores a page and a half
of plain English (`data/plain_english.txt`, 748 tokens) with prompt logprobs, as
``/v1/completions`` with ``echo`` and ``logprobs`` does; held against the unquantized model (scored
once for the module): top-1 agreement (the most likely next token the same), the mean |difference|
of the text's logprobs printed (``-s``). The issue asks 93% for FP8 with dynamic activations and
85% for 4-bit; the floors below are what was measured, rounded down, and the README's table says
where they fall short and why. ``kv-fp8`` is the unquantized weights with ``--kv-cache-dtype fp8``
(float8 K and V, scales 1.0 as without calibrated ones): the prompt's own K and V are read back
from the float8 cache, so its logprobs carry the cache's rounding as decoding does.

The 4-bit checkpoint is calibrated as GPTQ calibrates: its algorithm (`quant_utils`), on another
text (`data/calibration.txt`, 370 tokens), the statistics gathered once for the module. SmolLM2's hidden size is 576, which groups of 128 do not divide: the
4-bit formats use groups of 64 here (AutoAWQ and GPTQ refuse 128 on it too).

Time (measured on the shared 2-core machine at load 8): 195 s wall, 147 s of CPU; of it GPTQ's
writing 53 s, each scoring ~20 s, the GGUF's conversion and the calibration ~15 s each."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from parity_utils import BatchDriver, load_ours
from quant_utils import Calibration, calibrate, dequantize_int4, gptq_quantize, quantize_int4, write_quantized
from safetensors.torch import save_file

DATA = Path(__file__).parent / "data"
TEXT = (DATA / "plain_english.txt").read_text()
CALIBRATION_TEXT = (DATA / "calibration.txt").read_text()   # another text: GPTQ fits on it
# Measured (CPU, float32): FP8 dynamic 92.5% (compressed-tensors' own forward gives the same: the
# model, not our numerics), block FP8 93.6%, GPTQ 74.0% (round-to-nearest: 72.6%). AWQ's loader
# makes the same weight of the same values as GPTQ's (test_formats), so it is not scored twice.
# The 85% for 4-bit is past what GPTQ reaches on this 135M model (HF's forward, groups of
# 64, 2026-11-28): calibrated on the scored text itself, an upper bound no real calibration
# reaches, 78.3%; on the 370 tokens here 74.8%; on those plus the GPL-3 text (7,658 tokens of
# legal English) 70.4%, and with 10x the damping 73.4%; in groups of 32 (published too, 1.3x the
# scales' bytes) on the 370 tokens, 78.8% (2026-11-28, session 38).
# The CPU's own kernels move near-ties: on another machine (AMD EPYC, AVX-512, 2026-11-28) the same
# code and packages scored FP8 dynamic 91.4% (mean |d logprob| 0.152 against 0.154), block FP8
# 93.6%, GPTQ 74.7% and the float8 KV cache 95.3% (0.072 against 0.067), so FP8 dynamic's floor
# sits below both.
FLOORS = {"fp8-dynamic": 0.91, "fp8-block": 0.93, "gptq": 0.73}
# The float8 KV cache with the unquantized weights, scales 1.0: 95.3%, mean |d logprob| 0.067.
KV_FP8_FLOOR = 0.95


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory, default_model_checkpoint, smollm2_tokenizer) -> Path:
    ckpt = default_model_checkpoint
    path = tmp_path_factory.mktemp("smollm2")
    (path / "config.json").write_text(json.dumps({**ckpt.config, "architectures": ["LlamaForCausalLM"]}))
    save_file({k: v.contiguous() for k, v in ckpt.tensors.items()}, str(path / "model.safetensors"))
    smollm2_tokenizer.save_pretrained(path)
    return path


def text_logprobs(path: Path, tokens: list[int], **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each next token of the text, the most likely next token), as prompt logprobs."""
    model = load_ours(path, device="cpu", dtype=torch.float32, max_total_token_num=len(tokens) + 16, **kw)
    driver = BatchDriver(model)
    try:
        logp = torch.log_softmax(driver.prefill([tokens], return_all_logits=True)[:-1].float(), dim=-1)
    finally:
        driver.free()
    return logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0], logp.argmax(-1)


@pytest.fixture(scope="module")
def reference(smollm2_dir, smollm2_tokenizer):
    tokens = smollm2_tokenizer(TEXT)["input_ids"]
    return tokens, *text_logprobs(smollm2_dir, tokens)


@pytest.fixture(scope="module")
def calibration(smollm2_dir, smollm2_tokenizer) -> Calibration:
    start = time.perf_counter()
    cal = calibrate(smollm2_dir, smollm2_tokenizer(CALIBRATION_TEXT)["input_ids"])
    print(f"\ncalibration: {time.perf_counter() - start:.1f} s")
    return cal


@pytest.mark.parametrize("fmt", list(FLOORS))
def test_format_keeps_the_models_predictions(fmt, smollm2_dir, reference, calibration, tmp_path):
    start = time.perf_counter()
    if fmt == "fp8-dynamic":
        # --quantization fp8 at load: the same numbers as compressed-tensors' FP8_DYNAMIC preset
        # (per-channel amax / 448, per-token activations), without writing 0.5 GB; test_formats
        # holds that checkpoint's loading against HF.
        path, kw = smollm2_dir, {"quantization": "fp8"}
    else:
        path, kw = tmp_path, {}
        write_quantized(smollm2_dir, tmp_path, fmt, group=64, calibration=calibration)
    written = time.perf_counter()
    agree = score(fmt, reference, path, **kw)
    print(f"(written in {written - start:.1f} s, scored in {time.perf_counter() - written:.1f} s)")
    assert agree >= FLOORS[fmt]


def test_fp8_kv_cache_keeps_the_models_predictions(smollm2_dir, reference):
    """--kv-cache-dtype fp8 on the unquantized weights (scales 1.0: the GGUF has none)."""
    assert score("kv-fp8", reference, smollm2_dir, kv_cache_dtype="fp8") >= KV_FP8_FLOOR


def score(name: str, reference, path: Path, **kw) -> float:
    """Top-1 agreement of the model at ``path`` (loaded with ``kw``) with the reference's
    predictions on the text; printed with the mean |difference| of the text's logprobs."""
    tokens, ref_logp, ref_top = reference
    logp, top = text_logprobs(path, tokens, **kw)
    agree = (top == ref_top).float().mean().item()
    delta = (logp - ref_logp).abs().mean().item()
    print(f"\n{name}: {len(tokens) - 1} tokens, top-1 agreement {agree:.1%}, mean |d logprob| {delta:.4f}, "
          f"text logprob {logp.sum():.1f} vs {ref_logp.sum():.1f}", end=" ")
    return agree


def test_gptq_beats_round_to_nearest_on_a_layer(calibration, smollm2_dir):
    """GPTQ's error feedback lowers the layer's output error (dW H dW^T) below rounding each weight."""
    from safetensors import safe_open

    name = "model.layers.3.mlp.down_proj"
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name + ".weight")
    h = calibration.hessian[name]

    def error(q, z, s):
        dw = dequantize_int4(q, z, s, 64) - w
        return ((dw @ h) * dw).sum().item()

    gptq, rtn = error(*gptq_quantize(w, h, 64)), error(*quantize_int4(w, 64))
    print(f"\n{name}: output error GPTQ {gptq:.3g}, round-to-nearest {rtn:.3g}")
    assert gptq < 0.8 * rtn
