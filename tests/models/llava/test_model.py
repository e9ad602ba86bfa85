"""LlavaTpPartModel against HF's LlavaForConditionalGeneration on a tiny random checkpoint: logits
of prompts with one and two images (batched beside a text-only prompt) and greedy continuations,
a prompt whose image is split across prefill chunks, the pre-4.52 checkpoint layout, and tp=2."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from llmserve.worker.images import RequestImages, step_input_embeds
from parity_utils import EXACT, LOGITS_TOL, build_tiny_llava, hf_llava_greedy, load_ours, rel_err

STEPS = 8


@pytest.fixture(scope="module")
def llava(tiny_llava):
    path, hf = tiny_llava
    return path, hf, load_ours(path)


def _prompt(ours, parts: list) -> list[int]:
    """Token ids from parts: a list of ids, or "img" for one image's placeholders."""
    ids: list[int] = []
    for part in parts:
        ids += [ours.image_token_id] * ours.tokens_per_image if part == "img" else part
    return ids


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 30, 30, generator=torch.Generator().manual_seed(seed))


class Driver:
    """Runs requests through the model as the worker does: features once, then the placeholder
    rows of each step written from them."""

    def __init__(self, ours, prompts, pixels):
        self.ours = ours
        self.images = [None if px is None else RequestImages.of_prompt(p, ours.image_token_id, ours.encode_images(px))
                       for p, px in zip(prompts, pixels)]
        self.rows = [ours.req_manager.alloc_req() for _ in prompts]
        self.lens = [0] * len(prompts)

    def extend(self, chunks: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        parts, start = [], 0
        for images, n_cached, chunk in zip(self.images, self.lens, chunks):
            if images is not None:
                parts.append((start, images, n_cached, len(chunk)))
            start += len(chunk)
        ids = torch.tensor([t for c in chunks for t in c])
        logits = self.ours.forward(ids, self.rows, list(self.lens), [len(c) for c in chunks], all_logits,
                                   input_embeds=step_input_embeds(parts, self.ours.device))
        self.lens = [n + len(c) for n, c in zip(self.lens, chunks)]
        return logits

    def free(self):
        for r in self.rows:
            self.ours.req_manager.free_req(r)


def test_images_beside_text_match_hf_greedy(llava):
    path, hf, ours = llava
    prompts = [_prompt(ours, [[1, 40, 41], "img", [300, 301, 302]]),
               _prompt(ours, [[1, 7], "img", [900], "img", [5, 6]]),
               _prompt(ours, [[1, 2, 3, 4, 5]])]
    pixels = [_pixels(1, 1), _pixels(2, 2), None]
    refs = [hf_llava_greedy(hf, p, px, STEPS + 1) for p, px in zip(prompts, pixels)]
    driver = Driver(ours, prompts, pixels)
    try:
        logits = driver.extend(prompts)
        for step in range(STEPS + 1):
            for i, (tokens, ref_logits) in enumerate(refs):
                err = rel_err(logits[i].cpu(), ref_logits[step])
                assert err < LOGITS_TOL, f"prompt {i} step {step}: relative error {err:.2e}"
                if EXACT:
                    assert int(logits[i].argmax()) == tokens[step], f"prompt {i} step {step}"
            if step < STEPS:
                logits = driver.extend([[tokens[step]] for tokens, _ in refs])
    finally:
        driver.free()


def test_an_image_split_across_prefill_chunks(llava):
    """Chunks that cut through the placeholders (and a one-token chunk that is one): every
    position's logits equal HF's over the whole prompt."""
    path, hf, ours = llava
    prompt = _prompt(ours, [[1, 40], "img", [300, 301]])
    px = _pixels(1, 3)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt]), pixel_values=px).logits[0].float()
    driver = Driver(ours, [prompt], [px])
    try:
        got = torch.cat([driver.extend([prompt[a:b]], all_logits=True) for a, b in ((0, 10), (10, 11), (11, len(prompt)))])
    finally:
        driver.free()
    assert rel_err(got.cpu(), ref) < LOGITS_TOL


def test_the_pre_452_checkpoint_layout_loads_the_same(llava, tmp_path, smollm2_tokenizer):
    path, hf, ours = llava
    build_tiny_llava(tmp_path, smollm2_tokenizer, old_layout=True)
    old = load_ours(tmp_path, max_total_token_num=256)
    prompt = _prompt(ours, [[1, 40], "img", [300]])
    px = _pixels(1, 4)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt]), pixel_values=px).logits[0, -1].float()
    driver = Driver(old, [prompt], [px])
    try:
        assert rel_err(driver.extend([prompt])[0].cpu(), ref) < LOGITS_TOL
    finally:
        driver.free()


def _rank_main(rank: int, world: int, path: str, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ours = load_ours(path, tp_rank=rank, world_size=world, device="cpu", dtype=torch.float32,
                         max_total_token_num=256)
        prompts = [_prompt(ours, [[1, 40], "img", [300]]), [1, 2, 3]]
        driver = Driver(ours, prompts, [_pixels(1, 5), None])
        prefill = driver.extend(prompts)
        decode = driver.extend([[7], [8]])
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode}, out)
    finally:
        dist.destroy_process_group()


def test_tp2_equals_tp1(llava, tmp_path):
    from llmserve.engine.worker_client import free_tcp_port

    path, _, _ = llava
    out = str(tmp_path / "logits.pt")
    mp.start_processes(_rank_main, args=(2, str(path), free_tcp_port(), out), nprocs=2, start_method="spawn")
    got = torch.load(out)
    # the ranks run on the CPU in float32 (gloo), so tp=1 does too, whatever LLMSERVE_TEST_DEVICE says
    ours = load_ours(path, device="cpu", dtype=torch.float32)
    prompts = [_prompt(ours, [[1, 40], "img", [300]]), [1, 2, 3]]
    driver = Driver(ours, prompts, [_pixels(1, 5), None])
    try:
        assert rel_err(got["prefill"], driver.extend(prompts)) < 1e-5
        assert rel_err(got["decode"], driver.extend([[7], [8]])) < 1e-5
    finally:
        driver.free()
