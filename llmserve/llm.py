"""The offline API: ``LLM(...).generate(prompts, params)`` for scripts, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, Union

from llmserve.chat_template import ChosenTemplate, StopWords, choose_chat_template, load_chat_template
from llmserve.chat_template.base import Message
from llmserve.generation_config import load_sampling_defaults
from llmserve.engine.config import EngineConfig, inspect_model, resolve_model_path
from llmserve.engine.engine import LLMEngine
from llmserve.engine.request import RequestDelta
from llmserve.engine.worker_client import ModelWorkerGroup
from llmserve.output import ClientRequest
from llmserve.multimodal import ImageLimits, ImageProcessor, decode_image, expand_image_tokens
from llmserve.sampling_params import InvalidRequest, SamplingParams
from llmserve.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image


class MultimodalPrompt(TypedDict):
    """A prompt with images: ``prompt`` marks each image's place with ``<image>`` (text), or holds
    each image's placeholder tokens already expanded (token ids); ``images`` are in that order,
    PIL images or encoded bytes (jpg, png, webp...)."""
    prompt: str | list[int]
    images: list[Image.Image | bytes]


Prompt = Union[str, list[int], MultimodalPrompt]


@dataclass
class RequestOutput:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None                       # per generated token, when asked for
    finish_reason: str                                 # length | eos_token | stop_sequence | error
    prompt_token_ids: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Per prompt token when params.prompt_logprobs was set (None for the first token).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # Why this prompt failed (finish_reason "error"), e.g. parameters the sampler cannot use; the
    # other prompts of the call are unaffected. Its text and tokens are what came before.
    error: str | None = None
    # Prompt tokens taken from the prefix cache (not computed again), as vLLM's RequestOutput.
    num_cached_tokens: int | None = None

    @classmethod
    def from_request(cls, req: ClientRequest) -> RequestOutput:
        wants = req.params.logprobs is not None
        return cls(
            text=req.output_text, token_ids=list(req.output_token_ids),
            logprobs=list(req.output_logprobs) if wants else None, finish_reason=req.finish_reason.value,
            prompt_token_ids=list(req.prompt_token_ids), top_logprobs=list(req.output_top_logprobs) if wants else None,
            prompt_logprobs=req.prompt_logprobs, prompt_top_logprobs=req.prompt_top_logprobs, error=req.error,
            num_cached_tokens=req.num_cached_tokens,
        )


class LLM:
    """A model served by worker processes (one per tensor-parallel rank) behind the same
    continuous-batching scheduler the HTTP server uses. All prompts of a ``generate`` call run
    together. A prompt that fails on its own (say, parameters the sampler cannot use) does not
    raise: its output has ``finish_reason == "error"`` and ``error`` set, and the other prompts
    complete as if it had not been there."""

    def __init__(self, model: str | None = None, tp: int = 1, dtype: str | None = None,
                 max_total_token_num: int | None = None, chat_template: str | None = None,
                 generation_config: str = "auto", **engine_options):
        """``chat_template``: as ``llmserve serve --chat-template`` (a built-in name, a .json or
        .jinja file; None: the model's own template, else one matched from its name).
        ``generation_config``: as ``llmserve serve --generation-config``; its values make the
        SamplingParams of a ``generate``/``chat`` call that passes none (as vLLM's LLM does)."""
        loaded = load_chat_template(chat_template) if chat_template else None
        model_path = resolve_model_path(model)
        self.sampling_defaults = load_sampling_defaults(generation_config, model_path)
        config = EngineConfig(model=model, tp=tp, dtype=dtype, max_total_token_num=max_total_token_num, **engine_options)
        workers = ModelWorkerGroup.of(config)  # first: they import torch and the model code while the tokenizer loads
        try:
            self.tokenizer = load_tokenizer(model_path)
            self.engine = LLMEngine(config, inspect_model(config, self.tokenizer), workers)
        except BaseException:
            workers.close()
            raise
        self.chat_template = choose_chat_template(loaded, self.tokenizer, self.engine.model_path)
        # the model's own image preprocessing (LLaVA); None for a text-only model
        self.image_processor = ImageProcessor(model_path) if self.engine.info.image_token_id is not None else None

    @property
    def chat_template(self) -> ChosenTemplate | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, chosen: ChosenTemplate | None) -> None:
        # Its stop words are tokenized here, once per template, not on every chat() (as the server does at start-up).
        self._chat_template = chosen
        self._chat_stop = chosen.stop_words(self.tokenizer) if chosen else StopWords()

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """``prompts``: text, token ids, or ``{"prompt": ..., "images": [...]}`` for a model that
        takes images (see ``MultimodalPrompt``); one or a list. ``lora``: the LoRA adapter (a name
        of ``lora_modules``) for every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = self.default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA adapters")
        inputs = [self._model_input(p) for p in prompts]
        # all validated before any is queued
        requests = [self.engine.new_request(ids, p, pixels, name) for (ids, pixels), p, name in zip(inputs, params, loras)]
        outputs = {r.req_id: ClientRequest.start(r.req_id, r.prompt_token_ids, r.params, self.tokenizer) for r in requests}
        for r in requests:
            self.engine.enqueue(r)
        try:
            while any(not out.is_finished for out in outputs.values()):
                for delta in self.engine.step():
                    out = outputs.get(delta.req_id)    # None: a request someone queued on the engine itself
                    if out is not None and not out.is_finished and out.apply(delta):   # it ended here: a stop string, say
                        self.engine.abort_request(delta.req_id)
        except BaseException:
            for r in requests:   # nothing of this call stays queued (a Ctrl-C, a dead worker)
                self.engine.abort_request(r.req_id)
            raise
        self.engine.flush()
        return [RequestOutput.from_request(outputs[r.req_id]) for r in requests]

    def _model_input(self, prompt: Prompt) -> tuple[list[int], list[np.ndarray] | None]:
        """The token ids the model runs (a text prompt's image placeholders expanded) and the
        images' pixel values."""
        if not isinstance(prompt, dict):
            return (self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)), None
        text, images = prompt["prompt"], prompt.get("images") or []
        if images and self.image_processor is None:
            raise InvalidRequest("image", "this model takes text only: images are not supported")
        if not isinstance(text, str):
            return list(text), self._pixel_values(images)
        info = self.engine.info
        ids = self.tokenizer(text).input_ids
        if info.image_token_id is not None:
            ids = expand_image_tokens(ids, info.image_token_id, info.tokens_per_image)
        return ids, self._pixel_values(images)

    def _pixel_values(self, images: list) -> list[np.ndarray] | None:
        if not images:
            return None
        limits = ImageLimits(max_images=len(images))
        return self.image_processor([decode_image(im, limits) if isinstance(im, bytes) else im.convert("RGB")
                                     for im in images])

    def default_sampling_params(self, chat: bool = False) -> SamplingParams:
        """The SamplingParams of a call that passes none: the model's recommended sampling (see
        generation_config.py), then, for ``chat``, the chat template's, as the server's
        completions and chat routes resolve a request that sets no sampling field."""
        template = self.chat_template.template if chat and self.chat_template else None
        return SamplingParams(**self.sampling_defaults.resolve({}, template))

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        """The prompt tokens of an OpenAI-style conversation, through the chat template."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: pass chat_template= (a built-in name or a file)")
        return self.chat_template.encode(self.tokenizer, messages)

    def chat(self, messages: list[Message], params: SamplingParams | None = None) -> RequestOutput:
        """Answer a conversation; the template's stop words end the answer too."""
        params = self._chat_stop.add_to(params or self.default_sampling_params(chat=True))
        (out,) = self.generate([self.chat_prompt(messages)], params)
        return out

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (as vLLM's ``LLM.reset_prefix_cache``); the slots freed."""
        freed = self.engine.reset_prefix_cache()
        self.engine.flush()   # the workers drop the slots now
        return freed

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
