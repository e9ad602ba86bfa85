"""Choosing the next token of every request in a batch from the model's logits: the model worker's
sampler (rank 0), run right after the forward pass.

sampler.py     the ``Sampler``: per-request state by id; a batch sampled, or its drafts verified,
               with a request that breaks the step failing alone
state.py       what the sampler keeps per request, and the snapshot of its random stream
pipeline.py    one sampling step over a batch, in order, and its draw on the way to the host
processors.py  the edits of the logits in place: grammar mask, min_tokens ban, penalties
warp.py        the token chosen: argmax, or temperature / top-k / top-p / typical-p and a seeded draw
logprobs.py    logprobs under the raw logits: the chosen tokens', their top alternatives, a prompt's
verify.py      speculative decoding: each request's draft checked, every row at once
transfer.py    host <-> device copies that do not wait for the device
"""

from llmserve.worker.sampling.logprobs import prompt_logprobs
from llmserve.worker.sampling.pipeline import PendingSample, SampleResult
from llmserve.worker.sampling.sampler import Sampler
from llmserve.worker.sampling.verify import VerifyResult

__all__ = ["PendingSample", "SampleResult", "Sampler", "VerifyResult", "prompt_logprobs"]
