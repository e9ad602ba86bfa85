"""TpPartBaseModel: one tensor-parallel rank's share of a decoder-only model (of its pipeline
stage's layers, at pp > 1), assembled from weight classes and layer-infer classes named as class
attributes (lightllm's layout)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, PretrainedConfig

from llmserve.common.basemodel.cuda_graph import DecodeGraphs, VerifyGraphs
from llmserve.common.basemodel.infer_struct import InferStateInfo, InputEmbeds
from llmserve.common.basemodel.layer_weights.gguf_load_utils import GGUFArch, load_gguf
from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError, iter_hf_weight_files, load_hf_config
from llmserve.common.basemodel.model_shape import (  # noqa: F401  (verify_tp_split: also imported from here)
    head_dim, num_kv_heads, stage_layers, verify_tp_split,
)
from llmserve.common.distributed import PartialSum, PipelineLink, reduce_over_ranks
from llmserve.common.mem_manager import MemoryManager, ReqManager, kv_bytes_per_token
from llmserve.quantization.config import Quantization, quantization_for
from llmserve.quantization.kv_cache import KVCacheScales, check_kv_cache_scheme, kv_cache_dtype

if TYPE_CHECKING:
    from llmserve.lora.pool import LoraBatch, LoraPool

logger = logging.getLogger(__name__)

# The CPU's KV pool when none is asked for: this many tokens' bytes at the model's dtype (a float8
# cache holds more tokens in them, as on a GPU).
DEFAULT_CPU_KV_TOKENS = 16384
_INT32_PER_16_BYTES = 4   # Triton specialises a pointer argument on 16-byte alignment


@dataclass
class ModelInitParams:
    model_path: str                       # an HF model directory or a .gguf file
    tp_rank: int = 0                      # this rank's place in its pipeline stage's tp ranks
    world_size: int = 1                   # the tp ranks of a stage (tensor parallelism)
    # Pipeline parallelism: this rank's stage of pp_size; a stage holds only its share of the
    # layers (model_shape.stage_layers), hands its output on to the next stage's rank of the same
    # tp_rank, and the last one makes the logits (common/distributed.py, PipelineLink).
    pp_rank: int = 0
    pp_size: int = 1
    device: str = "cpu"
    dtype: torch.dtype | None = None      # None: fp32 on CPU; the checkpoint's fp16/bf16 on GPU
    max_total_token_num: int | None = None  # KV pool size in tokens; None: sized from free memory
    mem_fraction: float = 0.85            # GPU: share of the card's memory the process may fill
    max_running_requests: int = 256                # rows of the req->token table
    max_seq_len: int | None = None        # longest request; None: min(context window, KV pool)
    # Decode steps of up to this many requests replay CUDA graphs (cuda_graph.py); 0: never.
    cuda_graph_max_bs: int = 0
    # Speculative verify steps (up to 1 + speculate new tokens a request, in batches of up to
    # speculate_max_batch and cuda_graph_max_bs requests) replay graphs of their own; 0: none.
    speculate: int = 0
    speculate_max_batch: int = 0
    # Test hook: the graphs' padded static-buffer path without capturing (CPU tests).
    cuda_graph_capture: bool = True
    config: dict | None = None            # use this HF-style config instead of the checkpoint's
    weights: Iterable[dict[str, torch.Tensor]] | None = None  # use these tensors (random-weight benchmarks)
    # "auto": the checkpoint's tensors; "dummy": random ones drawn from the config alone
    # (layer_weights/random_weights.py; vLLM's --load-format dummy), for benchmarks.
    load_format: str = "auto"
    # A GGUF file's Q4_0 / Q4_1 / Q8_0 matrices run on the CPU in their blocks (kernels/quantized_linear);
    # True expands them to dense float32 at load, as on a GPU (same values, torch's GEMM).
    dequantize: bool = False
    # LoRA: adapter slots on the device (0: the model serves no adapters; its layers run as
    # without LoRA) and the largest rank a slot holds (llmserve/lora/pool.py).
    max_loras: int = 0
    max_lora_rank: int = 64
    # The checkpoint's quantization (quantization_config) is read whatever this says; "fp8" also
    # quantizes an unquantized checkpoint at load (llmserve.quantization; vLLM's --quantization).
    quantization: str | None = None
    # The KV cache's dtype (vLLM's --kv-cache-dtype): auto (the model's) or fp8 / fp8_e4m3 (float8
    # with per-tensor scales: llmserve.quantization.kv_cache).
    kv_cache_dtype: str = "auto"


class TpPartBaseModel:
    # weight classes
    pre_and_post_weight_class: type | None = None
    transformer_weight_class: type | None = None
    # infer classes
    pre_layer_infer_class: type | None = None
    post_layer_infer_class: type | None = None
    transformer_layer_infer_class: type | None = None
    # infer state class
    infer_state_class: type[InferStateInfo] = InferStateInfo
    # the GGUF architectures the model reads, by name (its family's tables); none: HF checkpoints only
    gguf_archs: Mapping[str, GGUFArch] = {}
    # whether the layers add LoRA adapters' products (q/k/v/o/gate/up/down projections)
    supports_lora: bool = False

    def __init__(self, params: ModelInitParams):
        self.params = params
        self.tp_rank_ = params.tp_rank
        self.world_size_ = params.world_size
        self.device = torch.device(params.device)
        self._gguf_tensors: dict[str, torch.Tensor] | None = None

        self._init_config()
        self.is_first_stage = params.pp_rank == 0
        self.is_last_stage = params.pp_rank == params.pp_size - 1
        self.stage_layers: range = stage_layers(self.network_config_.num_hidden_layers, params.pp_size, params.pp_rank)
        self.pipeline: PipelineLink | None = None
        if params.pp_size > 1:
            self.pipeline = PipelineLink(params.pp_rank * params.world_size + params.tp_rank, params.world_size,
                                         params.pp_size)
        # after _init_config: a subclass may narrow the config to its decoder's (LLaVA's text config)
        self.kv_cache_scales = KVCacheScales(self.network_config_.num_hidden_layers)
        self._verify_must()
        self._verify_params()
        self._init_weights()
        self.lora_pool: LoraPool | None = self._init_lora_pool()   # before the KV cache takes what is left
        self._init_mem_manager()
        self._init_infer_layer()
        self._init_some_value()
        self._init_custom()
        self.decode_graphs: DecodeGraphs | None = self._init_decode_graphs()
        self.verify_graphs: VerifyGraphs | None = self._init_verify_graphs()

    # -- construction -------------------------------------------------------------------
    def _init_config(self) -> None:
        """Read the checkpoint's config and normalise it through transformers' config class for
        the architecture, so aliases (BLOOM's n_embed, rope_scaling vs rope_parameters) resolve."""
        p = self.params
        if p.config is not None:
            raw = dict(p.config)
        elif p.model_path.endswith(".gguf"):
            ckpt = load_gguf(p.model_path, self.gguf_archs, progress=self.tp_rank_ == 0, quantized=self._runs_quantized())
            raw, self._gguf_tensors = ckpt.config, ckpt.tensors
        else:
            raw = load_hf_config(p.model_path)
        self.network_config_: PretrainedConfig = hf_config_from_dict(raw)
        self.quantization: Quantization | None = quantization_for(raw.get("quantization_config"), p.quantization)
        # None: the model's dtype (known once the weights are); float8 with --kv-cache-dtype fp8
        self.kv_cache_dtype_: torch.dtype | None = kv_cache_dtype(p.kv_cache_dtype, self.device)
        if self.kv_cache_dtype_ is not None:
            check_kv_cache_scheme(raw.get("quantization_config"))

    def _runs_quantized(self) -> bool:
        """Whether GGUF matrices stay in their blocks: on the CPU in float32, unless asked not to,
        and where the quantized kernel builds (it needs a C compiler)."""
        from llmserve.kernels.quantized_linear import kernel_available, kernel_unavailable_reason

        p = self.params
        if p.dequantize or self.device.type != "cpu" or p.dtype not in (None, torch.float32):
            return False
        if not kernel_available():
            logger.warning("GGUF weights dequantized to float32: the quantized CPU kernel is unavailable (%s)",
                           kernel_unavailable_reason())
            return False
        return True

    def _verify_must(self) -> None:
        from llmserve.models.registry import check_pipeline_split

        verify_tp_split(self.network_config_, self.world_size_)
        check_pipeline_split(self.model_type, self.network_config_.num_hidden_layers, self.params.pp_size)

    def _verify_params(self) -> None:
        """Model-specific checks of the config (unsupported features fail here, not mid-forward)."""

    def _default_dtype(self) -> torch.dtype:
        if self.device.type != "cuda":
            return torch.float32
        ckpt_dtype = getattr(self.network_config_, "dtype", None) or getattr(self.network_config_, "torch_dtype", None)
        return torch.float16 if ckpt_dtype in (torch.float16, "float16") else torch.bfloat16

    def _weight_source(self) -> Iterable[dict[str, torch.Tensor]]:
        if self.params.weights is not None:
            return self.params.weights
        if self._gguf_tensors is not None:
            return [self._gguf_tensors]
        if self.params.load_format == "dummy":
            from llmserve.common.basemodel.layer_weights.random_weights import random_hf_weights

            return random_hf_weights(self.network_config_.to_dict(), self.device, self.data_type)
        return iter_hf_weight_files(self.params.model_path, progress=self.tp_rank_ == 0)

    def _rename_hf_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hook for checkpoints whose tensor names vary (a "transformer." prefix, say)."""
        return weights

    def _init_weights(self) -> None:
        self.data_type = self.params.dtype or self._default_dtype()
        args = (self.tp_rank_, self.world_size_, self.data_type, self.network_config_, self.device)
        self.pre_post_weight = self.pre_and_post_weight_class(*args)
        self.pre_post_weight.holds_pre_, self.pre_post_weight.holds_post_ = self.is_first_stage, self.is_last_stage
        self.trans_layers_weight = [self.transformer_weight_class(i, *args) for i in self.stage_layers]
        self.extra_weights = self._init_extra_weights(*args)
        all_weights = [self.pre_post_weight, *self.trans_layers_weight, *self.extra_weights]
        quant = self.quantization
        for w in all_weights:
            w.quantization_ = quant
        for weights in self._weight_source():
            weights = self.kv_cache_scales.take(self._rename_hf_weights(weights))
            if quant is not None:
                weights = quant.collect(weights)
            for w in all_weights:
                w.load_hf_weights(weights)
        if quant is not None:
            quant.finish()
        for w in all_weights:
            w.finalize()
        self._gguf_tensors = None

    def _init_lora_pool(self) -> LoraPool | None:
        p = self.params
        if p.max_loras <= 0:
            return None
        if not self.supports_lora:
            raise ModelLoadError(f"LoRA adapters are not supported for {self.model_type} models")
        from llmserve.lora.pool import LoraPool

        pool = LoraPool(self.network_config_, p.max_loras, p.max_lora_rank, self.tp_rank_, self.world_size_,
                        self.data_type, self.device, layers=self.stage_layers)
        pool.widen(self.trans_layers_weight)
        return pool

    def _init_extra_weights(self, *args) -> list:
        """Hook: weight objects beyond the decoder's (LLaVA's vision tower and projector), loaded
        from the same checkpoint files; ``args`` are the weight classes' constructor arguments."""
        return []

    @property
    def model_type(self) -> str:
        return self.network_config_.model_type

    @property
    def cuda_graph_max_bs(self) -> int:
        """The largest decode batch that replays a CUDA graph; 0: none (not asked for, not on a
        GPU, or the model cannot). ``cuda_graph_capture=False`` (tests) runs the graphs' padded
        path without capturing, so it needs no GPU."""
        p = self.params
        if p.cuda_graph_max_bs <= 0 or not self._graphs_supported():
            return 0
        if p.cuda_graph_capture and self.device.type != "cuda":
            return 0
        return min(p.cuda_graph_max_bs, p.max_running_requests)

    def _graphs_supported(self) -> bool:
        """Hook: False for a model whose decode step needs the host (Llama's dynamic NTK rotary)."""
        return True

    def _init_mem_manager(self) -> None:
        cfg = self.network_config_
        tp_kv_heads = num_kv_heads(cfg) // self.world_size_
        dim = head_dim(cfg)
        context = getattr(cfg, "max_position_embeddings", None)
        kv_dtype = self.kv_cache_dtype_ or self.data_type
        layers = self.stage_layers      # a stage caches its own layers only: it holds more tokens
        size = self.params.max_total_token_num or self._auto_kv_size(
            kv_bytes_per_token(len(layers), tp_kv_heads, dim, kv_dtype))
        # Every rank allocates the same slots step by step: the pool is the smallest any rank
        # (a stage, a GPU with less free memory) can hold.
        [size] = reduce_over_ranks([size], "min", self.device)
        self.max_total_token_num = size
        # The CUDA graphs' padding request takes one slot and one row that nobody else sees.
        spare = 1 if self.cuda_graph_max_bs else 0
        scales = self.kv_cache_scales.pairs()[layers.start : layers.stop] if self.kv_cache_dtype_ is not None else None
        self.mem_manager = MemoryManager(size + spare, kv_dtype, tp_kv_heads, dim, len(layers), self.device,
                                         kv_scales=scales)
        self.max_seq_len = self.params.max_seq_len or min(context or size, size)
        self.req_manager = ReqManager(self.params.max_running_requests + spare, self.max_seq_len, self.mem_manager, self.device)

    def _init_decode_graphs(self) -> DecodeGraphs | None:
        if not self.cuda_graph_max_bs:
            return None
        return DecodeGraphs(self, self.cuda_graph_max_bs, capture=self.params.cuda_graph_capture)

    @property
    def verify_graph_max_bs(self) -> int:
        """The largest verify step (in requests) that replays a CUDA graph; 0: none."""
        p = self.params
        if not self.cuda_graph_max_bs or p.speculate < 1:
            return 0
        return min(self.cuda_graph_max_bs, p.speculate_max_batch)

    def _init_verify_graphs(self) -> VerifyGraphs | None:
        if not self.verify_graph_max_bs:
            return None
        decode = self.decode_graphs   # the padding request and the memory pool are shared
        return VerifyGraphs(self, self.verify_graph_max_bs, 1 + self.params.speculate, decode.pad_row, decode.pad_slot,
                            capture=self.params.cuda_graph_capture, pool=decode.pool)

    def _graph_rows(self) -> int:
        """The most rows (new tokens) a graphed step has, which sizes the graphs' memory."""
        return max(self.cuda_graph_max_bs, self.verify_graph_max_bs * (1 + self.params.speculate))

    @property
    def kv_cache_description(self) -> str:
        """The KV cache's dtype as /info and the start-up line say it ("bfloat16", "fp8_e4m3 ...")."""
        if self.kv_cache_dtype_ is None:
            return str(self.data_type).removeprefix("torch.")
        return f"fp8_e4m3 ({self.kv_cache_scales.describe()})"

    def _auto_kv_size(self, bytes_per_token: int) -> int:
        """KV slots that fit in what the weights left over (GPU), or a modest default (CPU); a
        token's bytes over all layers (of this pipeline stage) are ``bytes_per_token``.

        The budget is this process's share (``mem_fraction`` of the card, less what it holds
        already) but never more than is actually free on the card less the headroom that
        share leaves, so a second process on the same GPU gets a clear error here instead of
        running out of memory mid-forward. The CUDA graphs' memory comes out of it too."""
        cfg = self.network_config_
        if self.device.type != "cuda":
            model_bytes = kv_bytes_per_token(cfg.num_hidden_layers, num_kv_heads(cfg) // self.world_size_,
                                             head_dim(cfg), self.data_type)
            return DEFAULT_CPU_KV_TOKENS * model_bytes // bytes_per_token
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = self.params.mem_fraction
        budget = min(total * fraction - torch.cuda.memory_reserved(self.device), free - total * (1 - fraction))
        if self.cuda_graph_max_bs:
            budget -= DecodeGraphs.memory_estimate(self._graph_rows(), cfg, self.data_type.itemsize, self.world_size_)
        budget -= self._activation_reserve_bytes()
        if budget < bytes_per_token * 1024:
            raise ValueError(
                f"not enough GPU memory left for a KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                f"(mem_fraction={fraction}); free memory, raise mem_fraction or set max_total_token_num"
            )
        return int(budget // bytes_per_token)

    def _activation_reserve_bytes(self) -> int:
        """Hook: GPU memory a model needs beyond the decoder's forward (LLaVA's vision tower),
        kept out of the KV cache."""
        return 0

    def _init_infer_layer(self) -> None:
        args = (self.tp_rank_, self.world_size_, self.network_config_)
        self.pre_infer = self.pre_layer_infer_class(*args)
        self.post_infer = self.post_layer_infer_class(*args)
        self.layers_infer = [self.transformer_layer_infer_class(i, *args) for i in self.stage_layers]
        for cache_layer, layer_infer in enumerate(self.layers_infer):
            layer_infer.cache_layer_ = cache_layer

    def _init_some_value(self) -> None:
        self.layers_num = self.network_config_.num_hidden_layers   # the model's (a stage's: stage_layers)
        self.vocab_size = self.network_config_.vocab_size

    def _init_custom(self) -> None:
        """Model-specific setup after everything else (Llama builds its rotary tables here)."""

    def held_weights(self) -> list:
        """Every distinct weight (a tensor, ``QuantizedWeight`` or ``PackedWeight``) the decoder's
        weight objects hold, a mixture of experts' included, a tied lm_head once: what /info
        counts and the benchmarks' floors read."""
        from llmserve.kernels import QuantizedWeight
        from llmserve.quantization.weights import PackedWeight

        weights: dict[int, object] = {}
        for layer in (self.pre_post_weight, *self.trans_layers_weight):
            values = list(vars(layer).values())
            if getattr(layer, "moe_", None) is not None:
                values += vars(layer.moe_).values()
            for value in values:
                if isinstance(value, (QuantizedWeight, PackedWeight)) or (
                        isinstance(value, torch.Tensor) and value.is_floating_point()):
                    weights.setdefault(id(value), value)
        return list(weights.values())

    def counted_weights(self) -> list:
        """``held_weights`` as the model's total counts them: a tied lm_head is the embedding,
        which at pp > 1 stage 0 holds too, so a later stage leaves it to stage 0's count."""
        tied = getattr(self.network_config_, "tie_word_embeddings", False) and not self.is_first_stage
        return [t for t in self.held_weights() if not (tied and t is self.pre_post_weight.lm_head_weight_)]

    # -- inference --------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        b_req_idx: list[int],
        b_cached_len: list[int],
        b_q_len: list[int],
        return_all_logits: bool | list[bool] = False,
        input_embeds: InputEmbeds | None = None,
        b_lora_slot: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Run one batch. Request i (row ``b_req_idx[i]`` of the req->token table, which already
        maps its first ``b_cached_len[i]`` tokens) brings ``b_q_len[i]`` new tokens, packed in
        ``input_ids``. Their KV slots are allocated here. Returns float32 logits: one row per
        request (its last new token), or one per new token with ``return_all_logits``; a list of
        flags asks for all rows of the flagged requests only (prompt logprobs of one request
        should not cost a vocab-wide row for every token of the batch), requests back to back.
        ``input_embeds``: rows whose embeddings are given (image features), for models whose pre
        layer writes them. ``b_lora_slot``: request i's adapter, a slot of ``lora_pool`` (-1 or
        None: the base model). A pipeline stage before the last returns None (its output went on
        to the next stage)."""
        mem_index = self.req_manager.alloc_batch(b_req_idx, b_q_len, expected_lens=b_cached_len)
        all_logits = return_all_logits if isinstance(return_all_logits, list) else [return_all_logits] * len(b_q_len)
        is_decode = all(n == 1 for n in b_q_len) and not any(all_logits)
        # A captured step has no place for given embeddings (a one-token prompt chunk may be an
        # image's placeholder): such a step runs eagerly.
        if input_embeds is None:
            if is_decode and self.decode_graphs is not None and self.decode_graphs.can_run(len(b_q_len)):
                return self.decode_graphs.run(torch.as_tensor(input_ids), b_req_idx, b_cached_len, mem_index, b_lora_slot)
            if not is_decode and self.verify_graphs is not None and self.verify_graphs.can_run(b_q_len, all_logits):
                return self.verify_graphs.run(torch.as_tensor(input_ids), b_req_idx, b_cached_len, b_q_len, mem_index,
                                              b_lora_slot)
        state = self._build_infer_state(b_req_idx, b_cached_len, b_q_len, mem_index, all_logits, is_decode)
        state.input_embeds = input_embeds
        if b_lora_slot is not None and any(slot >= 0 for slot in b_lora_slot):
            state.lora = self.lora_batch(b_lora_slot, b_q_len)
        input_ids = torch.as_tensor(input_ids).to(self.device, torch.int64, non_blocking=True)
        return self.forward_layers(input_ids, state)

    def lora_batch(self, b_lora_slot: list[int], b_q_len: list[int]) -> LoraBatch:
        """The layers' view of a batch's adapters: its tokens grouped by adapter slot, on the host,
        then one copy to the device."""
        from llmserve.lora.pool import LoraBatch

        if self.lora_pool is None:
            raise ValueError("a request names a LoRA adapter, and this model serves none")
        return LoraBatch.of(self.lora_pool, b_lora_slot, b_q_len)

    def forward_layers(self, input_ids: torch.Tensor, state: InferStateInfo) -> torch.Tensor | None:
        """The layers over a batch whose slots and state are ready (``input_ids`` on the device);
        at pp > 1, this stage's, between the stage before's output and the stage after."""
        pending = None  # a layer's output that the next norm adds to h (see TransformerLayerInfer)
        if self.is_first_stage:
            h = self.pre_infer.forward(input_ids, state, self.pre_post_weight)
        else:
            h, pending = self.pipeline.recv_hidden((state.total_token_num, self.network_config_.hidden_size),
                                                   self.data_type, self.device)
        for layer_infer, layer_weight in zip(self.layers_infer, self.trans_layers_weight):
            h, pending = layer_infer.forward(h, pending, state, layer_weight)
        if not self.is_last_stage:
            if isinstance(pending, PartialSum):   # the next stage's first add-norm is not this stage's
                pending = pending.reduce()
            self.pipeline.send_hidden(*self._stage_output(h, pending))
            return None
        return self.post_infer.forward(h, pending, state, self.pre_post_weight)

    def _stage_output(self, h: torch.Tensor, pending: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook: what a pipeline stage before the last hands on, which the next stage's first
        layer takes as a first layer after pp=1's would (Gemma 2 normalises ``pending`` here)."""
        return h, pending

    @torch.inference_mode()
    def warm_up(self, max_prefill_tokens: int = 8192) -> None:
        """Run once the step shapes serving meets first, so that Triton compiles its kernels'
        variants (the attention's tile sizes, integers specialised on being 1 or a multiple of 16)
        and cuBLAS picks its algorithms now, not inside the first requests' steps, where each
        compile costs 1-2 s on an H100. (Pointer alignment, the other thing Triton specialises
        on, is kept constant by `_build_infer_state`.) Triton keeps what it compiled on disk, so
        later starts pay little. Leaves the pools as it found them."""
        decode_rows = 17                                  # neither 1 nor a multiple of 16
        prefill_lens = [n for n in (100, 512, min(2048, max_prefill_tokens)) if n <= self.max_seq_len - 2]
        # The most slots held at once: the prompts' steps (each prompt's row emptied after it), or
        # the last verify step's, the decode rows' tokens by then and 1 + speculate more each.
        held = decode_rows * (1 + len(prefill_lens))
        need = max(decode_rows * 3 + sum(prefill_lens), held + decode_rows * (1 + self.params.speculate)) + 8
        if need > self.mem_manager.can_use_mem_size or decode_rows + 1 > self.req_manager.can_use_req_size:
            return                                        # a pool too small to be worth warming
        rows = [self.req_manager.alloc_req() for _ in range(decode_rows + 1)]
        try:
            def ids(n: int) -> torch.Tensor:
                return torch.arange(n, dtype=torch.int64) % self.vocab_size

            lens = [0] * decode_rows
            self.forward(ids(decode_rows), rows[:-1], lens, [1] * decode_rows)          # short prompts
            lens = [1] * decode_rows
            for n in prefill_lens:                        # decode rows beside a prompt: the mixed step
                self.forward(ids(decode_rows + n), rows, lens + [0], [1] * decode_rows + [n])
                self.req_manager.truncate(rows[-1], 0)
                lens = [m + 1 for m in lens]
            # Eager verify steps (past the verify graphs' batch) of 1 + k tokens: the verify
            # attention's tile holds a request's rows times its group's heads, one variant a
            # power of two of them.
            for n in range(2, 2 + self.params.speculate):
                self.forward(ids(decode_rows * n), rows[:-1], lens, [n] * decode_rows)
                self.req_manager.truncate_batch(rows[:-1], lens)
            if self.device.type == "cuda":
                if self.quantization is not None:
                    # Every row bucket of every quantized weight tunes its tiles now: an eager
                    # decode step of a batch size not seen above would tune inside serving.
                    from llmserve.quantization.weights import warm_up as warm_up_weights
                    # A gated MLP's gate_up also runs fused with its activation at one row.
                    layers = zip(self.trans_layers_weight, self.layers_infer)
                    warm_up_weights((v for w in self.trans_layers_weight for v in vars(w).values()), self.data_type,
                                    gate_ups=((w.gate_up_weight_, infer.mlp_act) for w, infer in layers
                                              if hasattr(w, "gate_up_weight_") and hasattr(infer, "mlp_act")))
                torch.cuda.synchronize(self.device)
        finally:
            for row in rows:
                self.req_manager.free_req(row)

    def _build_infer_state(self, b_req_idx: list[int], b_cached_len: list[int], b_q_len: list[int],
                           mem_index: torch.Tensor, all_logits: list[bool], is_decode: bool) -> InferStateInfo:
        q_len = torch.tensor(b_q_len, dtype=torch.int32)
        cached = torch.tensor(b_cached_len, dtype=torch.int32)
        q_start = torch.cumsum(q_len, 0, dtype=torch.int32) - q_len
        seq_len = cached + q_len
        total = int(q_len.sum())
        # position of each new token: its request's cached length plus its index among the new ones
        positions = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave((q_start - cached).long(), q_len.long())
        # One host-to-device copy for all the per-request columns (each copy costs a launch). Each
        # column starts on a 16-byte boundary, whatever the batch size: Triton specialises a kernel
        # on its pointers' alignment, so columns that followed each other unpadded compiled the
        # attention kernel anew (1-2 s) the first time a step's batch size met another residue mod 4.
        bs = len(b_req_idx)
        columns = torch.zeros(5, -(-bs // _INT32_PER_16_BYTES) * _INT32_PER_16_BYTES, dtype=torch.int32)
        columns[:, :bs] = torch.stack([torch.tensor(b_req_idx, dtype=torch.int32), q_start, q_len, cached, seq_len])
        req_idx_d, q_start_d, q_len_d, cached_d, seq_len_d = columns.to(self.device, non_blocking=True)[:, :bs]
        state = self.infer_state_class(
            batch_size=len(b_req_idx),
            total_token_num=total,
            is_decode=is_decode,
            b_req_idx=req_idx_d,
            b_q_start=q_start_d,
            b_q_len=q_len_d,
            b_cached_len=cached_d,
            b_seq_len=seq_len_d,
            max_q_len=max(b_q_len),
            max_seq_len=int(seq_len.max()),
            position_ids=positions.to(self.device, non_blocking=True),
            mem_index=mem_index,
            mem_manager=self.mem_manager,
            req_manager=self.req_manager,
            logit_rows=_logit_rows(q_start, q_len, all_logits, self.device),
        )
        state.init_some_extra_state(self)
        return state


def _logit_rows(q_start: torch.Tensor, q_len: torch.Tensor, all_logits: list[bool],
                device: torch.device) -> torch.Tensor | None:
    """Which new-token rows need logits: every row of a flagged request, the last row of the
    others; None when that is every row (all flagged, or one new token each, as in decode)."""
    lens = q_len.tolist()
    if all(flag or n == 1 for n, flag in zip(lens, all_logits)):
        return None
    last = q_start + q_len - 1
    if not any(all_logits):
        return last.long().to(device, non_blocking=True)
    rows = [torch.arange(s, s + n) if flag else torch.tensor([e])
            for s, n, e, flag in zip(q_start.tolist(), lens, last.tolist(), all_logits)]
    return torch.cat(rows).to(device, non_blocking=True)


def hf_config_from_dict(raw: dict) -> PretrainedConfig:
    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise ModelLoadError("config has no model_type")
    try:
        return AutoConfig.for_model(model_type, **raw)
    except ValueError as e:
        raise ModelLoadError(f"unknown architecture {model_type!r}") from e
