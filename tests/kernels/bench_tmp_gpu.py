# Temporary GPU benchmark (deleted after use).
import math, re, inspect, textwrap, torch, triton, triton.language as tl
import torch.nn.functional as F
from triton.testing import do_bench
from llmserve.kernels import context_attention as ca
from llmserve.kernels import decode_attention_stage1 as s1
from llmserve.kernels.decode_attention import decode_attention_fwd_triton
from llmserve.kernels.backend import dot_precision

# variant of the context kernel that feeds tl.dot in the storage dtype (not allowed by the rules; measured for the report)
src = inspect.getsource(ca._context_attention_kernel.fn)
src = src.replace("other=0.0).to(tl.float32)  # [D, N]", "other=0.0)  # [D, N]")
src = src.replace("other=0.0).to(tl.float32)  # [N, D]", "other=0.0)  # [N, D]")
src = src.replace("q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)", "q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)")
src = src.replace("tl.dot(p, v, input_precision=DOT_PRECISION)", "tl.dot(p.to(v.dtype), v)").replace("tl.dot(q, k, input_precision=DOT_PRECISION)", "tl.dot(q, k)")
src = src.replace("_context_attention_kernel", "_ctx_native")
import os, importlib.util, tempfile
path = os.path.join(tempfile.mkdtemp(), "ctx_native.py")
open(path, "w").write("import triton\nimport triton.language as tl\n" + src)
spec = importlib.util.spec_from_file_location("ctx_native", path); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
native = mod._ctx_native

def ctx_launch(kernel, q, k, v, o, rt, bri, bqs, bql, bcl, maxq, bm, bn, nw, ns_):
    bs = bri.shape[0]; _, Hq, D = q.shape
    kernel[(bs, Hq, triton.cdiv(maxq, bm))](
        q, k, v, o, rt, bri, bqs, bql, bcl, q, 1.0 / math.sqrt(D) * 1.4426950408889634,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *rt.stride(), Hq // k.shape[1], D,
        HAS_ALIBI=False, DOT_PRECISION=dot_precision(q.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=D,
        num_warps=nw, num_stages=ns_)

dev = "cuda"; dtype = torch.bfloat16
for Hq, Hkv, D in ((32, 8, 128), (32, 32, 64)):
    bs, L = 4, 1024
    pool = bs * L + 10
    k = torch.randn(pool, Hkv, D, device=dev, dtype=dtype); v = torch.randn_like(k)
    rt = torch.randperm(pool, device=dev)[: bs * L].view(bs, L).int()
    q = torch.randn(bs * L, Hq, D, device=dev, dtype=dtype); o = torch.empty_like(q)
    args = (q, k, v, o, rt, torch.arange(bs, device=dev).int(), (torch.arange(bs, device=dev) * L).int(),
            torch.full((bs,), L, device=dev).int(), torch.zeros(bs, device=dev).int(), L)
    flops = 4 * bs * L * L / 2 * Hq * D
    ref = None
    for name, kern in (("fp32", ca._context_attention_kernel), ("native", native)):
        for bm, bn, nw, st in ((128, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2)):
            try:
                t = do_bench(lambda: ctx_launch(kern, *args, bm, bn, nw, st))
                out = o.clone()
                if ref is None: ref = out
                err = (out.float() - ref.float()).abs().max().item()
                print(f"ctx D={D} {name} bm={bm} bn={bn} w={nw} st={st}: {t*1e3:.0f} us {flops/t/1e9:.0f} TFLOP/s err {err:.3g}")
            except Exception as e:
                print(f"ctx D={D} {name} bm={bm} bn={bn} w={nw} st={st}: FAIL {repr(e)[:150]}")

Hq, Hkv, D = 32, 8, 128
for bs, L in ((64, 1024), (8, 8192), (1, 32768), (1, 1024)):
    pool = bs * L + 10
    k = torch.randn(pool, Hkv, D, device=dev, dtype=dtype); v = torch.randn_like(k)
    rt = torch.randperm(pool, device=dev)[: bs * L].view(bs, L).int()
    q = torch.randn(bs, Hq, D, device=dev, dtype=dtype); o = torch.empty_like(q)
    bri = torch.arange(bs, device=dev).int(); bsl = torch.full((bs,), L, device=dev).int()
    nbytes = 2 * bs * L * Hkv * D * 2
    for blk in (256, 512):
        for bn, nw, st in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2)):
            num_splits = triton.cdiv(L, blk)
            mo = torch.empty(bs, Hq, num_splits, D, device=dev); ml = torch.empty(bs, Hq, num_splits, device=dev)
            def f():
                s1._decode_attention_stage1_kernel[(bs, Hkv, num_splits)](
                    q, k, v, rt, bri, bsl, q, mo, ml, 0.1, *q.stride(), *k.stride(), *v.stride(), *rt.stride(),
                    *mo.stride(), *ml.stride(), Hq // Hkv, D, HAS_ALIBI=False, DOT_PRECISION="tf32",
                    BLOCK_SEQ=blk, BLOCK_N=bn, BLOCK_H=16, BLOCK_D=D, num_warps=nw, num_stages=st)
            t = do_bench(f)
            print(f"decode-stage1 bs={bs} L={L} blk={blk} bn={bn} w={nw} st={st}: {t*1e3:.0f} us {nbytes/t/1e6:.0f} GB/s")
        t = do_bench(lambda: decode_attention_fwd_triton(q, k, v, o, rt, bri, bsl, L, block_seq=blk))
        print(f"decode full bs={bs} L={L} blk={blk}: {t*1e3:.0f} us {nbytes/t/1e6:.0f} GB/s")
