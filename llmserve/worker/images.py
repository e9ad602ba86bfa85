"""A worker's side of image input: each request's image features, computed once when its prompt
first runs and kept until it finishes (a re-prefill after a preemption, or the next chunk of a
long prompt, reuses them), and the rows of a step they are written at."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.common.basemodel import InputEmbeds


@dataclass
class RequestImages:
    """One request's image features, placeholder by placeholder."""

    positions: torch.Tensor   # [n] int64 on the CPU: the prompt positions of the placeholder tokens, ascending
    # [n, hidden]: the features written there, in the same order; on the device until the prompt
    # is cached past its last placeholder, then in pinned host memory (see offload)
    embeds: torch.Tensor

    @classmethod
    def of_prompt(cls, prompt_token_ids: list[int], image_token_id: int, features: torch.Tensor) -> RequestImages:
        """``features``: [n_images, tokens_per_image, hidden], the prompt's images in order; the
        k-th placeholder of the prompt takes the k-th feature row (admission checked the counts)."""
        positions = torch.nonzero(torch.tensor(prompt_token_ids) == image_token_id).flatten()
        embeds = features.reshape(-1, features.shape[-1])
        if positions.numel() != embeds.shape[0]:
            raise ValueError(f"{positions.numel()} image placeholder tokens for {embeds.shape[0]} image features")
        return cls(positions, embeds)

    @property
    def end(self) -> int:
        """One past the last placeholder's position: a chunk from here on has none (decode steps)."""
        return int(self.positions[-1]) + 1 if self.positions.numel() else 0

    def offload_if_done(self, cached_end: int) -> None:
        """Once the KV cache holds the prompt past its last placeholder, only a re-prefill after a
        preemption needs the features again: they wait in pinned host memory (a copy queued on
        the stream, so the host does not wait, and stream order keeps the copy valid), not in
        GPU memory the KV cache was sized without (576 x 4096 x 2 bytes = 4.5 MiB a LLaVA-1.5
        image, per running request)."""
        if self.embeds.device.type != "cuda" or cached_end < self.end:
            return
        host = torch.empty(self.embeds.shape, dtype=self.embeds.dtype, pin_memory=True)
        self.embeds = host.copy_(self.embeds, non_blocking=True)

    def within(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The placeholders among prompt positions [start, end): their offsets from start, and
        their feature rows."""
        lo = int(torch.searchsorted(self.positions, start))
        hi = int(torch.searchsorted(self.positions, end))
        return self.positions[lo:hi] - start, self.embeds[lo:hi]


def step_input_embeds(parts: list[tuple[int, RequestImages, int, int]], device: torch.device) -> InputEmbeds | None:
    """The given embeddings of one forward. Each part is (the request's first row among the
    step's packed new tokens, its images, its cached length, its number of new tokens)."""
    rows, embeds = [], []
    for q_start, images, num_cached, num_new in parts:
        offsets, feats = images.within(num_cached, num_cached + num_new)
        if offsets.numel():
            rows.append(offsets + q_start)
            embeds.append(feats)
    if not rows:
        return None
    return InputEmbeds(torch.cat(rows).to(device, non_blocking=True), torch.cat(embeds).to(device, non_blocking=True))


def stack_pixel_values(images: list[np.ndarray]) -> torch.Tensor:
    """The image processor's arrays ([3, H, W] float32 each) as one batch for the vision tower."""
    return torch.from_numpy(np.stack(images))
