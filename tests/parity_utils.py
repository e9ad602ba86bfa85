"""Shared helpers for the tests that hold our models against HF transformers.

By default our models run on the CPU in float32 (the torch twins of the kernels) and must
match HF within 1e-4 relative error with identical greedy tokens. On the GPU machine set
``LLMSERVE_TEST_DEVICE=cuda`` and ``LLMSERVE_TEST_DTYPE=float16|bfloat16`` to run the same
tests with compiled Triton kernels in half precision (the HF reference stays float32 on the
CPU, and the tolerance widens to what half precision allows)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmserve.common.basemodel import ModelInitParams, TpPartBaseModel
from llmserve.models.registry import get_model_class


def build_tiny_hf_model(config, path, seed: int = 0):
    """A random-weight HF model saved as safetensors under ``path``. Weights are drawn wider than
    HF's default init so logits are spread out and greedy picks are not near-ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def random_prompts(lens: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


TEST_DEVICE = os.environ.get("LLMSERVE_TEST_DEVICE", "cpu")
TEST_DTYPE = getattr(torch, os.environ.get("LLMSERVE_TEST_DTYPE", "float32"))
# relative error of logits against HF float32: float32 arithmetic vs half-precision weights and activations
# (bf16 keeps 8 mantissa bits: two layers of these wide random weights already drift ~5%; a real
# bug - a wrong mask, rotary or head split - is an O(1) error)
LOGITS_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-1}[TEST_DTYPE]
EXACT = TEST_DTYPE == torch.float32


def load_ours(path, **kw) -> TpPartBaseModel:
    from llmserve.common.basemodel.layer_weights.hf_load_utils import load_hf_config

    kw.setdefault("device", TEST_DEVICE)
    kw.setdefault("dtype", TEST_DTYPE)
    params = ModelInitParams(model_path=str(path), max_total_token_num=kw.pop("max_total_token_num", 2048), **kw)
    return get_model_class(load_hf_config(str(path))["model_type"])(params)


def hf_and_ours(configs: dict, name: str, tmp_path_factory):
    """The pair a family's parity tests compare: HF's tiny random model built from
    ``configs[name]()`` and ours loaded from the same checkpoint (a module fixture's body)."""
    path = tmp_path_factory.mktemp(name)
    hf = build_tiny_hf_model(configs[name](), path)
    return hf, load_ours(path)


@dataclass
class BatchDriver:
    """Drives a TpPartBaseModel directly: one table row per prompt, prefill then decode."""

    model: TpPartBaseModel
    lora_slots: list[int] | None = None     # request i's LoRA adapter slot (-1: none); None: no adapters

    def __post_init__(self) -> None:
        self.rows: list[int] = []
        self.lens: list[int] = []

    def prefill(self, prompts: list[list[int]], return_all_logits: bool = False) -> torch.Tensor:
        self.rows = [self.model.req_manager.alloc_req() for _ in prompts]
        self.lens = [0] * len(prompts)
        return self.extend(prompts, return_all_logits)

    def extend(self, chunks: list[list[int]], return_all_logits: bool = False) -> torch.Tensor:
        """Append ``chunks[i]`` to request i (any lengths >= 1) in one forward."""
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        logits = self.model.forward(ids, self.rows, list(self.lens), [len(c) for c in chunks], return_all_logits,
                                    b_lora_slot=self.lora_slots)
        self.lens = [n + len(c) for n, c in zip(self.lens, chunks)]
        return logits

    def decode(self, tokens: list[int]) -> torch.Tensor:
        return self.extend([[t] for t in tokens])

    def free(self) -> None:
        for r in self.rows:
            self.model.req_manager.free_req(r)
        self.rows, self.lens = [], []


def tp2_logits(build_driver, prompts: list[list[int]], out: str) -> dict[str, torch.Tensor]:
    """Two gloo ranks (spawned processes) each build their driver with ``build_driver(rank,
    world_size)`` (a picklable callable: a module-level function or a partial of one), prefill
    ``prompts`` and decode one token each (1, 2, ...); rank 0's logits of both steps, through
    the file ``out``."""
    import torch.multiprocessing as mp

    from llmserve.engine.worker_client import free_tcp_port

    mp.start_processes(_tp_rank_main, args=(2, build_driver, prompts, free_tcp_port(), out), nprocs=2,
                       start_method="spawn")
    return torch.load(out)


def _tp_rank_main(rank: int, world: int, build_driver, prompts: list[list[int]], port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        driver = build_driver(rank, world)
        prefill = driver.prefill(prompts)
        decode = driver.decode(list(range(1, len(prompts) + 1)))
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode}, out)
        # Both ranks done before either tears its group down: on a loaded 2-core machine a rank
        # that left first once had its peer abort in gloo's teardown ("terminate called without
        # an active exception", SIGABRT), failing a test whose checks had passed.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def hf_greedy_with_logits(hf_model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy continuation of one prompt (its KV cache, no EOS handling) and the logits it
    produced at each step."""
    tokens, logits, past = [], [], None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            out = hf_model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


def hf_prompt_logprobs(hf_model, ids: list[int]) -> list[float]:
    """HF's logprob of each prompt token after the first (what ``echo`` with ``logprobs`` reports)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_matches_hf_greedy(ours: TpPartBaseModel, hf_model, prompts: list[list[int]], steps: int = 16) -> None:
    """Prefill all prompts as one batch, then decode ``steps`` tokens; every step's logits must be
    within LOGITS_TOL relative error of HF's. In float32 our greedy tokens must equal HF's and
    are fed back; in half precision HF's tokens are fed back (a near-tie may legitimately flip)
    and our argmax must agree on at least 90% of steps."""
    refs = [hf_greedy_with_logits(hf_model, p, steps + 1) for p in prompts]
    driver = BatchDriver(ours)
    try:
        compare_steps(driver, refs, prompts, steps)
    finally:
        driver.free()   # the model is shared by the module's tests: leave its KV pool empty
    assert ours.mem_manager.can_use_mem_size == ours.mem_manager.size


def compare_steps(driver: BatchDriver, refs, prompts: list[list[int]], steps: int) -> None:
    logits = driver.prefill(prompts)
    agree = 0
    for step in range(steps + 1):
        ours_next = logits.argmax(-1).tolist()
        for i, (ref_tokens, ref_logits) in enumerate(refs):
            err = rel_err(logits[i].cpu(), ref_logits[step])
            assert err < LOGITS_TOL, f"prompt {i} step {step}: relative error {err:.2e}"
            if EXACT:
                assert ours_next[i] == ref_tokens[step], f"prompt {i} step {step}: greedy token differs"
            agree += ours_next[i] == ref_tokens[step]
        if step < steps:
            logits = driver.decode([ref[0][step] for ref in refs])
    assert agree >= 0.9 * len(prompts) * (steps + 1)


def assert_chunked_prefill_matches_hf(ours: TpPartBaseModel, hf_model, prompt: list[int], cuts: list[int]) -> None:
    """``prompt`` fed in chunks (cut at ``cuts``), each on top of the cache of the ones before:
    every position's logits within LOGITS_TOL of HF's over the whole prompt at once (the general
    case of cached tokens plus several new ones)."""
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    bounds = [0, *cuts, len(prompt)]
    chunks = [prompt[a:b] for a, b in zip(bounds, bounds[1:])]
    driver = BatchDriver(ours)
    try:
        got = torch.cat([driver.prefill([chunks[0]], return_all_logits=True),
                         *(driver.extend([c], return_all_logits=True) for c in chunks[1:])])
    finally:
        driver.free()
    assert rel_err(got.cpu(), ref) < LOGITS_TOL


def assert_matches_hf_past_the_window(ours: TpPartBaseModel, hf_model, vocab: int, steps: int = 16) -> None:
    """For models with a sliding window of about 8 tokens: prompts shorter and longer than it,
    prefilled as one batch and decoded ``steps`` tokens past it (`assert_matches_hf_greedy`),
    and a 30-token prompt fed in four chunks across it (`assert_chunked_prefill_matches_hf`)."""
    assert_matches_hf_greedy(ours, hf_model, random_prompts([5, 12, 1, 20], vocab), steps=steps)
    assert_chunked_prefill_matches_hf(ours, hf_model, random_prompts([30], vocab, seed=2)[0], cuts=[7, 13, 25])


IMAGE_TOKEN = "<image>"


def build_tiny_llava(path, tokenizer, seed: int = 0, old_layout: bool = False):
    """A random-weight ``LlavaForConditionalGeneration`` saved under ``path``: a tiny CLIP tower
    (30x30 images in 6x6 patches: 25 image tokens), a tiny Llama decoder, ``tokenizer`` with an
    ``<image>`` token added, and a CLIP image processor, as a real LLaVA directory has them.
    ``old_layout`` saves the tensor names of checkpoints from before transformers 4.52."""
    from safetensors.torch import save_file
    from transformers import (
        AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}).save_pretrained(path)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=30, patch_size=6, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    if old_layout:
        from safetensors.torch import load_file

        from llmserve.models.llava.model import replace_prefix

        state = load_file(os.path.join(path, "model.safetensors"))
        renames = [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                   ("model.vision_tower.", "vision_tower.vision_model."), ("model.multi_modal_projector.", "multi_modal_projector.")]
        old = {replace_prefix(name, renames): t.contiguous() for name, t in state.items()}
        save_file(old, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return model, tokenizer


def hf_llava_greedy(hf, prompt: list[int], pixels: torch.Tensor | None, steps: int):
    """HF's greedy tokens and last-row logits for a LLaVA prompt, recomputing the whole sequence
    each step (HF's generate cannot take a text-only prompt on a LLaVA model)."""
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            kwargs = {} if pixels is None else {"pixel_values": pixels}
            out = hf(input_ids=torch.tensor([prompt + tokens]), **kwargs)
            logits.append(out.logits[0, -1].float())
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits
