"""The custom all-reduce (common/custom_all_reduce.py) and how ``distributed.all_reduce`` picks it.

On the CPU: which all-reduce a message gets (the gloo path itself is held exact by the tensor-
parallel tests, which it leaves untouched). With two CUDA devices: both kernels give NCCL's sum
bit for bit (at world size 2 both add a + b once, in bf16 or fp32), eagerly and replayed from a
CUDA graph, as does the kernel that fuses the sum with the residual add and the norm (against
NCCL's sum and add_rmsnorm); and a tp=2 model decodes with them exactly the tokens it decodes
with NCCL. The fused kernel's protocol on the CPU: tests/kernels/test_all_reduce_add_rmsnorm.py."""

from __future__ import annotations

import os

import pytest
import torch

from llmserve.common import distributed
from llmserve.common.custom_all_reduce import (
    FUSED_ENV_VAR, FUSED_MAX_BYTES, ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, CustomAllReduce, algorithm_for,
)

BF16 = torch.bfloat16


def test_small_messages_go_one_shot_medium_two_shot_and_large_to_nccl():
    decode_row = 4096 * BF16.itemsize   # a Llama-3-8B decode step at batch 1: 8 KiB
    assert algorithm_for(decode_row, BF16, 2) == "one_shot"
    assert algorithm_for(ONE_SHOT_MAX_BYTES, BF16, 2) == "one_shot"
    assert algorithm_for(ONE_SHOT_MAX_BYTES + 64, BF16, 4) == "two_shot"
    assert algorithm_for(TWO_SHOT_MAX_BYTES, torch.float32, 8) == "two_shot"
    assert algorithm_for(TWO_SHOT_MAX_BYTES + 16, BF16, 2) == "nccl"
    # two-shot only where each rank's share is whole 16-byte vectors
    assert algorithm_for(ONE_SHOT_MAX_BYTES + 16, BF16, 2) == "nccl"
    assert algorithm_for(ONE_SHOT_MAX_BYTES + 32, BF16, 2) == "two_shot"
    # two-shot is compiled for 2, 4 and 8 ranks only
    assert algorithm_for(ONE_SHOT_MAX_BYTES + 48, BF16, 3) == "nccl"
    # dtypes the kernels do not take, sizes they cannot vectorise
    assert algorithm_for(decode_row, torch.float16, 2) == "nccl"
    assert algorithm_for(decode_row + 2, BF16, 2) == "nccl"
    assert algorithm_for(0, BF16, 2) == "nccl"


def test_all_reduce_sends_each_message_where_the_custom_all_reduce_says(monkeypatch):
    used = []
    custom = CustomAllReduce.__new__(CustomAllReduce)   # its choice only: no buffer, no peers
    custom.world_size, custom.one_shot_max, custom.two_shot_max = 2, ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES
    custom.fuses_add_rmsnorm = False
    monkeypatch.setattr(custom, "all_reduce", lambda t, algorithm: used.append(algorithm))
    monkeypatch.setattr(distributed, "tp_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda t, op, group: used.append("nccl"))
    distributed.set_custom_all_reduce(custom)
    try:
        for t in [torch.zeros(1, 4096, dtype=BF16),                 # a decode step's
                  torch.zeros(256, 4096, dtype=BF16),               # 2 MiB
                  torch.zeros(4096, 4096, dtype=BF16),              # 32 MiB: a long prefill's
                  torch.zeros(1, 4096, dtype=torch.float16),
                  torch.zeros(4, 4096, dtype=BF16)[:, :2048],       # not contiguous
                  torch.zeros(4096 + 1, dtype=BF16)[1:]]:           # starts 2 bytes into its storage
            distributed.all_reduce(t)
    finally:
        distributed.set_custom_all_reduce(None)
    assert used == ["one_shot", "two_shot", "nccl", "nccl", "nccl", "nccl"]


def test_add_rmsnorm_fuses_what_the_fused_kernel_takes_and_reduces_the_rest_first(monkeypatch):
    used = []
    custom = CustomAllReduce.__new__(CustomAllReduce)   # its choices only: no buffers, no peers
    custom.world_size, custom.one_shot_max, custom.two_shot_max = 2, ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES
    custom.fused_max, custom.fuses_add_rmsnorm, custom.one_way = FUSED_MAX_BYTES, True, False
    monkeypatch.setattr(custom, "all_reduce_add_rmsnorm", lambda addend, h, w, eps, round_first, delta_weight,
                        pushed: used.append("fused, pushed" if pushed else "fused"))
    monkeypatch.setattr(custom, "all_reduce", lambda t, algorithm: used.append(algorithm))
    monkeypatch.setattr(distributed, "tp_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda t, op, group: used.append("nccl"))
    distributed.set_custom_all_reduce(custom)
    try:
        for fuses in (True, False):
            custom.fuses_add_rmsnorm = fuses
            for rows, dtype in [(1, BF16), (1, torch.float16), (256, BF16), (4096, BF16)]:
                h = torch.zeros(rows, 4096, dtype=dtype)
                distributed.add_rmsnorm(h, distributed.PartialSum(torch.zeros_like(h)), torch.ones(4096, dtype=dtype),
                                        1e-6)
        custom.fuses_add_rmsnorm = True
        pushed = distributed.PartialSum(torch.zeros(1, 4096, dtype=BF16), pushed=True)
        distributed.add_rmsnorm(torch.zeros(1, 4096, dtype=BF16), pushed, torch.ones(4096, dtype=BF16), 1e-6)
        for only_the_fused_kernel_may_sum_it in (pushed.reduce, lambda: pushed[[0]]):
            with pytest.raises(RuntimeError, match="summed whole"):
                only_the_fused_kernel_may_sum_it()
    finally:
        distributed.set_custom_all_reduce(None)
    # the fused kernel takes fp16 too, and what fits one-shot's buffer; larger sums reduce first
    assert used == ["fused", "fused", "two_shot", "nccl"] + ["one_shot", "nccl", "two_shot", "nccl"] + ["fused, pushed"]


def test_a_push_target_only_with_one_way_push_and_for_what_the_fused_kernel_takes():
    custom = CustomAllReduce.__new__(CustomAllReduce)   # its choices only: no buffers, no peers
    custom.rank, custom.fused_max, custom.pushes, custom.fuses_add_rmsnorm = 1, 1 << 20, True, True
    custom._fused_ptrs, custom._epochs = torch.zeros(2, dtype=torch.int64), torch.zeros(32, dtype=torch.int64)
    target = custom.push_target(BF16, 4096)
    assert target is not None and (target.rank, target.rank_stride) == (1, (1 << 20) // 2)
    assert target.constexprs() == {"RANK": 1, "WORLD": 2}
    assert custom.push_target(torch.float32, (1 << 18) + 4) is None  # larger than the fused kernel takes
    custom.pushes = False
    assert custom.push_target(BF16, 4096) is None                     # one-way without the push


# -- two GPUs ---------------------------------------------------------------------------------
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA devices")
# Bytes: a decode row of a tiny model, one of Llama-3-8B, a batch of 32 and of 256 of them, and
# the largest message the buffer takes; each with an odd number of 16-byte vectors somewhere.
SIZES = [16, 4096 * 2, 32 * 4096 * 2 + 16, 256 * 4096 * 2, TWO_SHOT_MAX_BYTES]


def _graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up outside the capture, as DecodeGraphs does
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# Seconds after which a rank still running writes its Python stack beside the reports: where a
# hang is (the checks take a few seconds).
STACK_AFTER_S = 45


def _rank_main(rank: int, world: int, port: int, report_dir: str) -> None:
    """One rank's checks. What fails is written to ``report_dir`` at once: its peer then waits at
    the next barrier, and this rank's own cleanup (destroying the NCCL group) may wait with it, so
    the exception would otherwise never reach the test (`_join_within` reads the reports). A rank
    still running after ``STACK_AFTER_S`` writes its stack there too.

    A rank whose checks passed leaves at once, without torch's teardown: on the 2 x H200 host
    (torch 2.11) ``destroy_process_group`` never returns once a symmetric-memory buffer has been
    rendezvoused (the stacks showed both ranks there, every check passed), which is what kept
    this test from ending for three sessions. The model's workers leave the same way
    (``worker/ranks.exit_now``)."""
    import faulthandler
    import os
    import traceback
    from pathlib import Path

    with open(Path(report_dir, f"rank{rank}.stack"), "w") as stack:
        faulthandler.dump_traceback_later(STACK_AFTER_S, file=stack)
        try:
            _check_rank(rank, world, port)
        except BaseException:
            Path(report_dir, f"rank{rank}.txt").write_text(traceback.format_exc())
            raise
        faulthandler.cancel_dump_traceback_later()
    os._exit(0)


def _check_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    try:
        custom = CustomAllReduce.setup(dist.group.WORLD, device)
        assert custom is not None, "the custom all-reduce did not start (its reason is in the log above)"
        gen = torch.Generator(device).manual_seed(rank)
        for dtype in (BF16, torch.float32):
            for nbytes in SIZES:
                inputs = [torch.randn(nbytes // dtype.itemsize, generator=gen, device=device, dtype=dtype)
                          for _ in range(2)]
                sums = [x.clone() for x in inputs]
                for s in sums:
                    dist.all_reduce(s)
                two_shot = nbytes % (16 * world) == 0     # where algorithm_for may pick it
                for algorithm in ("one_shot", "two_shot") if two_shot else ("one_shot",):
                    what = f"{algorithm}, {nbytes} bytes of {dtype}"
                    assert torch.equal(custom.all_reduce(inputs[0].clone(), algorithm), sums[0]), what
                    static = torch.empty_like(inputs[0])
                    graph = _graph_of(lambda: custom.all_reduce(static, algorithm))
                    for x, expected in zip(inputs, sums):   # one capture, new inputs each replay
                        static.copy_(x)
                        graph.replay()
                        assert torch.equal(static, expected), f"{what}, in a CUDA graph"
        # As the model calls it, one graph holding all three paths (one-shot, two-shot, NCCL).
        distributed.set_custom_all_reduce(custom)
        statics = [torch.empty(n // 2, dtype=BF16, device=device) for n in (8 << 10, 2 << 20, 32 << 20)]
        graph = _graph_of(lambda: [distributed.all_reduce(s) for s in statics])
        inputs = [torch.randn(s.shape, generator=gen, device=device, dtype=BF16) for s in statics]
        for s, x in zip(statics, inputs):
            s.copy_(x)
        graph.replay()
        for s, x in zip(statics, inputs):
            dist.all_reduce(x)
            assert torch.equal(s, x), f"{s.numel() * 2} bytes through distributed.all_reduce in a graph"
        _check_fused(custom, gen, device)
        os.environ[FUSED_ENV_VAR] = "one-way"   # the flagless protocol, over buffers of its own
        try:
            one_way = CustomAllReduce(dist.group.WORLD, device)
        finally:
            del os.environ[FUSED_ENV_VAR]
        assert one_way.one_way and "(one-way)" in one_way.describe()
        _check_fused(one_way, gen, device)
    finally:
        distributed.set_custom_all_reduce(None)


# Rows x hidden: a decode row of Llama-3-8B, 40 rows (more rows than the fused
# kernel's programs: some take two), rows wider than one 4096 block (70B's), an odd small size,
# and a batch of 128 rows of 4096 (1 MiB in bf16: the largest message at two GPUs).
FUSED_SHAPES = [(1, 4096), (40, 3072), (3, 8192), (5, 100), (128, 4096)]


def _check_fused(custom: CustomAllReduce, gen: torch.Generator, device: torch.device) -> None:
    """all_reduce_add_rmsnorm against NCCL's sum then add_rmsnorm, bit for bit (h and the norm),
    eagerly and replayed from a CUDA graph with new inputs (so the epochs and buffer halves move on);
    Llama's norms, and in bf16 Gemma 2's too (the sum's own norm before the add)."""
    import torch.distributed as dist

    from llmserve.kernels import add_rmsnorm_forward

    shared = torch.Generator(device).manual_seed(1234)   # h and the weights: the same on every rank
    cases = [(dtype, m, n, False) for dtype in (BF16, torch.float32) for m, n in FUSED_SHAPES]
    cases += [(BF16, m, n, True) for m, n in FUSED_SHAPES]
    cases = [case for case in cases if case[1] * case[2] * case[0].itemsize <= custom.fused_max]
    for dtype, m, n, gemma2 in cases:
        what = f"fused, {m} x {n} of {dtype}{', Gemma 2' if gemma2 else ''}"
        round_first = not gemma2
        w = torch.randn(n, generator=shared, device=device, dtype=dtype)
        delta_w = 1.0 + torch.randn(n, generator=shared, device=device) if gemma2 else None   # fp32, as Gemma's
        inputs = [(torch.randn(m, n, generator=gen, device=device, dtype=dtype),
                   3 * torch.randn(m, n, generator=shared, device=device, dtype=dtype)) for _ in range(3)]
        wants = []
        for addend, h0 in inputs:
            total = addend.clone()
            dist.all_reduce(total)
            h = h0.clone()
            wants.append((h, add_rmsnorm_forward(h, total, w, 1e-6, round_first, delta_w)))
        assert custom.takes_add_rmsnorm(inputs[0][0]), what
        h = inputs[0][1].clone()
        y = custom.all_reduce_add_rmsnorm(inputs[0][0], h, w, 1e-6, round_first, delta_w)
        assert torch.equal(h, wants[0][0]) and torch.equal(y, wants[0][1]), what
        static_a, static_h = torch.empty_like(inputs[0][0]), torch.empty_like(inputs[0][1])
        out = []
        graph = _graph_of(lambda: out.append(custom.all_reduce_add_rmsnorm(static_a, static_h, w, 1e-6, round_first,
                                                                           delta_w)))
        for (addend, h0), (want_h, want_y) in zip(inputs, wants):
            static_a.copy_(addend)
            static_h.copy_(h0)
            graph.replay()
            assert torch.equal(static_h, want_h) and torch.equal(out[-1], want_y), f"{what}, in a CUDA graph"


@two_gpus
def test_equals_nccl_eagerly_and_in_cuda_graphs(tmp_path):
    import torch.multiprocessing as mp

    from llmserve.engine.worker_client import free_tcp_port

    context = mp.start_processes(_rank_main, args=(2, free_tcp_port(), str(tmp_path)), nprocs=2,
                                 start_method="spawn", join=False)
    _join_within(context, seconds=STACK_AFTER_S + 15, report_dir=tmp_path)


def _join_within(context, seconds: float, report_dir) -> None:
    """Join the ranks, failing the test (and killing them) as soon as a rank has reported a failure
    (`_rank_main`), or if they have not ended in ``seconds``: a rank stuck at a kernel's barrier
    would otherwise hang the suite."""
    import time

    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        reports = sorted(report_dir.glob("rank*.txt"))
        if reports or time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            if reports:
                pytest.fail("\n".join(f"{r.stem} failed:\n{r.read_text()}" for r in reports))
            stacks = "\n".join(f"{s.stem}:\n{s.read_text()}" for s in sorted(report_dir.glob("rank*.stack")))
            pytest.fail(f"the ranks did not finish within {seconds} s (a kernel waiting at its barrier?); "
                        f"where they were:\n{stacks}")


@two_gpus
def test_tp2_decodes_the_tokens_of_nccl_and_of_tp1(tiny_llama_dir):
    from llmserve import LLM, SamplingParams

    prompts = [[5, 17, 300, 2, 9], [44] * 3, list(range(100, 131))]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    def tokens(tp: int, dtype: str, prompts: list[list[int]] = prompts, **options) -> tuple[list[list[int]], str]:
        with LLM(tiny_llama_dir, tp=tp, dtype=dtype, **options) as llm:
            assert llm.engine.info.cuda_graph_max_bs > 0   # decode steps replay graphs
            return [out.token_ids for out in llm.generate(prompts, params)], llm.engine.info.all_reduce

    custom, used = tokens(2, "bfloat16", custom_all_reduce=True)
    assert used.startswith("custom") and "fused with the residual add and norm" in used, used
    nccl, used = tokens(2, "bfloat16", custom_all_reduce=False)
    assert used == "NCCL", used
    assert custom == nccl   # the same sums, bit for bit, so the same logits
    # the one-way protocol, and its batch-1 GEMVs pushing their rows (one prompt: one-row steps)
    for protocol in ("one-way", "one-way-push"):
        os.environ[FUSED_ENV_VAR] = protocol   # the workers inherit it
        try:
            one_way, used = tokens(2, "bfloat16", custom_all_reduce=True)
            alone, _ = tokens(2, "bfloat16", custom_all_reduce=True, prompts=prompts[:1])
        finally:
            del os.environ[FUSED_ENV_VAR]
        assert "(one-way" in used and ("pushing" in used) == (protocol == "one-way-push"), used
        assert one_way == nccl and alone == nccl[:1], protocol
    # fp32: tp=1 and tp=2 differ only in how the matmuls' sums are split
    assert tokens(2, "float32")[0] == tokens(1, "float32")[0]
