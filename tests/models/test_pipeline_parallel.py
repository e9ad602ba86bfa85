"""Pipeline parallelism at the logits level, in one process: the stages of a model (each built
with only its layers, stage 0 the embedding, the last the final norm and lm_head) run one after
another, the residual stream handed on in memory instead of over torch.distributed, and must
produce HF's logits; for every family that splits, with more layers than stages and a count the
stages do not divide. The engine-level tests (over gloo) are in tests/test_pipeline_parallel.py."""

from __future__ import annotations

import pytest
import torch
from transformers import (BloomConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig, MixtralConfig, Phi3Config,
                          Qwen2MoeConfig, Qwen3Config)

from llmserve.common.basemodel.model_shape import describe_stages, stage_layers
from parity_utils import LOGITS_TOL, build_tiny_hf_model, load_ours, rel_err

PROMPTS = [[5, 17, 300, 2, 9], [44] * 3, list(range(100, 111))]
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=511)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE, intermediate_size=128, num_hidden_layers=5),
    "llama_tied": lambda: LlamaConfig(**SHAPE, intermediate_size=128, num_hidden_layers=3, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SHAPE, intermediate_size=128, num_hidden_layers=3, head_dim=32,
                                 tie_word_embeddings=True),
    "phi3": lambda: Phi3Config(**SHAPE, intermediate_size=128, num_hidden_layers=3, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2),
    "gemma2": lambda: Gemma2Config(**SHAPE, intermediate_size=128, num_hidden_layers=3, head_dim=16, sliding_window=4,
                                   query_pre_attn_scalar=16, final_logit_softcapping=10.0),
    "gemma3": lambda: Gemma3TextConfig(**SHAPE, intermediate_size=128, num_hidden_layers=3, head_dim=16,
                                       sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                      "sliding_attention"]),
    "mixtral": lambda: MixtralConfig(**SHAPE, intermediate_size=64, num_hidden_layers=3, num_local_experts=4,
                                     num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**SHAPE, intermediate_size=96, num_hidden_layers=3, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
}


class LocalLink:
    """The hand-offs between stages in one process (PipelineLink's send_hidden / recv_hidden)."""

    def __init__(self):
        self.sent: tuple[torch.Tensor, torch.Tensor] | None = None

    def send_hidden(self, h: torch.Tensor, pending: torch.Tensor) -> None:
        self.sent = (h.clone(), pending.clone())

    def recv_hidden(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        h, pending = self.sent
        assert h.shape == shape and h.dtype == dtype and pending.shape == shape
        self.sent = None
        return h, pending

    def recv_into(self, h: torch.Tensor, pending: torch.Tensor) -> None:
        got = self.recv_hidden(h.shape, h.dtype, h.device)
        h.copy_(got[0])
        pending.copy_(got[1])


def run_stages(stages, prompts: list[list[int]], steps: list[list[list[int]]]) -> list[torch.Tensor]:
    """Every stage runs each step (prefill of ``prompts``, then each of ``steps``: one chunk per
    request) in order; the last stage's logits of each step."""
    rows = [[m.req_manager.alloc_req() for _ in prompts] for m in stages]
    lens = [0] * len(prompts)
    out = []
    for chunks in [prompts, *steps]:
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        for m, r in zip(stages, rows):
            logits = m.forward(ids, r, list(lens), [len(c) for c in chunks])
            assert (logits is None) == (not m.is_last_stage)
        out.append(logits)
        lens = [n + len(c) for n, c in zip(lens, chunks)]
    return out


def load_stages(path, pp: int, **kw):
    link = LocalLink()    # one mailbox: the stages run one after another
    stages = []
    for s in range(pp):
        # The link before the graphs are built: a stage's graphs hand off through the model's link.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("llmserve.common.basemodel.basemodel.PipelineLink", lambda *args: link)
            stages.append(load_ours(path, pp_rank=s, pp_size=pp, **kw))
    return stages


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stages_give_hf_logits(name, tmp_path):
    hf = build_tiny_hf_model(CONFIGS[name](), tmp_path)
    pp = 3 if name == "llama" else 2     # 5 layers over 3 stages: 2, 2, 1; 3 over 2: 2, 1
    stages = load_stages(tmp_path, pp)
    num_layers = hf.config.num_hidden_layers
    assert [list(m.stage_layers) for m in stages] == [list(stage_layers(num_layers, pp, s)) for s in range(pp)]
    assert [len(m.trans_layers_weight) for m in stages] == [len(m.stage_layers) for m in stages]
    assert [m.mem_manager.layer_num for m in stages] == [len(m.stage_layers) for m in stages]
    assert stages[0].pre_post_weight.wte_weight_ is not None and stages[0].pre_post_weight.lm_head_weight_ is None
    assert stages[-1].pre_post_weight.lm_head_weight_ is not None and stages[-1].pre_post_weight.final_norm_weight_ is not None
    # What /info counts (counted_weights, summed over the ranks): the model's parameters, a tied
    # lm_head once though two stages hold it.
    with torch.device("meta"):
        hf_params = type(hf)(hf.config).num_parameters()
    assert sum(t.shape.numel() for m in stages for t in m.counted_weights()) == hf_params
    prefill, next_token = run_stages(stages, PROMPTS, [[[i + 1] for i in range(len(PROMPTS))]])
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = hf(torch.tensor([prompt + [i + 1]])).logits[0].float()
            assert rel_err(prefill[i].cpu(), ref[-2]) < LOGITS_TOL
            assert rel_err(next_token[i].cpu(), ref[-1]) < LOGITS_TOL


def test_stage_layers_split_as_evenly_as_possible_earlier_stages_first():
    assert [list(stage_layers(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(stage_layers(32, 4, s)) for s in range(4)] == [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    assert describe_stages(32, 2) == "layers 0-15 | 16-31"
    assert describe_stages(3, 3) == "layers 0 | 1 | 2"


def test_a_family_that_cannot_split_is_refused(tmp_path):
    build_tiny_hf_model(BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=511), tmp_path)
    with pytest.raises(ValueError, match="pipeline parallelism .pp > 1. is not supported for bloom"):
        load_ours(tmp_path, pp_rank=0, pp_size=2)


def test_more_stages_than_layers_are_refused(tmp_path):
    build_tiny_hf_model(LlamaConfig(**SHAPE, intermediate_size=128, num_hidden_layers=2), tmp_path)
    with pytest.raises(ValueError, match="pp=3 stages need at least one layer each; the model has 2"):
        load_ours(tmp_path, pp_rank=0, pp_size=3)


def test_stages_replay_their_layers_with_hand_offs_around_the_graphs(tmp_path):
    """At pp > 1 each stage's decode graphs hold its own layers, the hand-offs run around the
    replays (cuda_graph.py, _StageLink): the graphs' padded, static-buffer path (capture=False, the
    CPU's) gives the eager stages' logits, at batch sizes that pad (3 -> 4) and that do not."""
    hf = build_tiny_hf_model(CONFIGS["llama"](), tmp_path)
    eager = load_stages(tmp_path, 3)
    graphed = load_stages(tmp_path, 3, cuda_graph_max_bs=4, cuda_graph_capture=False)
    assert all(m.decode_graphs is not None for m in graphed) and all(m.decode_graphs is None for m in eager)
    for prompts in (PROMPTS, PROMPTS[:1]):
        steps = [[[i + 1 + j] for i in range(len(prompts))] for j in range(3)]
        want = run_stages(eager, prompts, steps)
        got = run_stages(graphed, prompts, steps)
        for step, (g, w) in enumerate(zip(got, want)):
            assert rel_err(g.float(), w.float()) < LOGITS_TOL, step
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0] + [1, 2, 3]])).logits[0].float()
    assert rel_err(got[-1][0].cpu(), ref[-1]) < LOGITS_TOL


def test_stages_replay_verify_steps_with_hand_offs_around_the_graphs(tmp_path):
    """The same for speculative verify steps (1 + K new tokens a request, every row's logits):
    each stage's verify graphs (padded path) give the eager stages' rows."""
    build_tiny_hf_model(CONFIGS["llama"](), tmp_path)
    spec = dict(speculate=3, speculate_max_batch=3)
    eager = load_stages(tmp_path, 2, **spec)
    graphed = load_stages(tmp_path, 2, cuda_graph_max_bs=4, cuda_graph_capture=False, **spec)
    assert all(m.verify_graphs is not None for m in graphed)
    rows = [[m.req_manager.alloc_req() for _ in PROMPTS] for m in eager + graphed]
    lens = [0] * len(PROMPTS)
    for chunks, all_logits in [(PROMPTS, False), ([[7, 8, 9, 10], [3], [11, 12]], [True, False, True])]:
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        out = []
        for stages, stage_rows in ((eager, rows[:2]), (graphed, rows[2:])):
            for m, r in zip(stages, stage_rows):
                logits = m.forward(ids, r, list(lens), [len(c) for c in chunks], all_logits)
            out.append(logits)
        flags = all_logits or [False] * len(chunks)
        assert out[0].shape[0] == sum(len(c) if f else 1 for c, f in zip(chunks, flags))
        if all_logits:    # the graphed stages replayed (their padded path), not the eager forward
            assert all(m.verify_graphs.can_run([len(c) for c in chunks], all_logits) for m in graphed)
        assert rel_err(out[1].float(), out[0].float()) < LOGITS_TOL
        lens = [n + len(c) for n, c in zip(lens, chunks)]
