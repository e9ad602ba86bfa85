"""One rank (of a tensor-parallel group, of a pipeline stage): the model, its KV cache and the
sampler, served over rpyc.

A worker process starts in ``llmserve.worker.main`` and serves ``ModelRpcServer``; the engine
drives it through ``llmserve.engine.worker_client``. The messages are in ``protocol``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import rpyc
import torch
from rpyc.utils.server import ThreadedServer

from llmserve.common.logs import adopt_library_logging
from llmserve.ipc import error_line, socket_path
from llmserve.lora.adapter import AdapterCache
from llmserve.worker.faults import InjectedFaults, is_device_failure
from llmserve.worker.images import RequestImages, stack_pixel_values, step_input_embeds
from llmserve.worker.prefix_slots import PrefixSlots
from llmserve.worker.prompt_lookup import LONG_MATCH, PromptLookup
from llmserve.worker.protocol import (
    RPYC_CONFIG, BatchEntry, StepInput, StepOutput, TokenRun, WorkerError, WorkerInfo, WorkerInitArgs,
)

if TYPE_CHECKING:
    from llmserve.common.basemodel import InputEmbeds
    from llmserve.common.distributed import Rendezvous
    from llmserve.worker.sampling import PendingSample, SampleResult

logger = logging.getLogger(__name__)


class ModelWorker:
    """One rank: owns the model, its KV cache and the request -> table-row map."""

    def __init__(self, args: WorkerInitArgs, rendezvous: Rendezvous | None = None):
        """``rendezvous``: where the ranks met (``ranks.host`` / ``ranks.join``), when world_size > 1."""
        from llmserve.common.basemodel import ModelInitParams
        from llmserve.common.distributed import StepChannel, init_distributed, reduce_over_ranks
        from llmserve.grammar import GrammarCompiler
        from llmserve.models.registry import get_model_class
        from llmserve.worker.sampling import Sampler

        self.args = args
        device = torch.device(args.device if args.device == "cpu" else f"cuda:{args.local_rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(cpu_threads(args.ranks_per_node))
        self.rendezvous = rendezvous
        # The custom all-reduce maps the peers' GPU memory: the ranks must share one node.
        init_distributed(rendezvous.store if rendezvous else None, args.rank, args.world_size, device,
                         custom_all_reduce=args.custom_all_reduce and args.nnodes == 1, tp=args.tp)
        # Rank 0 hands each step to the other ranks (see ModelRpcServer.exposed_step, follow).
        self.channel = StepChannel() if args.world_size > 1 else None
        params = ModelInitParams(
            model_path=args.model_path, tp_rank=args.tp_rank, world_size=args.tp, pp_rank=args.pp_rank, pp_size=args.pp,
            device=str(device),
            dtype=getattr(torch, args.dtype) if args.dtype else None, max_total_token_num=args.max_total_token_num,
            mem_fraction=args.mem_fraction, max_running_requests=args.max_running_requests,
            cuda_graph_max_bs=args.cuda_graph_max_bs, speculate=args.speculate,
            speculate_max_batch=args.speculate_max_batch, dequantize=args.dequantize,
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, load_format=args.load_format,
        )
        model_cls = get_model_class(args.model_type)
        self.model = model_cls(params)
        self.device = device
        if args.pp > 1:
            layers = self.model.stage_layers
            logger.info("rank %d: pipeline stage %d of %d, layers %d-%d", args.rank, args.pp_rank, args.pp, layers[0],
                        layers[-1])
        # The weights' parameters and bytes over all ranks (for /info), summed while every rank is
        # here: each stage holds other layers.
        tensors = self.model.counted_weights()
        self.weight_totals: list[int] = reduce_over_ranks([sum(t.shape.numel() for t in tensors),
                                                           sum(t.nbytes for t in tensors)], "sum", device)
        pool = self.model.lora_pool
        self.adapters = AdapterCache(args.lora_modules, self.model.network_config_, args.max_lora_rank,
                                     args.max_cpu_loras, pack=pool.pack if pool is not None else None)
        if device.type == "cuda":
            self.model.warm_up()   # Triton's compiles now, not inside the first requests' steps
            # Once the weights are loaded (conversions on the CPU may use every core), the host
            # only does bookkeeping on tiny CPU tensors, where torch's OpenMP pool spins and stalls
            # (benchmarks/README.md, "2026-11-23, evening: one-thread workers").
            torch.set_num_threads(1)
        InjectedFaults.from_environ().install(self.model)   # tests only: none unless asked for
        self.sampler = None
        if args.rank == 0:
            # Its tokenizer is loaded on the first constrained request, not at start-up.
            grammar = GrammarCompiler(functools.partial(_tokenizer_json, args.model_path), self.model.vocab_size,
                                      args.eos_token_ids)
            self.sampler = Sampler(eos_token_ids=args.eos_token_ids, grammar=grammar)
        self.req_rows: dict[int, int] = {}   # req_id -> row of req_to_token
        self.prefix_slots = PrefixSlots(self.model.req_manager)   # the prefix cache's slots
        self._owed: _Launched | None = None   # an overlapped step whose output is not sent yet
        # The last step's draw, on the device, and each sampling request's row in it: where a
        # pending token of the next step comes from.
        self._last_sampled: torch.Tensor | None = None
        self._last_sampled_row: dict[int, int] = {}
        # req_id -> its image features, from its first prefill until it finishes (see images.py)
        self.req_images: dict[int, RequestImages] = {}
        # Requests whose draft the last step cached whole, on a rank that does not verify (only
        # rank 0 samples): their next entry's num_cached says how much of it was kept.
        self._unverified: set[int] = set()
        # Rank 0, with speculation on: each drafting request's n-gram index over its prompt and
        # every token emitted for it (``_read``), from its first step until it finishes.
        self.lookups: dict[int, PromptLookup] = {}

    def info(self) -> WorkerInfo:
        from llmserve.common.distributed import all_reduce_description
        from llmserve.kernels import QuantizedWeight

        m = self.model
        qtypes = sorted({t.qtype for t in m.held_weights() if isinstance(t, QuantizedWeight)})
        n_params, n_bytes = self.weight_totals
        return WorkerInfo(
            model_type=m.model_type, vocab_size=m.vocab_size, max_total_token_num=m.max_total_token_num,
            max_seq_len=m.max_seq_len, max_running_requests=self.args.max_running_requests,
            dtype=str(m.data_type).removeprefix("torch."),
            device=str(self.device), num_layers=m.layers_num, num_params=n_params,
            quantized="/".join(qtypes), quantization=m.quantization.description if m.quantization else "",
            weight_bytes=n_bytes, all_reduce=all_reduce_description(),
            kv_cache_dtype=m.kv_cache_description,
            **_graph_info(m), **_image_info(m),
        )

    def step(self, step: StepInput, raw: bytes | None = None) -> list[StepOutput]:
        """Run the step; return the outputs of the steps that are done, in the order they were
        sent: this one's, after the one still owed (an overlapped step before it). An overlapped
        step is only queued here, and its output owed to the next call, unless its forward
        failed. Ranks other than 0 return nothing (rank 0 samples).

        Rank 0 reads the owed step first, before this step's forward, when this step drafts or
        the owed one verified drafts (a draft continues the request's last token, and after a
        verify the request's next position is known only once it is read); it then fills this
        step's entries in (``_fill_in``) and hands the step to the other ranks (``raw``: the step
        as it came, sent as it is when nothing was filled in)."""
        owed, self._owed = self._owed, None
        done: list[StepOutput] = []
        if owed is not None and (owed.verifies or any(e.draft_budget for e in step.entries)):
            done = self._read(owed)
            self._fill_in(step.entries, done[0], owed.req_ids)
            owed, raw = None, None
        if self.sampler is not None and any(e.draft_budget for e in step.entries):
            self._propose_drafts(step.entries)
            raw = None
        if self.channel is not None and self.args.rank == 0:
            self._hand_over(raw if raw is not None else pickle.dumps(step))
        # Cache first: a finished or preempted request's tokens join the tree before its row goes.
        self.prefix_slots.apply(step.cache_ops, self.req_rows)
        for req_id in step.preempted_req_ids:
            self._free_kv(req_id)
        for req_id in step.finished_req_ids:
            self._free_kv(req_id)
            self.req_images.pop(req_id, None)
            self.lookups.pop(req_id, None)
            if self.sampler is not None:
                self.sampler.remove_request(req_id)
        for load in step.lora_loads:
            self.model.lora_pool.load(load.slot, self.adapters.get(load.name, load.path))
        self._drop_rejected(step.entries)
        if not step.entries:
            return done + self._read(owed)

        rows = [self._row(e.req_id) for e in step.entries]
        for e, row in zip(step.entries, rows):
            if e.prefix_node_ids:
                self.prefix_slots.share(row, e.prefix_node_ids)
        # Entries whose sampling setup failed still run the forward: every rank must run the
        # same batch (only rank 0 has a sampler), and their rows harm no one.
        errors = self._add_to_sampler(step.entries)
        q_lens = [e.num_new_tokens for e in step.entries]
        # The same flag on every rank: the lm_head's all-gather is a collective. A draft is verified
        # from the logits of all its entry's rows.
        all_logits = [e.want_prompt_logprobs or e.num_draft_tokens > 0 for e in step.entries]
        # An asking entry has one row of logits per new token, the others one, entries back to back.
        row_ends = list(itertools.accumulate(q if flag else 1 for q, flag in zip(q_lens, all_logits)))
        try:
            input_embeds = self._input_embeds(step.entries)
            lora_slots = [e.lora_slot for e in step.entries] if self.model.lora_pool is not None else None
            logits = self.model.forward(self._input_ids(step.entries), rows, [e.num_cached for e in step.entries],
                                        q_lens, return_all_logits=all_logits, input_embeds=input_embeds,
                                        b_lora_slot=lora_slots)
            if self.model.pipeline is not None:    # the last stage made them; rank 0 samples
                logits = self.model.pipeline.logits_to_rank0(logits, (row_ends[-1], self.model.vocab_size), self.device)
        except Exception as e:
            failed = self._forward_failed(step.entries, rows, e)
            return [*done, *self._read(owed), failed]
        drafting = [e for e in step.entries if e.num_draft_tokens]
        if self.sampler is None:
            self._unverified.update(e.req_id for e in drafting)
            if step.overlap and not drafting:
                self._share_draw(step.entries)
            return []
        # The forward is queued: now read the owed step's tokens (the device is busy meanwhile),
        # which also counts them for the penalties before this step samples.
        done += self._read(owed)
        prompt_lps, prompt_tops = self._prompt_logprobs(logits, step.entries, row_ends, errors)
        # Not an entry whose sampling setup failed, in this step or (overlapped) in the one
        # before, whose failure the engine has not read yet: it ends the request then.
        sampling = [i for i, e in enumerate(step.entries) if e.sample and errors[i] is None and e.req_id in self.sampler]
        req_ids = [e.req_id for e in step.entries]
        if drafting:
            # Verified when read: at once, or (overlapped) at the start of the next call. No draw
            # stays on the device: the next step's pending tokens are filled in from the read.
            keep = [r for i in sampling for r in range(row_ends[i] - 1 - step.entries[i].num_draft_tokens, row_ends[i])]
            rows_kept = logits[torch.tensor(keep, dtype=torch.long).to(logits.device, non_blocking=True)]
            launched = _Launched(req_ids, functools.partial(self._verify, rows_kept, step.entries, sampling,
                                                            prompt_lps, prompt_tops, errors), verifies=True)
            self._last_sampled, self._last_sampled_row = None, {}
        else:
            if sampling and row_ends[-1] != len(sampling):
                # Keep the last row of each entry that samples. (The common step, one row per entry
                # and all sampling, skips this.)
                last_rows = [row_ends[i] - 1 for i in sampling]
                logits = logits[torch.tensor(last_rows, dtype=torch.long).to(logits.device, non_blocking=True)]
            drawn = self.sampler.launch(logits, [req_ids[i] for i in sampling]) if sampling else None
            self._last_sampled = None if drawn is None else drawn.token_ids.to(self.device, non_blocking=True)
            self._last_sampled_row = {req_ids[i]: n for n, i in enumerate(sampling)}
            if step.overlap and self.args.world_size > 1:
                self._share_draw(step.entries, sampling, drawn)
            launched = _Launched(req_ids, _LaunchedStep(len(step.entries), sampling, drawn, prompt_lps,
                                                        prompt_tops, errors).output)
        if step.overlap:
            self._owed = launched
        else:
            done += self._read(launched)
        return done

    def _read(self, launched: _Launched | None) -> list[StepOutput]:
        """The output of a launched step, read now (waiting for its draw, or verifying its drafts),
        or nothing. Rank 0's n-gram indexes take the tokens it emitted, and the output says how
        long a match each request's next draft would continue (``match_lens``)."""
        if launched is None:
            return []
        output = launched.read()
        match_lens = [0] * len(launched.req_ids)
        for i, req_id in enumerate(launched.req_ids):
            lookup = self.lookups.get(req_id)
            if lookup is not None and output.token_ids[i] is not None:
                lookup.extend(output.run_of(i).token_ids)
                match_lens[i] = lookup.match_len(at_most=LONG_MATCH)
        if self.lookups:
            output.match_lens = match_lens
        return [output]

    def _fill_in(self, entries: list[BatchEntry], output: StepOutput, owed_req_ids: list[int]) -> None:
        """Rank 0, once it has read the step before this one early: the tokens in flight become
        ordinary tokens of the entries (every rank then feeds them from the step itself), and a
        request's position is its row's length (the engine, which scheduled this step before
        it read that one, does not know yet how much of a draft was kept)."""
        last = {req_id: output.run_of(i).token_ids[-1] for i, req_id in enumerate(owed_req_ids)
                if output.token_ids[i] is not None}
        for e in entries:
            if not e.pending_token:
                continue
            # A request whose draw failed gets any id: it fails once the engine reads that.
            e.token_ids = [*e.token_ids, last.get(e.req_id, 0)]
            e.pending_token = False
            row = self.req_rows.get(e.req_id)
            if row is not None:
                e.num_cached = self.model.req_manager.seq_len(row)

    def _propose_drafts(self, entries: list[BatchEntry]) -> None:
        """Rank 0: each entry with a draft budget gets the draft its request's n-gram index
        proposes (none if its tokens are not all known here: one still in flight)."""
        for e in entries:
            lookup = self.lookups.get(e.req_id)
            if not e.draft_budget or lookup is None or e.pending_token:
                continue
            if lookup.num_tokens != e.num_cached + len(e.token_ids):
                continue      # (the index is behind the request: it drafts nothing this step)
            draft = lookup.propose(e.draft_budget)
            e.token_ids = [*e.token_ids, *draft.token_ids]
            e.num_draft_tokens, e.draft_match_len = len(draft.token_ids), draft.match_len

    def _hand_over(self, step: bytes) -> None:
        """Rank 0 at tp > 1: the other ranks run the step too."""
        try:
            self.channel.send(step)
        except Exception as e:
            raise self.out_of_step(e) from None

    def _share_draw(self, entries: list[BatchEntry], sampling: list[int] | None = None,
                    drawn: PendingSample | None = None) -> None:
        """An overlapped step at tp > 1: every rank feeds the next step the tokens rank 0 drew in
        this one (``pending_token``), so rank 0 broadcasts them, device to device and queued like
        the forward: one per entry, 0 where it drew none (as for a failed draw: any id will do)."""
        tokens = torch.zeros(len(entries), dtype=torch.int64, device=self.device)
        if drawn is not None:
            rows = torch.tensor(sampling, dtype=torch.long).to(self.device, non_blocking=True)
            tokens[rows] = drawn.token_ids.to(self.device, torch.int64, non_blocking=True)
        torch.distributed.broadcast(tokens, 0)
        self._last_sampled = tokens
        self._last_sampled_row = {e.req_id: i for i, e in enumerate(entries)}

    def follow(self) -> None:
        """A rank other than 0: run the steps rank 0 hands over, until it sends the end (b"");
        raises once rank 0 is gone (its connection closed)."""
        while step := self.channel.recv():
            self.step(pickle.loads(step))

    def _verify(self, logits: torch.Tensor, entries: list[BatchEntry], sampling: list[int],
                prompt_lps: list, prompt_tops: list, errors: list[str | None]) -> StepOutput:
        """Sample the step's entries, verifying the drafts of those that bring one (``Sampler.verify``),
        and free the KV slots of the rejected draft tokens at once. ``logits``: the rows of the
        entries that sample, back to back: a drafting entry's sampled token's and one per draft
        token; another's, its last."""
        n = len(entries)
        token_ids: list[int | None] = [None] * n
        logprobs: list[float | None] = [None] * n
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * n
        runs: list[TokenRun | None] = [None] * n
        drafts = [entries[i].token_ids[len(entries[i].token_ids) - entries[i].num_draft_tokens :] for i in sampling]
        try:
            result = self.sampler.verify(logits, [entries[i].req_id for i in sampling], drafts)
        except Exception as err:   # a request's parameters the sampler cannot use: its batch fails with it
            logger.exception("verifying a step's drafts failed")
            for i in sampling:
                errors[i] = error_line(err)
            result = None
        kept: dict[int, int] = {}          # drafting entry -> its tokens that stay cached
        for m, i in enumerate(sampling if result is not None else []):
            emitted, lps, tops = result.token_ids[m], result.logprobs[m], result.top_logprobs[m]
            errors[i] = result.errors[m] if result.errors else None   # (sampling entries had none before)
            if not emitted:        # the request failed (errors says why)
                continue
            token_ids[i], logprobs[i], top_logprobs[i] = emitted[0], lps[0] if lps else None, tops[0] if tops else None
            e = entries[i]
            if e.num_draft_tokens:
                runs[i] = TokenRun(emitted, lps, tops, e.num_draft_tokens, e.draft_match_len)
                # What stays cached: the sampled token fed and the accepted draft tokens.
                kept[i] = e.num_cached + len(emitted)
        self._truncate(entries, kept, errors)
        return StepOutput(token_ids, logprobs, top_logprobs, prompt_lps, prompt_tops, errors, runs=runs)

    def _truncate(self, entries: list[BatchEntry], kept: dict[int, int], errors: list[str | None]) -> None:
        """Cut entry i's row to ``kept[i]`` tokens, for every i, in one free; if that fails (a row
        not as the engine says: a bug of ours), row by row, failing only the entries that fail."""
        rows = [self.req_rows[entries[i].req_id] for i in kept]
        try:
            self.model.req_manager.truncate_batch(rows, list(kept.values()))
        except ValueError:
            for (i, new_len), row in zip(kept.items(), rows):
                try:
                    self.model.req_manager.truncate(row, new_len)
                except ValueError as err:
                    errors[i] = error_line(err)

    def _drop_rejected(self, entries: list[BatchEntry]) -> None:
        """On a rank that does not verify, drop the rejected draft tokens of the last step: an
        entry's num_cached is how much of it the verifier kept."""
        if not self._unverified:
            return
        seq_len = self.model.req_manager.seq_len
        cut = {row: e.num_cached for e in entries if e.req_id in self._unverified
               and (row := self.req_rows.get(e.req_id)) is not None and seq_len(row) > e.num_cached}
        self.model.req_manager.truncate_batch(list(cut), list(cut.values()))   # in one free, as rank 0 does
        # Only the entries here: a drafting request that this step does not carry (a step that
        # only flushes cache ops) still owes its truncation to the step that next carries it.
        self._unverified.difference_update(e.req_id for e in entries)

    def _input_ids(self, entries: list[BatchEntry]) -> torch.Tensor:
        """The step's new tokens, those the engine sent and those still only on the device
        (``pending_token``: the last step's draw for the request)."""
        ids: list[int] = []
        pending_at: list[int] = []        # positions in the step of pending tokens
        pending_rows: list[int] = []      # their rows in the last step's draw
        for e in entries:
            ids += e.token_ids
            if e.pending_token:
                row = self._last_sampled_row.get(e.req_id)
                if row is not None:
                    pending_at.append(len(ids))
                    pending_rows.append(row)
                # else its draw failed last step (its sampling setup did): the request fails once
                # the engine reads that, and drops what this step makes for it. Any id will do.
                ids.append(0)
        input_ids = torch.tensor(ids, dtype=torch.int64)
        if not pending_at:
            return input_ids
        drawn = self._last_sampled.index_select(0, torch.tensor(pending_rows).to(self.device, non_blocking=True))
        if len(pending_at) == len(ids):   # a decode step: every token is a pending one
            return drawn
        input_ids = input_ids.to(self.device, non_blocking=True)
        input_ids[torch.tensor(pending_at).to(self.device, non_blocking=True)] = drawn
        return input_ids

    def _input_embeds(self, entries: list[BatchEntry]) -> InputEmbeds | None:
        """The image features this step writes at placeholder rows. The images of requests new to
        the worker are encoded first, all of the step's in one batch of the vision tower (in
        slices of at most ``model.max_images_per_encode``, the batch its activations were
        budgeted for); features are kept per request until it finishes."""
        new = [e for e in entries if e.pixel_values and e.req_id not in self.req_images]
        if new:
            pixels = stack_pixel_values([px for e in new for px in e.pixel_values])
            step = self.model.max_images_per_encode
            features = torch.cat([self.model.encode_images(pixels[i : i + step]) for i in range(0, len(pixels), step)])
            start = 0
            for e in new:
                n = len(e.pixel_values)
                # Positions from the whole prompt (sent with a prefill from position 0), not from
                # this chunk of it: later chunks hold the rest of the placeholders.
                self.req_images[e.req_id] = RequestImages.of_prompt(e.prompt_token_ids, self.model.image_token_id,
                                                                    features[start : start + n])
                start += n
        parts, q_start = [], 0
        for e in entries:
            images = self.req_images.get(e.req_id)
            if images is not None and e.num_cached < images.end:   # decodes skip this
                parts.append((q_start, images, e.num_cached, e.num_new_tokens))
            q_start += e.num_new_tokens
        given = step_input_embeds(parts, self.device) if parts else None
        for _, images, num_cached, num_new in parts:
            images.offload_if_done(num_cached + num_new)
        return given

    def _row(self, req_id: int) -> int:
        """The request's row of the req -> token table, taken on its first step."""
        if req_id not in self.req_rows:
            self.req_rows[req_id] = self.model.req_manager.alloc_req()
        return self.req_rows[req_id]

    def _add_to_sampler(self, entries: list[BatchEntry]) -> list[str | None]:
        """Start sampling the entries that bring their parameters; per entry, None or why that failed."""
        errors: list[str | None] = [None] * len(entries)
        for i, e in enumerate(entries):
            if e.params is not None and self.sampler is not None:
                try:
                    self.sampler.add_request(e.req_id, e.params, e.prompt_token_ids or [])
                except Exception as err:
                    errors[i] = error_line(err)
                if self.args.speculate and e.params.speculate and e.req_id not in self.lookups:
                    self.lookups[e.req_id] = PromptLookup(e.prompt_token_ids or [], self.args.prompt_lookup_min_ngram,
                                                          self.args.prompt_lookup_max_ngram)
        return errors

    def _forward_failed(self, entries: list[BatchEntry], rows: list[int], error: Exception) -> StepOutput:
        """Undo the step (free the KV slots the forward took) and say so; the router finds the culprit."""
        if self.args.world_size > 1:
            # This rank may have left the forward before a collective the others now wait in: the
            # ranks can never be in step again. The worker ends (rank 0 raises to the engine, the
            # others exit: see ranks.follow), and the others' collectives fail with it.
            logger.error("rank %d: the forward failed; the ranks are out of step", self.args.rank, exc_info=error)
            raise self.out_of_step(error)
        if is_device_failure(error):
            raise error      # not this batch's failure but the device's: the worker's (see faults.py)
        logger.warning("the forward of a batch of %d failed: %s", len(entries), error, exc_info=error)
        for e, row in zip(entries, rows):
            if self.model.req_manager.seq_len(row) > e.num_cached:
                self.model.req_manager.truncate(row, e.num_cached)
        return StepOutput.failed_forward(len(entries), error_line(error))

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, entries: list[BatchEntry], row_ends: list[int],
                         errors: list[str | None]) -> tuple[list, list]:
        """Per entry, its prompt logprobs, or None if it did not ask; entry i's rows of ``logits``
        end at ``row_ends[i]``. An entry for which that fails gets its error in ``errors``."""
        from llmserve.worker.sampling import prompt_logprobs

        logprobs: list[list[float | None] | None] = [None] * len(entries)
        top_logprobs: list[list[list[tuple[int, float]] | None] | None] = [None] * len(entries)
        for i, (e, end) in enumerate(zip(entries, row_ends)):
            if e.want_prompt_logprobs and errors[i] is None:
                # A first prefill: the new tokens are the whole prompt, from position 0.
                assert e.num_cached == 0 and e.params is not None and e.params.prompt_logprobs is not None
                try:
                    logprobs[i], top_logprobs[i] = prompt_logprobs(
                        logits[end - len(e.token_ids) : end], e.token_ids, e.params.prompt_logprobs
                    )
                except Exception as err:
                    errors[i] = error_line(err)
        return logprobs, top_logprobs

    def check_device(self) -> None:
        """Raise the device's error, if it has one. A CUDA error that poisoned the context fails
        every later call, so entries that failed may have failed because of it, whatever their
        error says (the sampler's fallback takes any error for its request's own)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def device_failed(self, error: BaseException) -> WorkerError:
        """The step met a failure of the device (``is_device_failure``): this worker cannot go on."""
        logger.error("rank %d: the device failed; this worker cannot go on", self.args.rank, exc_info=error)
        return WorkerError(f"model worker rank {self.args.rank}: the device failed ({error_line(error)})")

    def out_of_step(self, error: BaseException) -> WorkerError:
        """A forward or a collective failed at tp > 1. On rank 0 that is most often another rank's
        end (its closed connection fails our collective), which its node reports in a moment:
        that is the cause to tell."""
        cause = self.rendezvous.failure(wait=2.0) if self.args.rank == 0 else None
        return WorkerError(cause or f"model worker rank {self.args.rank}: {error_line(error)} "
                                    f"({self.args.world_size} ranks: they are out of step)")

    def _free_kv(self, req_id: int) -> None:
        self._unverified.discard(req_id)
        row = self.req_rows.pop(req_id, None)
        if row is not None:
            self.model.req_manager.free_req(row)


def cpu_threads(ranks_per_node: int) -> int:
    """A CPU rank's threads: ``OMP_NUM_THREADS`` where it is set (the operator's, or the test
    suite's, whose parallel workers share the cores), else the cores this process may run on
    split between the node's ranks: each one taking all of them would oversubscribe, and a
    kernel's OpenMP threads that wait for a descheduled one spin (on 2 busy cores the embedded
    model decoded up to 4x slower on 2 threads than on 1)."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, len(os.sched_getaffinity(0)) // ranks_per_node)


def _image_info(model) -> dict:
    if getattr(model, "image_token_id", None) is None:
        return {}
    return dict(image_token_id=model.image_token_id, tokens_per_image=model.tokens_per_image)


def _tokenizer_json(model_path: str) -> str:
    """The model's tokenizer as ``tokenizers`` JSON, for the grammar library."""
    from llmserve.grammar import tokenizer_json
    from llmserve.tokenizer import load_tokenizer

    return tokenizer_json(load_tokenizer(model_path))


def _graph_info(model) -> dict:
    graphs = [g for g in (model.decode_graphs, model.verify_graphs) if g is not None]
    if not graphs:
        return {}
    return dict(cuda_graph_max_bs=graphs[0].max_batch_size, cuda_graph_verify_bs=model.verify_graph_max_bs,
                cuda_graph_seconds=sum(g.capture_seconds for g in graphs),
                cuda_graph_mib=sum(g.capture_bytes for g in graphs) / 2**20)


@dataclass
class _LaunchedStep:
    """A step whose forward and draw are queued: what its ``StepOutput`` needs once the draw is read."""
    num_entries: int
    sampling: list[int]               # the entries that sample, in the draw's row order
    drawn: PendingSample | None
    prompt_logprobs: list
    prompt_top_logprobs: list
    errors: list[str | None]

    def output(self) -> StepOutput:
        result = self.drawn.result() if self.drawn is not None else None
        return StepOutput(*_per_entry(self.num_entries, self.sampling, result, self.errors),
                          self.prompt_logprobs, self.prompt_top_logprobs, self.errors)


@dataclass
class _Launched:
    """A step whose forward is queued: ``read`` waits for its draw (or verifies its drafts) and
    returns its output. A step that verifies is read before the next step's forward."""
    req_ids: list[int]                # per entry
    read: Callable[[], StepOutput]
    verifies: bool = False


def _per_entry(num_entries: int, sampled: list[int], result: SampleResult | None,
               errors: list[str | None]) -> tuple[list, list, list]:
    """The sampler's results (row n for entry ``sampled[n]``) spread back over all entries, None
    where an entry did not sample; a row the sampler failed on sets its entry's error."""
    token_ids: list[int | None] = [None] * num_entries
    logprobs: list[float | None] = [None] * num_entries
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * num_entries
    for n, i in enumerate(sampled):
        token_ids[i], logprobs[i], top_logprobs[i] = result.token_ids[n], result.logprobs[n], result.top_logprobs[n]
        errors[i] = errors[i] or result.errors[n]
    return token_ids, logprobs, top_logprobs


class ModelRpcServer(rpyc.Service):
    """The rpyc face of a ModelWorker: bytes in, bytes out."""

    worker: ModelWorker | None = None

    def __init__(self, imports: threading.Thread):
        super().__init__()
        self._imports = imports   # importing the model code meanwhile (see serve)

    def exposed_init_model(self, args: bytes) -> bytes:
        self._imports.join()   # two threads importing the same modules at once can deadlock
        adopt_library_logging()   # the imports brought transformers, which logs on its own
        from llmserve.worker import ranks

        started = time.monotonic()
        init_args = pickle.loads(args)
        # tp > 1: the other ranks join rank 0's store and read these args there (worker/ranks.py)
        rendezvous = ranks.host(init_args) if init_args.world_size > 1 else None
        self.worker = ModelWorker(init_args, rendezvous)
        if rendezvous is not None:
            ranks.wait_until_loaded(rendezvous, init_args)
        logger.info("rank %d: model loaded in %.1f s", init_args.rank, time.monotonic() - started)
        return pickle.dumps(self.worker.info())

    def exposed_failure(self) -> str | None:
        """What a rank elsewhere reported before it ended (see ranks.py), if anything; the engine
        asks while it waits, so that a node's failure ends it even while it has no step to run."""
        rendezvous = self.worker.rendezvous if self.worker is not None else None
        return rendezvous.failure() if rendezvous is not None else None

    def exposed_shutdown(self) -> None:
        """The engine is closing: the other ranks leave their step loops (and exit)."""
        if self.worker is not None and self.worker.channel is not None:
            self.worker.channel.send(b"")
    def exposed_read_lora(self, name: str, path: str) -> bytes:
        self.worker.adapters.get(name, path)
        return pickle.dumps(None)

    def exposed_step(self, step: bytes) -> bytes:
        try:
            outputs = self.worker.step(pickle.loads(step), raw=step)
            if any(error is not None for output in outputs for error in output.errors):
                self.worker.check_device()
        except Exception as e:
            if is_device_failure(e):
                raise self.worker.device_failed(e) from None
            raise
        return pickle.dumps(outputs)


def _import_model_code() -> None:
    """Import what ModelWorker's init will: the model classes (and with them Triton and the
    kernels), the sampler, and transformers' config class of each architecture, whose first use
    imports most of transformers (1.7 s on a 2-core CPU). A failure here is left for the init
    to meet and report."""
    try:
        from transformers import AutoConfig

        import llmserve.worker.sampling  # noqa: F401
        from llmserve.models.registry import MODEL_CLASSES, get_model_class

        for model_type in MODEL_CLASSES:
            get_model_class(model_type)
            AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001
        logger.debug("importing the model code ahead of init_model failed", exc_info=True)


def serve(address: str) -> None:
    """A worker process's life (see worker_main): serve the router until it closes us.

    The engine core sends init_model only once the HTTP process has loaded its tokenizer, seconds
    after this process started: a thread imports the model code meanwhile."""
    imports = threading.Thread(target=_import_model_code, name="import-model-code", daemon=True)
    imports.start()
    server = ThreadedServer(ModelRpcServer(imports), socket_path=socket_path(address), protocol_config=RPYC_CONFIG,
                            logger=logging.getLogger("llmserve.worker.rpyc"))   # not one named after the socket
    server.start()
