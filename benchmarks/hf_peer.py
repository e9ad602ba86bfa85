"""HF transformers as the peer in ``offline.py``'s table: the config's causal-LM class
(``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``) with the very same
random weights (the same generator, seed and order as ours), prefilled and then decoded one
step at a time, each step timed the way ours is (CUDA events around forward + argmax).

- ``hf``: eager, ``DynamicCache``: what ``model.generate`` does by default.
- ``hf-compiled``: ``StaticCache`` and ``torch.compile(mode="reduce-overhead", fullgraph=True)``
  of the forward: HF's recipe for fast decoding (CUDA graphs through inductor). The compile runs
  in the untimed warm-up steps, once per batch size.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

import torch

from common import IntervalTimer, gc_paused, synchronize

PEERS = ("hf", "hf-compiled")


def build_hf_model(cfg: dict, device: torch.device, dtype: torch.dtype, weights: Iterable[dict[str, torch.Tensor]]):
    """An HF model of ``cfg``'s architecture and shapes on ``device`` in ``dtype``, holding ``weights`` (HF names)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    for chunk in weights:
        chunk = fuse_experts(chunk)
        missing = set(chunk) - set(model.state_dict())
        assert not missing, f"HF {type(model).__name__} has no {sorted(missing)[:3]}"
        model.load_state_dict(chunk, strict=False)
        del chunk
    return model


_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


def fuse_experts(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names (each expert's gate / up / down, Mixtral's under ``block_sparse_moe``) as
    transformers 5 holds them in memory: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
    ``mlp.experts.down_proj`` ``[E, H, I]`` per layer (its loader converts so; load_state_dict
    does not). A chunk without experts comes back as it is."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, t in chunk.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(m[1], {})[int(m[2]), _EXPERT_PART[m[3]]] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([parts[e, 0], parts[e, 1]]) for e in range(n)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts[e, 2] for e in range(n)])
    return out


class HFPeer:
    def __init__(self, model, mode: str):
        assert mode in PEERS, mode
        self.model = model
        self.mode = mode
        self.device = next(model.parameters()).device
        self._forward = (torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                         if mode == "hf-compiled" else model.forward)

    @torch.inference_mode()
    def run(self, batch: int, prompt_len: int, warmup: int, steps: int) -> tuple[float, list[float]]:
        """Prefill ``batch`` random prompts in one forward, then ``warmup + steps`` greedy decode
        steps; returns the prefill's seconds and the timed steps' milliseconds."""
        from transformers import DynamicCache, StaticCache

        model, device = self.model, self.device
        if self.mode == "hf-compiled":
            warmup = max(warmup, 3)         # compile, then record the CUDA graph, then replay
            cache = StaticCache(config=model.config, max_cache_len=prompt_len + warmup + steps + 1)
        else:
            cache = DynamicCache(config=model.config)
        ids = torch.randint(model.config.vocab_size, (batch, prompt_len), device=device)
        synchronize(device)
        timer = IntervalTimer(device)
        timer.start()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(prompt_len, device=device))
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        timer.stop()
        prefill_s = timer.elapsed_ms()[0] / 1e3
        timer = IntervalTimer(device)
        with gc_paused():
            for s in range(warmup + steps):
                timer.start()
                out = self._forward(input_ids=tokens, past_key_values=cache, use_cache=True,
                                    cache_position=torch.tensor([prompt_len + s], device=device))
                tokens = out.logits[:, -1].argmax(-1, keepdim=True)
                timer.stop()
        if not bool(torch.isfinite(out.logits).all()):
            raise RuntimeError(f"{self.mode}: non-finite logits")
        return prefill_s, timer.elapsed_ms()[warmup:]


@torch.inference_mode()
def hf_generate_decode(model, prompt_ids: list[int], max_new_tokens: int,
                       prompt_lookup_num_tokens: int | None = None) -> tuple[list[int], float]:
    """One greedy ``model.generate`` of a prompt (batch 1: HF's prompt lookup takes no larger
    batch), with HF's own prompt-lookup decoding when ``prompt_lookup_num_tokens`` is set. Returns
    the tokens and the seconds of the decode phase: the whole call less a one-token call (the
    prefill and the first token), as ``prompt_lookup.py`` times ours from every first token."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kwargs = dict(do_sample=False, num_beams=1, pad_token_id=model.config.eos_token_id)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens

    def timed(n: int) -> tuple[torch.Tensor, float]:
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, **kwargs)
        synchronize(device)
        return out, time.perf_counter() - start

    timed(2)                                              # warm-up
    _, first = timed(1)
    out, whole = timed(max_new_tokens)
    return out[0, len(prompt_ids):].tolist(), whole - first
