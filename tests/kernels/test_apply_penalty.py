"""apply_penalty: twin vs a plain Python loop, Triton vs twin."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import DEVICES, rng

from llmserve.kernels.apply_penalty import apply_penalty_torch, apply_penalty_triton


def make_inputs(seed: int, lengths: list[int], vocab: int, device: str) -> dict:
    g = rng(seed)
    bs = len(lengths)
    ids, counts = [], []
    for n in lengths:
        ids.append(torch.randperm(vocab, generator=g)[:n])  # distinct per request
        counts.append(torch.randint(0, 4, (n,), generator=g))  # zeros: seen in the prompt only
    cum = [0]
    for n in lengths:
        cum.append(cum[-1] + n)
    return dict(
        logits=(torch.randn(bs, vocab, generator=g) * 3).to(device),  # both signs
        presence=torch.rand(bs, generator=g).to(device),
        frequency=torch.rand(bs, generator=g).to(device),
        repetition=(1.0 + torch.rand(bs, generator=g)).to(device),
        p_token_ids=torch.cat(ids).to(device=device, dtype=torch.int32),
        p_token_counts=torch.cat(counts).to(device=device, dtype=torch.int32),
        p_cumsum_seq_len=torch.tensor(cum, dtype=torch.int32, device=device),
        p_max_len_in_batch=max(lengths),
    )


def loop_reference(a: dict) -> torch.Tensor:
    logits = a["logits"].cpu().double().clone()
    cum = a["p_cumsum_seq_len"].tolist()
    for i in range(logits.shape[0]):
        rep, freq, pres = a["repetition"][i].item(), a["frequency"][i].item(), a["presence"][i].item()
        for j in range(cum[i], cum[i + 1]):
            t, c = a["p_token_ids"][j].item(), a["p_token_counts"][j].item()
            x = logits[i, t].item()
            x = x / rep if x > 0 else x * rep
            logits[i, t] = x - (freq * c + pres * (1.0 if c > 0 else 0.0))
    return logits


CASES = [[5, 0, 17, 1], [600, 3]]  # an empty request; 600 tokens span two 512-wide blocks


@pytest.mark.parametrize("lengths", CASES)
def test_twin_matches_loop(lengths):
    a = make_inputs(0, lengths, 1000, "cpu")
    want = loop_reference(a)
    before = a["logits"].clone()
    apply_penalty_torch(**a)
    assert not torch.equal(a["logits"], before)
    torch.testing.assert_close(a["logits"].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", CASES)
def test_triton_matches_twin(device, lengths):
    want = make_inputs(1, lengths, 1000, device)
    got = make_inputs(1, lengths, 1000, device)
    apply_penalty_torch(**want)
    apply_penalty_triton(**got)
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-6, rtol=1e-6)
