"""Decode steps through DecodeGraphs (padded up to a bucket, over static buffers; replayed from
captured CUDA graphs on the GPU) equal the plain forward token for token, while requests join,
leave and are preempted and the batch size wanders across the buckets and past the largest.

On the CPU the same padded static-buffer step runs without capture; the GPU suite
(LLMSERVE_TEST_DEVICE=cuda) runs this file with real graphs in fp16/bf16."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import BloomConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

from llmserve.common.basemodel.cuda_graph import batch_size_buckets, verify_row_buckets
from llmserve.kernels.decode_attention import decode_num_splits
from parity_utils import EXACT, TEST_DEVICE, build_tiny_hf_model, load_ours, random_prompts, rel_err

MAX_BS = 6             # buckets 1, 2, 4, 6; a larger decode batch runs the plain forward
SPECULATE, SPECULATE_MAX_BS = 4, 3   # verify steps of up to 3 requests x (1 + 4) tokens replay graphs
VOCAB = 512

CONFIGS = {
    "llama": lambda: LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256),
    "bloom": lambda: BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB),
    # q/k norms inside the captured step; a head size that is not hidden / heads
    "qwen3": lambda: Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=256),
    # LongRoPE's per-request choice of factors inside the captured steps (requests cross the
    # original 16 tokens while decoding, and padding rows sit beside them); partial rotary
    "phi3": lambda: Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
                               original_max_position_embeddings=16, partial_rotary_factor=0.5, rope_scaling={
                                   "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(4)],
                                   "long_factor": [1.0 + 1.5 * i for i in range(4)]}),
    # sliding windows (8: the requests outgrow them), attention and final-logit soft-caps
    "gemma2": lambda: Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=256,
                                   sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
    # the sliding layers' own rotary tables beside the global one's
    "gemma3": lambda: Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=256,
                                       sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    # routing, align and grouped GEMMs inside the captured step, their buffers sized for the bucket
    "qwen3_moe": lambda: Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        vocab_size=VOCAB, max_position_embeddings=256),
}
# A float8 KV cache (--kv-cache-dtype fp8): its scales are constants of the captured steps.
CONFIGS["llama-kv-fp8"] = CONFIGS["llama"]
KV_CACHE_DTYPE = {"llama-kv-fp8": "fp8"}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def eager_and_graphs(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_hf_model(CONFIGS[request.param](), path)
    kv = KV_CACHE_DTYPE.get(request.param, "auto")
    eager = load_ours(path, max_running_requests=32, kv_cache_dtype=kv)
    graphs = load_ours(path, max_running_requests=32, cuda_graph_max_bs=MAX_BS, cuda_graph_capture=TEST_DEVICE == "cuda",
                       speculate=SPECULATE, speculate_max_batch=SPECULATE_MAX_BS, kv_cache_dtype=kv)
    return eager, graphs


def test_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_size_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert verify_row_buckets(15) == [1, 2, 4, 8, 15]
    assert verify_row_buckets(352) == [1, 2, 4, *range(8, 65, 8), 80, 96, 112, 128, 160, 192, 224, 256, 320, 352]
    for max_rows in range(1, 600):
        buckets = verify_row_buckets(max_rows)
        assert buckets[-1] == max_rows and all(b - a <= max(8, a // 4) for a, b in zip(buckets, buckets[1:])), max_rows


@pytest.mark.parametrize("max_bs", [1, 6, 100, 256])
@pytest.mark.parametrize("kv_heads", [1, 2, 3, 8])
def test_a_bucket_splits_decode_attention_as_its_batches_do(max_bs, kv_heads):
    """Decode attention's split count reads the batch size; a graph runs at its bucket's size,
    so every batch size must get the same count as its bucket or graphs would not equal eager."""
    buckets = batch_size_buckets(max_bs)
    for bs in range(1, max_bs + 1):
        bucket = next(b for b in buckets if b >= bs)
        assert decode_num_splits(bs, kv_heads) == decode_num_splits(bucket, kv_heads), (bs, bucket)


def test_the_padding_request_is_invisible(eager_and_graphs):
    eager, graphs = eager_and_graphs
    assert graphs.decode_graphs is not None and eager.decode_graphs is None
    assert graphs.max_total_token_num == eager.max_total_token_num
    assert graphs.mem_manager.can_use_mem_size == eager.mem_manager.can_use_mem_size
    assert graphs.req_manager.can_use_req_size == eager.req_manager.can_use_req_size


class Twin:
    """One request run on both models: its table row in each, its tokens so far."""

    def __init__(self, tokens: list[int], target_len: int):
        self.tokens = tokens
        self.target_len = target_len
        self.rows: tuple[int, int] | None = None
        self.cached = 0


def forward_both(models, twins: list[Twin], chunks: list[list[int]], all_logits: list[bool] | bool = False) -> torch.Tensor:
    """One forward of the same batch on both models; the plain forward's logits, after checking
    the other's against them."""
    outs = []
    for m, model in enumerate(models):
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        outs.append(model.forward(ids, [t.rows[m] for t in twins], [t.cached for t in twins], [len(c) for c in chunks],
                                  return_all_logits=all_logits).float().cpu())
    plain, other = outs
    assert other.shape == plain.shape
    assert other.argmax(-1).tolist() == plain.argmax(-1).tolist()
    assert rel_err(other, plain) < (1e-5 if EXACT else 1e-2)
    for t, c in zip(twins, chunks):
        t.cached += len(c)
    return plain


def test_graph_steps_equal_plain_steps_as_requests_come_and_go(eager_and_graphs):
    models = eager_and_graphs
    rng = random.Random(0)
    waiting = [Twin(p, len(p) + rng.randint(3, 24)) for p in random_prompts([rng.randint(1, 12) for _ in range(28)], VOCAB)]
    running: list[Twin] = []
    decode_sizes = set()
    for step in range(160):
        if not waiting and not running:
            break
        if step in (40, 90) and len(running) > 2:
            # preemption: a running request loses its KV and queues again
            t = running.pop(rng.randrange(len(running)))
            for model, row in zip(models, t.rows):
                model.req_manager.free_req(row)
            waiting.append(t)
            continue
        if waiting and (not running or rng.random() < 0.3):
            # a prefill step for 1-3 arrivals (a preempted request comes back with its whole text)
            joining = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(1, 3)))]
            for t in joining:
                t.rows = (models[0].req_manager.alloc_req(), models[1].req_manager.alloc_req())
                t.cached = 0
            logits = forward_both(models, joining, [t.tokens for t in joining])
            batch = joining
            running += joining
        else:
            batch = list(running)
            decode_sizes.add(len(batch))
            logits = forward_both(models, batch, [[t.tokens[-1]] for t in batch])
        for t, token in zip(batch, logits.argmax(-1).tolist()):
            t.tokens.append(token)
        for t in [t for t in running if len(t.tokens) >= t.target_len]:
            running.remove(t)
            for model, row in zip(models, t.rows):
                model.req_manager.free_req(row)
    assert not running and not waiting
    buckets = {models[1].decode_graphs.bucket(n) for n in decode_sizes if n <= MAX_BS}
    assert buckets == {1, 2, 4, 6} and max(decode_sizes) > MAX_BS, decode_sizes   # across the buckets, and past them
    for model in models:   # nothing leaked: every slot and row is back (the padding request's excepted)
        assert model.mem_manager.can_use_mem_size == model.max_total_token_num


def test_verify_steps_replay_their_graphs(eager_and_graphs, monkeypatch):
    """Speculative verify steps (drafting requests bring 1 + draft new tokens and want every
    one's logits, beside requests bringing one) replay the verify graphs while they fit (at most
    SPECULATE_MAX_BS requests, 1 + SPECULATE tokens each), padded to a bucket of rows and to the
    largest batch, and equal the plain forward; the rejected tokens are then cut from the table,
    as the worker does. Steps that do not fit run the plain forward."""
    models = eager_and_graphs
    graphs = models[1].verify_graphs
    assert graphs is not None and models[1].verify_graph_max_bs == SPECULATE_MAX_BS
    replayed: list[int] = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *args: replayed.append(len(ids)) or run(ids, *args))
    rng = random.Random(1)
    twins = [Twin(p, 0) for p in random_prompts([rng.randint(2, 40) for _ in range(4)], VOCAB)]
    for t in twins:
        t.rows = (models[0].req_manager.alloc_req(), models[1].req_manager.alloc_req())
    forward_both(models, twins, [t.tokens for t in twins])
    eager_steps = 0
    for step in range(40):
        batch = rng.sample(twins, rng.randint(1, len(twins)))
        drafts = [[rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 2, 4, 4, 5]))] for _ in batch]
        if not any(drafts):
            drafts[0] = [rng.randrange(VOCAB)]
        chunks = [[t.tokens[-1], *d] for t, d in zip(batch, drafts)]
        flags = [len(d) > 0 for d in drafts]
        fits = len(batch) <= SPECULATE_MAX_BS and all(len(d) <= SPECULATE for d in drafts)
        before = len(replayed)
        logits = forward_both(models, batch, chunks, flags)
        assert len(replayed) == before + fits, (len(batch), [len(d) for d in drafts])
        eager_steps += not fits
        # keep the first token and a random part of the draft (the rest "rejected"), as verify would
        at = 0
        for t, chunk, flag in zip(batch, chunks, flags):
            kept = rng.randint(1, len(chunk))
            t.tokens.extend(chunk[1:kept] + [int(logits[at + kept - 1].argmax())])
            t.cached -= len(chunk) - kept
            for model, row in zip(models, t.rows):
                model.req_manager.truncate(row, t.cached)
            at += len(chunk) if flag else 1
        assert at == logits.shape[0]
    assert len(set(graphs.bucket(n) for n in replayed)) >= 3 and eager_steps > 5, (replayed, eager_steps)
    for t in twins:
        for model, row in zip(models, t.rows):
            model.req_manager.free_req(row)
    for model in models:
        assert model.mem_manager.can_use_mem_size == model.max_total_token_num
