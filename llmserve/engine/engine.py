"""LLMEngine: scheduler and model workers, advanced one step at a time, over token ids.

The offline ``LLM`` loops ``step()`` until its prompts finish; in the server the engine-core
process (``core.py``) drives it. Nothing here knows which of them is calling. Text is the
caller's (``llmserve.output``): this module imports neither torch nor transformers, so the
engine-core process starts in a fraction of a second.

A failure tied to one request (its sampling parameters, a forward that raises on its rows, its
text that will not decode) ends that request: it finishes with ``FinishReason.ERROR`` and
``Request.error`` set, its KV slots are freed, and the others go on as if it had never been
there. Only a ``WorkerError`` (a worker died or fell out of step) escapes ``step()``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING

from llmserve.common.basemodel.model_shape import describe_stages
from llmserve.engine.admission import RequestLimits, check_request
from llmserve.engine.config import EngineConfig, ModelSpec, check_speculation, with_device_defaults
from llmserve.engine.drafting import DRAFT_COSTS
from llmserve.engine.request import FinishReason, Request, RequestDelta, RequestStatus
from llmserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from llmserve.engine.worker_client import ModelWorkerGroup
from llmserve.ipc import error_line
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.worker.protocol import BatchEntry, CacheOp, StepInput, StepOutput, TokenRun, WorkerInitArgs

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: ModelSpec, workers: ModelWorkerGroup | None = None):
        """``workers``: the worker processes, if already started (the engine core starts them
        before it knows the model, so that they import torch meanwhile); else started here."""
        config = with_device_defaults(config, model.device)   # what /info reports: the values in force
        check_speculation(config)
        if config.serves_lora and not (config.max_loras >= 1 and config.max_lora_rank >= 1):
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {config.max_loras} and {config.max_lora_rank}")
        if not config.step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0 seconds, got {config.step_timeout}")
        self.config = config
        self.model = model
        self.model_path = model.path
        self.eos_token_ids = model.eos_token_ids
        self.workers = workers if workers is not None else ModelWorkerGroup.of(config)
        self.info = self.workers.init_model(WorkerInitArgs(
            model_path=model.path, model_type=model.model_type, rank=0, world_size=config.world_size, pp=config.pp,
            device=model.device,
            dtype=config.dtype, max_total_token_num=config.max_total_token_num, mem_fraction=config.mem_fraction,
            max_running_requests=config.max_running_requests, dist_init_addr=self.workers.dist_init_addr,
            nnodes=config.nnodes, dist_timeout=config.dist_timeout,
            eos_token_ids=sorted(model.eos_token_ids), cuda_graph_max_bs=config.cuda_graph_max_bs,
            speculate=config.speculate, speculate_max_batch=config.speculate_max_batch,
            prompt_lookup_min_ngram=config.prompt_lookup_min_ngram, prompt_lookup_max_ngram=config.prompt_lookup_max_ngram,
            dequantize=config.dequantize, lora_modules=dict(config.lora_modules),
            max_loras=config.max_loras if config.serves_lora else 0, max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras, quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
            load_format=config.load_format, custom_all_reduce=config.uses_custom_all_reduce,
        ))
        self.workers.step_timeout = config.step_timeout   # from now on: serving steps only
        self.limits = RequestLimits.of_model(self.info)
        self.scheduler = Scheduler(SchedulerConfig(
            max_total_token_num=self.info.max_total_token_num,
            max_running_requests=min(config.max_running_requests, self.info.max_running_requests),
            max_prefill_tokens=config.max_prefill_tokens, chunked_prefill=config.chunked_prefill,
            speculate=config.speculate, speculate_max_batch=config.speculate_max_batch,
            draft_cost=DRAFT_COSTS[model.device], prefix_cache=config.prefix_cache, image_token_id=self.info.image_token_id,
            tokens_per_image=self.info.tokens_per_image, lora_modules=dict(config.lora_modules),
            max_loras=config.max_loras,
        ))
        # At tp > 1 and pp > 1 too: rank 0 (stage 0, which embeds the tokens and samples from the
        # logits the last stage sends it) broadcasts each draw to the other ranks (ModelWorker._share_draw).
        self.overlap = config.overlap if config.overlap is not None else model.device == "cuda"
        self.requests: dict[int, Request] = {}
        self._to_free: list[int] = []       # finished requests whose KV the workers still hold
        self._in_flight: deque[SchedulerOutput] = deque()   # steps sent whose output is not read yet
        # Requests whose step just sent completes their prefill, or draws their last token (retired
        # from the scheduler): their tokens go in the prefix cache (see _cache_prefilled).
        self._prefilled: list[Request] = []
        self._retired: list[Request] = []
        self._ids = itertools.count()
        # For /metrics and the periodic log line: prompt tokens computed since start (again after
        # a preemption), and the tokens the last step fed (decodes and prompt tokens).
        self.num_prefill_tokens = 0
        self.last_step_num_tokens = 0
        # Speculation, since start: draft tokens verified, those accepted, and how many verifies
        # accepted 0, 1, ..., speculate of their draft tokens.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_length_counts = [0] * (config.speculate + 1)
        # LLMSERVE_STEP_TRACE=FILE: one JSON line per step (times and batch shape), to see where
        # a serving run's time goes (benchmarks/step_trace.py summarizes it).
        trace = os.environ.get("LLMSERVE_STEP_TRACE")
        self._trace = open(trace, "a", buffering=1 << 16) if trace else None

    # -- requests ----------------------------------------------------------------------
    def summary(self) -> str:
        """The line ``llmserve`` prints once the model is loaded: what runs, and where."""
        info = self.info
        verify = f" and verify steps up to {info.cuda_graph_verify_bs}" if info.cuda_graph_verify_bs else ""
        graphs = (f"CUDA graphs for decode batches up to {info.cuda_graph_max_bs}{verify} (captured in "
                  f"{info.cuda_graph_seconds:.1f} s, {info.cuda_graph_mib:.0f} MiB)" if info.cuda_graph_max_bs else "eager")
        weights = f"{info.num_params / 1e6:.0f}M params" + (f" in GGUF {info.quantized} blocks" if info.quantized else "")
        if info.quantization:
            weights += f" ({info.quantization})"
        weights += f", weights {info.weight_bytes / 2**30:.2f} GiB"
        tp = f"tp={self.config.tp}" + (f" (all-reduce: {info.all_reduce})" if info.all_reduce else "")
        if self.config.pp > 1:
            tp += f", pp={self.config.pp} ({describe_stages(info.num_layers, self.config.pp)})"
        return (f"# {info.model_type}, {weights}, {info.dtype} on {info.device}, "
                f"{tp}, KV cache {info.max_total_token_num} tokens in {info.kv_cache_dtype}, {graphs}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    pixel_values: list[np.ndarray] | None = None, session_id: str | None = None,
                    lora_name: str | None = None) -> Request:
        """Queue a request; ``InvalidRequest`` (a ``ValueError``) if it can never run.
        ``session_id``: when it finishes, its tokens stay pinned in the prefix cache for the
        session's next turn (until ``end_session``, or until the cache needs the room).
        ``lora_name``: the LoRA adapter to run it with (None: the base model)."""
        req = self.new_request(prompt_token_ids, params, pixel_values, lora_name)
        req.session_id = session_id
        self.enqueue(req)
        return req

    def end_session(self, session_id: str) -> None:
        """Unpin the session's tokens in the prefix cache: they stay, evictable like any entry."""
        self.scheduler.prefix_cache.end_session(session_id)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache of everything no running request uses (session pins too), as
        vLLM's ``reset_prefix_cache``; the slots freed (the workers free them with the next step)."""
        return self.scheduler.prefix_cache.evict_all()

    def new_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    pixel_values: list[np.ndarray] | None = None, lora_name: str | None = None) -> Request:
        """A validated request, not queued yet (``LLM.generate`` checks all its prompts before it
        queues any). ``pixel_values``: its images, preprocessed; the prompt has their placeholders
        expanded already (``llmserve.multimodal.expand_image_tokens``)."""
        check_request(prompt_token_ids, params, self.limits, len(pixel_values or ()))
        self.check_lora(lora_name)
        return Request(next(self._ids), list(prompt_token_ids), params, pixel_values=pixel_values or None,
                       lora_name=lora_name)

    def check_lora(self, lora_name: str | None) -> None:
        """``InvalidRequest`` unless ``lora_name`` is None or an adapter this engine serves."""
        if lora_name is not None and lora_name not in self.scheduler.loras.paths:
            known = ", ".join(sorted(self.scheduler.loras.paths)) or "none"
            raise InvalidRequest("lora", f"unknown LoRA adapter {lora_name!r} (served: {known})")

    @property
    def lora_names(self) -> list[str]:
        return list(self.scheduler.loras.paths)

    def load_lora(self, name: str, path: str) -> None:
        """Serve one more adapter (vLLM's /v1/load_lora_adapter): every rank reads and checks it
        now (``AdapterLoadError`` if it cannot be served); it takes a device slot when a request
        first uses it."""
        loras = self.scheduler.loras
        if not self.config.allow_runtime_lora_updating:
            raise ValueError("loading LoRA adapters at run time is off (--allow-runtime-lora-updating)")
        if name in loras.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        self.workers.read_lora(name, path)
        loras.register(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving an adapter (``KeyError`` if unknown; ``ValueError`` while a request that
        names it has not finished)."""
        loras = self.scheduler.loras
        if not self.config.allow_runtime_lora_updating:
            raise ValueError("unloading LoRA adapters at run time is off (--allow-runtime-lora-updating)")
        if name not in loras.paths:
            raise KeyError(name)
        if any(req.lora_name == name for req in self.requests.values()) or not loras.unregister(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by unfinished requests: unload it once they end")

    def enqueue(self, req: Request) -> None:
        """Queue a request that passed ``check_request`` (here, or at the server's API edge)."""
        self.check_lora(req.lora_name)      # (an adapter may have been unloaded since the edge's check)
        if req.lora_name is not None:
            req.lora_id = self.scheduler.loras.ids[req.lora_name]
        self.scheduler.add_request(req)
        self.requests[req.req_id] = req

    def abort_request(self, req_id: int) -> None:
        req = self.scheduler.abort_request(req_id)
        if req is not None:
            self._release(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    # -- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Send the workers the next scheduled batch; return what the steps whose output came
        back did to each request: a token, or a failure (the request is then finished, with
        ``error`` set). One call may bring a request two deltas (a step and the one before it).

        Without overlap that is this step's. With it, the workers answer once this step is
        queued on the device, with the output of the step before: the host reads those tokens
        and schedules the next step while the device computes, and a request that ended (an
        EOS) in the step read has run one step more, whose token is dropped.

        Drafting changes none of this: a decode brings a draft budget, rank 0 drafts from the
        tokens it knows (the one in flight included), and the engine learns how many tokens the
        step gave once it reads it (``_verified``)."""
        plan = self.scheduler.schedule()
        self.last_step_num_tokens = 0
        entries = [self._batch_entry(s) for s in plan.scheduled]
        overlap = self.overlap
        step = StepInput(entries, finished_req_ids=self._to_free, preempted_req_ids=[r.req_id for r in plan.preempted],
                         overlap=overlap, cache_ops=self._take_cache_ops(), lora_loads=self.scheduler.loras.take_loads())
        self._to_free = []
        if (not entries and not step.finished_req_ids and not step.preempted_req_ids and not step.cache_ops
                and not step.lora_loads and not self._in_flight):
            return []
        self.num_prefill_tokens += plan.num_prefill_tokens
        self.last_step_num_tokens = plan.num_tokens
        started = time.perf_counter()
        outputs = self.workers.step(step)
        if self._trace is not None:
            self._trace.write(json.dumps({"start": started, "end": time.perf_counter(), "decode": plan.num_decode_tokens,
                                          "prefill": plan.num_prefill_tokens, "draft_slots": plan.num_draft_slots,
                                          "overlap": overlap, "waiting": self.scheduler.num_waiting}) + "\n")
        if entries:
            self._in_flight.append(plan)
            self._sent(plan, overlap)
        # The steps these outputs are of, taken off first: whatever goes wrong below, what stays
        # in flight is what the workers still owe.
        done = [self._in_flight.popleft() for _ in outputs]
        if outputs and outputs[-1].forward_failed:
            # Undone first, so that reading the steps before it (a request that stops there puts
            # its tokens in the prefix cache) sees only the tokens really cached.
            for s in done[-1].scheduled:
                s.request.num_cached -= s.num_new_tokens
            self._prefilled.clear()
        self._cache_prefilled()
        deltas = [delta for plan, output in zip(done, outputs) for delta in self._take_step(plan, output)]
        self._cache_retired()
        return deltas

    def _sent(self, plan: SchedulerOutput, overlap: bool = False) -> None:
        """The workers have the step: its tokens are in the KV cache, or on their way there, and
        its drafts hold their budgets' slots until it is read (see ``_verified``)."""
        self.scheduler.update_after_step(plan)
        for s in plan.scheduled:
            req = s.request
            req.num_pending_tokens += s.samples
            if s.prefill and s.samples:
                self._prefilled.append(req)
            if overlap and req.final_token_pending and self.scheduler.retire(req):
                # Its last token is drawn: free its KV with the next step, as the plain loop does
                # once it reads that token, so that the next batches are the plain loop's too.
                self._to_free.append(req.req_id)
                self._retired.append(req)

    # The prefix cache learns of a step's tokens once the step is known to have run (its forward
    # did not fail): a completed prefill's once the step is sent (the overlapped loop) or read
    # (the plain one), and a retired request's once the token before its last is read. So both
    # loops put the same tokens in the tree in the same order, and make the same batches.
    def _cache_prefilled(self) -> None:
        for req in self._prefilled:
            self.scheduler.prefix_cache.insert(req, min(req.num_cached, req.num_tokens))
        self._prefilled.clear()

    def _cache_retired(self) -> None:
        for req in self._retired:
            self.scheduler.prefix_cache.leave(req, keep=True)
        self._retired.clear()

    def _take_step(self, plan: SchedulerOutput, result: StepOutput) -> list[RequestDelta]:
        """Give a step's output to its requests; the deltas of those that got a token or failed."""
        for s in plan.scheduled:
            s.request.num_pending_tokens -= s.samples
            s.request.num_draft_slots -= s.draft_budget
        if result.forward_failed and len(plan.scheduled) > 1:
            return self._run_again(plan)
        updated = []
        for i, s in enumerate(plan.scheduled):
            req = s.request
            if req.is_finished:    # ended while the step ran (aborted, or stopped by the step before)
                continue
            num_before = req.num_output_tokens
            error = result.errors[i] or self._take_output(s, result, i)
            if error is not None:
                self._fail(req, error)
                updated.append(RequestDelta.of(req))
            elif s.samples:   # one delta per new token (a verify step brings several), in order
                updated += [RequestDelta.of_token(req, j) for j in range(num_before, req.num_output_tokens)]
        return updated

    def _run_again(self, plan: SchedulerOutput) -> list[RequestDelta]:
        """A step whose forward raised, which the workers have undone: undo it here too, and run
        its live entries again at once, in halves (see ``_run_in_halves``). (``step`` has taken
        the step's tokens off the requests' ``num_cached`` already.)"""
        live = SchedulerOutput([s for s in plan.scheduled if not s.request.is_finished], [])
        if not live.scheduled:
            return []
        result = self._run_in_halves([self._batch_entry(s) for s in live.scheduled])
        self._sent(live)
        deltas = self._take_step(live, result)
        self._cache_prefilled()   # after the entries that failed again have ended (their rows are undone)
        return deltas

    def _run_in_halves(self, entries: list[BatchEntry]) -> StepOutput:
        """Run entries whose forward failed together again, not overlapped, in halves (and the
        halves of a half that fails), so that those which cause it fail alone and the others get
        their tokens as if alone: an entry's logits depend only on its own tokens, and nothing
        was sampled by the failed try."""
        if len(entries) == 1:
            [result] = self.workers.step(StepInput(entries))
            return result
        half = len(entries) // 2
        return StepOutput.concat([self._run(entries[:half]), self._run(entries[half:])])

    def _run(self, entries: list[BatchEntry]) -> StepOutput:
        [result] = self.workers.step(StepInput(entries))
        return self._run_in_halves(entries) if result.forward_failed and len(entries) > 1 else result

    def _take_output(self, s: ScheduledRequest, result: StepOutput, i: int) -> str | None:
        """Give the request what entry ``i`` of the step made for it (prompt logprobs, a token),
        finishing it if a stop rule fires. Returns None, or why the request must fail."""
        req = s.request
        try:
            if result.prompt_logprobs[i] is not None:
                req.set_prompt_logprobs(result.prompt_logprobs[i], result.prompt_top_logprobs[i])
            if not s.samples:      # a chunk of a prompt still being prefilled: no token yet
                return None
            run = result.run_of(i)
            if s.draft_budget:
                self._verified(s, run)
            if result.match_lens is not None:
                self.scheduler.drafter.matched(req, result.match_lens[i])
            reason = None
            for j, token_id in enumerate(run.token_ids):
                reason = req.append_token(token_id, eos_token_ids=self.eos_token_ids,
                                          logprob=run.logprobs[j] if run.logprobs else None,
                                          top_logprobs=run.top_logprobs[j] if run.top_logprobs else None)
                if reason is not None:     # a stop inside an accepted run: the tokens after it are dropped
                    break
        except Exception as e:     # output the worker got wrong for this entry: its failure, not the engine's
            logger.exception("request %d: its output could not be taken", req.req_id)
            return error_line(e)
        if reason is not None:
            self.scheduler.finish_request(req, reason)
            self._release(req)
        return None

    def _verified(self, s: ScheduledRequest, run: TokenRun) -> None:
        """A decode with a draft budget was read: the worker drafted ``run.num_drafted`` tokens
        (cached with the step) and kept those its run accepted."""
        num_drafted, num_accepted = run.num_drafted, len(run.token_ids) - 1
        if not 0 <= num_accepted <= num_drafted <= s.draft_budget:
            raise ValueError(f"the worker accepted {num_accepted} tokens of a draft of {num_drafted} "
                             f"(budget {s.draft_budget})")
        if s.request.status is RequestStatus.RUNNING:    # (a preempted one has no cache left)
            s.request.num_cached += num_accepted
        self.scheduler.drafter.verified(s, num_drafted, run.match_len, num_accepted)
        if num_drafted:
            self.num_draft_tokens += num_drafted
            self.num_accepted_tokens += num_accepted
            self.accepted_length_counts[num_accepted] += 1

    def _fail(self, req: Request, error: str) -> None:
        """End a request with an error; the engine goes on without it."""
        logger.warning("request %d failed: %s", req.req_id, error)
        req.error = error
        self.scheduler.finish_request(req, FinishReason.ERROR)
        self._release(req)

    def _batch_entry(self, s: ScheduledRequest) -> BatchEntry:
        req, start = s.request, s.request.num_cached
        end = start + s.num_new_tokens
        # First chunk, or the first after a preemption: (re)send the sampling setup, and the
        # cached prefix the request starts from.
        first = start == req.num_cached_prefix
        tree = self.scheduler.prefix_cache.tree
        return BatchEntry(
            req_id=req.req_id, token_ids=req.token_slice(start, min(end, req.num_tokens)),
            num_cached=start, draft_budget=s.draft_budget,
            params=req.params if first else None, prompt_token_ids=req.prompt_token_ids if first else None,
            want_prompt_logprobs=first and req.needs_prompt_logprobs, sample=s.samples,
            pending_token=end > req.num_tokens,   # its last token is the one in flight
            pixel_values=req.pixel_values if first else None,
            prefix_node_ids=[node.id for node in tree.path(req.cache_node)] if first and start else None,
            lora_slot=req.lora_slot,
        )

    def _take_cache_ops(self) -> list[CacheOp]:
        """The prefix cache's changes the workers have yet to mirror."""
        return self.scheduler.prefix_cache.tree.take_ops()

    def _release(self, req: Request) -> None:
        self._to_free.append(req.req_id)
        self.requests.pop(req.req_id, None)

    def flush(self) -> None:
        """The caller is going idle: read the step still in flight (``generate`` is done once its
        own requests are, and a step may be running for one that stopped) and hand the workers
        the pending frees, scheduling nothing new."""
        while self._in_flight or self._to_free or self.scheduler.prefix_cache.tree.ops:
            step = StepInput([], finished_req_ids=self._to_free, overlap=self.overlap, cache_ops=self._take_cache_ops())
            self._to_free = []
            outputs = self.workers.step(step)
            for plan, output in [(self._in_flight.popleft(), output) for output in outputs]:
                self._take_step(plan, output)

    def shutdown(self) -> None:
        self.workers.close()
        if self._trace is not None:
            self._trace.close()
