"""Decode steps replayed from CUDA graphs.

A decode step launches a dozen kernels per layer from Python; at small batches launching them
takes longer than the GPU takes to run them. So every decode step of up to ``max_batch_size``
requests is captured once at start-up, one graph per batch-size bucket (1, 2, 4, then multiples
of 8), and replayed: a step writes its inputs into static buffers, pads the batch up to its
bucket, and launches one graph.

What makes one capture valid for every later step of its bucket:

- The inputs live in static device buffers, written before each replay: token ids, req->token
  table rows, sequence lengths, positions, the tokens grouped by LoRA adapter (one int64 block,
  one host-to-device copy) and the new tokens' KV slots. With a LoRA pool the graphs always run
  the adapters' kernels (the base model's tokens are in no adapter's segment, and the programs of
  a segment without tokens exit at once); without one they hold no LoRA work at all.
- The padding rows are a request of their own: a table row and a KV slot reserved at start-up
  (the model's pools are built one larger for them), one token long, so they read and write
  that slot only, and their logits are dropped.
- Decode attention gets the model's longest sequence as its bound: the split-K grid is then
  the same at every step, the splits past a row's length exit at once, and the merge reads only
  the splits that exist, so the result does not depend on the bound.
- Nothing inside reads a value back to the host; what the layers take from Python (batch size,
  bounds) is fixed per bucket.

Speculative verify steps (each request brings its sampled token and up to K draft tokens, and
wants logits for every one) replay graphs of their own, ``VerifyGraphs``: the same static-buffer
scheme over the context-attention path, one graph per bucket of new tokens (rows), each written
for the largest batch and 1 + K tokens a request (see that class for why one shape serves all).

``capture=False`` runs the same padded, static-buffer step without a graph: the CPU tests hold
that path against the plain forward token for token; the GPU tests hold the graphs against it.

A pipeline stage (pp > 1) captures its own layers only. Its hand-offs run outside the graph, as
eager sends and receives around each replay: a stage after the first receives the stage before's
``(h, pending)`` into static buffers the graph reads, and a stage before the last sends the tensors
its graph wrote (``_StageLink``). So no collective is captured, every stage captures on its own
(nothing crosses ranks while capturing), and all stages replay the same bucket: they run the same
steps, padded alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from llmserve.lora.pool import LoraBatch, lora_segments

if TYPE_CHECKING:
    from llmserve.common.basemodel.basemodel import TpPartBaseModel


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, then every multiple of 8, and the max."""
    sizes = {b for b in (1, 2, 4) if b < max_batch_size} | set(range(8, max_batch_size, 8)) | {max_batch_size}
    return sorted(sizes)


class _StepGraphs:
    """What decode and verify graphs share: one graph per bucket of rows, replayed (or, not
    captured, the same padded step run), captured largest first into one memory pool.
    A subclass fills the static buffers (``_write_padding``) and holds the step (``_step``)."""

    def __init__(self, model: TpPartBaseModel, buckets: list[int]):
        self.model = model
        self.buckets = buckets
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.pool = None     # the graphs' memory pool (the verify graphs share the decode graphs')
        self._link: _StageLink | None = None   # a pipeline stage's hand-offs (made on first use)

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.buckets if b >= num_rows)

    def _replay(self, bucket: int, num_rows: int) -> torch.Tensor | None:
        """The step of the inputs written for ``bucket``: its first ``num_rows`` rows of logits
        (None on a pipeline stage before the last, whose output went on to the next stage)."""
        link = self._stage_link
        if link is not None:
            link.receive(bucket)
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            out = self._outputs[bucket]
        else:
            out = self._step(bucket)
        if link is not None:
            link.send(bucket)
        return None if out is None else out[:num_rows]

    def _forward_layers(self, input_ids: torch.Tensor, state) -> torch.Tensor | None:
        """The model's layers inside a graph's step: a pipeline stage's hand-offs go to its
        ``_StageLink`` (static buffers) for the time of the call."""
        model, link = self.model, self._stage_link
        if link is None:
            return model.forward_layers(input_ids, state)
        model.pipeline, real = link, model.pipeline
        try:
            return model.forward_layers(input_ids, state)
        finally:
            model.pipeline = real

    @property
    def _stage_link(self) -> _StageLink | None:
        if self.model.pipeline is None:
            return None
        if self._link is None:     # made outside any capture, from the model's real link
            self._link = _StageLink(self.model, self.buckets[-1])
        return self._link

    def _write_padding(self, bucket: int) -> None:
        raise NotImplementedError

    # -- LoRA: the tail of a step's input block --------------------------------------------
    def _lora_size(self, num_rows: int) -> int:
        """The int64s the tail takes: ``num_rows`` token rows and the segment starts (none without a pool)."""
        pool = self.model.lora_pool
        return 0 if pool is None else num_rows + pool.max_loras + 1

    def _lora_inputs(self, b_lora_slot: list[int] | None, b_q_len: list[int], num_rows: int) -> list[int]:
        """The tail's values: the step's token rows grouped by adapter (``lora_segments``), padded
        to ``num_rows``, then the segments' starts."""
        pool = self.model.lora_pool
        if pool is None:
            return []
        slots = b_lora_slot if b_lora_slot is not None else [-1] * len(b_q_len)
        seg_start, rows, _ = lora_segments(slots, b_q_len, pool.max_loras)
        return [*rows, *[0] * (num_rows - len(rows)), *seg_start]

    def _lora_batch(self, tail: torch.Tensor, num_rows: int, max_len: int) -> LoraBatch | None:
        """The layers' view of the tail (None without a pool): segments of at most ``max_len`` rows."""
        pool = self.model.lora_pool
        return None if pool is None else LoraBatch(pool, tail[num_rows:], tail[:num_rows], max_len)

    def _step(self, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        """A graph per bucket, into ``pool``; records the seconds it took and the GPU memory the
        graphs took."""
        self.pool = pool
        device = self.model.device
        torch.cuda.synchronize(device)
        # Capturing empties the allocator's cache (torch.cuda.graph does): empty it first, so that
        # the difference in free memory is the graphs' own.
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        # Largest first: the smaller graphs then fit in the memory the largest took from the pool.
        for bucket in reversed(self.buckets):
            self._write_padding(bucket)
            # Once outside the graph: Triton compiles its kernels, cuBLAS picks its algorithms.
            self._step(bucket)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self._step(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]


class _StageLink:
    """A pipeline stage's hand-offs around its graphs. Inside a graph's step it stands in for the
    model's ``PipelineLink``: ``recv_hidden`` gives the static input buffers (their first
    ``bucket`` rows) and ``send_hidden`` keeps what the graph hands on. Around a replay,
    ``receive`` fills those buffers from the stage before and ``send`` sends what the graph wrote,
    through the real link."""

    def __init__(self, model: TpPartBaseModel, max_rows: int):
        self.model, self.real = model, model.pipeline
        shape = (max_rows, model.network_config_.hidden_size)
        self._inputs = None if model.is_first_stage else [
            torch.zeros(shape, dtype=model.data_type, device=model.device) for _ in range(2)]
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- inside a graph's step (forward_layers) ---------------------------------------------
    def recv_hidden(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
        return tuple(buf[: shape[0]] for buf in self._inputs)

    def send_hidden(self, h: torch.Tensor, pending: torch.Tensor) -> None:
        self._outputs[h.shape[0]] = (h, pending)

    # -- around a replay --------------------------------------------------------------------
    def receive(self, bucket: int) -> None:
        if self._inputs is not None:
            self.real.recv_into(*(buf[:bucket] for buf in self._inputs))

    def send(self, bucket: int) -> None:
        if not self.model.is_last_stage:
            self.real.send_hidden(*self._outputs[bucket])


class DecodeGraphs(_StepGraphs):
    def __init__(self, model: TpPartBaseModel, max_batch_size: int, *, capture: bool = True):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        super().__init__(model, batch_size_buckets(max_batch_size))
        self.max_batch_size = self.buckets[-1]
        device = model.device
        # The padding request (the pools hold one row and one slot more than they report).
        self.pad_row = model.req_manager.alloc_req()
        self.pad_slot = int(model.req_manager.append_tokens(self.pad_row, 1)[0])
        n = self.max_batch_size
        # One int64 block, one host-to-device copy a step: rows token id, table row, sequence
        # length (with the new token), position; then the LoRA tail (see _lora_inputs).
        self._block = torch.zeros(4 * n + self._lora_size(n), dtype=torch.int64, device=device)
        self._inputs = self._block[: 4 * n].view(4, n)
        self._lora = self._block[4 * n :]
        self._slots = torch.full((n,), self.pad_slot, dtype=torch.int32, device=device)
        self._q_start = torch.arange(n, dtype=torch.int32, device=device)
        self._q_len = torch.ones(n, dtype=torch.int32, device=device)
        if capture:
            self._capture(torch.cuda.graph_pool_handle())

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    # -- a step --------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, b_req_idx: list[int], b_cached_len: list[int],
            mem_index: torch.Tensor, b_lora_slot: list[int] | None = None) -> torch.Tensor:
        """One decode step (request i: row ``b_req_idx[i]`` of the table, ``b_cached_len[i]``
        tokens cached, its new token ``input_ids[i]`` already given KV slot ``mem_index[i]``).
        Returns float32 logits ``[batch, vocab]``: a view of the graph's output, valid until the
        next step."""
        bs = len(b_req_idx)
        bucket = self.bucket(bs)
        self._write_inputs(bucket, b_req_idx, b_cached_len, b_lora_slot)
        self._inputs[0, :bs].copy_(input_ids)
        self._slots[:bs].copy_(mem_index)
        return self._replay(bucket, bs)

    def _write_inputs(self, bucket: int, b_req_idx: list[int], b_cached_len: list[int],
                      b_lora_slot: list[int] | None = None) -> None:
        """Rows, lengths and positions of the requests, then of the padding request up to
        ``bucket`` (zeros past it), and the requests' adapters; token ids 0 and the padding slot
        everywhere (the caller writes the requests' own ids and slots over theirs)."""
        n, pad = self.max_batch_size, bucket - len(b_req_idx)
        rest = [0] * (n - bucket)
        host = torch.tensor([
            *[0] * n,
            *b_req_idx, *[self.pad_row] * pad, *rest,
            *[c + 1 for c in b_cached_len], *[1] * pad, *rest,
            *b_cached_len, *[0] * pad, *rest,
            *self._lora_inputs(b_lora_slot, [1] * len(b_req_idx), n),
        ], dtype=torch.int64)
        self._block.copy_(host, non_blocking=True)   # a blocking copy would wait for the step before
        self._slots[:bucket].fill_(self.pad_slot)

    def _write_padding(self, bucket: int) -> None:
        self._write_inputs(bucket, [], [])

    def _step(self, bucket: int) -> torch.Tensor:
        """The work a graph holds: the layers over the static buffers' first ``bucket`` rows."""
        model = self.model
        inputs = self._inputs[:, :bucket]
        seq_len = inputs[2].int()
        state = model.infer_state_class(
            batch_size=bucket, total_token_num=bucket, is_decode=True,
            b_req_idx=inputs[1].int(), b_q_start=self._q_start[:bucket], b_q_len=self._q_len[:bucket],
            b_cached_len=seq_len - 1, b_seq_len=seq_len, max_q_len=1, max_seq_len=model.max_seq_len,
            position_ids=inputs[3], mem_index=self._slots[:bucket],
            mem_manager=model.mem_manager, req_manager=model.req_manager, logit_rows=None,
        )
        state.lora = self._lora_batch(self._lora, self.max_batch_size, bucket)
        state.init_some_extra_state(model)
        return self._forward_layers(inputs[0], state)

    @staticmethod
    def memory_estimate(max_batch_size: int, config, itemsize: int, tp: int) -> int:
        """Bytes the graphs' pool will take (an upper estimate, so the KV cache can leave room):
        the largest bucket's logits (the lm_head's output and its float32 copy), a layer's
        activations, and decode attention's split-K scratch (whose rows times splits peak at
        whichever bucket)."""
        from llmserve.common.basemodel.basemodel import head_dim, num_kv_heads
        from llmserve.kernels.decode_attention import decode_num_splits

        hq, hkv, d = config.num_attention_heads // tp, num_kv_heads(config) // tp, head_dim(config)
        intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        per_row = (config.vocab_size * (itemsize + 4)
                   + (4 * config.hidden_size + 3 * intermediate // tp) * itemsize)
        split_rows = max(bs * decode_num_splits(bs, hkv) for bs in batch_size_buckets(max_batch_size))
        scratch = split_rows * hq * (d + 1) * 4
        return int(1.5 * (max_batch_size * per_row + scratch)) + (64 << 20)


def verify_row_buckets(max_rows: int) -> list[int]:
    """The row counts a verify graph is captured for: 1, 2, 4, multiples of 8 up to 64, then
    steps that double every fourth bucket (80, 96, 112, 128, 160, ..., 256, 320, ...), and the max:
    a step pads at most about a quarter of its rows, with a few dozen graphs for hundreds of rows."""
    sizes, size, step = {1, 2, 4}, 8, 8
    while size < max_rows:
        sizes.add(size)
        if size >= 8 * step:
            step *= 2
        size += step
    return sorted(b for b in sizes | {max_rows} if b <= max_rows)


class VerifyGraphs(_StepGraphs):
    """Speculative verify steps replayed from CUDA graphs.

    A verify step is a context-attention step: request i brings ``q_len[i]`` new tokens (its
    sampled token and its draft, 1 + K at most) on ``cached[i]`` cached ones, and wants the logits
    of every new token (or brings one token, a request that did not draft). Its shape varies in
    two ways, the number of requests and the number of new tokens; a graph is captured per bucket
    of new tokens (rows) only, because what the layers take from Python is fixed otherwise:

    - The attention's grid is (the largest batch, kv heads, splits of the context): the verify
      kernel's (kernels/verify_attention) while 1 + K <= VERIFY_MAX_Q_LEN, the context kernel's
      (heads, query blocks of 1 + K tokens, the largest batch) past that. Requests past the
      step's are padding requests with no new tokens, whose programs do nothing.
    - The new tokens are packed back to back as in the eager step; the rows past them up to the
      bucket are padding rows that store their KV in the padding slot, that no request attends to,
      and whose logits are dropped. Per-request columns (table row, first row, new and cached
      lengths) and per-row inputs (token ids, positions, KV slots) live in static buffers.

    Rows are the lm_head's and the MLP's work, so bucketing rows rather than padding every request
    to 1 + K keeps a batch of short drafts as cheap as its tokens."""

    def __init__(self, model: TpPartBaseModel, max_batch_size: int, tokens_per_request: int,
                 pad_row: int, pad_slot: int, *, capture: bool = True, pool=None):
        if max_batch_size < 1 or tokens_per_request < 2:
            raise ValueError(f"verify graphs need >= 1 request of >= 2 tokens, got {max_batch_size} x {tokens_per_request}")
        super().__init__(model, verify_row_buckets(max_batch_size * tokens_per_request))
        self.max_batch_size = max_batch_size
        self.tokens_per_request = tokens_per_request
        self.pad_row, self.pad_slot = pad_row, pad_slot
        device, n, rows = model.device, max_batch_size, self.buckets[-1]
        # One int64 block, one host-to-device copy a step: per request (table row, first row, new
        # tokens, cached tokens, sequence length), then per row the positions, then the LoRA tail.
        self._block = torch.zeros(5 * n + rows + self._lora_size(rows), dtype=torch.int64, device=device)
        self._columns = self._block[: 5 * n].view(5, n)
        self._positions = self._block[5 * n : 5 * n + rows]
        self._lora = self._block[5 * n + rows :]
        self._input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self._slots = torch.full((rows,), pad_slot, dtype=torch.int32, device=device)
        if capture:
            self._capture(pool if pool is not None else torch.cuda.graph_pool_handle())

    def can_run(self, b_q_len: list[int], all_logits: list[bool]) -> bool:
        """Whether a step fits: few enough requests, each with one new token or 1 + K at most whose
        logits it all wants (the graph computes every row's), and the rows within the buckets."""
        return (len(b_q_len) <= self.max_batch_size and sum(b_q_len) <= self.buckets[-1]
                and all(n == 1 or (flag and n <= self.tokens_per_request) for n, flag in zip(b_q_len, all_logits)))

    # -- a step --------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, b_req_idx: list[int], b_cached_len: list[int], b_q_len: list[int],
            mem_index: torch.Tensor, b_lora_slot: list[int] | None = None) -> torch.Tensor:
        """One verify step (``can_run`` holds; the new tokens' KV slots given in ``mem_index``).
        Returns float32 logits ``[new tokens, vocab]``, the rows in the step's order: a view of the
        graph's output, valid until the next step."""
        num_rows = sum(b_q_len)
        bucket = self.bucket(num_rows)
        self._write_inputs(bucket, b_req_idx, b_cached_len, b_q_len, b_lora_slot)
        self._input_ids[:num_rows].copy_(input_ids)
        self._slots[:num_rows].copy_(mem_index)
        return self._replay(bucket, num_rows)

    def _write_inputs(self, bucket: int, b_req_idx: list[int], b_cached_len: list[int], b_q_len: list[int],
                      b_lora_slot: list[int] | None = None) -> None:
        """The requests' columns, then padding requests (no new tokens) up to the largest batch;
        the rows' positions, then padding rows (position 0); the rows' adapters; every row's KV
        slot the padding slot (the caller writes the requests' own over theirs)."""
        pad = self.max_batch_size - len(b_req_idx)
        num_rows = sum(b_q_len)
        q_start = [0]
        for n in b_q_len:
            q_start.append(q_start[-1] + n)
        positions = [c + j for c, n in zip(b_cached_len, b_q_len) for j in range(n)]
        host = torch.tensor(
            [*b_req_idx, *[self.pad_row] * pad,
             *q_start[:-1], *[num_rows] * pad,
             *b_q_len, *[0] * pad,
             *b_cached_len, *[0] * pad,
             *[c + n for c, n in zip(b_cached_len, b_q_len)], *[0] * pad,
             *positions, *[0] * (self.buckets[-1] - num_rows),
             *self._lora_inputs(b_lora_slot, b_q_len, self.buckets[-1])], dtype=torch.int64)
        self._block.copy_(host, non_blocking=True)   # non-blocking: see DecodeGraphs
        self._slots[:bucket].fill_(self.pad_slot)

    def _write_padding(self, bucket: int) -> None:
        self._write_inputs(bucket, [], [], [])

    def _step(self, bucket: int) -> torch.Tensor:
        """The work a graph holds: the layers over ``bucket`` rows of the static buffers."""
        model = self.model
        columns = self._columns.int()
        state = model.infer_state_class(
            batch_size=self.max_batch_size, total_token_num=bucket, is_decode=False,
            b_req_idx=columns[0], b_q_start=columns[1], b_q_len=columns[2], b_cached_len=columns[3],
            b_seq_len=columns[4], max_q_len=self.tokens_per_request, max_seq_len=model.max_seq_len,
            position_ids=self._positions[:bucket], mem_index=self._slots[:bucket],
            mem_manager=model.mem_manager, req_manager=model.req_manager, logit_rows=None,
        )
        state.lora = self._lora_batch(self._lora, self.buckets[-1], bucket)
        state.init_some_extra_state(model)
        return self._forward_layers(self._input_ids[:bucket], state)

