"""What the engine and a model worker say to each other, once per step: plain dataclasses,
pickled and sent as bytes over rpyc (which keeps rpyc's proxies out of the hot path).

Every step the engine sends rank 0 a ``StepInput``, which rank 0 hands to the other ranks in one
broadcast (``common.distributed.StepChannel``); each rank runs its share of the forward (the
collectives inside line them up; at pp > 1 each stage its layers, the last stage sending rank 0
the logits), and rank 0 samples and returns a ``StepOutput``.

With ``StepInput.overlap``, the worker answers as soon as it has queued the step
on the device, with the outputs of the steps before it that are done: the engine reads step N's
tokens and schedules step N+1 while the GPU runs step N. A request that sampled in the step
still running feeds that token to the next step without the engine knowing it yet
(``BatchEntry.pending_token``): the worker takes it from the device (rank 0 broadcasts its draw
to the other ranks, device to device).

Speculation: the engine grants a decode a draft budget (``BatchEntry.draft_budget``); rank 0 keeps
each request's n-gram index from the tokens it emits, proposes the draft right before the forward,
and verifies it with the step's logits. A verify step is overlapped like any other: rank 0 reads it
at the start of the next call (before that step's forward, since the draft and the positions of
the request's next step depend on how much was accepted), fills the next step's entries in (their
pending tokens, positions and drafts) and only then hands the step to the other ranks.
A failure tied to some entries of a step (bad sampling parameters, a forward that raises) is
reported in ``StepOutput.errors``, and the worker stays usable; anything a worker raises
instead is a ``WorkerError``, like its death: its state is then unknown, and the engine stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.lora.manager import LoadAdapter
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

RPYC_CONFIG = {
    "allow_pickle": False,
    "sync_request_timeout": None,      # loading a large model takes minutes
    "import_custom_exceptions": True,  # a worker's ModelLoadError arrives as a ModelLoadError
    "instantiate_custom_exceptions": True,
}


class WorkerError(RuntimeError):
    """A model worker failed or died; the engine cannot go on."""


@dataclass
class WorkerInitArgs:
    model_path: str
    model_type: str                  # picks the model class (the router has read the config already)
    rank: int                        # this rank's place in the world (0: the one the engine talks to)
    world_size: int                  # all ranks: tp x pp
    device: str                      # "cpu" or "cuda" (rank r takes cuda:r)
    dtype: str | None = None         # "float32" | "float16" | "bfloat16" | None (model default)
    max_total_token_num: int | None = None
    mem_fraction: float = 0.85
    max_running_requests: int = 256
    # Where the ranks meet when world_size > 1: HOST:PORT of the store rank 0 hosts (see
    # common/distributed.py), the nodes the ranks are spread over (world_size / nnodes each, rank r
    # on node r // that), and how long rank 0 waits for the other ranks to join.
    dist_init_addr: str = ""
    nnodes: int = 1
    dist_timeout: float = 120.0
    eos_token_ids: list[int] = field(default_factory=list)  # banned by the sampler below min_tokens
    cuda_graph_max_bs: int = 0       # on CUDA, decode batches up to this size replay CUDA graphs
    speculate: int = 0               # draft tokens per request (EngineConfig): sizes the verify steps' graphs
    speculate_max_batch: int = 0
    # The n-gram sizes of rank 0's prompt-lookup index (EngineConfig's prompt_lookup_*_ngram).
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_max_ngram: int = 3
    dequantize: bool = False         # GGUF on CPU: expand the quantized matrices at load (ModelInitParams)
    # LoRA: the adapters (name -> local directory; each is read and checked at start-up), the
    # device pool's slots and largest rank, and how many adapters stay read on the host (the
    # others are read again from their directory when loaded; None: all). No slots: no pool.
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 0
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    quantization: str | None = None  # --quantization (ModelInitParams)
    # On GPUs of one node, small all-reduces over peer-to-peer buffers instead of NCCL
    # (common/custom_all_reduce.py); off: --disable-custom-all-reduce.
    custom_all_reduce: bool = True
    kv_cache_dtype: str = "auto"     # --kv-cache-dtype (ModelInitParams)
    load_format: str = "auto"        # --load-format (ModelInitParams)
    # Pipeline stages: rank r is tp rank r % tp of stage r // tp (common/distributed.py).
    pp: int = 1

    @property
    def tp(self) -> int:
        return self.world_size // self.pp

    @property
    def tp_rank(self) -> int:
        """This rank's place among its stage's tp ranks: its share of each weight."""
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_rank(self) -> int:
        """This rank's place on its node: its GPU's index."""
        return self.rank % self.ranks_per_node


@dataclass
class WorkerInfo:
    """What the router needs to know about the loaded model."""
    model_type: str
    vocab_size: int
    max_total_token_num: int
    max_seq_len: int
    max_running_requests: int
    dtype: str
    device: str
    num_layers: int
    num_params: int
    cuda_graph_max_bs: int = 0       # 0: every step runs eagerly
    cuda_graph_verify_bs: int = 0    # verify steps of up to this many requests replay graphs too
    cuda_graph_seconds: float = 0.0  # capture time at start-up
    cuda_graph_mib: float = 0.0      # GPU memory the graphs took
    quantized: str = ""              # GGUF block formats the weights run in ("Q4_1/Q8_0"); "": dense
    quantization: str = ""           # a quantized checkpoint's format or --quantization fp8 (its description); "": none
    weight_bytes: int = 0            # bytes of the weights (and their scales) over all ranks
    all_reduce: str = ""             # which all-reduce the ranks use ("" at tp=1; see common/distributed.py)
    kv_cache_dtype: str = ""         # what the KV cache holds ("bfloat16", "fp8_e4m3 (its scales)")
    # Image input (LLaVA): the placeholder token id, and how many of them one image fills; None
    # for a text-only model.
    image_token_id: int | None = None
    tokens_per_image: int = 0


@dataclass
class BatchEntry:
    req_id: int
    token_ids: list[int]             # the new tokens of this step
    num_cached: int                  # tokens of this request already in the KV cache
    params: SamplingParams | None = None          # sent with a prefill (num_cached == 0)
    prompt_token_ids: list[int] | None = None     # likewise (for the repetition penalty)
    # The request's first prefill, and it asked for prompt logprobs (a re-prefill after a
    # preemption never does: they were computed the first time).
    want_prompt_logprobs: bool = False
    # Sample a token from this entry's last row (false for a chunk of a prompt that continues
    # next step: drawing there would shift the request's random stream).
    sample: bool = True
    # One more new token after token_ids: the one this worker sampled for the request in the
    # step before, which the engine has not read yet (overlapped steps only).
    pending_token: bool = False
    # The request's images' pixel values ([3, H, W] float32 each, in prompt order), sent with
    # every prefill from position 0; a worker encodes them the first time only and keeps the
    # features until the request finishes (preemption keeps them too).
    pixel_values: list[np.ndarray] | None = None
    # Speculation: rank 0 may append a draft of up to this many tokens after the request's sampled
    # token, from its n-gram index of the request (the engine has reserved their KV slots).
    draft_budget: int = 0
    # Filled in by rank 0 before the forward (the engine sends 0): the last this many of token_ids
    # are the draft, verified from every row's logits (the accepted prefix stays cached), and how
    # many tokens of the request's end agree with where it was copied from (prompt_lookup.Draft).
    num_draft_tokens: int = 0
    draft_match_len: int = 0
    # The prefix cache's nodes whose slots hold this request's first num_cached tokens, root
    # first: sent with the step that (re)admits a request with a cached prefix, whose row the
    # worker starts with those slots (one more reference each).
    prefix_node_ids: list[int] | None = None
    # The request's LoRA adapter: a slot of the workers' pool (-1: the base model).
    lora_slot: int = -1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + self.pending_token


@dataclass
class StepInput:
    entries: list[BatchEntry]
    finished_req_ids: list[int] = field(default_factory=list)   # free KV and sampling state
    preempted_req_ids: list[int] = field(default_factory=list)  # free KV only; they come back later
    # Answer once the step is queued on the device, with the outputs of earlier steps only: this
    # step's output comes with the next call's answer (see the module's doc).
    overlap: bool = False
    # The prefix cache's changes since the last step, applied in order before anything else
    # (before the frees above: a finished request's slots are cached before its row goes).
    cache_ops: list[CacheOp] = field(default_factory=list)
    # LoRA adapters to put in pool slots before the forward (llmserve.lora.manager), in order.
    lora_loads: list[LoadAdapter] = field(default_factory=list)


@dataclass
class TokenRun:
    """The tokens a drafting entry emitted in one verify step: its accepted draft tokens, then one
    more; the logprobs are None unless its request asked for them."""
    token_ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # The draft rank 0 proposed (len(token_ids) - 1 of them were accepted) and its match length.
    num_drafted: int = 0
    match_len: int = 0


@dataclass
class StepOutput:
    # Per entry; None where the entry did not sample (a chunk of a prompt that continues) or failed.
    token_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    # Per entry: None unless it had want_prompt_logprobs; see sampler.prompt_logprobs.
    prompt_logprobs: list[list[float | None] | None]
    prompt_top_logprobs: list[list[list[tuple[int, float]] | None] | None]
    # Per entry: None, or why it failed (its request must end with that error).
    errors: list[str | None]
    # The forward raised, so every entry has that error, though maybe only one caused it. The
    # worker has undone the step (the KV slots it took), so the entries can run again, fewer
    # at a time, to find out which.
    forward_failed: bool = False
    # Verify steps only: per entry, every token a drafting entry emitted (token_ids and the
    # logprobs fields hold its first), None for an entry without a draft (one with a budget whose
    # lookup found nothing included).
    runs: list[TokenRun | None] | None = None
    # Rank 0 with speculation on, per entry: the match a draft of its request would continue now,
    # with this step's tokens, counted up to LONG_MATCH (`PromptLookup.match_len`; 0 where none
    # recurs or the request does not draft). The engine ends a request's back-off on a long one
    # (`Drafter.matched`).
    match_lens: list[int] | None = None

    @classmethod
    def failed_forward(cls, num_entries: int, error: str) -> StepOutput:
        def nones() -> list:
            return [None] * num_entries

        return cls(nones(), nones(), nones(), nones(), nones(), [error] * num_entries, forward_failed=True)

    @classmethod
    def concat(cls, parts: list[StepOutput]) -> StepOutput:
        """The outputs of consecutive slices of one batch, as one output of the whole batch."""
        def joined(name: str, absent: object) -> list | None:     # a per-entry field that may be None
            if all(getattr(p, name) is None for p in parts):
                return None
            return sum((getattr(p, name) if getattr(p, name) is not None else [absent] * len(p.token_ids)
                        for p in parts), [])

        return cls(*(sum((getattr(p, name) for p in parts), []) for name in (
            "token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "errors")),
            runs=joined("runs", None), match_lens=joined("match_lens", 0))

    def run_of(self, i: int) -> TokenRun:
        """Every token entry ``i`` emitted (one, unless it drafted), with its logprobs."""
        if self.runs is not None and self.runs[i] is not None:
            return self.runs[i]
        return TokenRun([self.token_ids[i]], [self.logprobs[i]], [self.top_logprobs[i]])


# -- the prefix cache's ops (llmserve/engine/radix_cache.py makes them, every rank mirrors them in
# llmserve/worker/prefix_slots.py) --------------------------------------------------------------

@dataclass(frozen=True)
class SplitNode:
    """Node ``node_id``'s first ``at`` slots go to a new node ``new_node_id`` (its new parent)."""
    node_id: int
    at: int
    new_node_id: int


@dataclass(frozen=True)
class CacheTokens:
    """The slots at positions [start, end) of request ``req_id``'s row now also belong to the new
    node ``node_id`` (one more reference each)."""
    node_id: int
    req_id: int
    start: int
    end: int


@dataclass(frozen=True)
class EvictNode:
    """The node is gone: drop its references to its slots."""
    node_id: int


CacheOp = SplitNode | CacheTokens | EvictNode
