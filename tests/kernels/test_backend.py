"""Backend selection: use_triton, set_backend, each dispatcher's routing, and launcher."""

from __future__ import annotations

import importlib

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kernel_test_utils import CUDA, INTERPRETED, cpu_triton

import llmserve.kernels as K
from llmserve.kernels import backend

# dispatcher name -> the module that holds it, its _triton and _torch versions
OPS = {
    "apply_penalty": "apply_penalty",
    "context_attention_fwd": "context_attention",
    "decode_attention_fwd": "decode_attention",
    "destindex_copy_kv": "destindex_copy_kv",
    "layernorm_forward": "layernorm",
    "rmsnorm_forward": "rmsnorm",
    "rotary_emb_copy_kv": "rotary_emb_copy_kv",
    "rotary_emb_fwd": "rotary_emb",
    "silu_and_mul_fwd": "silu_and_mul",
}


@pytest.fixture(autouse=True)
def clean_backend(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    backend.set_backend(None)
    yield
    backend.set_backend(None)


def test_exports():
    assert set(OPS) <= set(K.__all__)
    for name in K.__all__:
        assert callable(getattr(K, name))


@pytest.mark.parametrize("env,want", [(None, False), ("auto", False), ("triton", True), ("torch", False)])
def test_use_triton_on_cpu_follows_env(monkeypatch, env, want):
    if env is not None:
        monkeypatch.setenv(backend.ENV_VAR, env)
    assert backend.use_triton(torch.zeros(1)) is want


def test_set_backend_overrides_env(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    backend.set_backend("triton")
    assert backend.use_triton(torch.zeros(1))
    backend.set_backend(None)
    assert not backend.use_triton(torch.zeros(1))


def test_bad_backend_names_raise(monkeypatch):
    with pytest.raises(ValueError):
        backend.set_backend("cuda")
    monkeypatch.setenv(backend.ENV_VAR, "fast")
    with pytest.raises(ValueError):
        backend.use_triton(torch.zeros(1))


@pytest.mark.parametrize("env,want", [("auto", "torch"), ("triton", "triton"), ("torch", "torch")])
@pytest.mark.parametrize("op", sorted(OPS))
def test_dispatcher_routes(monkeypatch, op, env, want):
    module = importlib.import_module(f"llmserve.kernels.{OPS[op]}")
    called = []
    for kind in ("triton", "torch"):
        monkeypatch.setattr(module, f"{op}_{kind}", lambda *a, _k=kind, **kw: called.append(_k))
    monkeypatch.setenv(backend.ENV_VAR, env)
    x = torch.ones(2, 4, 4)  # every dispatcher looks at its first tensor only
    args = [x] * 12
    n_params = getattr(K, op).__code__.co_argcount
    getattr(K, op)(*args[:n_params])
    assert called == [want]


def _add_one(X):
    pass  # never run: only launcher's check sees it


def test_kernels_are_interpreted_without_cuda():
    """tests/conftest.py sets TRITON_INTERPRET=1 before triton's import wherever CUDA is missing."""
    from llmserve.kernels.rmsnorm import _rmsnorm_kernel

    assert INTERPRETED == isinstance(_rmsnorm_kernel, InterpretedFunction)
    if not CUDA:
        assert INTERPRETED


def test_launcher_rejects_compiled_kernels_on_cpu():
    kernel = JITFunction(_add_one)  # what @triton.jit makes without TRITON_INTERPRET=1
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.launcher(kernel, torch.zeros(1))
    if CUDA:
        assert backend.launcher(kernel, torch.zeros(1, device="cuda")) is kernel


@pytest.mark.skipif(not INTERPRETED, reason="kernels are compiled here (TRITON_INTERPRET unset)")
def test_launcher_returns_interpreted_kernels_on_cpu():
    from llmserve.kernels.rmsnorm import _rmsnorm_kernel

    assert backend.launcher(_rmsnorm_kernel, torch.zeros(1)) is _rmsnorm_kernel
    kernel = InterpretedFunction(_add_one)
    assert backend.launcher(kernel, torch.zeros(1)) is kernel


@cpu_triton
def test_dispatchers_run_end_to_end_on_cpu(monkeypatch):
    """auto and triton give the same numbers through the public names."""
    x = torch.randn(3, 40)
    w = torch.randn(40)
    monkeypatch.setenv(backend.ENV_VAR, "auto")
    a = K.rmsnorm_forward(x, w, 1e-6)
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    b = K.rmsnorm_forward(x, w, 1e-6)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


HOPPER = CUDA and torch.cuda.get_device_capability() >= (9, 0)


def test_pdl_is_hoppers_and_can_be_turned_off(monkeypatch):
    monkeypatch.delenv(backend.PDL_ENV_VAR, raising=False)
    assert backend.pdl(torch.zeros(1)) == {"PDL": False}
    if CUDA:
        t = torch.zeros(1, device="cuda")
        assert backend.pdl(t) == ({"PDL": True, "launch_pdl": True} if HOPPER else {"PDL": False})
        monkeypatch.setenv(backend.PDL_ENV_VAR, "0")
        assert backend.pdl(t) == {"PDL": False}


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs Hopper or later")
@pytest.mark.parametrize("graph", [False, True])
def test_pdl_launches_equal_serial_ones(monkeypatch, graph):
    """Eight decode layers' norms and GEMVs at one row, each kernel reading the one before's output,
    with PDL and without (eager, or captured in a CUDA graph): bitwise the same. A kernel that read
    its input before its wait would read the row the kernel before had not written yet."""
    from llmserve.kernels.add_rmsnorm import add_rmsnorm_forward
    from llmserve.kernels.gemv import gemv, gemv_act_and_mul
    from llmserve.kernels.rmsnorm import rmsnorm_forward

    torch.manual_seed(0)
    hidden, inter = 1024, 2816
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = [(torch.randn(hidden, hidden, device=dev, dtype=dt) / 32,
               torch.randn(2 * inter, hidden, device=dev, dtype=dt) / 32,
               torch.randn(hidden, inter, device=dev, dtype=dt) / 53) for _ in range(8)]
    norm = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    h0 = torch.randn(1, hidden, device=dev, dtype=dt)
    h = torch.empty_like(h0)

    def forward() -> torch.Tensor:
        h.copy_(h0)
        x = rmsnorm_forward(h, norm, 1e-5)
        for o, gate_up, down in layers:
            x = add_rmsnorm_forward(h, gemv(x, o), norm, 1e-5)
            x = add_rmsnorm_forward(h, gemv(gemv_act_and_mul(x, gate_up, "silu"), down), norm, 1e-5)
        return torch.cat([x, h])

    def run(pdl_on: bool) -> torch.Tensor:
        monkeypatch.setenv(backend.PDL_ENV_VAR, "1" if pdl_on else "0")
        forward()                                   # compile (and warm) outside any capture
        torch.cuda.synchronize()
        if not graph:
            return forward()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = forward()
        outs = []
        for _ in range(3):
            g.replay()
            outs.append(out.clone())
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        return outs[0]

    assert torch.equal(run(pdl_on=True), run(pdl_on=False))
