"""What every route handler shares: the router, the tokenizer, the limits, the metrics."""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request as HTTPRequest

from llmserve.chat_template import BaseTemplate, ChatTemplateError, ChosenTemplate, StopWords, choose_chat_template
from llmserve.chat_template.base import Message
from llmserve.chat_template.jinja import JinjaTemplate
from llmserve.engine.admission import RequestLimits, check_request
from llmserve.generation_config import SamplingDefaults, load_sampling_defaults
from llmserve.multimodal import ImageLimits, ImageProcessor, decode_image, expand_image_tokens
from llmserve.sampling_params import InvalidRequest, SamplingParams, check_ranges
from llmserve.server.api.errors import (
    APIError, APIFields, generation_error, overloaded_error, template_error, validation_error,
)
from llmserve.server.api.media import MediaConfig, load_image_bytes
from llmserve.server.api.schema import MAX_INPUT_CHARS
from llmserve.server.metrics import RequestOutcome, ServerMetrics
from llmserve.server.sessions import SessionStore
from llmserve.server.data_parallel import DataParallelEngineClient
from llmserve.server.engine_client import EngineClient, EngineError, RequestStream, TokenEvent
from llmserve.tool_parsers import ToolParser, parser_for_template_source, tool_parser

if TYPE_CHECKING:
    import numpy as np

# A text longer than this many characters per allowed token is first tokenized by its head
# (see ServerState.encode); real text averages 3-5 characters per token.
_HEAD_CHARS_PER_TOKEN = 8
# Threads that tokenize prompts (each with its own tokenizer copy): a long prompt on one does not
# hold up the short ones on the other.
TOKENIZER_THREADS = 2
_HEAD_MARGIN_TOKENS = 8


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_concurrent_requests: int = 128     # client requests in flight; beyond: 429
    max_model_len: int | None = None       # prompt + max_new_tokens; None: what the model and KV pool allow
    max_input_tokens: int | None = None    # None: max_model_len - 1
    max_top_n_tokens: int = 5
    max_best_of: int = 2                   # TGI's best_of limit (its --max-best-of, and its default)
    full_text_enabled: bool = False        # seed 004's fullTextEnabled: TGI stream events carry the text so far
    served_model_name: str | None = None   # None: the model file or directory name
    chat_template: str | None = None       # a registry name, .json or .jinja file; None: the model's own or a match
    generation_config: str = "auto"        # sampling defaults: auto (the model's), none/vllm, or a folder
    payload_limit: int | None = None       # request body bytes; None: middleware.DEFAULT_PAYLOAD_LIMIT
    # Image input (models that take images): see server/api/media.py
    max_images_per_request: int = 1
    max_image_bytes: int = ImageLimits.max_bytes
    max_image_pixels: int = ImageLimits.max_pixels
    allowed_local_media_path: str | None = None   # None: requests may not name local files
    allowed_media_domains: tuple[str, ...] = ()    # hosts image URLs may name; "*": any; (): none
    tool_call_parser: str | None = None    # how answers write tool calls (tool_choice "auto"); None: from the chat template
    # /v1/chat/interactive (server/sessions.py): sessions kept at once, and how long an idle one lives
    max_sessions: int = 256
    session_idle_timeout: float = 600.0
    ui: bool = True                        # the chat page at GET / (server/api/ui.py); off: --no-ui
    # --api-server-count: the HTTP processes serving the port (server/api_servers.py), and this
    # one's index among them (0: the launcher). Limits such as --max-concurrent-requests hold per process.
    api_server_count: int = 1
    api_server: int = 0


@dataclass
class Limits:
    request: RequestLimits              # what one generation may be (engine/admission.py)
    max_concurrent_requests: int
    max_top_n_tokens: int
    max_best_of: int

    @property
    def max_model_len(self) -> int:
        return self.request.max_model_len

    @property
    def max_input_tokens(self) -> int:
        return self.request.max_input_tokens


class ServerState:
    def __init__(self, config: ServerConfig, engine: EngineClient | DataParallelEngineClient, metrics: ServerMetrics,
                 chat_template: ChosenTemplate | None = None, sampling_defaults: SamplingDefaults | None = None):
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.model_path = engine.model_path
        self.model_name = config.served_model_name or default_model_name(self.model_path)
        # The names an OpenAI request may use for this model.
        self.model_names = frozenset({self.model_name, self.model_path, os.path.basename(self.model_path)})
        # The LoRA adapters served (--lora-modules): name -> directory. An OpenAI request selects
        # one by its `model`, a TGI request by `adapter_id`.
        self.lora_modules: dict[str, str] = dict(engine.config.lora_modules)
        engine.watch_loras(self._lora_changed)      # another HTTP process's runtime load or unload
        self.started_at = int(time.time())
        # HF fast tokenizers must not be used by two threads at once ("Already borrowed"): the
        # event loop uses the client's tokenizer (single-token texts, echo), and prompts are
        # tokenized on TOKENIZER_THREADS threads, each with a copy of its own (tokenize_in_thread).
        # Detokenization runs on the event loop too (the engine client's reader task).
        self.tokenizer = engine.tokenizer
        self._thread_tokenizers = threading.local()
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="llmserve-tokenize",
                                                  initializer=self._give_thread_a_tokenizer)
        self._start_tokenizer_threads()
        # chat_template: what --chat-template loaded at start-up, or None to use the model's own
        self.chat_template = choose_chat_template(chat_template, self.tokenizer, self.model_path)
        self.chat_stop = self.chat_template.stop_words(self.tokenizer) if self.chat_template else StopWords()
        self.tool_parser = auto_tool_parser(config.tool_call_parser, self.chat_template)
        # Values for the sampling fields a request leaves unset (see generation_config.py); serve
        # loads them before the model, so that a bad --generation-config fails fast.
        self.sampling_defaults = (sampling_defaults if sampling_defaults is not None
                                  else load_sampling_defaults(config.generation_config, self.model_path))
        info = engine.info
        self.info = info
        self.limits = Limits(RequestLimits.of_model(info, config.max_model_len, config.max_input_tokens,
                                                    config.max_images_per_request),
                             config.max_concurrent_requests, config.max_top_n_tokens, config.max_best_of)
        self.media = MediaConfig(ImageLimits(config.max_images_per_request, config.max_image_bytes, config.max_image_pixels),
                                 config.allowed_local_media_path,
                                 frozenset(d.lower() for d in config.allowed_media_domains))
        # the model's own image preprocessing; None for a text-only model
        self.image_processor = ImageProcessor(self.model_path) if info.image_token_id is not None else None
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.sessions = SessionStore(config.max_sessions, config.session_idle_timeout, engine.end_session)
        self._in_flight = 0

    # -- admission -------------------------------------------------------------------
    def admit(self, generations: int = 1) -> Slot:
        """Take one concurrency slot per generation a client request asks for (prompts x n), or
        raise the 429 TGI gives; a request that asks for more than the server ever runs at
        once is refused outright, since waiting would not help."""
        limit = self.limits.max_concurrent_requests
        if generations > limit:
            raise validation_error(f"the request asks for {generations} generations (prompts x n); this server "
                                   f"runs at most {limit} at once (--max-concurrent-requests)")
        if self._in_flight + generations > limit:
            self.metrics.count(RequestOutcome.OVERLOADED)
            raise overloaded_error()
        self._in_flight += generations
        self.metrics.in_flight.inc(generations)
        return Slot(self, generations)

    def _release(self, generations: int) -> None:
        self._in_flight -= generations
        self.metrics.in_flight.dec(generations)

    def _lora_changed(self, name: str, path: str | None) -> None:
        if path is None:
            self.lora_modules.pop(name, None)
        else:
            self.lora_modules[name] = path

    # -- tokens ----------------------------------------------------------------------
    def encode(self, text: str, param: str = "inputs", add_special_tokens: bool = True,
               check_size: bool = True) -> list[int]:
        """A prompt's tokens; with ``check_size``, refused (422) as soon as it cannot fit
        ``max_input_tokens`` (see ``check_size``)."""
        if check_size:
            self.check_size(text, param, add_special_tokens)
        else:
            _check_chars(text, param)
        return self._tokenize(text, param, add_special_tokens)

    def check_size(self, text: str, param: str, add_special_tokens: bool = True) -> None:
        """Refuse a text that cannot fit ``max_input_tokens`` without tokenizing it whole.

        Tokenizing costs microseconds per character, so beyond ``MAX_INPUT_CHARS`` a text is
        refused outright, and a long one is judged first by its head: a text has at least
        about as many tokens as any head of it.
        """
        limit = self.limits.max_input_tokens
        _check_chars(text, param)
        head_chars = _HEAD_CHARS_PER_TOKEN * (limit + 1)
        if len(text) > head_chars:
            head = self._tokenize(text[:head_chars], param, add_special_tokens)
            # Cutting the text can split a word, so the head may have a token or two more
            # than the same characters have inside the whole text: keep a margin.
            if len(head) > limit + _HEAD_MARGIN_TOKENS:
                raise validation_error(f"`{param}` must have less than {limit + 1} tokens. "
                                       f"Given: more than {len(head) - _HEAD_MARGIN_TOKENS}", param)

    async def tokenize_in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (``encode``, ``encode_chat``, ...) on a tokenizer thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, functools.partial(fn, *args))

    def _give_thread_a_tokenizer(self) -> None:
        self._thread_tokenizers.tokenizer = copy.deepcopy(self.tokenizer)

    def _start_tokenizer_threads(self) -> None:
        """Start every tokenizer thread now, each copying its tokenizer (0.16 s for SmolLM2's), so
        that the first requests after start-up do not wait for the copies. The pool makes a thread
        per task while none is idle: each task waits at a barrier until all are running."""
        barrier = threading.Barrier(TOKENIZER_THREADS)
        for started in [self._tokenizer_pool.submit(barrier.wait, 60) for _ in range(TOKENIZER_THREADS)]:
            started.result()

    @property
    def thread_tokenizer(self) -> Any:
        """The calling tokenizer thread's own tokenizer."""
        return self._thread_tokenizers.tokenizer

    def _tokenize(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        return self.tokenize_fully(text, param, add_special_tokens=add_special_tokens).input_ids

    def tokenize_fully(self, text: str, param: str, **options: Any) -> Any:
        """The calling tokenizer thread's encoding of ``text`` (ids, and offsets if asked); the
        tokenizer's own refusal of a text is the client's error."""
        try:
            return self.thread_tokenizer(text, **options)
        except Exception as e:
            raise validation_error(f"`{param}` could not be tokenized: {e}", param) from None

    def require_chat_template(self, param: str = "messages") -> None:
        """A 422 naming ``param`` unless the server has a chat template to render conversations with."""
        if self.chat_template is None:
            raise template_error("this model has no chat template: start the server with --chat-template "
                                 "NAME, FILE.json or FILE.jinja", param)

    def encode_chat(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt tokens of a conversation (and the tools it may call), ending where the
        assistant's answer starts."""
        self.require_chat_template()
        try:
            text = self.chat_template.render(messages, tools)
        except ChatTemplateError as e:
            raise template_error(str(e)) from None
        return self.encode(text, "messages", self.chat_template.template.add_special_tokens)

    # -- images ----------------------------------------------------------------------
    @property
    def takes_images(self) -> bool:
        return self.image_processor is not None

    async def load_images(self, urls: list[str], fields: APIFields) -> list[np.ndarray] | None:
        """The pixel values of a request's images (fetched or decoded, then the model's own
        preprocessing, off the event loop); None when it has none. Any bad image is the request's
        4xx, before it costs the engine anything."""
        if not urls:
            return None
        try:
            if self.image_processor is None:
                raise InvalidRequest("image", "this model takes text only: images are not supported")
            limits = self.media.limits
            if len(urls) > limits.max_images:
                raise InvalidRequest("image", f"at most {limits.max_images} image(s) per request "
                                              f"(--max-images-per-request); got {len(urls)}")
            data = [await load_image_bytes(url, self.media) for url in urls]
            return await asyncio.get_running_loop().run_in_executor(None, self._preprocess, data)
        except InvalidRequest as e:
            raise fields.error(e) from None

    def _preprocess(self, data: list[bytes]) -> list[np.ndarray]:
        return self.image_processor([decode_image(d, self.media.limits) for d in data])

    def expand_images(self, prompt_token_ids: list[int]) -> list[int]:
        """A tokenized prompt with each image placeholder expanded to its image's token count (the
        prompt the model runs, which the limits are checked against); unchanged for a text-only model."""
        info = self.info
        if info.image_token_id is None:
            return prompt_token_ids
        return expand_image_tokens(prompt_token_ids, info.image_token_id, info.tokens_per_image)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def room_for(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate."""
        return self.limits.request.room_for(num_prompt_tokens)

    def sampling_fields(self, api: str, request: Mapping[str, Any],
                        template: BaseTemplate | None = None) -> dict[str, Any]:
        """The sampling fields of a request's SamplingParams: its own values (None: unset) checked
        where ``api``'s documentation narrows their range, the unset ones resolved
        (``SamplingDefaults.resolve``: the model's, then ``template``'s, then the API's), and top_k
        held to the vocabulary, since a larger one cuts nothing. Raises ``InvalidRequest``."""
        check_ranges(request, api)
        values = self.sampling_defaults.resolve(request, template)
        values["top_k"] = min(values["top_k"], self.info.vocab_size)
        return values

    def start_all(self, jobs: list[tuple[list[int], SamplingParams]], fields: APIFields,
                  pixel_values: list[np.ndarray] | None = None, session_id: str | None = None,
                  lora_name: str | None = None) -> tuple[list[RequestStream], Slot]:
        """Admit one client request and queue its generations (one per prompt and choice).

        This is where a request is checked against the engine's rules, once (check_request);
        the engine core trusts what it is sent. ``fields`` names the API's fields in the errors.
        ``pixel_values``: the request's images (``load_images``), shared by its generations;
        ``session_id``: the interactive session it is a turn of (server/sessions.py); ``lora_name``:
        the LoRA adapter it runs with (one of ``lora_modules``, checked by the API; None: the base
        model)."""
        for prompt, params in jobs:
            try:
                check_request(prompt, params, self.limits.request, len(pixel_values or ()))
            except InvalidRequest as e:
                raise fields.error(e) from None
        slot = self.admit(len(jobs))
        try:
            return self._start(jobs, pixel_values, session_id, lora_name), slot
        except APIError:
            slot.release()
            raise

    def _start(self, jobs: list[tuple[list[int], SamplingParams]], pixel_values: list[np.ndarray] | None,
               session_id: str | None, lora_name: str | None) -> list[RequestStream]:
        """Queue a request's admitted generations, all on one data-parallel replica (the router's
        choice for its first prompt: n choices share their prompt's cache); a dead engine is a 424."""
        streams: list[RequestStream] = []
        try:
            engine = self.engine.route(jobs[0][0], session_id, lora_name)
            for prompt, params in jobs:
                streams.append(engine.generate(prompt, params, pixel_values, session_id, lora_name))
        except EngineError as e:
            for s in streams:
                s.abort()
            raise generation_error(str(e)) from None
        return streams

    async def complete(self, jobs: list[tuple[list[int], SamplingParams]], fields: APIFields,
                       http_request: HTTPRequest, pixel_values: list[np.ndarray] | None = None,
                       lora_name: str | None = None) -> tuple[list[RequestStream], list[list[TokenEvent]]]:
        """A non-streaming request, run to the end: its streams and each one's events."""
        streams, slot = self.start_all(jobs, fields, pixel_values, lora_name=lora_name)
        return streams, await self.run_to_end(streams, slot, http_request)

    async def run_to_end(self, streams: list[RequestStream], slot: Slot,
                         http_request: HTTPRequest) -> list[list[TokenEvent]]:
        """Each started stream's events, once all have ended; the slot is given back."""
        try:
            events = await collect(streams, http_request, self)
        except EngineError as e:
            self.metrics.count(RequestOutcome.ERROR)
            raise generation_error(str(e)) from None
        finally:
            slot.release()
        self.metrics.count(RequestOutcome.SUCCESS)
        return events


def auto_tool_parser(name: str | None, chosen: ChosenTemplate | None) -> ToolParser | None:
    """The parser for answers that may call tools: --tool-call-parser's, else the one the chat
    template's tool format implies (a built-in's, or the tags a Jinja template writes)."""
    if name is None and chosen is not None:
        template = chosen.template
        if isinstance(template, JinjaTemplate):
            name = parser_for_template_source(template.source)
        elif getattr(template, "tool_format", None) is not None:
            name = template.tool_format.parser
    return tool_parser(name) if name is not None else None


def _check_chars(text: str, param: str) -> None:
    if len(text) > MAX_INPUT_CHARS:
        raise validation_error(f"`{param}` must have at most {MAX_INPUT_CHARS} characters. Given: {len(text)}", param)


def default_model_name(model_path: str) -> str:
    """``/models/SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.Q4_1``."""
    return os.path.basename(model_path.rstrip(os.sep)).removesuffix(".gguf")


def json_logprob(value: float | None) -> float | None:
    """JSON has no -inf: a token the model rules out entirely gets a very negative number instead."""
    return None if value is None else max(value, -9999.0)


def fresh_seed() -> int:
    """A seed for a sampling request that did not bring one, so that it can be reported back; never
    0, which TGI's seed range (0, 2^64-1] leaves out, so that sending it back always works."""
    return 1 + secrets.randbelow(2**63 - 1)


class Slot:
    """One client request's share of --max-concurrent-requests; release() is idempotent."""

    def __init__(self, state: ServerState, generations: int):
        self._state: ServerState | None = state
        self.generations = generations

    def release(self) -> None:
        if self._state is not None:
            self._state._release(self.generations)
            self._state = None


async def collect(streams: list[RequestStream], http_request: HTTPRequest, state: ServerState) -> list[list[TokenEvent]]:
    """Run streams to the end for a non-streaming response. If the client disconnects first, abort
    them (their KV slots are freed at once) and raise CancelledError."""

    async def drain(stream: RequestStream) -> list[TokenEvent]:
        return [event async for event in stream]

    results = asyncio.gather(*(drain(s) for s in streams))
    watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        done, _ = await asyncio.wait([results, watcher], return_when=asyncio.FIRST_COMPLETED)
        if results in done:
            return results.result()       # raises EngineError if the engine failed
        state.metrics.count(RequestOutcome.ABORTED)
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()
        results.cancel()
        for s in streams:
            s.abort()


async def _wait_for_disconnect(http_request: HTTPRequest, poll_s: float = 0.2) -> None:
    while not await http_request.is_disconnected():
        await asyncio.sleep(poll_s)


async def stream_with_cleanup(streams: list[RequestStream], events: AsyncIterator[Any], state: ServerState,
                              slot: Slot, error_items: Callable[[APIError], list[Any]]) -> AsyncIterator[Any]:
    """Wrap an SSE generator: count its outcome; if the engine fails, end with ``error_items``
    (the API's error event); whatever ends it (done, error, client gone, shutdown), abort the
    streams that are still running and give the concurrency slot back."""
    try:
        async with aclosing(events):
            try:
                async for item in events:
                    yield item
            except EngineError as e:
                state.metrics.count(RequestOutcome.ERROR)
                for item in error_items(generation_error(str(e))):
                    yield item
            else:
                state.metrics.count(RequestOutcome.SUCCESS)
    finally:
        if any(not s.finished for s in streams):
            state.metrics.count(RequestOutcome.ABORTED)
        for s in streams:
            s.abort()
        slot.release()
