"""dequant_linear (4-bit groups, FP8 blocks, FP8 channels) and fp8_linear: the Triton kernel and
`_scaled_mm` against the torch twins, the twins against independent float64 references."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import CUDA, DEVICE_DTYPES, DEVICES, randn, rng

from llmserve.kernels import linear
from llmserve.kernels import autotune
from llmserve.kernels.dequant_linear import configs_for, dequant_linear_torch, dequant_linear_triton
from llmserve.kernels.fp8_linear import (FP8, _fp8_gemm, fp8_gemm_triton, fp8_linear, fp8_linear_torch,
                                         fp8_linear_w8a8, quantize_fp8_rows_torch, quantize_fp8_rows_triton)
from llmserve.quantization.weights import BlockFp8Weight, Fp8Weight, Int4Weight, pack_int4

ROWS = [1, 3, 20, 70]


def fp8_randn(g, *shape: int, std: float) -> torch.Tensor:
    """Normal FP8 values of standard deviation ``std``, clamped to e4m3's ±448 first: torch's cast
    turns anything past 448 into NaN (0x7F), so an unclamped draw at std 100 holds a NaN about
    once in 270k values, which is what made a 40 x 4096 bf16 case on the GPU go NaN."""
    return (torch.randn(*shape, generator=g) * std).clamp(-448, 448).to(FP8)


def int4_weight(g, n: int, k: int, group: int, device: str) -> tuple[Int4Weight, torch.Tensor]:
    """A random 4-bit weight and its float64 values, computed without the kernels' unpacking."""
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (n, k // group), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
    dense = (q - zeros.repeat_interleave(group, 1)).double() * scales.double().repeat_interleave(group, 1)
    w = Int4Weight(pack_int4(q), scales, zeros.to(torch.uint8), group)
    return w.to(torch.device(device), torch.float32), dense


def block_fp8_weight(g, n: int, k: int, block: tuple[int, int], device: str) -> tuple[BlockFp8Weight, torch.Tensor]:
    q = fp8_randn(g, n, k, std=100)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 0.001
    s_full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return BlockFp8Weight(q, scale, block).to(torch.device(device), torch.float32), q.double() * s_full.double()


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N,K,group", [(48, 256, 128), (40, 96, 32), (8, 64, 64), (16, 64, 16)])
def test_int4_kernel_matches_twin_and_reference(device, dtype, M, N, K, group):
    g = rng(M * N + K)
    w, dense = int4_weight(g, N, K, group, device)
    w = w.to(torch.device(device), dtype)
    x = randn(g, M, K, dtype=dtype, device=device)
    ref = (x.double().cpu() @ dense.t()).to(dtype)
    twin = dequant_linear_torch(x, w.qweight, w.scales, w.zeros, (1, group))
    got = dequant_linear_triton(x, w.qweight, w.scales, w.zeros, (1, group))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(twin.cpu(), ref, **tol)
    torch.testing.assert_close(got.cpu(), ref, **tol)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N,K,block", [(200, 300, (128, 128)), (64, 64, (1, 32))])
def test_block_fp8_kernel_matches_twin_and_reference(device, dtype, M, N, K, block):
    g = rng(M * N + K)
    w, dense = block_fp8_weight(g, N, K, block, device)
    x = randn(g, M, K, dtype=dtype, device=device)
    # The GEMM (M > 1) multiplies the weight in the activations' dtype (the module doc): rounding
    # it to bf16 moves each product by up to 2^-9 of itself, and over K = 300 products of ~N(0, 1)
    # size the sum by ~0.03 whatever the sum's own size; an output near 0 then misses rtol. Round
    # the reference's weight too there, and for the torch twin, which rounds it so at every row
    # count. The one-row GEMV multiplies in float32, unrounded: held to the bf16-rounded weight it
    # is off by that rounding (0.08 at an output of -1.8 here, past the tolerance), so its
    # reference keeps the exact weight, as `test_every_tile_matches_the_reference`'s does.
    rounded = (x.double().cpu() @ dense.to(dtype).double().t()).to(dtype)
    exact = (x.double().cpu() @ dense.t()).to(dtype)
    got = linear(x, w)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(dequant_linear_torch(x, w.weight, w.scale, None, block).cpu(), rounded, **tol)
    torch.testing.assert_close(dequant_linear_triton(x, w.weight, w.scale, None, block).cpu(),
                               rounded if M > 1 else exact, **tol)
    assert got.shape == (M, N)


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, input_scale: float | None) -> torch.Tensor:
    """The W8A8 product in float64: x rounded to FP8 per row (amax / 448) or by the static scale."""
    xd = x.double().cpu()
    s = xd.abs().amax(-1, keepdim=True) / 448 if input_scale is None else torch.full((x.shape[0], 1), input_scale, dtype=torch.float64)
    xq = (xd / s).clamp(-448, 448).float().to(FP8).double()
    return (xq @ q.double().cpu().t()) * s * w_scale.double().cpu()[None, :]


@pytest.mark.parametrize("input_scale", [None, 0.01])
@pytest.mark.parametrize("M", ROWS)
def test_fp8_twin_is_the_w8a8_product(M, input_scale):
    g = rng(M)
    q = fp8_randn(g, 48, 64, std=50)
    ws = torch.rand(48, generator=g) * 0.01 + 0.001
    x = randn(g, M, 64, dtype=torch.float32, device="cpu")
    static = None if input_scale is None else torch.tensor([input_scale])
    torch.testing.assert_close(fp8_linear_torch(x, q, ws, static), w8a8_reference(x, q, ws, input_scale).float(),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="_scaled_mm and the compiled GEMV need a GPU")
@pytest.mark.parametrize("input_scale", [None, 0.01])
@pytest.mark.parametrize("M", ROWS + [512])
@pytest.mark.parametrize("N,K", [(4096, 4096), (48, 96), (40, 72)])
def test_fp8_gpu_paths_match_the_twin(M, N, K, input_scale):
    """Many rows: _scaled_mm's W8A8 (or, for dims not multiples of 16, the dequantizing kernel's
    W8A16); one row: the GEMV (W8A16). Both within bf16 rounding plus an FP8 step of x of the twin."""
    g = rng(M * N)
    q = fp8_randn(g, N, K, std=50).cuda()
    ws = (torch.rand(N, generator=g) * 0.01 + 0.001).cuda()
    x = randn(g, M, K, dtype=torch.bfloat16, device="cuda")
    static = None if input_scale is None else torch.tensor([input_scale], device="cuda")
    got = fp8_linear(x, q, ws, static)
    want = fp8_linear_torch(x, q, ws, static)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 3e-2, err


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_fp8_one_row_gemv_matches_the_dequantized_product(device, dtype):
    g = rng(7)
    q = fp8_randn(g, 40, 96, std=50)
    ws = torch.rand(40, generator=g) * 0.01 + 0.001
    x = randn(g, 1, 96, dtype=dtype, device=device)
    got = dequant_linear_triton(x, q.to(device), ws.to(device).view(-1, 1), None, (1, 96))
    ref = (x.double().cpu() @ (q.double() * ws.double()[:, None]).t()).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.cpu(), ref, **tol)


def test_linear_runs_each_weight_class_with_a_bias():
    g = rng(3)
    w, dense = int4_weight(g, 16, 64, 32, "cpu")
    x, bias = torch.randn(2, 64, generator=g), torch.randn(16, generator=g)
    torch.testing.assert_close(linear(x, w, bias), (x.double() @ dense.t() + bias.double()).float(), atol=1e-4, rtol=1e-4)
    f = Fp8Weight(fp8_randn(g, 16, 64, std=50), torch.full((16,), 0.01))
    torch.testing.assert_close(linear(x, f, bias), fp8_linear_torch(x, f.weight, f.weight_scale, None) + bias)


# Every tile the autotuner may pick, for each format and each row bucket (1: the GEMV; then the
# GEMM's 16, 32, 64 and 128-and-more buckets): K = 4096 lets the GEMV's widest K steps fit, 512 the
# GEMM's; N = 40 leaves every BLOCK_N a ragged last tile.
FORMATS = ["int4-g128", "int4-one-group", "fp8-block", "fp8-channel"]


def format_weight(fmt: str, g, n: int, k: int, device: str):
    """(weight, scale, zeros, block) of format ``fmt`` and its float64 values."""
    if fmt.startswith("int4"):
        w, dense = int4_weight(g, n, k, 128 if fmt == "int4-g128" else k, device)
        return (w.qweight, w.scales, w.zeros, (1, w.group)), dense
    if fmt == "fp8-block":
        w, dense = block_fp8_weight(g, n, k, (128, 128), device)
        return (w.weight, w.scale, None, w.block), dense
    q = fp8_randn(g, n, k, std=50)
    ws = torch.rand(n, 1, generator=g) * 0.01 + 0.001
    return (q.to(device), ws.to(device), None, (1, k)), q.double() * ws.double()


def fenced(t: torch.Tensor, pad: int = 32) -> torch.Tensor:
    """``t`` (2-D) as a view inside a larger buffer whose row above, row below and ``pad``
    columns either side hold NaN (0xFF for integers): a kernel that reads past an operand's
    extent, or takes its row stride for its width, gets NaN or a wrong value, in the interpreter
    as on the GPU (where an unmasked read past a tensor's end finds whatever the allocator left)."""
    buf = torch.empty(t.shape[0] + 2, t.shape[1] + 2 * pad, dtype=t.dtype, device=t.device)
    if t.is_floating_point():
        buf.view(torch.uint8).fill_(0x7F) if t.element_size() == 1 else buf.fill_(float("nan"))
    else:
        buf.fill_(0xFF)
    view = buf[1:-1, pad:-pad]
    view.copy_(t)
    return view


def tile_error(config, got: torch.Tensor) -> str:
    """A failed tile, said so that the cause can be told from the GPU's log: its sizes and where
    the output is NaN."""
    bad = got.isnan().nonzero()[:, -1].tolist()
    return f"{config.kwargs}, num_warps={config.num_warps}: NaN at output features {bad[:16]} of {got.shape[-1]}"


@pytest.mark.parametrize("device,dtype", [p for p in DEVICE_DTYPES if p.values[1] != torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [1, 5, 20, 40, 130])
def test_every_tile_matches_the_reference(device, dtype, fmt, M):
    K = 4096 if M == 1 else 512
    g = rng(M + K)
    (w, scale, zeros, block), dense = format_weight(fmt, g, 40, K, device)
    if scale.is_floating_point() and w.dtype == torch.uint8:
        scale = scale.to(dtype)               # 4-bit scales run in the activations' dtype (Int4Weight.to)
    x = randn(g, M, K, dtype=dtype, device=device)
    # The GEMM rounds the dequantized weight to x's dtype before the dot; the GEMV does not.
    ref = (x.double().cpu() @ dense.to(dtype if M > 1 else torch.float64).double().t())
    # Every operand fenced by NaN: no tile may read past one (ragged rows, K tails, scale blocks).
    w, scale, x = fenced(w), fenced(scale), fenced(x)
    zeros = None if zeros is None else fenced(zeros)
    configs = configs_for(x, w, scale, block)
    assert len(configs) >= 3
    for config in configs:
        got = dequant_linear_triton(x, w, scale, zeros, block, config=config).double().cpu()
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 4e-3, (tile_error(config, got), err)


def test_row_buckets():
    assert [autotune.rows_bucket(m) for m in (2, 16, 17, 33, 64, 65, 129, 300, 9000)] == [16, 16, 32, 64, 64, 128, 256,
                                                                                          512, 512]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("input_scale", [None, 0.01])
@pytest.mark.parametrize("M,K", [(1, 64), (3, 300), (17, 4100)])
def test_fp8_activation_quantization_kernel_is_the_twin_bit_for_bit(device, dtype, input_scale, M, K):
    g = rng(M * K)
    x = randn(g, M, K, dtype=dtype, device=device, scale=3.0)
    x[0, :] = 0                                           # an all-zero row: the smallest scale, not NaN
    static = None if input_scale is None else torch.tensor([input_scale], device=device)
    q, s = quantize_fp8_rows_triton(x, static)
    want_q, want_s = quantize_fp8_rows_torch(x, static)
    assert q.shape == (M, K) and s.shape == (M, 1) and s.is_contiguous() and q.is_contiguous()
    assert torch.equal(s.cpu(), want_s.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), want_q.view(torch.uint8).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,K", [(5, 512), (20, 300), (40, 512), (130, 512)])
def test_every_triton_w8a8_tile_is_the_w8a8_product(device, M, K):
    g = rng(M * K)
    q = fp8_randn(g, 48, K, std=50).to(device)
    ws = (torch.rand(48, generator=g) * 0.01 + 0.001).to(device)
    xq, xs = quantize_fp8_rows_torch(randn(g, M, K, dtype=torch.float32, device=device, scale=3.0), None)
    want = (xq.double() @ q.double().t()) * xs.double() * ws.double()[None, :]
    configs = _fp8_gemm.early_config_prune(_fp8_gemm.configs, {"K": K, "ROWS": autotune.rows_bucket(M)})
    assert len(configs) >= 3
    for config in configs:
        got = fp8_gemm_triton(xq, xs.contiguous(), q, ws, torch.float32, config=config)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=str(config))


@pytest.mark.skipif(not CUDA, reason="the W8A8 paths need a GPU")
@pytest.mark.parametrize("gemm", ["scaled_mm", "triton"])
@pytest.mark.parametrize("M", [2, 17, 128, 512])
def test_w8a8_gemms_match_the_twin(gemm, M):
    g = rng(M)
    q = fp8_randn(g, 4096, 1024, std=50).cuda()
    ws = (torch.rand(4096, generator=g) * 0.01 + 0.001).cuda()
    x = randn(g, M, 1024, dtype=torch.bfloat16, device="cuda")
    got = fp8_linear_w8a8(x, q, ws, None, gemm)
    want = fp8_linear_torch(x, q, ws, None)
    assert got.dtype == torch.bfloat16 and got.shape == (M, 4096)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.parametrize("device,dtype", [p for p in DEVICE_DTYPES if p.values[1] != torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul_gemv_is_the_linear_then_the_activation(device, dtype, fmt, act):
    # gate_up of 2 x 40 rows: every tile's ragged last program holds rows of gate and of up.
    from llmserve.kernels.dequant_linear import dequant_gemv_act_and_mul_triton
    from llmserve.kernels.gemv import ACTIVATIONS

    K = 512
    g = rng(K + len(fmt))
    (w, scale, zeros, block), dense = format_weight(fmt, g, 80, K, device)
    if fmt == "fp8-block":      # a gate_up fused from two block-FP8 weights has a scale a row
        w8 = BlockFp8Weight(w, scale, block).per_row()
        scale, block = w8.scale, w8.block
    if scale.is_floating_point() and w.dtype == torch.uint8:
        scale = scale.to(dtype)
    x = randn(g, 1, K, dtype=dtype, device=device)
    # What the unfused path computes: the GEMV (rounded to x's dtype), then the activation's twin.
    want = ACTIVATIONS[act](dequant_linear_triton(x, w, scale, zeros, block).cpu())
    configs = configs_for(x, w, scale, block)
    for config in configs:
        got = dequant_gemv_act_and_mul_triton(x, w, scale, zeros, block, act, config=config).cpu()
        assert got.shape == (1, 40)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    ref = ACTIVATIONS[act]((x.double().cpu() @ dense.t()).to(dtype))
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("device,dtype", [p for p in DEVICE_DTYPES if p.values[1] != torch.float32])
def test_each_weight_class_fuses_its_gate_up_activation_at_one_row(device, dtype):
    # What the llama MLP calls for a quantized gate_up at one row on the Triton backend: the
    # fused kernel, which must be the linear layer then the activation.
    from llmserve.kernels import backend
    from llmserve.kernels.gemv import ACTIVATIONS
    from llmserve.quantization.config import quantize_fp8, quantize_fp8_blocks, quantize_int4

    g = rng(5)
    dense = torch.randn(256, 128, generator=g) * 0.05
    x = randn(g, 1, 128, dtype=dtype, device=device)
    # Quantized as the loader does, on the CPU before the backend is forced (quantize_fp8 runs the
    # activation-quantization kernel, which the Triton backend would launch on CPU tensors).
    weights = []
    for quantize in (quantize_int4, quantize_fp8, quantize_fp8_blocks):
        halves = [quantize(dense[:128]), quantize(dense[128:])]
        weights.append(type(halves[0]).cat(halves).to(torch.device(device), dtype))
    backend.set_backend("triton")
    try:
        for w in weights:
            got = w.act_and_mul(x, "silu")
            assert got.shape == (1, 128)
            torch.testing.assert_close(got.float(), ACTIVATIONS["silu"](w.apply(x)).float(), atol=2e-2, rtol=2e-2)
    finally:
        backend.set_backend(None)
