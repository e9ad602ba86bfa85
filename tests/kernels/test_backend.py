"""Backend selection: use_triton, set_backend, each dispatcher's routing, and launcher."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from kernel_test_utils import cpu_triton

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


def test_launcher_interprets_on_cpu_whatever_the_decorator_made():
    from llmserve.kernels.rmsnorm import _rmsnorm_kernel

    launched = backend.launcher(_rmsnorm_kernel, torch.zeros(1))
    assert isinstance(launched.kernel, InterpretedFunction)
    assert launched.kernel.fn is _rmsnorm_kernel.fn
    if torch.cuda.is_available():
        assert backend.launcher(_rmsnorm_kernel, torch.zeros(1, device="cuda")) is _rmsnorm_kernel


def _language_state() -> list[dict]:
    import triton.language as tl

    return [dict(vars(obj)) for obj in (tl, tl.core, tl.standard, tl.core.tensor, tl.core.dtype)]


def test_interpreted_launch_restores_triton_language():
    """A CPU launch leaves triton.language as it found it (kernels compiled later depend on it)."""
    before = _language_state()
    backend.set_backend("triton")
    try:
        K.rmsnorm_forward(torch.randn(3, 40), torch.randn(40), 1e-6)  # calls tl.sum inside
    except Exception:
        assert torch.cuda.is_available()  # only where this Triton cannot interpret (see conftest)
    after = _language_state()
    for old, new in zip(before, after):
        assert all(new.get(name) is value for name, value in old.items())
    assert after[3].keys() == before[3].keys() and after[4].keys() == before[4].keys()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiles_after_cpu_interpretation():
    backend.set_backend("triton")
    x, w, b = torch.randn(3, 200), torch.randn(200), torch.randn(200)
    try:
        K.layernorm_forward(x, w, b, 1e-5)
    except Exception:
        pass  # whether or not this Triton can interpret, compiling afterwards must work
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()  # N=200: a block size no other test compiles
    torch.testing.assert_close(K.layernorm_forward(xc, wc, bc, 1e-5),
                               F.layer_norm(xc, (200,), wc, bc, 1e-5), atol=1e-5, rtol=1e-5)


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
