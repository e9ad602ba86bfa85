"""Image requests on a LLaVA-1.5-7B-shaped random model: throughput and time to first token at
concurrency 1 and 32, and the vision tower's share of the time to first token.

The model (written once to ``--out`` unless it is there): CLIP ViT-L/14-336 (24 layers, hidden
1024, 336x336 images in 14x14 patches: 576 image tokens) + the GELU projector + a Llama-2-7B
decoder (32 layers, hidden 4096, 32 heads, intermediate 11008) in the current transformers
layout (``model.language_model.*``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``),
random weights; the tokenizer is the embedded SmolLM2's with an ``<image>`` token (so the vocab
is 49153 rather than LLaVA's 32064: the lm_head is 1.5x LLaVA's, 0.7% of the weights), and a
CLIP image processor at 336 px. ``--shape tiny`` writes a small twin, for CPU checks.

The engine runs in this process with its worker in-process too (the same ``ModelWorker``,
``LLMEngine`` and scheduler as ``llmserve serve``, without the rpyc hop), so that the worker's
``encode_images`` can be timed (synchronized on CUDA). Each request is one 336x336 random image
in a LLaVA-1.5 chat prompt (~600 prompt tokens) and ``--new-tokens`` greedy tokens (EOS ignored).
TTFT is from ``add_request`` (the image already preprocessed: the front end's share is
reported apart) to the step that returns the request's first token.

GPU (H100):  python benchmarks/llava.py --out /tmp/llava-7b-random --requests 64
CPU check:   python benchmarks/llava.py --shape tiny --out /tmp/llava-tiny --device cpu --requests 6 --new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from make_random_model import load_source_tokenizer, write_shards  # also sets up sys.path (see common.py)
from offline import random_hf_weights

IMAGE_TOKEN = "<image>"
PROMPT = "USER: <image>\nDescribe this image in detail. ASSISTANT:"

SHAPES = {
    # LLaVA-1.5-7B: CLIP ViT-L/14-336 + Vicuna-7B (Llama 2)
    "7b": dict(
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5),
    ),
    "tiny": dict(
        vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    image_size=56, patch_size=14, projection_dim=64),
        text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5),
    ),
}


# -- the model directory ---------------------------------------------------------------------
def write_llava(out: Path, shape: str, device: torch.device, dtype: torch.dtype, tokenizer_dir: str | None) -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlavaConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_source_tokenizer(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(out)
    s = SHAPES[shape]
    size = s["vision"]["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(out)
    text = dict(s["text"], vocab_size=len(tokenizer))
    config = LlavaConfig(vision_config=CLIPVisionConfig(**s["vision"]),
                         text_config=LlamaConfig(**text, eos_token_id=tokenizer.eos_token_id,
                                                 bos_token_id=tokenizer.bos_token_id),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-2,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    config.dtype = dtype
    config.save_pretrained(out)

    def layers():
        for layer in random_hf_weights(text, device, dtype):
            yield {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k.removeprefix("model.")): v
                   for k, v in layer.items()}
        with torch.device(device):
            tower = CLIPVisionModel(config.vision_config).to(dtype)
        yield {"model.vision_tower." + k: v.detach().contiguous() for k, v in tower.state_dict().items()}
        gen = torch.Generator(device=device).manual_seed(1)
        v_hidden, t_hidden = s["vision"]["hidden_size"], s["text"]["hidden_size"]

        def normal(*shape_: int) -> torch.Tensor:
            return torch.randn(shape_, generator=gen, device=device, dtype=dtype).mul_(0.02)

        yield {"model.multi_modal_projector.linear_1.weight": normal(t_hidden, v_hidden),
               "model.multi_modal_projector.linear_1.bias": normal(t_hidden),
               "model.multi_modal_projector.linear_2.weight": normal(t_hidden, t_hidden),
               "model.multi_modal_projector.linear_2.bias": normal(t_hidden)}

    write_shards(layers(), out, shard_bytes=5 * 10**9)


# -- the engine, its worker in this process ----------------------------------------------------
class InProcessWorkers:
    """``ModelWorkerGroup``'s interface over one ``ModelWorker`` in this process; times its
    model's ``encode_images``."""

    dist_init_addr = ""      # one rank: no rendezvous

    def __init__(self) -> None:
        self.worker = None
        self.vision_seconds = 0.0
        self.images_encoded = 0

    def init_model(self, args):
        from llmserve.worker.model_worker import ModelWorker

        self.worker = ModelWorker(args)
        model = self.worker.model
        encode = model.encode_images
        cuda = model.device.type == "cuda"

        def timed(pixels: torch.Tensor) -> torch.Tensor:
            if cuda:
                torch.cuda.synchronize(model.device)
            start = time.perf_counter()
            features = encode(pixels)
            if cuda:
                torch.cuda.synchronize(model.device)
            self.vision_seconds += time.perf_counter() - start
            self.images_encoded += len(pixels)
            return features

        model.encode_images = timed
        return self.worker.info()

    def step(self, step):
        return self.worker.step(step)

    def failure(self) -> str | None:
        return None

    def close(self) -> None:
        self.worker = None


def random_image(seed: int, size: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def run_load(engine, requests: list[tuple[list[int], list]], concurrency: int, new_tokens: int,
             workers: InProcessWorkers) -> dict:
    """Closed loop: ``concurrency`` requests in flight until all are done. Per request, TTFT; for
    the run, requests/s and output tokens/s, and the vision tower's total time."""
    from llmserve import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    pending = list(requests)
    started: dict[int, float] = {}
    ttft: dict[int, float] = {}
    done = 0
    out_tokens = 0
    workers.vision_seconds, workers.images_encoded = 0.0, 0
    t0 = time.perf_counter()
    while done < len(requests):
        while pending and len(started) - done < concurrency:
            ids, pixels = pending.pop(0)
            req = engine.add_request(ids, params, pixels)
            started[req.req_id] = time.perf_counter()
        for delta in engine.step():
            now = time.perf_counter()
            if delta.token_id is not None:
                out_tokens += 1
                ttft.setdefault(delta.req_id, now - started[delta.req_id])
            if delta.finish_reason is not None:
                done += 1
    engine.flush()
    elapsed = time.perf_counter() - t0
    ttfts = sorted(ttft.values())
    return {
        "concurrency": concurrency, "requests": len(requests), "seconds": round(elapsed, 3),
        "requests_per_s": round(len(requests) / elapsed, 3), "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "ttft_ms_mean": round(1e3 * statistics.mean(ttfts), 1), "ttft_ms_p50": round(1e3 * ttfts[len(ttfts) // 2], 1),
        "ttft_ms_p99": round(1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "vision_ms_total": round(1e3 * workers.vision_seconds, 1), "images_encoded": workers.images_encoded,
        "vision_ms_per_image": round(1e3 * workers.vision_seconds / max(1, workers.images_encoded), 2),
        # the tower's time over the time from arrival to first token, summed over requests
        "vision_share_of_ttft": round(workers.vision_seconds / max(1e-9, sum(ttfts)), 4),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="model directory (written if it has no config.json)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--tokenizer", default=None, help="saved HF tokenizer directory to add <image> to (default: the embedded SmolLM2's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from llmserve.engine.config import EngineConfig, ModelSpec
    from llmserve.engine.engine import LLMEngine
    from llmserve.multimodal import ImageProcessor, expand_image_tokens
    from transformers import AutoTokenizer

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
    out = Path(args.out)
    if not (out / "config.json").exists():
        t = time.perf_counter()
        write_llava(out, args.shape, torch.device(args.device), dtype, args.tokenizer)
        print(f"# wrote {out} in {time.perf_counter() - t:.0f} s", file=sys.stderr)

    tokenizer = AutoTokenizer.from_pretrained(out)
    workers = InProcessWorkers()
    config = EngineConfig(model=str(out), dtype=str(dtype).removeprefix("torch."), device=args.device)
    spec = ModelSpec(str(out.resolve()), "llava", args.device, frozenset({tokenizer.eos_token_id}))
    engine = LLMEngine(config, spec, workers)
    print(engine.summary(), file=sys.stderr)
    info = engine.info
    processor = ImageProcessor(str(out))
    size = SHAPES[args.shape]["vision"]["image_size"]
    ids = expand_image_tokens(tokenizer(PROMPT).input_ids, info.image_token_id, info.tokens_per_image)
    t = time.perf_counter()
    images = [random_image(i, size + 64) for i in range(args.requests)]   # resized and cropped by the processor
    pixels = [processor([im]) for im in images]
    preprocess_ms = 1e3 * (time.perf_counter() - t) / args.requests

    # warm-up: compiles and cuBLAS choices for the tower's and the prompt's shapes
    run_load(engine, [(ids, pixels[0])] * 2, 2, 2, workers)
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "dtype": str(dtype), "prompt_tokens": len(ids), "new_tokens": args.new_tokens,
               "tokens_per_image": info.tokens_per_image, "front_end_preprocess_ms_per_image": round(preprocess_ms, 2),
               "runs": []}
    for c in (int(x) for x in args.concurrency.split(",")):
        r = run_load(engine, [(ids, px) for px in pixels], c, args.new_tokens, workers)
        results["runs"].append(r)
        print(json.dumps(r), file=sys.stderr)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    engine.shutdown()


if __name__ == "__main__":
    main()
