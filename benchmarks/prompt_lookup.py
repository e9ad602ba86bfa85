"""Prompt-lookup speculation (``--speculate K``): what it gains on input-grounded prompts.

Two modes.

``engine`` (the default; CPU, the embedded model)
  Greedy requests on prompts whose answers copy from them, built from text that ships with this
  repository: edit a Python source file ("rename X to Y, output the whole file"), repeat a paragraph
  of a passage, answer from a passage, summarise it. Each workload runs at batch 1, 8 and 32 (the
  batch's prompts cycle through the workload's texts), without drafts and then with them (the
  same engine; ``SamplingParams.speculate`` off), ``--repeats`` such pairs back to back, the
  outputs checked equal token for token. Each distinct prompt is prefilled once first, into the
  prefix cache, so that the timed runs prefill one token per request.

  Columns, over the decode phase (from the step that gave every request its first token):
  tokens per forward (output tokens over the (request, step) pairs that made them), draft tokens
  per verify, mean accepted length (draft tokens accepted per verify), the share of draft tokens
  wasted (rejected: rows verified for nothing), out tok/s on and off (medians), speed-up
  (the median pair's, and the fastest off run's over the fastest on run's: a load can only add
  time), the same by the worker's CPU time, and the load average at each pair.
  On a machine whose cores others share, only pairs run at a steady load compare.
  It also times the prompt-lookup proposal itself at a 32k-token context.

``step`` (``--device cuda --model PATH``; the 8B checkpoint of make_random_model.py)
  Random weights accept nothing, so this times one step instead: a verify step, where each of B
  requests feeds 1 + K tokens on a cached context and the sampler verifies them, against a plain
  decode step (one token each), both replaying CUDA graphs as the server does (cuda_graph.py's
  DecodeGraphs and VerifyGraphs), and both again eagerly. With the acceptance the
  engine mode measured on a real model (``--accepted-len X``), a step emits 1 + X tokens per
  request instead of 1, so the projected speed-up is (1 + X) * t_decode / t_verify.

Run (CPU):  python benchmarks/prompt_lookup.py --batches 1,2,4,8,32 --output-len 96,96,96,96,48 --repeats 2
Run (GPU):  python benchmarks/make_random_model.py --out /tmp/llama3-8b-random
            python benchmarks/prompt_lookup.py --device cuda --model /tmp/llama3-8b-random --accepted-len 2.6
Smoke (CPU, step mode):  python benchmarks/make_random_model.py --shape tiny --device cpu --out /tmp/tiny
            python benchmarks/prompt_lookup.py --device cpu --model /tmp/tiny --mode step --batches 1,2 --context 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import environment, markdown_table, remove_script_dir_from_sys_path, synchronize, write_json
from hf_peer import hf_generate_decode

remove_script_dir_from_sys_path()

import torch  # noqa: E402

from llmserve import LLM  # noqa: E402
from llmserve.engine.config import resolve_model_path  # noqa: E402
from llmserve.engine.drafting import DraftCost  # noqa: E402
from llmserve.engine.engine import LLMEngine  # noqa: E402
from llmserve.worker.prompt_lookup import PromptLookup  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402


# -- the prompts -------------------------------------------------------------------------------

# The texts are pinned copies (benchmarks/texts/, this repository's files and module docstrings as
# of 2026-11-25, commit 1fea7fa): the live files change with the code, and so did the workloads'
# outputs (after one docstring edit, repeat at batch 1 went from 5.94 to 1.07 tokens per forward).
TEXTS = Path(__file__).resolve().parent / "texts"

# (source file, name, its new name); the file's text is TEXTS / "<its name>.txt"
CODE_EDITS = [("llmserve/engine/prompt_lookup.py", "propose", "draft"),
              ("llmserve/engine/admission.py", "check_request", "validate_request"),
              ("llmserve/detokenize.py", "step", "push"),
              ("benchmarks/common.py", "markdown_table", "md_table")]


def source(rel: str) -> str:
    """A screenful of a pinned source file: 32 of them fit the CPU's default KV cache."""
    return (TEXTS / f"{Path(rel).name}.txt").read_text()[:1500]


def code_edit_asks() -> list[str]:
    """Rename a function in a source file of this repository and print the file back."""
    return [f"Here is a Python file:\n\n```python\n{source(rel)}\n```\n\nRename `{old}` to `{new}` everywhere "
            "in this file. Output the whole file, nothing else." for rel, old, new in CODE_EDITS]


def passages() -> list[str]:
    """Module docstrings of this repository (the engine's scheduler, request, core and engine):
    prose about its own workings."""
    return [(TEXTS / f"{name}_doc.txt").read_text().rstrip("\n") for name in ("scheduler", "request", "core", "engine")]


def paragraphs(min_chars: int = 200) -> list[str]:
    """The passages' paragraphs of a few lines or more, in order: the text a user pastes to have it
    repeated. Asked to repeat a whole docstring, the 135M model paraphrases it within a sentence
    or two (0% of its answer from the prompt on the scheduler's); a paragraph it repeats (67-100%
    of each answer's 4-grams from the prompt, checked on the docstrings' first eight paragraphs, greedy, 64 tokens)."""
    return [q for p in passages() for q in p.split("\n\n") if len(q) >= min_chars]


def code_continue_prompts() -> list[str]:
    """code-edit as a completion rather than a chat turn: the file, then the start of the edited
    file for the model to continue. A small instruct model asked in a chat turn tends to rewrite
    the file; here it continues it, as an editor's completion of a changed file would."""
    prompts = []
    for rel, old, new in CODE_EDITS:
        prompts.append(f"```python\n# {rel}\n{source(rel)}\n```\n\nThe same file with `{old}` renamed to `{new}`:\n\n"
                       f"```python\n# {rel}\n")
    return prompts


def free_asks() -> list[str]:
    """Answers that copy nothing from their prompt: what speculation costs where it cannot help."""
    return ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
            "Explain to a ten-year-old how a bicycle stays upright.",
            "Write a poem about a city in autumn.",
            "Describe a perfect weekend, hour by hour."]


# Workloads whose prompts go to the model as they are, not as a chat turn.
COMPLETION_WORKLOADS = {"code-continue"}

WORKLOADS = {
    "code-edit": code_edit_asks,
    "code-continue": code_continue_prompts,
    "free": free_asks,
    "repeat": lambda: [f"Repeat the following text exactly.\n\n{p}" for p in paragraphs()],
    "answer": lambda: [f"Passage:\n{p}\n\nAnswer from the passage, quoting it: what does it say happens at each step?"
                       for p in passages()],
    "summarise": lambda: [f"Passage:\n{p}\n\nSummarise the passage." for p in passages()],
}


# -- engine mode -------------------------------------------------------------------------------

@dataclass
class Result:
    workload: str
    batch: int
    output_len: int                  # most tokens per answer (--output-len for this batch)
    output_tokens: int
    tokens_per_forward_on: float
    mean_accepted_len: float         # draft tokens accepted per verify
    mean_draft_len: float            # draft tokens verified per verify
    wasted: float                    # share of the draft tokens rejected (rows verified for nothing)
    tok_per_s_off: float             # medians over the repeats
    tok_per_s_on: float
    speedup: float                   # median of the back-to-back pairs' off / on seconds
    speedup_best: float              # fastest off / fastest on: the load only ever adds time
    cpu_ms_per_token_off: float      # the worker's CPU time per output token (medians)
    cpu_ms_per_token_on: float
    cpu_speedup: float               # median of the pairs' off / on CPU seconds
    load: str                        # the 1-minute load average at each pair's start
    runs: list[tuple[float, float, float, float]]  # (off s, on s, off CPU s, on CPU s) of each pair
    unequal: int = 0                 # outputs that differed between off and on (0: token for token)
    # What the answers are made of (copy_profile): shares of their 4-grams found in their prompt,
    # only earlier in their own output (a small model's loops), and new.
    from_prompt: float = 0.0
    from_own_output: float = 0.0
    # --ab-sizing: a third run each repeat, drafts as long as their match allows (no cut to what
    # pays): its median pair's speed-up over off, and its drafted / accepted per verify.
    speedup_unsized: float = 0.0
    unsized_drafted_accepted: str = ""
    # The last "on" run's verifies (a request's step that carried a draft), so that a row's lost
    # time can be put per verify: (off s - on s) / verifies is what a verify cost beyond its tokens.
    verifies: int = 0


@dataclass
class PeerResult:
    """Batch 1, one prompt: ours without and with drafts, HF transformers' generate without and
    with its own prompt lookup (``prompt_lookup_num_tokens=K``), decode-phase tok/s."""
    workload: str
    tokens: int
    ours_off: float
    ours_on: float
    hf_off: float
    hf_on: float
    hf_equal: bool                   # HF's greedy tokens equal ours


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], Timing, int]:
    """Run the prompts together to their end: their outputs, the time from the step that gave
    every request its first token to the end (the decode phase: prefill costs the same either
    way), and the (request, step) pairs of that phase in which a request got tokens (its forwards)."""
    reqs = [engine.add_request(p, params) for p in prompts]
    forwards = 0
    start = None
    while any(not r.is_finished for r in reqs):
        got = {d.req_id for d in engine.step()}
        if start is None and all(r.num_output_tokens for r in reqs):
            start = Timing.now(engine)
        elif start is not None:
            forwards += len(got)
    took = Timing.now(engine) - start
    engine.flush()
    return [r.output_token_ids for r in reqs], took, forwards


@dataclass
class Timing:
    """Wall-clock seconds, and the CPU seconds the model worker used (all its threads). On a
    machine whose cores others share, a step's wall clock swings 10-70x with their load (each
    OpenMP region waits for its slower thread); the CPU time is a second view, steadier under a
    light load, but it grows too under a heavy one (the waiting threads spin, and that counts)."""
    wall: float
    cpu: float

    @classmethod
    def now(cls, engine: LLMEngine) -> Timing:
        ticks = 0
        for pid in engine.workers.pids:
            # /proc/PID/stat fields 14 and 15 (after the ")" that ends the command name: 12 and 13)
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        return cls(time.perf_counter(), ticks / os.sysconf("SC_CLK_TCK"))

    def __sub__(self, other: Timing) -> Timing:
        return Timing(self.wall - other.wall, self.cpu - other.cpu)


def load_average() -> float:
    """The machine's 1-minute load average (the other processes' share of the cores)."""
    return os.getloadavg()[0]


def warm_up(engine: LLMEngine, texts: list[list[int]]) -> None:
    """Run each distinct prompt once, a few tokens with drafts: the code paths warm, and every
    prompt's KV lands in the prefix cache, so that the timed batches prefill one token per request
    instead of all of them (batch 32 on code-edit was 15k prompt tokens, a minute of CPU per run)."""
    run_batch(engine, texts, SamplingParams(max_new_tokens=8, temperature=0))


def run_drafting(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
                  ) -> tuple[list[list[int]], Timing, int, tuple[int, int, int]]:
    """``run_batch`` with drafts, and the draft tokens verified, accepted and the verifies it took."""
    before = engine.num_draft_tokens, engine.num_accepted_tokens, sum(engine.accepted_length_counts)
    out, took, forwards = run_batch(engine, prompts, params)
    after = engine.num_draft_tokens, engine.num_accepted_tokens, sum(engine.accepted_length_counts)
    return out, took, forwards, tuple(b - a for a, b in zip(before, after))


def measure(engine: LLMEngine, name: str, prompts: list[list[int]], output_len: int, repeats: int,
            ab_sizing: bool = False) -> Result:
    """``repeats`` back-to-back pairs of the batch without drafts, then with (off first, as a run
    can only warm the next): tokens per forward and acceptance are those of every "on" run (the
    same greedy outputs each time), the tok/s medians, the speed-up the median of the pairs'.
    ``ab_sizing``: each pair is followed by a run whose drafts are not cut to what pays."""
    on = SamplingParams(max_new_tokens=output_len, temperature=0)
    off = SamplingParams(max_new_tokens=output_len, temperature=0, speculate=False)
    batch, runs, loads, unequal, unsized = len(prompts), [], [], 0, []
    drafter = engine.scheduler.drafter
    for _ in range(repeats):
        loads.append(load_average())
        out_off, s_off, _ = run_batch(engine, prompts, off)
        out_on, s_on, forwards, (drafted, accepted, verifies) = run_drafting(engine, prompts, on)
        if ab_sizing:
            sized, drafter.cost = drafter.cost, DraftCost()
            try:
                out_unsized, s_unsized, _, counts = run_drafting(engine, prompts, on)
            finally:
                drafter.cost = sized
            unequal += sum(a != b for a, b in zip(out_unsized, out_off))
            unsized.append((s_off.wall / s_unsized.wall, counts))
        if out_on != out_off:
            # Reported, not fatal: in half precision on a GPU a verify step's other kernels can
            # round a near-tie the other way (the CPU's float32 tables have always been equal).
            unequal += sum(a != b for a, b in zip(out_on, out_off))
            print(f"{name} batch {batch}: speculation changed {unequal} greedy outputs", file=sys.stderr)
        runs.append((s_off.wall, s_on.wall, s_off.cpu, s_on.cpu))
    tokens = sum(map(len, out_on)) - batch     # those after each request's first
    median = statistics.median
    return Result(name, batch, output_len, tokens, tokens / forwards, accepted / verifies if verifies else 0.0,
                  drafted / verifies if verifies else 0.0, 1 - accepted / drafted if drafted else 0.0,
                  tokens / median(r[0] for r in runs), tokens / median(r[1] for r in runs),
                  median(r[0] / r[1] for r in runs), min(r[0] for r in runs) / min(r[1] for r in runs),
                  1e3 * median(r[2] for r in runs) / tokens,
                  1e3 * median(r[3] for r in runs) / tokens, median(r[2] / max(r[3], 1e-9) for r in runs),
                  "/".join(f"{x:.1f}" for x in loads), runs, unequal, *copy_profile(prompts, out_on),
                  *_unsized_columns(unsized), verifies=verifies)


def _unsized_columns(unsized: list[tuple[float, tuple[int, int, int]]]) -> tuple[float, str]:
    if not unsized:
        return 0.0, ""
    drafted, accepted, verifies = unsized[-1][1]
    return statistics.median(r for r, _ in unsized), f"{drafted / max(verifies, 1):.2f} / {accepted / max(verifies, 1):.2f}"


def copy_profile(prompts: list[list[int]], outputs: list[list[int]], n: int = 4) -> tuple[float, float]:
    """Of the answers' n-grams (all answers together): the share that occurs in the answer's
    prompt, and the share that occurs only earlier in the answer itself. Prompt lookup drafts from
    both; the second is mostly a small model's loops (a 135M model repeats itself within a few
    hundred tokens), which make drafts easy without the answer being grounded in its input."""
    total = from_prompt = from_own = 0
    for prompt, output in zip(prompts, outputs):
        in_prompt = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
        seen: set[tuple[int, ...]] = set()
        for i in range(len(output) - n + 1):
            gram = tuple(output[i : i + n])
            total += 1
            from_prompt += gram in in_prompt
            from_own += gram not in in_prompt and gram in seen
            seen.add(gram)
    return (from_prompt / total, from_own / total) if total else (0.0, 0.0)


def hf_peer(args: argparse.Namespace, prompts: dict[str, list[int]], results: list[Result],
            ours: dict[str, list[int]]) -> list[PeerResult]:
    """HF transformers on the same checkpoint (a GGUF dequantized by transformers), batch 1: its
    plain greedy generate and its prompt-lookup one, on each workload's first prompt."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args.model)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype or "", torch.float32)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    peers = []
    for name, ids in prompts.items():
        mine = next(r for r in results if r.workload in (name, f"{name} #1") and r.batch == 1)   # its first text
        off, s_off = hf_generate_decode(model, ids, mine.output_len)
        on, s_on = hf_generate_decode(model, ids, mine.output_len, args.speculate)
        peers.append(PeerResult(name, len(off) - 1, mine.tok_per_s_off, mine.tok_per_s_on,
                                (len(off) - 1) / s_off, (len(on) - 1) / s_on, off == ours[name]))
        print(f"{name}: HF {peers[-1].hf_off:.1f} -> {peers[-1].hf_on:.1f} tok/s, equal to ours: {peers[-1].hf_equal}",
              file=sys.stderr)
    return peers


def engine_mode(args: argparse.Namespace) -> tuple[list[Result], list[PeerResult]]:
    llm = LLM(args.model, dtype=args.dtype, speculate=args.speculate, speculate_max_batch=max(args.batch_list),
              max_running_requests=max(args.batch_list), overlap=False if args.no_overlap else True if args.overlap else None)
    engine = llm.engine
    print(engine.summary(), file=sys.stderr)
    results = []
    peer_prompts: dict[str, list[int]] = {}
    ours: dict[str, list[int]] = {}
    try:
        for name in args.workload_list:
            texts = [llm.tokenizer.encode(t) if name in COMPLETION_WORKLOADS else llm.chat_prompt([{"role": "user", "content": t}])
                     for t in WORKLOADS[name]()]
            warm_up(engine, texts if args.each_prompt else texts[:max(args.batch_list)])   # those the rows run
            if args.peer == "hf" and 1 in args.batch_list:
                peer_prompts[name] = texts[0]
                length = args.output_lens[args.batch_list.index(1)]
                [ours[name]] = [r.token_ids for r in llm.generate([texts[0]], SamplingParams(
                    max_new_tokens=length, temperature=0, speculate=False))]
            for batch, output_len in zip(args.batch_list, args.output_lens):
                if batch == 1 and args.each_prompt:    # a row per text, each alone
                    rows = [(f"{name} #{i + 1}", [text]) for i, text in enumerate(texts)]
                else:
                    rows = [(name, [texts[i % len(texts)] for i in range(batch)])]
                for row_name, prompts in rows:
                    r = measure(engine, row_name, prompts, output_len, args.repeats, args.ab_sizing)
                    results.append(r)
                    pairs = ", ".join(f"{a:.1f}/{b:.1f} s, CPU {c:.1f}/{d:.1f} s" for a, b, c, d in r.runs)
                    print(f"{row_name} batch {batch}: {r.tokens_per_forward_on:.2f} tok/forward, accepted "
                          f"{r.mean_accepted_len:.2f} of {r.mean_draft_len:.2f} drafted ({r.wasted:.0%} wasted), {r.tok_per_s_off:.1f} -> {r.tok_per_s_on:.1f} tok/s ({r.speedup:.2f}x; "
                          f"CPU {r.cpu_speedup:.2f}x; pairs {pairs}; load {r.load})"
                          + (f"; unsized drafts {r.speedup_unsized:.2f}x, drafted / accepted per verify "
                             f"{r.unsized_drafted_accepted}" if args.ab_sizing else ""), file=sys.stderr)
    finally:
        llm.close()
    return results, hf_peer(args, peer_prompts, results, ours) if peer_prompts else []


def proposal_us(context: int = 32768, calls: int = 2000) -> float:
    """Microseconds to index one appended token and propose a draft, at ``context`` tokens."""
    rng = random.Random(0)
    lookup = PromptLookup([rng.randrange(49152) for _ in range(context)])
    start = time.perf_counter()
    for _ in range(calls):
        lookup.extend([rng.randrange(49152)])
        lookup.propose(10)
    return (time.perf_counter() - start) / calls * 1e6


# -- step mode ---------------------------------------------------------------------------------

@dataclass
class StepResult:
    batch: int
    context: int
    decode_ms: float
    eager_decode_ms: float           # the same decode step without its CUDA graph
    verify_ms: float                 # 1 + K tokens per request, logits of every row, Sampler.verify (graph)
    verify_forward_ms: float         # the verify step's forward alone (the rest is Sampler.verify)
    eager_verify_ms: float           # the verify step without CUDA graphs (what the server ran before)
    ratio: float                     # verify / decode
    projected_speedup: float | None  # (1 + accepted_len) / ratio


def step_mode(args: argparse.Namespace) -> list[StepResult]:
    from llmserve.common.basemodel import ModelInitParams
    from llmserve.models.registry import get_model_class, peek_model_config
    from llmserve.worker.sampling import Sampler

    device = torch.device(args.device)
    dtype = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype or "auto"]
    path = resolve_model_path(args.model)
    max_batch = max(args.batch_list)
    max_len = args.context + args.speculate + 8
    model = get_model_class(peek_model_config(path)["model_type"])(ModelInitParams(
        model_path=path, device=str(device), dtype=dtype, max_total_token_num=max_batch * max_len + 64,
        max_running_requests=max_batch, max_seq_len=max_len, cuda_graph_max_bs=max_batch if device.type == "cuda" else 0,
        speculate=args.speculate, speculate_max_batch=max_batch))   # verify graphs, as the server has with --speculate
    sampler = Sampler()
    results = []
    for batch in args.batch_list:
        rows = [model.req_manager.alloc_req() for _ in range(batch)]
        ids = torch.randint(model.vocab_size, (batch * args.context,), device=device)
        model.forward(ids, rows, [0] * batch, [args.context] * batch)          # the cached context
        for r in rows:
            sampler.add_request(r, SamplingParams(temperature=0), [])
        k = args.speculate
        drafts = [[int(t) for t in torch.randint(model.vocab_size, (k,))] for _ in rows]
        decode_ids = torch.randint(model.vocab_size, (batch,), device=device)
        verify_ids = torch.tensor([t for d in drafts for t in [0, *d]], device=device)

        def decode() -> None:
            model.forward(decode_ids, rows, [args.context] * batch, [1] * batch).argmax(-1).tolist()

        def verify() -> None:
            sampler.verify(verify_forward(), rows, drafts)

        def verify_forward() -> torch.Tensor:
            return model.forward(verify_ids, rows, [args.context] * batch, [1 + k] * batch, return_all_logits=True)

        def eager(step):
            def run() -> None:
                graphs = model.decode_graphs, model.verify_graphs
                model.decode_graphs = model.verify_graphs = None
                try:
                    step()
                finally:
                    model.decode_graphs, model.verify_graphs = graphs
            return run

        def timed(step) -> float:
            times = []
            for i in range(args.warmup + args.iters):
                synchronize(device)
                start = time.perf_counter()
                step()
                synchronize(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
                for r in rows:   # back to the context alone, as the worker's truncation leaves a rejected draft
                    model.req_manager.truncate(r, args.context)
            return statistics.median(times) * 1e3

        decode_ms, verify_ms = timed(decode), timed(verify)
        eager_decode_ms, verify_forward_ms = timed(eager(decode)), timed(verify_forward)
        eager_verify_ms = timed(eager(verify))
        ratio = verify_ms / decode_ms
        projected = (1 + args.accepted_len) / ratio if args.accepted_len is not None else None
        results.append(StepResult(batch, args.context, decode_ms, eager_decode_ms, verify_ms, verify_forward_ms,
                                  eager_verify_ms, ratio, projected))
        print(f"batch {batch}: decode {decode_ms:.2f} ms, verify 1+{k} {verify_ms:.2f} ms ({ratio:.2f}x), "
              f"eager verify {eager_verify_ms:.2f} ms", file=sys.stderr)
        for r in rows:
            sampler.remove_request(r)
            model.req_manager.free_req(r)
    return results


# -- main --------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["engine", "step"], default=None,
                   help="engine: the CPU table on real prompts; step: verify vs decode step cost (default: step "
                        "with --device cuda, else engine)")
    p.add_argument("--device", default="cpu", help="step mode's device: cuda or cpu (the engine mode picks its own)")
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--speculate", type=int, default=10, help="draft tokens per step, K (default: 10)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default: 1,8,32)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--output-len", default="256",
                   help="engine mode: most tokens per answer (default: 256); a comma-separated list gives each batch "
                        "its own (e.g. 96,96,48 for 1,8,32: batch 32's verify steps are 352 rows on a CPU)")
    p.add_argument("--repeats", type=int, default=1,
                   help="engine mode: off/on pairs per row, run back to back (tok/s and speed-up: their medians)")
    p.add_argument("--context", type=int, default=1024, help="step mode: cached tokens per request (default: 1024)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--accepted-len", type=float, default=None,
                   help="step mode: mean accepted draft tokens per verify, measured in engine mode, for the projection")
    p.add_argument("--each-prompt", action="store_true",
                   help="engine mode: at batch 1, a row for each of a workload's texts, run alone (default: its first)")
    p.add_argument("--no-overlap", action="store_true",
                   help="engine mode: run every step without the overlapped loop's look-ahead (the default on a CPU)")
    p.add_argument("--overlap", action="store_true",
                   help="engine mode: run every step with the overlapped loop's look-ahead, drafting ones included "
                        "(the default on a GPU)")
    p.add_argument("--peer", choices=["none", "hf"], default="none",
                   help="engine mode: also time HF transformers' generate on the same checkpoint at batch 1, plain "
                        "and with its own prompt lookup (prompt_lookup_num_tokens=K)")
    p.add_argument("--ab-sizing", action="store_true",
                   help="engine mode: after each off/on pair a third run whose drafts are as long as their match "
                        "allows (not cut to the length that pays): its speed-up in the same process, alternating")
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    args.workload_list = [w for w in args.workloads.split(",") if w.strip()]
    lens = [int(n) for n in args.output_len.split(",") if n.strip()]
    if len(lens) not in (1, len(args.batch_list)):
        p.error(f"--output-len: one length, or one per batch ({len(args.batch_list)})")
    args.output_lens = lens * len(args.batch_list) if len(lens) == 1 else lens
    args.mode = args.mode or ("step" if args.device.startswith("cuda") else "engine")
    return args


def main() -> int:
    args = parse_args()
    if args.mode == "step":
        results = step_mode(args)
        print(f"\n### Verify step (1 + {args.speculate} tokens per request) vs decode step, context {args.context}, "
              f"{args.device}\n")
        print(markdown_table(["batch", "decode ms", "eager decode ms", "verify ms", "verify forward ms",
                              "eager verify ms", "verify / decode", "projected speed-up"],
                             [[r.batch, f"{r.decode_ms:.2f}", f"{r.eager_decode_ms:.2f}", f"{r.verify_ms:.2f}",
                               f"{r.verify_forward_ms:.2f}", f"{r.eager_verify_ms:.2f}", f"{r.ratio:.2f}",
                               "-" if r.projected_speedup is None else f"{r.projected_speedup:.2f}x"] for r in results]))
        if args.accepted_len is not None:
            print(f"\nprojected = (1 + {args.accepted_len}) / (verify / decode): {args.accepted_len} accepted draft tokens "
                  "per verify (measured on the embedded model on CPU), random weights accepting nothing here")
    else:
        results, peers = engine_mode(args)
        print(f"\n### Prompt lookup, K = {args.speculate}, greedy, {args.repeats} off/on pair(s) a row; proposal at a "
              f"32k context: {proposal_us():.1f} us\n")
        print(markdown_table(["workload", "batch", "max tokens", "tokens", "from prompt / own output", "tokens / forward",
                              "verifies", "drafted / verify", "accepted / verify", "wasted", "off tok/s", "on tok/s", "speed-up", "best / best", "CPU ms / token off",
                              "on", "CPU speed-up", "load (1 min)",
                              *(["unsized: speed-up", "drafted / accepted"] if args.ab_sizing else [])],
                             [[r.workload, r.batch, r.output_len, r.output_tokens,
                               f"{r.from_prompt:.0%} / {r.from_own_output:.0%}", f"{r.tokens_per_forward_on:.2f}",
                               r.verifies, f"{r.mean_draft_len:.2f}", f"{r.mean_accepted_len:.2f}", f"{r.wasted:.0%}",
                               f"{r.tok_per_s_off:.1f}", f"{r.tok_per_s_on:.1f}",
                               f"{r.speedup:.2f}x", f"{r.speedup_best:.2f}x", f"{r.cpu_ms_per_token_off:.0f}",
                               f"{r.cpu_ms_per_token_on:.0f}",
                               f"{r.cpu_speedup:.2f}x", r.load,
                               *([f"{r.speedup_unsized:.2f}x", r.unsized_drafted_accepted] if args.ab_sizing else [])]
                              for r in results]))
        if any(r.unequal for r in results):
            print("\nNOT token for token: " + ", ".join(f"{r.workload} batch {r.batch}: {r.unequal} outputs differ"
                                                      for r in results if r.unequal))
        if peers:
            print(f"\n### Batch 1 beside HF transformers' generate (greedy; HF's prompt lookup with "
                  f"prompt_lookup_num_tokens={args.speculate}), decode-phase tok/s\n")
            print(markdown_table(["workload", "tokens", "ours off", "ours on", "HF off", "HF on", "HF's tokens = ours"],
                                 [[p.workload, p.tokens, f"{p.ours_off:.1f}", f"{p.ours_on:.1f}", f"{p.hf_off:.1f}",
                                   f"{p.hf_on:.1f}", "yes" if p.hf_equal else "no"] for p in peers]))
            results = [*results, *peers]
    if args.json:
        write_json(args.json, {"benchmark": "prompt_lookup", "mode": args.mode,
                               "environment": environment(torch.device(args.device)),
                               "results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
