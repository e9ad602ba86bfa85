"""fused_moe: the twin against a per-token float64 reference, Triton (both paths: the GEMVs for a
few tokens, the grouped GEMM) against the twin (the align kernel's blocks checked on their own)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import DEVICE_DTYPES, DEVICES, randn, rng, tol

from llmserve.kernels.fused_moe import (
    GEMV_MAX_TOKENS,
    fused_moe_gemv,
    fused_moe_grouped,
    fused_moe_torch,
    fused_moe_triton,
    moe_align,
    moe_align_sorting,
)
from llmserve.kernels.moe_route import select_experts_torch

# (tokens, hidden, intermediate, experts, top_k): a decode-sized batch, more rows than one block
# for some experts, widths that are no power of two, a single token; by rows per expert the
# three tile configurations (16, 32 and 64 rows a block); more pairs than ALIGN_KERNEL_MAX_PAIRS
# (a prefill: torch's sort aligns them)
SHAPES = [(1, 64, 32, 8, 2), (5, 48, 40, 4, 2), (40, 64, 96, 6, 3), (130, 32, 32, 4, 2), (2100, 16, 16, 4, 2)]


def make_inputs(n, H, I, E, k, dtype, device, seed=0):
    g = rng(seed)
    x = randn(g, n, H, dtype=dtype, device=device)
    w13 = randn(g, E, 2 * I, H, dtype=dtype, device=device, scale=H ** -0.5)
    w2 = randn(g, E, H, I, dtype=dtype, device=device, scale=I ** -0.5)
    weights, ids = select_experts_torch(randn(g, n, E, dtype=torch.float32, device=device), k, renormalize=True)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids):
    """Each token on its own, in float64."""
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gu = w13[e].double() @ x[t].double()
            out[t] += weights[t, slot].double() * (w2[e].double() @ (F.silu(gu[:I]) * gu[I:]))
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_twin_matches_reference(shape):
    inputs = make_inputs(*shape, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(fused_moe_torch(*inputs).double(), reference(*inputs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_twin(device, dtype, shape):
    inputs = make_inputs(*shape, dtype=dtype, device=device, seed=1)
    got = fused_moe_triton(*inputs)
    assert got.dtype == dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got, fused_moe_torch(*inputs), **tol(dtype))


# (tokens, hidden, intermediate, experts, top_k): a few tokens, some sharing an expert; widths
# that no chunk divides (masked K) and that one does; top 1 (a padded slot) and top 3
FEW_TOKEN_SHAPES = [(1, 64, 32, 8, 2), (3, 40, 72, 4, 3), (GEMV_MAX_TOKENS, 128, 64, 6, 1)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("shape", FEW_TOKEN_SHAPES)
@pytest.mark.parametrize("path", [fused_moe_gemv, fused_moe_grouped], ids=["gemv", "grouped"])
def test_both_paths_match_twin_at_a_few_tokens(device, dtype, shape, path):
    """The GEMVs run up to GEMV_MAX_TOKENS tokens, the grouped GEMM above: at a few tokens both
    must agree with the twin (the benchmark times both there to place the switch)."""
    inputs = make_inputs(*shape, dtype=dtype, device=device, seed=2)
    got = path(*inputs)
    assert got.dtype == dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got, fused_moe_torch(*inputs), **tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_tiles_that_split_k_give_the_same_sums(device):
    """Narrow chunks (several trips over K, a masked last one) sum as one wide chunk does."""
    inputs = make_inputs(2, 200, 100, 4, 2, dtype=torch.float32, device=device, seed=3)
    wide = fused_moe_gemv(*inputs, gate_up_tiles=(4, 256, 4), down_tiles=(4, 128, 4))
    narrow = fused_moe_gemv(*inputs, gate_up_tiles=(2, 64, 1), down_tiles=(8, 32, 2))
    torch.testing.assert_close(narrow, wide, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_align_sorts_every_pair_into_its_experts_blocks(device):
    """Each expert's pairs fill whole blocks of that expert, in pair order; the rest is padding."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=device)  # pairs 0..7, row-major
    sorted_pairs, block_expert, num_padded = moe_align(ids, num_experts=5, block_m=2)
    used = int(num_padded)
    assert used == 2 + 2 + 2 + 4  # expert 4 has none; expert 3's four pairs fill two blocks
    rows = sorted_pairs[:used].view(-1, 2).tolist()
    assert block_expert[: used // 2].tolist() == [0, 1, 2, 3, 3]
    P = ids.numel()
    assert rows == [[1, 4], [3, P], [7, P], [0, 2], [5, 6]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("P,E,block_m", [(12, 5, 2), (300, 16, 16), (2000, 128, 16), (900, 6, 64)])
def test_align_kernel_and_sort_agree(device, P, E, block_m):
    """The two ways to align (the one-program kernel for decode, torch's sort past
    ALIGN_KERNEL_MAX_PAIRS) give the same blocks."""
    ids = torch.randint(0, E, (P,), generator=rng(P)).to(device)
    num_blocks = -(-(P + min(E, P) * (block_m - 1)) // block_m)
    kernel = moe_align(ids, E, block_m)
    sorting = moe_align_sorting(ids, E, block_m, num_blocks)
    used = int(kernel[2])
    assert used == int(sorting[2]) and used % block_m == 0
    assert torch.equal(kernel[0][:used], sorting[0][:used])
    assert torch.equal(kernel[1][: used // block_m], sorting[1][: used // block_m])
    assert torch.equal(kernel[0][used:], sorting[0][used:])   # all padding
