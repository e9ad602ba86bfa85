"""Weights of one part of the network, loaded from HF-named tensors and split for one TP rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError
from llmserve.kernels import QuantizedWeight
from llmserve.kernels.quantized_linear import BLOCK
from llmserve.quantization.config import Quantization
from llmserve.quantization.weights import PackedWeight

# A checkpoint tensor: dense, a GGUF weight kept in its quantized blocks (CPU; see load_gguf), or a
# linear weight of a quantized checkpoint format (llmserve.quantization).
Weight = torch.Tensor | QuantizedWeight | PackedWeight

# How a checkpoint tensor is cut for tensor parallelism. HF stores linear weights as [out, in]:
# "col" keeps this rank's rows (column-parallel: outputs split), "row" its columns (row-parallel:
# inputs split, the partial outputs are all-reduced), "vocab" rows padded to equal shards, None
# keeps the whole tensor. A callable does model-specific cuts (BLOOM's fused qkv).
Split = str | None | Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WeightSpec:
    hf_name: str
    split: Split = None
    required: bool = True


class BaseLayerWeight:
    """Collects the tensors named by ``weight_specs()`` from however many checkpoint files they
    are spread over, then ``finalize()`` turns them into the attributes the layer-infer classes use
    (fusing q/k/v or gate/up into single matmuls)."""

    def __init__(self, tp_rank: int, world_size: int, data_type: torch.dtype, network_config, device: torch.device):
        self.tp_rank_ = tp_rank
        self.world_size_ = world_size
        self.data_type_ = data_type
        self.network_config_ = network_config
        self.device_ = device
        self._staged: dict[str, Weight] = {}
        # Set by the model before loading: how linear weights are stored (None: dense).
        self.quantization_: Quantization | None = None

    # Whether this part's "col" / "row" matrices are linear layers that `--quantization fp8`
    # quantizes at load (the decoder layers'; not the embedding, lm_head or vision tower).
    quantizes_on_load = False

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Our short name -> where the tensor is in an HF checkpoint and how it is split."""
        raise NotImplementedError

    def load_hf_weights(self, weights: dict[str, Weight]) -> None:
        for key, spec in self.weight_specs().items():
            if spec.hf_name in weights:
                t = self._to_device(self._split(weights[spec.hf_name], spec.split))
                if self._quantizes(t, spec):
                    t = self.quantization_.quantize(t)
                self._staged[key] = t

    def _quantizes(self, t: Weight, spec: WeightSpec) -> bool:
        return (self.quantizes_on_load and self.quantization_ is not None and self.quantization_.on_load
                and spec.split in ("col", "row") and isinstance(t, torch.Tensor) and t.dim() == 2)

    def finalize(self) -> None:
        """Check that every required tensor arrived, then build the runtime attributes."""
        missing = [s.hf_name for k, s in self.weight_specs().items() if s.required and k not in self._staged]
        if missing:
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing)}")
        self._build(self._staged)
        self._staged = {}

    def _build(self, w: dict[str, Weight]) -> None:
        raise NotImplementedError

    # -- tensor-parallel cuts ------------------------------------------------------------
    def _split(self, t: Weight, split: Split) -> Weight:
        if split is None:
            return t
        if isinstance(t, QuantizedWeight) and (callable(split) or (split == "row" and not self._splits_blocks(t))):
            t = t.dequantize()      # a cut the blocks cannot follow
        if isinstance(t, PackedWeight) and callable(split):
            t = t.dequantize()      # a model-specific cut (BLOOM's fused qkv) of a dense tensor
        if callable(split):
            return split(t)
        if split == "col":
            return self._shard(t, dim=0)
        if split == "row":
            return self._shard(t, dim=1)
        if split == "vocab":
            return self._vocab_shard(t)
        raise ValueError(f"unknown split {split!r}")

    def _splits_blocks(self, t: QuantizedWeight) -> bool:
        """Whether a row-parallel cut of t falls on its blocks' boundaries."""
        return (t.shape[1] // self.world_size_) % BLOCK == 0

    def _shard(self, t: Weight, dim: int) -> Weight:
        n = t.shape[dim]
        if n % self.world_size_:
            raise ModelLoadError(f"dimension {n} of a weight is not divisible by tp={self.world_size_}")
        size = n // self.world_size_
        return t.narrow(dim, self.tp_rank_ * size, size)

    def _vocab_shard(self, t: Weight) -> Weight:
        """This rank's rows of an embedding / lm_head, zero-padded so every rank's shard has the
        same size (all-gather needs equal parts; the padding logits are cut off afterwards)."""
        size = vocab_shard_size(t.shape[0], self.world_size_)
        start = self.tp_rank_ * size
        shard = t.narrow(0, start, max(0, min(size, t.shape[0] - start)))
        if shard.shape[0] < size:
            if isinstance(shard, QuantizedWeight):
                return shard.pad_rows(size - shard.shape[0])
            pad = shard.new_zeros((size - shard.shape[0], *shard.shape[1:]))
            shard = torch.cat([shard, pad])
        return shard

    def _to_device(self, t: Weight) -> Weight:
        if isinstance(t, PackedWeight):
            return t.to(self.device_, self.data_type_)
        if isinstance(t, QuantizedWeight):
            # The quantized kernel runs on the CPU in float32 only; anywhere else, dense weights.
            if self.device_.type == "cpu" and self.data_type_ == torch.float32:
                return t.contiguous()
            t = t.dequantize()
        return t.to(device=self.device_, dtype=self.data_type_).contiguous()


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)
