"""What the HTTP process and the engine-core process say to each other over their local socket:
plain dataclasses, one verb each, pickled and framed by an 8-byte length.

HTTP -> core: ``StartEngine`` and then a ``ModelSpec`` (once each, on the core's stdin), then over
the socket ``AddRequest``, ``AbortRequests``, ``EndSession``, ``Ping``, ``Shutdown``.
Core -> HTTP: ``EngineReady`` or ``StartupFailed`` (once), then one ``EngineOutputs`` per engine
step (every request's ``RequestDelta`` of that step, token ids and no text, plus a stats
snapshot), ``StepFailed`` when a step raised for no request of its own, ``Pong`` for each ``Ping``,
and ``EngineDead`` last if the engine cannot go on.

With ``--api-server-count N`` the core has N such connections, one per HTTP process: each gets
the deltas of the requests it sent (and every step's stats), the answers to its own pings and
LoRA updates, and ``LoraChanged`` when another HTTP process changed the adapters served.

Each HTTP -> core frame on the socket is a list of messages: all that the HTTP process
sent in one turn of its event loop, taken in whole by the core between two steps.

Requests arrive validated and tokenized; their ids are the HTTP process's (with several, each
numbers its own residue class modulo N, so ids never collide; the core checks). Both ends are the
same program (one source tree), so pickle is safe here and needs no schema.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.engine.config import EngineConfig, ModelSpec
from llmserve.engine.request import RequestDelta
from llmserve.sampling_params import SamplingParams
from llmserve.worker.protocol import WorkerInfo

if TYPE_CHECKING:
    import numpy as np

_HEADER = struct.Struct("!Q")


# -- HTTP -> core --------------------------------------------------------------------------

@dataclass
class StartEngine:
    """On stdin, first: the core starts its worker processes at once (they take seconds to import
    torch), then reads the ``ModelSpec`` that follows on stdin once the HTTP process has its
    tokenizer (``inspect_model`` needs it), and loads the model."""
    config: EngineConfig
    num_clients: int = 1      # HTTP processes that connect (--api-server-count); the first is the launcher


@dataclass
class AddRequest:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    pixel_values: list[np.ndarray] | None = None   # the images of a multimodal prompt (Request.pixel_values)
    # An interactive session's id: the request's tokens stay pinned in the prefix cache for the
    # session's next turn once it finishes (until EndSession, or until the cache needs the room).
    session_id: str | None = None
    lora_name: str | None = None     # the LoRA adapter to run it with (None: the base model)


@dataclass
class AbortRequests:
    req_ids: list[int]


@dataclass
class EndSession:
    """The session is over: unpin its tokens in the prefix cache."""
    session_id: str


@dataclass
class UpdateLora:
    """Load adapter ``name`` from local directory ``path``, or unload it (``path`` None); the core
    answers ``LoraUpdated`` with the same ``call_id`` (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter)."""
    call_id: int
    name: str
    path: str | None


@dataclass
class Ping:
    """Are you there? (``/health``.) The core answers ``Pong`` at once, during a step too."""


@dataclass
class Shutdown:
    pass


# -- core -> HTTP --------------------------------------------------------------------------

@dataclass
class EngineReady:
    info: WorkerInfo
    config: EngineConfig              # what the core runs: the StartEngine's, echoed
    model: ModelSpec
    summary: str                      # LLMEngine.summary(): the line `llmserve serve` prints


@dataclass
class StartupFailed:
    error: BaseException              # re-raised by the HTTP process (a ModelLoadError stays one)


@dataclass
class EngineStats:
    """A snapshot for /metrics, taken between two steps (never the live scheduler lists)."""
    num_waiting: int = 0
    num_running: int = 0
    num_used_slots: int = 0
    # Counts since the engine started (the HTTP process turns them into counters and rates).
    num_preemptions: int = 0
    num_prefill_tokens: int = 0       # prompt tokens computed, again after a preemption
    # Speculation: draft tokens verified, those accepted, and how many verifies accepted 0, 1, ...
    # of their draft tokens (LLMEngine.accepted_length_counts).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_length_counts: tuple[int, ...] = ()
    # The prefix cache: slots only it holds (evictable), and since start the tokens admissions
    # looked up in it and found there.
    num_cached_slots: int = 0
    num_cache_queried_tokens: int = 0
    num_cache_hit_tokens: int = 0
    num_loras_resident: int = 0       # LoRA adapters in the workers' device pool
    # Tokens sent to the HTTP processes since start: with --api-server-count > 1 the status line's
    # generation throughput (each HTTP process streams only its own).
    num_output_tokens: int = 0

    @classmethod
    def total(cls, snapshots: list[EngineStats]) -> EngineStats:
        """Several engines' snapshots (data-parallel replicas) as one: every count added up."""
        total = cls()
        for s in snapshots:
            for f in dataclasses.fields(cls):
                mine, theirs = getattr(total, f.name), getattr(s, f.name)
                if isinstance(mine, tuple):     # counts per length: added length by length
                    setattr(total, f.name, tuple(a + b for a, b in itertools.zip_longest(mine, theirs, fillvalue=0)))
                else:
                    setattr(total, f.name, mine + theirs)
        return total


@dataclass
class EngineOutputs:
    deltas: list[RequestDelta] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    num_step_tokens: int = 0          # tokens the step sent in this turn fed; 0: no step was sent


@dataclass
class StepFailed:
    """A step raised for no request of its own (a bug of ours): these requests were ended."""
    req_ids: list[int]
    error: str


@dataclass
class LoraUpdated:
    call_id: int
    error: str | None = None          # None: done
    not_found: bool = False           # unloading a name that is not loaded


@dataclass
class LoraChanged:
    """Another HTTP process loaded adapter ``name`` from ``path`` (None: unloaded it): every HTTP
    process serves the same adapters."""
    name: str
    path: str | None


@dataclass
class Pong:
    """The answer to a ``Ping``."""


@dataclass
class EngineDead:
    """The engine cannot go on (a worker died); the core exits after sending this."""
    error: str


# -- framing -------------------------------------------------------------------------------

def encode(message: object) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class FrameBuffer:
    """Bytes as they arrive from a socket in, whole messages out."""

    HEADER_SIZE = _HEADER.size

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[object]:
        self._buf += data
        messages = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            end = _HEADER.size + size
            if len(self._buf) < end:
                break
            messages.append(pickle.loads(self._buf[_HEADER.size:end]))
            del self._buf[:end]
        return messages


def frame_size(header: bytes) -> int:
    return _HEADER.unpack(header)[0]
