"""Text Generation Inference's interface: /generate, /generate_stream, / (and /tokenize's TGI body).

Request fields, validation ranges and event shapes follow TGI (and the seed document): a
stream is one SSE event per token, the last one carrying ``generated_text`` and ``details``;
an error (a failed engine) is an event ``{"error": ..., "error_type": ...}``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request as HTTPRequest
from pydantic import ConfigDict, Field
from sse_starlette import EventSourceResponse

from llmserve.multimodal import IMAGE_PLACEHOLDER
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.server.api.errors import APIFields, validation_error
from llmserve.server.api.guided import tgi_guided_decoding
from llmserve.server.api.schema import MAX_STOP_SEQUENCES, APIModel, ImageURL, check_stop, image_url_of, stop_list
from llmserve.server.api.state import ServerState, fresh_seed, json_logprob, stream_with_cleanup
from llmserve.server.api.streaming import sse_response
from llmserve.server.engine_client import RequestStream, TokenEvent

if TYPE_CHECKING:
    import numpy as np

DEFAULT_MAX_NEW_TOKENS = 20   # TGI's documented default
MAX_INT32 = 2**31 - 1         # seed 004's upper bound of truncate and max_new_tokens (top_k's is SAMPLING_RULES')
__all__ = ["MAX_STOP_SEQUENCES", "build_router"]   # /info reports the stop limit


class TGIParameters(APIModel):
    model_config = ConfigDict(extra="ignore")

    adapter_id: str | None = None
    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool | None = None
    frequency_penalty: float | None = None
    grammar: Any = None
    ignore_eos: bool = False  # lightllm's and vLLM's: generate past EOS, to max_new_tokens or a stop string
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = False
    seed: int | None = None
    stop: list[str] | str | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False   # accepted and ignored: no watermarking here
    speculate: bool = True    # ours: false keeps this request off prompt-lookup drafts (--speculate)


class InputPart(APIModel):
    """One part of a multimodal ``inputs`` list: ``{"type": "text", "text": ...}`` or an image,
    ``{"type": "image_url", "image_url": URL}`` as seed 004 writes it, or OpenAI's
    ``{"image_url": {"url": URL}}`` (media.py: which URLs)."""
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: str | ImageURL | None = None


class TGIRequest(APIModel):
    inputs: str | list[InputPart]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


# TGI's inline image in a string input: a markdown image whose target is the URL.
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]*)\)")


def split_images(inputs: str | list[InputPart], takes_images: bool) -> tuple[str, list[str]]:
    """The prompt text, each image standing as ``<image>`` where it was, and the images' URLs in
    order. A list's parts are joined with nothing between them; in a string, a markdown image
    ``![](URL)`` is an image for a model that takes images (for a text-only one it is text)."""
    if isinstance(inputs, str):
        if not takes_images:
            return inputs, []
        urls = _MARKDOWN_IMAGE.findall(inputs)
        return _MARKDOWN_IMAGE.sub(IMAGE_PLACEHOLDER, inputs), urls
    text, urls = [], []
    for part in inputs:
        if part.type == "text":
            _check(part.text is not None, "an `inputs` part of type 'text' needs a `text` string")
            text.append(part.text)
        else:
            _check(part.image_url is not None, "an `inputs` part of type 'image_url' needs an `image_url`")
            text.append(IMAGE_PLACEHOLDER)
            urls.append(image_url_of(part.image_url))
    return "".join(text), urls


class TokenizeRequest(APIModel):
    inputs: str
    parameters: TGIParameters = Field(default_factory=TGIParameters)


# The engine's rules (SamplingParams, check_request) in TGI's words.
TGI_FIELDS = APIFields({"prompt": "inputs", "logprobs": "top_n_tokens", "prompt_logprobs": "decoder_input_details"},
                       quote=True)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise validation_error(message)


def sampling_params(p: TGIParameters, state: ServerState, num_prompt_tokens: int) -> SamplingParams:
    """TGI parameters -> SamplingParams. Checked here: TGI's own rules (the fields it does not
    support, its limits), in TGI's messages; the ranges of sampling numbers (SAMPLING_RULES, with
    TGI's narrower ones) and the engine's rules are SamplingParams' and check_request's, rendered
    in TGI's field names."""
    _check(p.max_new_tokens is None or p.max_new_tokens <= MAX_INT32, f"`max_new_tokens` must be <= {MAX_INT32}")
    lim = state.limits.max_top_n_tokens
    _check(p.top_n_tokens is None or 0 <= p.top_n_tokens <= lim,
           f"`top_n_tokens` must be >= 0 and <= {lim}. Given: {p.top_n_tokens}")
    stop = stop_list(p.stop)
    check_stop(stop)

    sample = wants_sampling(p)
    if p.max_new_tokens is None:
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, state.room_for(num_prompt_tokens))
    else:
        max_new_tokens = p.max_new_tokens
    guided_decoding = tgi_guided_decoding(p.grammar)
    try:
        sampling = state.sampling_fields("tgi", {
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "typical_p": p.typical_p,
            "repetition_penalty": p.repetition_penalty, "seed": p.seed})
        return SamplingParams(
            # the model's recommended values never turn a greedy request into a sampling one
            **sampling | ({} if sample else {"temperature": 0.0}),
            max_new_tokens=max_new_tokens,
            frequency_penalty=p.frequency_penalty or 0.0,
            seed=(p.seed or fresh_seed()) if sample else None,
            stop=stop, ignore_eos=p.ignore_eos,
            logprobs=p.top_n_tokens or 0,                       # TGI always reports each token's logprob
            prompt_logprobs=0 if p.decoder_input_details else None,
            guided_decoding=guided_decoding, speculate=p.speculate,
        )
    except InvalidRequest as e:
        raise TGI_FIELDS.error(e) from None


def lora_of(p: TGIParameters, state: ServerState) -> str | None:
    """The LoRA adapter ``adapter_id`` names (seed 004's default "None": the base model)."""
    if p.adapter_id in (None, "None"):
        return None
    served = ", ".join(state.lora_modules) or "none: this server serves no LoRA adapters"
    _check(p.adapter_id in state.lora_modules, f"adapter `{p.adapter_id}` is not loaded (served: {served})")
    return p.adapter_id


def wants_sampling(p: TGIParameters) -> bool:
    """TGI samples when asked to, or when any warper is set (the text-generation client always
    sends do_sample=false, and a temperature of 0.7 there still means sampling). A temperature or
    typical_p of 1.0 changes nothing, so it does not count."""
    return bool(p.do_sample) or any(v is not None and v != 1.0 for v in (p.temperature, p.typical_p)) or any(
        v is not None for v in (p.top_k, p.top_p))


def best_of_params(p: TGIParameters, params: SamplingParams, state: ServerState, stream: bool) -> list[SamplingParams]:
    """``best_of`` samples of one request, each with a seed of its own (TGI's rules: sampling only,
    no seed of the client's, no streaming, at most --max-best-of)."""
    best_of = 1 if p.best_of is None else p.best_of
    limit = state.limits.max_best_of
    _check(best_of > 0, "`best_of` must be strictly positive")
    _check(best_of <= limit, f"`best_of` must be <= {limit} (--max-best-of). Given: {best_of}")
    if best_of > 1:
        _check(wants_sampling(p), "you must use sampling when `best_of` is > 1")
        _check(p.seed is None, "`seed` must not be set when `best_of` is > 1")
        _check(not stream, "`best_of` != 1 is not supported when streaming tokens")
    return [params] + [dataclasses.replace(params, seed=fresh_seed()) for _ in range(best_of - 1)]


@dataclasses.dataclass
class Prepared:
    """A request ready to start: its prompt's tokens, the SamplingParams of each of its
    generations (``best_of`` of them), its images' pixel values and its LoRA adapter."""
    prompt_token_ids: list[int]
    params: list[SamplingParams]
    pixel_values: list[np.ndarray] | None = None
    lora_name: str | None = None


async def prepare(body: TGIRequest, state: ServerState, stream: bool) -> Prepared:
    _check(body.inputs not in ("", []), "`inputs` cannot be empty")
    p = body.parameters
    lora_name = lora_of(p, state)
    # Seed 004: any truncate in (0, 2^31-1]; one of the prompt's length or more cuts nothing.
    _check(p.truncate is None or 0 < p.truncate <= MAX_INT32, f"`truncate` must be in (0, {MAX_INT32}]. Given: {p.truncate}")
    text, urls = split_images(body.inputs, state.takes_images)
    # With truncate, a long input is cut to its last tokens rather than refused.
    ids = await state.tokenize_in_thread(state.encode, text, "inputs", True, p.truncate is None)
    ids = state.expand_images(ids)
    if p.truncate is not None:
        ids = ids[-p.truncate:]
    pixel_values = await state.load_images(urls, TGI_FIELDS)
    return Prepared(ids, best_of_params(p, sampling_params(p, state, len(ids)), state, stream), pixel_values, lora_name)


def tokenize_with_offsets(state: ServerState, text: str) -> Any:
    """/tokenize's encoding (ids and character offsets), within the same bounds as a prompt."""
    state.check_size(text, "inputs")
    return state.tokenize_fully(text, "inputs", return_offsets_mapping=True)


async def tokenize(state: ServerState, body: TokenizeRequest) -> list[dict[str, Any]]:
    """TGI's /tokenize (the route, shared with vLLM's body, is in tokenization.py): each token
    with its id, its text and its character span in ``inputs``."""
    _check(body.inputs != "", "`inputs` cannot be empty")
    enc = await state.tokenize_in_thread(tokenize_with_offsets, state, body.inputs)
    return [{"id": tid, "text": body.inputs[start:stop], "start": start, "stop": stop}
            for tid, (start, stop) in zip(enc.input_ids, enc.offset_mapping)]


# -- response pieces ---------------------------------------------------------------------

def token_json(state: ServerState, token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
    return {"id": token_id, "text": text, "logprob": json_logprob(logprob), "special": token_id in state.special_ids}


def top_tokens_json(state: ServerState, event: TokenEvent) -> list[dict[str, Any]]:
    return [token_json(state, tid, state.token_text(tid), lp) for tid, lp in (event.top_logprobs or [])]


def prefill_json(state: ServerState, stream: RequestStream) -> list[dict[str, Any]]:
    req = stream.request
    logprobs = req.prompt_logprobs or [None] * req.num_prompt_tokens
    return [{"id": tid, "text": state.token_text(tid), "logprob": json_logprob(lp)}
            for tid, lp in zip(req.prompt_token_ids, logprobs)]


def tokens_json(state: ServerState, stream: RequestStream, events: list[TokenEvent]) -> list[dict[str, Any]]:
    """Each generated token with its own text (never shifted by a stop string's hold-back)."""
    texts = stream.request.output_token_texts
    return [token_json(state, e.token_id, text, e.logprob) for e, text in zip(events, texts)]


def details_json(state: ServerState, p: TGIParameters, stream: RequestStream, events: list[TokenEvent]) -> dict[str, Any]:
    return stream_details(stream) | {
        "prefill": prefill_json(state, stream) if p.decoder_input_details else [],
        "tokens": tokens_json(state, stream, events),
        "top_tokens": [top_tokens_json(state, e) for e in events] if p.top_n_tokens else None,
    }


def logprob_sum(events: list[TokenEvent]) -> float:
    """What best_of ranks samples by (as TGI): the sum of their tokens' logprobs."""
    return sum(e.logprob for e in events if e.logprob is not None)


def stream_details(stream: RequestStream) -> dict[str, Any]:
    req = stream.request
    return {"finish_reason": req.finish_reason.value, "generated_tokens": req.num_output_tokens,
            "seed": req.params.seed, "input_length": req.num_prompt_tokens, "prompt_tokens": req.num_prompt_tokens}


def generated_text(body: TGIRequest, stream: RequestStream) -> str:
    inputs = body.inputs if isinstance(body.inputs, str) else "".join(
        part.text if part.type == "text" else IMAGE_PLACEHOLDER for part in body.inputs)
    prefix = inputs if body.parameters.return_full_text else ""
    return prefix + stream.request.output_text


# -- routes ------------------------------------------------------------------------------

def build_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    async def generate_json(body: TGIRequest, http_request: HTTPRequest) -> dict[str, Any]:
        job = await prepare(body, state, stream=False)
        streams, all_events = await state.complete([(job.prompt_token_ids, sp) for sp in job.params], TGI_FIELDS,
                                                   http_request, job.pixel_values, job.lora_name)
        best = max(range(len(streams)), key=lambda i: logprob_sum(all_events[i]))
        response: dict[str, Any] = {"generated_text": generated_text(body, streams[best])}
        p = body.parameters
        if p.details or p.decoder_input_details:
            others = [details_json(state, p, s, ev) | {"generated_text": generated_text(body, s)}
                      for i, (s, ev) in enumerate(zip(streams, all_events)) if i != best]
            response["details"] = details_json(state, p, streams[best], all_events[best]) | {
                "best_of_sequences": others or None}
        return response

    async def generate_sse(body: TGIRequest) -> EventSourceResponse:
        _check(not body.parameters.decoder_input_details,
               "`decoder_input_details` == true is not supported when streaming tokens")
        job = await prepare(body, state, stream=True)
        [stream], slot = state.start_all([(job.prompt_token_ids, job.params[0])], TGI_FIELDS, job.pixel_values,
                                         lora_name=job.lora_name)
        full_text = state.config.full_text_enabled

        async def events():
            # A token's event waits until all of its text is safe to show (no stop string can
            # start in it any more): the stop hold-back delays events, it never moves text from
            # one token to another. The last event lets out whatever is still waiting.
            request = stream.request
            waiting: list[TokenEvent] = []
            streamed_chars = shown_chars = 0     # safe text so far; text of the events sent
            index = 0
            async for event in stream:
                streamed_chars += len(event.text)
                waiting.append(event)
                last = event.finish_reason is not None
                while waiting:
                    text = request.output_token_texts[index]
                    if not last and shown_chars + len(text) > streamed_chars:
                        break
                    e = waiting.pop(0)
                    index += 1
                    shown_chars += len(text)
                    done = last and not waiting
                    if full_text:     # seed 004's fullTextEnabled: each event carries the text so far
                        text = request.output_text[:shown_chars]
                    yield {
                        "index": index,
                        "token": token_json(state, e.token_id, text, e.logprob),
                        "top_tokens": top_tokens_json(state, e),
                        "generated_text": generated_text(body, stream) if done else None,
                        "details": stream_details(stream) if done and body.parameters.details else None,
                    }

        return sse_response(stream_with_cleanup([stream], events(), state, slot,
                                                error_items=lambda error: [error.tgi_body()]))

    @router.post("/generate")
    async def generate(body: TGIRequest, http_request: HTTPRequest):
        return await generate_json(body, http_request)

    @router.post("/generate_stream")
    async def generate_stream(body: TGIRequest):
        return await generate_sse(body)

    @router.post("/")
    async def compat_generate(body: TGIRequest, http_request: HTTPRequest):
        # TGI's root route answers a list, as the HF Inference API did.
        if body.stream:
            return await generate_sse(body)
        return [await generate_json(body, http_request)]

    return router
