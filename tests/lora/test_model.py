"""LoRA adapters in our models against PEFT on the same weights: tiny random Llama, Qwen2,
Mistral and Gemma 2 (its own MLP activation), each with three random adapters of different
ranks and targets (fp32 on the CPU: identical greedy tokens), a batch mixing the base model and
all three, and prompts in chunks; Phi-3 with an adapter on its fused qkv_proj and gate_up_proj
(HF's module names), Qwen3 and Gemma 3, an MoE model with one on its attention, and a LLaVA with one on its language
model (a prompt with an image), each beside the base model."""

from __future__ import annotations

import pytest
import torch
from lora_utils import ALL_TARGETS, AdapterSpec, adapter_active, make_peft_adapter, peft_greedy, peft_model_of
from transformers import (
    Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
)

from llmserve.lora.adapter import AdapterLoadError, read_adapter
from llmserve.worker.images import RequestImages, step_input_embeds
from parity_utils import (
    EXACT, LOGITS_TOL, BatchDriver, build_tiny_hf_model, compare_steps, hf_llava_greedy, load_ours, random_prompts,
    rel_err,
)

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
    "gemma2": lambda: Gemma2Config(**SHAPE, head_dim=16),
}
ADAPTERS = {
    "attn-r4": AdapterSpec(r=4, targets=("q_proj", "v_proj"), alpha=8, seed=1),
    "all-r8-rslora": AdapterSpec(r=8, targets=ALL_TARGETS, alpha=4, rslora=True, seed=2),
    "mlp-r2": AdapterSpec(r=2, targets=("o_proj", "gate_proj", "down_proj", "k_proj"), alpha=32, seed=3),
}
MAX_RANK = 8


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_hf_model(CONFIGS[request.param](), path)
    dirs = {name: make_peft_adapter(hf, path / name, spec) for name, spec in ADAPTERS.items()}
    ours = load_ours(path, max_loras=len(dirs), max_lora_rank=MAX_RANK)
    for slot, (name, adapter_dir) in enumerate(dirs.items()):
        ours.lora_pool.load(slot, read_adapter(name, adapter_dir, ours.network_config_, MAX_RANK))
    return peft_model_of(hf, dirs), ours


# Request i's adapter: the base model, then each adapter (slot = its index in ADAPTERS).
MIXED = [None, *ADAPTERS]


def _slot(adapter: str | None) -> int:
    return -1 if adapter is None else list(ADAPTERS).index(adapter)


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_each_adapter_matches_peft(family, adapter):
    peft_model, ours = family
    prompts = random_prompts([5, 11], ours.vocab_size, seed=7)
    refs = [peft_greedy(peft_model, adapter, p, 9) for p in prompts]
    driver = BatchDriver(ours, lora_slots=[_slot(adapter)] * len(prompts))
    try:
        compare_steps(driver, refs, prompts, 8)
    finally:
        driver.free()


def test_mixed_batch_gives_each_request_its_own_tokens(family):
    """Base and three adapters in one batch: each request's logits and greedy tokens are PEFT's
    with its own adapter (what it gets alone), through prefill and decode."""
    peft_model, ours = family
    prompts = random_prompts([6, 3, 9, 4], ours.vocab_size, seed=11)
    refs = [peft_greedy(peft_model, adapter, p, 9) for adapter, p in zip(MIXED, prompts)]
    driver = BatchDriver(ours, lora_slots=[_slot(a) for a in MIXED])
    try:
        compare_steps(driver, refs, prompts, 8)
    finally:
        driver.free()
    # The adapters change the tokens (else this test could not tell them apart).
    assert len({tuple(peft_greedy(peft_model, a, prompts[0], 6)[0]) for a in MIXED}) == len(MIXED)


def test_chunked_prompts_with_adapters(family):
    """Prompts fed in chunks beside each other (cached tokens plus several new ones per request)."""
    peft_model, ours = family
    prompts = random_prompts([12, 10], ours.vocab_size, seed=5)
    adapters = ["all-r8-rslora", "mlp-r2"]
    with torch.no_grad():
        want = []
        for adapter, p in zip(adapters, prompts):
            with adapter_active(peft_model, adapter):
                want.append(peft_model(torch.tensor([p])).logits[0].float())
    driver = BatchDriver(ours, lora_slots=[_slot(a) for a in adapters])
    try:
        first = driver.prefill([p[:5] for p in prompts], return_all_logits=True)
        rest = driver.extend([p[5:] for p in prompts], return_all_logits=True)
    finally:
        driver.free()
    got = [torch.cat([first[:5], rest[:7]]), torch.cat([first[5:], rest[7:]])]
    for g, w in zip(got, want):
        assert rel_err(g.cpu(), w) < LOGITS_TOL


def test_triton_kernels_give_the_twins_logits(family):
    """The model's mixed batch with every kernel in Triton (the interpreter on the CPU): the LoRA
    kernels read the pool's stacked A and B as the twins do."""
    from llmserve.kernels import set_backend

    _, ours = family
    if ours.model_type != "llama":
        pytest.skip("the interpreter is slow: one family shows the kernels' reading of the pool")
    prompts = random_prompts([5, 3, 6, 2], ours.vocab_size, seed=13)
    logits = {}
    for backend in ("torch", "triton"):
        set_backend(backend)
        driver = BatchDriver(ours, lora_slots=[_slot(a) for a in MIXED])
        try:
            first = driver.prefill(prompts)
            logits[backend] = torch.cat([first, driver.decode(first.argmax(-1).tolist())])
        finally:
            driver.free()
            set_backend(None)
    assert rel_err(logits["triton"].cpu(), logits["torch"].cpu()) < (1e-5 if EXACT else 2e-2)


# More families, one adapter each: Qwen3 and Gemma 3 (q/k norms; Gemma 3's sliding layers) on
# every projection, Llama with per-module ranks and alphas, Phi-3's fused projections (PEFT's only
# targets there), and an MoE model's attention (its experts take none).
OTHER_FAMILIES = {
    "phi3-fused": (lambda: Phi3Config(**SHAPE, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                   AdapterSpec(r=4, targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), alpha=8, seed=4)),
    "qwen3": (lambda: Qwen3Config(**SHAPE, head_dim=16), AdapterSpec(r=4, alpha=8, seed=7)),
    # sliding-window and global layers, q/k norms; prompts past the window
    "gemma3": (lambda: Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"]),
               AdapterSpec(r=4, alpha=8, seed=8)),
    # PEFT's rank_pattern / alpha_pattern: modules of other ranks and alphas in one adapter
    "llama-rank-pattern": (lambda: LlamaConfig(**SHAPE), AdapterSpec(r=4, alpha=8, seed=9, extra={
        "rank_pattern": {"q_proj": 2, "down_proj": 6}, "alpha_pattern": {"v_proj": 32, "layers.1.mlp.up_proj": 3}})),
    "qwen3-moe-attention": (lambda: Qwen3MoeConfig(**{**SHAPE, "intermediate_size": 48}, head_dim=16,
                                                   moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
                            AdapterSpec(r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), alpha=8, seed=5)),
}


@pytest.mark.parametrize("name", list(OTHER_FAMILIES))
def test_other_families_match_peft(name, tmp_path):
    config, spec = OTHER_FAMILIES[name]
    hf = build_tiny_hf_model(config(), tmp_path / "model")
    adapter_dir = make_peft_adapter(hf, tmp_path / "adapter", spec)
    ours = load_ours(tmp_path / "model", max_loras=1, max_lora_rank=MAX_RANK)
    ours.lora_pool.load(0, read_adapter("a", adapter_dir, ours.network_config_, MAX_RANK))
    peft_model = peft_model_of(hf, {"a": adapter_dir})
    prompts = random_prompts([5, 9], ours.vocab_size, seed=3)
    refs = [peft_greedy(peft_model, adapter, p, 7) for adapter, p in zip(("a", None), prompts)]
    assert refs[0][0] != peft_greedy(peft_model, None, prompts[0], 7)[0]    # the adapter changes the tokens
    driver = BatchDriver(ours, lora_slots=[0, -1])
    try:
        compare_steps(driver, refs, prompts, 6)
    finally:
        driver.free()


def test_llava_language_model_adapter_matches_peft(tiny_llava, tmp_path):
    """PEFT's adapter of a LLaVA's language model (targets as a regex over module paths, as LLaVA
    fine-tunes leave the vision tower alone): a prompt with an image on the adapter beside a
    text-only one on the base model, greedy tokens and logits as PEFT's. An adapter that also
    wraps the vision tower (plain module names match its attention too) is refused."""
    path, hf = tiny_llava
    adapter_dir = make_peft_adapter(hf, tmp_path / "lm", AdapterSpec(
        r=4, targets=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)", seed=6))
    ours = load_ours(path, max_loras=1, max_lora_rank=4)
    ours.lora_pool.load(0, read_adapter("lm", adapter_dir, ours.network_config_, 4))
    peft_model = peft_model_of(hf, {"lm": adapter_dir})
    image = [ours.image_token_id] * ours.tokens_per_image
    prompts = [[1, 40, 41, *image, 300, 301], [1, 2, 3, 4, 5]]
    pixels = [torch.randn(1, 3, 30, 30, generator=torch.Generator().manual_seed(1)), None]
    with adapter_active(peft_model, "lm"):
        ref_lm = hf_llava_greedy(peft_model, prompts[0], pixels[0], 6)
    with adapter_active(peft_model, None):
        ref_base = hf_llava_greedy(peft_model, prompts[1], None, 6)
        assert hf_llava_greedy(peft_model, prompts[0], pixels[0], 6)[0] != ref_lm[0]    # the adapter matters
    images = [RequestImages.of_prompt(prompts[0], ours.image_token_id, ours.encode_images(pixels[0])), None]
    rows, lens, chunks = [ours.req_manager.alloc_req() for _ in prompts], [0, 0], prompts
    try:
        for step in range(6):
            parts = [(0, images[0], lens[0], len(chunks[0]))] if step == 0 else []
            ids = torch.tensor([t for c in chunks for t in c])
            logits = ours.forward(ids, rows, list(lens), [len(c) for c in chunks], b_lora_slot=[0, -1],
                                  input_embeds=step_input_embeds(parts, ours.device) if parts else None)
            for i, (tokens, ref_logits) in enumerate((ref_lm, ref_base)):
                assert rel_err(logits[i].cpu(), ref_logits[step]) < LOGITS_TOL, f"request {i} step {step}"
                if EXACT:
                    assert int(logits[i].argmax()) == tokens[step], f"request {i} step {step}"
            lens = [n + len(c) for n, c in zip(lens, chunks)]
            chunks = [[ref_lm[0][step]], [ref_base[0][step]]]
    finally:
        for row in rows:
            ours.req_manager.free_req(row)
    tower_too = make_peft_adapter(hf, tmp_path / "all", AdapterSpec(r=4, targets=("q_proj", "v_proj")))
    with pytest.raises(AdapterLoadError, match="unexpected tensor .*vision_tower"):
        read_adapter("all", tower_too, ours.network_config_, 4)
