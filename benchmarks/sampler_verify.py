"""The cost of speculative verification in the sampler (``Sampler.verify``) against a plain
decode step's ``Sampler.sample``, for the sampler alone (the forward is not included).

What is measured
  A batch of ``--batch`` requests, each with a ``--draft``-token draft, so ``verify`` takes
  ``batch * (1 + draft)`` rows of logits; ``sample`` takes ``batch`` rows (one decode step), and
  ``sample x rows`` as many rows as ``verify`` (the per-row work ``verify`` cannot avoid). Rows
  are peaked as a trained model's are, not flat as random weights': a Zipf law of exponent 1.5
  over a random order of the vocabulary, plus noise (the largest 1024 logits hold ~98% of the
  probability, so top-p's cut on the CPU falls among them). The drafts are the rows' argmax chain: greedy requests accept them whole (the longest path through
  verify), sampling ones accept what p gives. Median wall time per call (synchronised), ms.
  Settings: greedy; sampling (temperature 0.8, top-p 0.95); sampling with penalties
  (repetition 1.1, frequency 0.2, over a ``--context``-token prompt); greedy with logprobs=5.
  Each setting also checks one verify's answer: no request failed, and greedy ones emitted the
  whole chain plus the last row's argmax.

Run (GPU):   python benchmarks/sampler_verify.py
Run (CPU):   python benchmarks/sampler_verify.py --device cpu
Smoke (CPU): python benchmarks/sampler_verify.py --device cpu --batch 2 --draft 3 --vocab 1000 --iters 2
"""

from __future__ import annotations

import argparse
import random

from common import (
    add_device_arguments, device_name, markdown_table, remove_script_dir_from_sys_path, wall_median_ms, write_json,
)

remove_script_dir_from_sys_path()

import torch  # noqa: E402

from llmserve.sampling_params import SamplingParams  # noqa: E402
from llmserve.worker.sampling import Sampler, VerifyResult  # noqa: E402

SETTINGS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "sampling": {"temperature": 0.8, "top_p": 0.95},
    "sampling + penalties": {"temperature": 0.8, "top_p": 0.95, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "greedy + logprobs=5": {"temperature": 0.0, "logprobs": 5},
}


def fresh_sampler(params: SamplingParams, batch: int, prompt: list[int]) -> Sampler:
    sampler = Sampler(eos_token_ids=[0])
    for req_id in range(batch):
        sampler.add_request(req_id, SamplingParams(**{**vars(params), "seed": req_id}), prompt)
    return sampler


def peaked_logits(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per row, log p(rank r) = -1.5 log r (up to a constant) at a random token order, plus noise."""
    generator = torch.Generator().manual_seed(0)
    zipf = -1.5 * torch.arange(1, vocab_size + 1, dtype=torch.float32).log()
    order = torch.rand(rows, vocab_size, generator=generator).argsort(dim=-1)
    logits = zipf[order] + 0.1 * torch.randn(rows, vocab_size, generator=generator)
    return logits.to(device)


def check_verify(result: VerifyResult, logits: torch.Tensor, chain: list[list[int]], params: SamplingParams) -> None:
    """No request failed, each emitted a prefix of its draft and one more token, and greedy ones their
    whole draft (the rows' argmax chain) and the last row's argmax: the path just timed gives the
    right tokens on this device."""
    assert result.errors == [None] * len(chain), result.errors
    assert all(1 <= len(t) <= len(d) + 1 and t[:-1] == d[: len(t) - 1] for t, d in zip(result.token_ids, chain))
    if params.is_greedy:
        last = logits.view(len(chain), len(chain[0]) + 1, -1)[:, -1].argmax(dim=-1).tolist()
        assert result.token_ids == [[*draft, t] for draft, t in zip(chain, last)], "greedy verify's tokens"


def measure(setting: str, args: argparse.Namespace, device: torch.device) -> list[object]:
    params = SamplingParams(**SETTINGS[setting])
    rng = random.Random(0)
    prompt = [rng.randrange(args.vocab) for _ in range(args.context)]
    rows = args.batch * (1 + args.draft)
    logits = peaked_logits(rows, args.vocab, device)
    chain = logits.argmax(dim=-1).view(args.batch, 1 + args.draft)[:, :-1].tolist()
    req_ids = list(range(args.batch))
    # A fresh sampler per call would time add_request too; one sampler's state grows by a few
    # tokens per call, which changes nothing measurable.
    one = fresh_sampler(params, args.batch, prompt)
    many = fresh_sampler(params, rows, prompt)
    spec = fresh_sampler(params, args.batch, prompt)
    sample_ms = wall_median_ms(lambda: one.sample(logits[: args.batch], req_ids), device, args.iters)
    sample_rows_ms = wall_median_ms(lambda: many.sample(logits, list(range(rows))), device, args.iters)
    verify_ms = wall_median_ms(lambda: spec.verify(logits, req_ids, chain), device, args.iters)
    check_verify(fresh_sampler(params, args.batch, prompt).verify(logits, req_ids, chain), logits, chain, params)
    return [setting, f"{sample_ms:.2f}", f"{sample_rows_ms:.2f}", f"{verify_ms:.2f}", f"{verify_ms / sample_ms:.1f}x"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_arguments(p)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--draft", type=int, default=10, help="draft tokens per request")
    p.add_argument("--vocab", type=int, default=128256, help="default: Llama 3's")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (the penalties' work)")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device(args.device)
    table = [measure(setting, args, device) for setting in SETTINGS]
    headers = ["setting", f"sample {args.batch} rows (ms)", f"sample {args.batch * (1 + args.draft)} rows (ms)",
               f"verify {args.batch} x (1 + {args.draft}) (ms)", "verify / sample"]
    print(f"{device_name(device)}, vocab {args.vocab}, batch {args.batch}, draft {args.draft}\n")
    print(markdown_table(headers, table))
    if args.json:
        write_json(args.json, {"device": device_name(device), "args": vars(args), "headers": headers, "rows": table})


if __name__ == "__main__":
    main()
