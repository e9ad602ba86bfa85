"""What an engine runs (``EngineConfig``) and on which model (``ModelSpec``, from ``inspect_model``):
the part of the engine the front ends (the HTTP process, the offline ``LLM``) and the engine-core
process share. Config only: importing it imports no scheduler, worker client, torch or tokenizer.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

from llmserve.common.errors import ModelLoadError
from llmserve.default_model import default_model_path


@dataclass
class EngineConfig:
    model: str | None = None            # HF model directory or .gguf file; None: the embedded default
    tp: int = 1
    # Pipeline stages (`--pp`), each of tp ranks holding its share of the layers: tp x pp ranks in
    # all, rank r tp rank r % tp of stage r // tp (common/distributed.py). The stages run one
    # after another (no micro-batches yet): pp is for a model that one node's tp group cannot
    # hold, or nodes between which tensor parallelism would not pay.
    pp: int = 1
    # The ranks spread over this many machines (tp x pp / nnodes each); this one, the head, runs
    # ranks 0 .. tp x pp / nnodes - 1 and the others run `llmserve serve --headless`. All ranks
    # meet at dist_init_addr (HOST:PORT of the head; None: a free local port, one node only) and
    # must join within dist_timeout seconds.
    nnodes: int = 1
    # Data-parallel replicas (`llmserve serve --dp N`, server/data_parallel.py): N engine cores of
    # tp workers each behind the HTTP process, on GPUs r*tp .. r*tp+tp-1. Each core runs as if alone.
    dp: int = 1
    dist_init_addr: str | None = None
    dist_timeout: float = 120.0
    dtype: str | None = None            # float32 | float16 | bfloat16; None: fp32 on CPU, checkpoint's on GPU
    device: str = "auto"                # auto | cpu | cuda
    max_total_token_num: int | None = None  # KV pool size in tokens; None: from free memory / CPU default
    mem_fraction: float = 0.85
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192      # prompt tokens per step
    chunked_prefill: bool = True        # split longer prompts over steps (see scheduler.py)
    cuda_graph_max_bs: int = 256        # GPU decode steps up to this batch replay CUDA graphs; 0: eager
    # At tp > 1 on the GPUs of one node: small all-reduces (a decode step's) over peer-to-peer
    # buffers instead of NCCL (common/custom_all_reduce.py). None: on where it applies (not yet
    # between pipeline stages' tp groups: see uses_custom_all_reduce); False: --disable-custom-all-reduce.
    custom_all_reduce: bool | None = None
    # Schedule step N+1 while the device runs step N (see LLMEngine.step). None: on for GPUs,
    # where it hides the host's work; True also on the CPU (tests: same tokens either way).
    overlap: bool | None = None
    dequantize: bool = False            # GGUF on CPU: dense float32 matrices instead of the quantized kernel
    quantization: str | None = None     # --quantization: checks the checkpoint's; "fp8" quantizes a dense one at load
    kv_cache_dtype: str = "auto"        # --kv-cache-dtype: auto (the model's) | fp8 | fp8_e4m3 (float8, per-tensor scales)
    # --load-format: auto (the checkpoint's weights) | dummy (random weights from config.json alone,
    # for benchmarks: common/basemodel/layer_weights/random_weights.py)
    load_format: str = "auto"
    # Prompt-lookup speculation (see scheduler.py): draft tokens per decoding request per step
    # (0: off), the largest decode batch that still drafts (None: the device's, from
    # SPECULATE_MAX_BATCH), and the n-gram sizes matched.
    speculate: int = 0
    speculate_max_batch: int | None = None
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_max_ngram: int = 3
    # Keep computed tokens' KV in a radix tree and start requests from their longest cached prefix
    # (engine/radix_cache.py); off: every prompt is prefilled in full.
    prefix_cache: bool = True
    # Seconds a step may take before it counts as hung (a stopped worker, a collective that never
    # returns) and the engine stops with an error, rather than waiting for ever. Loading the model,
    # compiling kernels and capturing CUDA graphs at start-up are not steps.
    step_timeout: float = 600.0
    # LoRA adapters (llmserve/lora/): name -> local PEFT adapter directory (vLLM's --lora-modules),
    # the slots of the workers' device pool (adapters resident at once; others load on demand,
    # the least recently used unheld one evicted), the largest rank a slot holds, and how many
    # adapters the workers keep read on the host (None: all of them).
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters from local
    # directories named by the request): off, the adapters are --lora-modules' and no request
    # makes the server read a path.
    allow_runtime_lora_updating: bool = False

    @property
    def uses_custom_all_reduce(self) -> bool:
        """What the workers are told: the custom all-reduce unless turned off, or left to its default
        at pp > 1, where it does not run yet (check_pipeline refuses it asked for there)."""
        return self.custom_all_reduce if self.custom_all_reduce is not None else self.pp == 1

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_modules) or self.allow_runtime_lora_updating

    @property
    def world_size(self) -> int:
        """The model's ranks: tp x pp."""
        return self.tp * self.pp


# The largest decode batch that drafts, by device, when --speculate-max-batch is not given: past
# it a verify step costs more than its accepted drafts save (benchmarks/README.md, "prompt_lookup.py").
SPECULATE_MAX_BATCH = {"cuda": 32, "cpu": 8}


@dataclass(frozen=True)
class ModelSpec:
    """The model as the front end found it before starting an engine (``inspect_model``): the
    engine trusts it, and needs neither torch nor a tokenizer to get it."""
    path: str
    model_type: str
    device: str                         # cpu | cuda ("auto" resolved)
    eos_token_ids: frozenset[int]       # every id that ends a generation (tokenizer.eos_token_ids)


def inspect_model(config: EngineConfig, tokenizer) -> ModelSpec:
    """What the front end (the HTTP process, the offline ``LLM``) learns of the model before an
    engine starts: the errors a config alone reveals (a missing path, an unknown architecture,
    heads that tp cannot split, too few GPUs) come from here in a second, instead of from every
    worker after start-up (which check again, on the full config).

    It reads the raw config and imports torch only on a machine with a GPU driver: torch is 200 MB
    of resident memory, which on a CPU would be a fifth of serving the embedded model."""
    from llmserve.common.basemodel.layer_weights.random_weights import check_load_format
    from llmserve.common.basemodel.model_shape import verify_tp_split
    from llmserve.models.registry import check_model_type, check_pipeline_split, peek_model_config
    from llmserve.tokenizer import eos_token_ids

    if config.tp < 1:
        raise ValueError(f"tp must be >= 1, got {config.tp}")
    path = resolve_model_path(config.model)
    raw = peek_model_config(path)
    check_model_type(raw.get("model_type"))
    check_load_format(config.load_format, raw.get("model_type"), path)
    heads = raw.get("num_attention_heads") or raw.get("n_head")     # BLOOM's name for it
    if isinstance(heads, int):     # else the worker's config class says what is wrong
        verify_tp_split(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads")),
                        config.tp)
    check_nodes(config)
    check_pipeline(config)
    layers = raw.get("num_hidden_layers") or raw.get("n_layer")
    check_pipeline_split(raw["model_type"], layers if isinstance(layers, int) else None, config.pp)
    device, gpus = _resolve_device(config.device)
    if device == "cuda" and config.dp * config.world_size // config.nnodes > gpus:
        per = "" if config.nnodes == 1 else f" on each of {config.nnodes} nodes"
        shape = " x ".join(f"{name}={n}" for name, n in (("dp", config.dp), ("tp", config.tp), ("pp", config.pp))
                           if n > 1 or name == "tp")
        raise ValueError(f"{shape} needs {config.dp * config.world_size // config.nnodes} GPUs{per}, found {gpus}")
    return ModelSpec(path, raw["model_type"], device, frozenset(eos_token_ids(path, tokenizer)))


def check_nodes(config: EngineConfig) -> None:
    """The ranks must split evenly over the nodes, which need an address to meet at; replicas
    are of one node."""
    if config.dp < 1:
        raise ValueError(f"dp must be >= 1, got {config.dp}")
    if config.dp > 1 and config.nnodes > 1:
        raise ValueError("dp > 1 runs its replicas on one machine: for replicas of several nodes each, run one "
                         "server per group behind a load balancer (README, \"Deployment shapes\")")
    if config.nnodes < 1 or config.world_size % config.nnodes:
        ranks = f"tp={config.tp}" if config.pp == 1 else f"tp x pp = {config.world_size}"
        raise ValueError(f"{ranks} does not split over nnodes={config.nnodes} (it must be a multiple of it)")
    if config.nnodes > 1 and not config.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of the head, which every node can reach)")


def check_pipeline(config: EngineConfig) -> None:
    """What pipeline stages (pp > 1) cannot run with yet is refused here, not run wrong."""
    if config.pp < 1:
        raise ValueError(f"pp must be >= 1, got {config.pp}")
    if config.pp > 1 and config.tp > 1 and config.custom_all_reduce is True:
        raise ValueError("the custom all-reduce (--enable-custom-all-reduce) is not supported with pp > 1 yet")


def _resolve_device(device: str) -> tuple[str, int]:
    """(cpu | cuda, GPUs torch sees). "auto" is cuda when torch sees a GPU; on Linux without a GPU
    driver's device (NVIDIA's /dev/nvidiactl, ROCm's /dev/kfd, WSL2's /dev/dxg) it cannot, and
    torch is not imported to ask."""
    if device == "cpu" or (device == "auto" and sys.platform == "linux"
                           and not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg"))):
        return "cpu", 0
    import torch

    gpus = torch.cuda.device_count()
    return ("cuda" if gpus else "cpu") if device == "auto" else device, gpus


def with_device_defaults(config: EngineConfig, device: str) -> EngineConfig:
    """``config`` with the fields it leaves to the device (None) set to that device's values."""
    if config.speculate_max_batch is None:
        config = dataclasses.replace(config, speculate_max_batch=SPECULATE_MAX_BATCH[device])
    return config


def check_speculation(config: EngineConfig) -> None:
    if config.speculate < 0:
        raise ValueError(f"speculate must be >= 0 (draft tokens per step; 0: off), got {config.speculate}")
    if config.speculate_max_batch < 1:
        raise ValueError(f"speculate_max_batch must be >= 1, got {config.speculate_max_batch}")
    if not 1 <= config.prompt_lookup_min_ngram <= config.prompt_lookup_max_ngram:
        raise ValueError(f"need 1 <= prompt_lookup_min_ngram <= prompt_lookup_max_ngram, got "
                         f"{config.prompt_lookup_min_ngram} and {config.prompt_lookup_max_ngram}")


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {model!r} does not exist")
    return path
