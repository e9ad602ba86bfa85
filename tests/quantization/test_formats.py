"""Each quantized checkpoint format, written the way its publishers write it (tests/quant_utils.py),
loaded by our model and held against HF transformers running the weights those tensors stand for
(dequantized by the writer's own arithmetic) and, for FP8 activations, quantizing each linear
layer's input as the format defines (per token, or by the static scale)."""

from __future__ import annotations

import json

import pytest
import torch
from parity_utils import LOGITS_TOL, TEST_DEVICE, BatchDriver, build_tiny_hf_model, hf_greedy_with_logits, load_ours, rel_err
from quant_utils import FORMATS, LINEARS, static_input_scale, write_quantized
from transformers import AutoModelForCausalLM, LlamaConfig

from llmserve.common.errors import ModelLoadError
from llmserve.quantization.weights import BlockFp8Weight, Fp8Weight, Int4Weight

PROMPTS = [[5, 17, 30, 2, 9, 100, 3], [4, 4, 4], list(range(10, 31))]
STEPS = 6
FP8_MAX = 448.0
WEIGHT_CLASS = {"ct-fp8-dynamic": Fp8Weight, "ct-fp8-static": Fp8Weight, "fp8-block": BlockFp8Weight,
                "awq": Int4Weight, "gptq": Int4Weight, "on-load": Fp8Weight}
# Weight-only formats are exact to float32 rounding. W8A8 formats are not: an activation a float32
# rounding away from an FP8 rounding boundary may round the other way (a step of 1/16 of its
# value), and the next layers' inputs then differ by more, so the flips multiply along the
# layers (measured: 1 of 896 inputs of layer 0's o_proj, 911 of 1792 of layer 1's down_proj,
# logits 0.4% apart, with weights 3x larger than `dense_dir`'s). A wrong scale is an O(1) error.
TOL = {"ct-fp8-dynamic": 1e-3, "ct-fp8-static": 1e-3, "on-load": 1e-3, "fp8-block": 1e-4, "awq": 1e-4, "gptq": 1e-4}


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """The tiny model with its linear layers' weights a third of the parity tests' (std 0.05): at
    0.15 each layer amplifies a difference in its input so much that one FP8 rounding flip in
    layer 0 moves the logits by percents, as much as a wrong scale would."""
    path = tmp_path_factory.mktemp("dense")
    model = build_tiny_hf_model(tiny_config(), path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-2] in LINEARS:
                p.mul_(1 / 3)
    model.save_pretrained(path)
    return path


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def reference(dense_dir, ref_weights: dict[str, torch.Tensor], acts: str | None):
    """HF's model with the linear weights ``ref_weights``; ``acts`` "dynamic" / "static": each
    linear layer's input rounded to FP8 first, per token or by the layer's static scale."""
    hf = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in ref_weights:
                p.copy_(ref_weights[name])
    for name, mod in hf.named_modules():
        if acts is None or name.split(".")[-1] not in LINEARS:
            continue
        if acts == "dynamic":
            def hook(m, args):
                x = args[0]
                return (fake_quant_fp8(x, (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12 / FP8_MAX)),)
        else:
            def hook(m, args, s=static_input_scale(name)):
                return (fake_quant_fp8(args[0], torch.tensor(s)),)
        mod.register_forward_pre_hook(hook)
    return hf


def on_load_reference(dense_dir) -> dict[str, torch.Tensor]:
    """--quantization fp8's weights: each row rounded to FP8 at scale amax / 448."""
    hf = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32)
    out = {}
    for name, p in hf.named_parameters():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            s = (p.detach().abs().amax(1, keepdim=True) / FP8_MAX)
            out[name] = fake_quant_fp8(p.detach(), s)
    return out


@pytest.fixture(scope="module", params=list(FORMATS) + ["on-load"])
def case(request, dense_dir, tmp_path_factory):
    fmt = request.param
    if fmt == "on-load":
        return fmt, dense_dir, on_load_reference(dense_dir), load_ours(dense_dir, quantization="fp8")
    path = tmp_path_factory.mktemp(fmt)
    ref = write_quantized(dense_dir, path, fmt)
    return fmt, path, ref, load_ours(path)


def test_quantized_model_matches_hf_on_the_weights_it_stands_for(case, dense_dir):
    fmt, _, ref_weights, ours = case
    acts = {"ct-fp8-dynamic": "dynamic", "on-load": "dynamic", "ct-fp8-static": "static"}.get(fmt)
    hf = reference(dense_dir, ref_weights, acts)
    tol = max(TOL[fmt], LOGITS_TOL)
    refs = [hf_greedy_with_logits(hf, p, STEPS + 1) for p in PROMPTS]
    driver = BatchDriver(ours)
    errors = []
    try:
        logits = driver.prefill(PROMPTS)
        for step in range(STEPS + 1):
            for i, (_, ref_logits) in enumerate(refs):
                err = rel_err(logits[i].float().cpu(), ref_logits[step])
                errors.append(err)
                assert err < tol, (fmt, step, i)
            if step < STEPS:
                logits = driver.decode([tokens[step] for tokens, _ in refs])
    finally:
        driver.free()
    print(f"{fmt}: logits relative error mean {sum(errors) / len(errors):.2e}, max {max(errors):.2e}")


def test_linear_weights_stay_quantized_and_the_rest_dense(case):
    fmt, _, _, ours = case
    layer = ours.trans_layers_weight[0]
    for w in (layer.qkv_weight_, layer.o_weight_, layer.gate_up_weight_, layer.down_weight_):
        assert isinstance(w, WEIGHT_CLASS[fmt])
    assert isinstance(ours.pre_post_weight.lm_head_weight_, torch.Tensor)
    assert isinstance(ours.pre_post_weight.wte_weight_, torch.Tensor)
    dense = layer.gate_up_weight_.shape.numel() * 4
    assert layer.gate_up_weight_.nbytes < dense * (0.3 if fmt in ("awq", "gptq") else 0.55)
    assert ours.quantization is not None and ours.quantization.description


def test_static_scales_of_fused_layers_are_their_largest(case):
    fmt, _, _, ours = case
    if fmt != "ct-fp8-static":
        pytest.skip("static activation scales only")
    qkv = ours.trans_layers_weight[1].qkv_weight_
    assert float(qkv.input_scale) == pytest.approx(static_input_scale("model.layers.1.self_attn.q_proj"))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_variants_fail_at_load_with_the_reason(dense_dir, tmp_path):
    write_quantized(dense_dir, tmp_path, "gptq")
    _edit_config(tmp_path, desc_act=True)
    with pytest.raises(ModelLoadError, match="desc_act"):
        load_ours(tmp_path)
    _edit_config(tmp_path, desc_act=False, bits=3)
    with pytest.raises(ModelLoadError, match="3-bit"):
        load_ours(tmp_path)
    _edit_config(tmp_path, bits=4)
    with pytest.raises(ModelLoadError, match="does not match"):
        load_ours(tmp_path, quantization="awq")
    with pytest.raises(ModelLoadError, match="needs a awq checkpoint"):
        load_ours(dense_dir, quantization="awq")


def test_a_layer_missing_its_scales_is_named(dense_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    write_quantized(dense_dir, tmp_path, "fp8-block")
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj lacks weight_scale_inv"):
        load_ours(tmp_path)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the device is the parity tests' business")
def test_awq_and_gptq_of_the_same_values_load_alike(dense_dir, tmp_path):
    write_quantized(dense_dir, tmp_path / "awq", "awq")
    write_quantized(dense_dir, tmp_path / "gptq", "gptq")
    a, g = load_ours(tmp_path / "awq"), load_ours(tmp_path / "gptq")
    wa, wg = a.trans_layers_weight[0].gate_up_weight_, g.trans_layers_weight[0].gate_up_weight_
    for field in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(wa, field), getattr(wg, field))


def test_warm_up_runs_each_distinct_weight_at_every_row_bucket(monkeypatch):
    from llmserve.kernels.autotune import ROW_BUCKETS
    from llmserve.quantization import weights
    from llmserve.quantization.config import quantize_fp8, quantize_int4

    calls = []
    monkeypatch.setattr(weights.Int4Weight, "apply", lambda self, x: calls.append(("int4", x.shape)))
    monkeypatch.setattr(weights.Fp8Weight, "apply", lambda self, x: calls.append(("fp8", x.shape)))
    w = torch.randn(32, 256)
    int4, fp8 = quantize_int4(w), quantize_fp8(w)
    # Two layers' copies of each weight, a dense tensor and a non-weight: each format runs once.
    assert weights.warm_up([int4, fp8, quantize_int4(w), quantize_fp8(w), w, 3], torch.float32) == 2
    assert [(f, s[0]) for f, s in calls] == [(f, m) for f in ("int4", "fp8") for m in (1, *ROW_BUCKETS)]
    assert all(s[1] == 256 for _, s in calls)


def test_warm_up_runs_each_distinct_gate_up_fused_with_its_activation(monkeypatch):
    from llmserve.quantization import weights
    from llmserve.quantization.config import quantize_fp8

    calls = []
    monkeypatch.setattr(weights.Fp8Weight, "apply", lambda self, x: None)
    monkeypatch.setattr(weights.Fp8Weight, "act_and_mul", lambda self, x, act: calls.append((act, tuple(x.shape))))
    w = quantize_fp8(torch.randn(64, 256))
    gate_ups = [(w, "silu"), (quantize_fp8(torch.randn(64, 256)), "silu"), (w, "gelu_tanh"), (torch.randn(64, 256), "silu")]
    weights.warm_up([w], torch.float32, gate_ups=gate_ups)
    assert calls == [("silu", (1, 256)), ("gelu_tanh", (1, 256))]
