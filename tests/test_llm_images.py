"""The offline LLM with image prompts on the tiny LLaVA: HF's greedy tokens through the whole
engine path (front-end preprocessing, pixel values pickled to the worker, features written at
the placeholders), beside text-only prompts; image features computed once per request across
chunked prefill and preemption, and freed when it finishes; a text-only model refuses images."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from llmserve import LLM, SamplingParams
from llmserve.engine.config import EngineConfig
from llmserve.engine.engine import LLMEngine
from llmserve.multimodal import expand_image_tokens
from llmserve.sampling_params import InvalidRequest
from llmserve.worker.model_worker import ModelWorker
from llmserve.worker.protocol import StepInput, StepOutput, WorkerInitArgs
from parity_utils import hf_llava_greedy

NEW_TOKENS = 6
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


PROMPTS = [
    {"prompt": "USER: <image>\nWhat is in the picture? ASSISTANT:", "images": [image(1)]},
    "Once upon a time",
    {"prompt": "Compare <image> with <image>:", "images": [image(2), png_bytes(image(3, (20, 64)))]},
]


@pytest.fixture(scope="module")
def llava_llm(tiny_llava):
    path, _ = tiny_llava
    with LLM(path, max_total_token_num=4096) as llm:
        yield llm


def hf_greedy(tiny_llava, llm: LLM, prompt) -> list[int]:
    """HF's greedy tokens for one prompt, preprocessed by the model's image processor as ours is."""
    path, hf = tiny_llava
    if isinstance(prompt, str):
        ids, pixels = llm.tokenizer(prompt).input_ids, None
    else:
        images = [Image.open(io.BytesIO(im)) if isinstance(im, bytes) else im for im in prompt["images"]]
        pixels = torch.from_numpy(np.stack(llm.image_processor([im.convert("RGB") for im in images])))
        info = llm.engine.info
        ids = expand_image_tokens(llm.tokenizer(prompt["prompt"]).input_ids, info.image_token_id, info.tokens_per_image)
    return hf_llava_greedy(hf, ids, pixels, NEW_TOKENS)[0]


def test_image_prompts_beside_text_give_hf_greedy_tokens(tiny_llava, llava_llm):
    outs = llava_llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_llava, llava_llm, p) for p in PROMPTS]
    assert outs[0].prompt_token_ids.count(llava_llm.engine.info.image_token_id) == 25


class CountingWorkers:
    """An in-process worker behind an engine (pickling each message, as rpyc does), counting the
    images its model encodes."""

    worker: ModelWorker
    encoded = 0
    dist_init_addr = ""      # one rank: no rendezvous

    def init_model(self, args: WorkerInitArgs):
        self.worker = ModelWorker(args)
        encode = self.worker.model.encode_images

        def counting(pixels):
            self.encoded += len(pixels)
            return encode(pixels)

        self.worker.model.encode_images = counting
        return self.worker.info()

    def close(self) -> None:
        pass

    def step(self, step: StepInput) -> list[StepOutput]:
        return pickle.loads(pickle.dumps(self.worker.step(pickle.loads(pickle.dumps(step)))))

    def failure(self) -> str | None:
        return None


def test_features_are_encoded_once_across_chunks_and_preemption(tiny_llava, llava_llm, monkeypatch):
    """A 16-token prefill budget splits the image runs; a KV pool of room for about 1.5 requests
    preempts; each image is still encoded once, the tokens are unchanged, and every request's
    features are freed at the end."""
    path, _ = tiny_llava
    prompts = [{"prompt": f"Story {i}: <image> once upon a time", "images": [image(10 + i)]} for i in range(3)]
    params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    expected = llava_llm.generate(prompts, params)
    kv = len(expected[0].prompt_token_ids) + 20 + 20
    counting = CountingWorkers()
    config = EngineConfig(model=path, max_total_token_num=kv, max_prefill_tokens=16, device="cpu")
    engine = LLMEngine(config, llava_llm.engine.model, counting)
    preempted: list[int] = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda req: (preempted.append(req.req_id), preempt(req)))
    inputs = [llava_llm._model_input(p) for p in prompts]
    reqs = [engine.add_request(ids, params, pixels) for ids, pixels in inputs]
    got = {r.req_id: r for r in reqs}
    while engine.has_unfinished():
        engine.step()
    engine.flush()
    assert preempted
    assert [got[r.req_id].output_token_ids for r in reqs] == [o.token_ids for o in expected]
    assert counting.encoded == len(prompts)
    assert counting.worker.req_images == {}


def test_image_limits_offline(llava_llm, tiny_llama_dir):
    with pytest.raises(InvalidRequest, match="placeholder"):
        llava_llm.generate({"prompt": "no placeholder here", "images": [image(1)]}, GREEDY)
    with pytest.raises(InvalidRequest, match="placeholder"):
        llava_llm.generate("a stray <image> without its image", GREEDY)
    with pytest.raises(InvalidRequest, match="decoded"):
        llava_llm.generate({"prompt": "<image>", "images": [b"not an image"]}, GREEDY)


def test_the_prefix_cache_shares_an_image_only_with_the_same_image(llava_llm):
    prompt = "USER: <image>\nDescribe it. ASSISTANT:"
    same, other = {"prompt": prompt, "images": [image(5)]}, {"prompt": prompt, "images": [image(6)]}
    cold = []
    for p in (same, other):
        llava_llm.reset_prefix_cache()
        cold.append(llava_llm.generate(p, GREEDY)[0])
    assert cold[0].token_ids != cold[1].token_ids, "the two images should lead to different answers"
    llava_llm.reset_prefix_cache()
    llava_llm.generate(same, GREEDY)
    again, different = llava_llm.generate([same, other], GREEDY)
    assert again.token_ids == cold[0].token_ids and again.num_cached_tokens == len(again.prompt_token_ids) - 1
    # the other image shares the text before the placeholders only
    assert different.token_ids == cold[1].token_ids
    assert different.num_cached_tokens == different.prompt_token_ids.index(llava_llm.engine.info.image_token_id)
