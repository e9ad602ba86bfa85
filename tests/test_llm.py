"""The offline API end to end: worker processes, scheduler, sampling, stopping."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from llmserve import LLM, SamplingParams
from parity_utils import EXACT, hf_greedy_with_logits

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time", "Paris is", "a"]


def skip_without_default_model() -> None:
    """The GPU machine runs these tests without the embedded model's wheel (see gpu_suite.sh)."""
    from llmserve.default_model import ModelLoadError, default_model_path

    try:
        default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


def skip_without_two_ranks() -> None:
    """tp=2 runs over gloo on a CPU, but needs two GPUs where there is CUDA."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tp=2 needs 2 GPUs")


@pytest.fixture(scope="module")
def smollm2():
    skip_without_default_model()
    with LLM() as llm:
        yield llm


# On the GPU machine the tiny-model tests run with LLMSERVE_TEST_DTYPE=float32: exact batch
# invariance is a property of fp32 arithmetic, not of bf16 matmuls whose tiling follows the batch.
DTYPE = os.environ.get("LLMSERVE_TEST_DTYPE")
# Several engines may share one GPU in these tests: size their KV caches instead of letting each
# claim the card's free memory.
KV_TOKENS = 8192


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=KV_TOKENS) as llm:
        yield llm


@pytest.fixture(scope="module")
def tiny_tp2(tiny_llama_dir):
    skip_without_two_ranks()
    with LLM(tiny_llama_dir, tp=2, dtype=DTYPE, max_total_token_num=KV_TOKENS) as llm:
        yield llm


STORIES = [f"Story number {i}: once upon a time there was" for i in range(6)]
STORY_TOKENS = 30


@pytest.fixture(scope="module")
def small(tiny_llama_dir, tiny):
    """The tiny model with a KV pool of room for ~1.5 of the STORIES' requests, STORY_TOKENS new tokens each."""
    need = max(len(tiny.tokenizer(p).input_ids) for p in STORIES) + STORY_TOKENS
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=need + 20) as llm:
        yield llm


def test_embedded_model_answers_paris(smollm2):
    prompt = smollm2.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = smollm2.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0))
    assert "Paris" in out.text
    assert out.finish_reason == "eos_token"


def test_chat_answers_paris_through_the_template(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_new_tokens=24, temperature=0))
    assert "Paris" in out.text
    assert out.prompt_token_ids == smollm2.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])


def test_chat_ends_at_the_templates_stop_words(tiny):
    messages = [{"role": "user", "content": "Once upon a time"}]
    free = tiny.chat(messages, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    word = tiny.tokenizer.decode(free.token_ids[5:7])
    assert word.strip() and word in free.text
    chosen = tiny.chat_template
    tiny.chat_template = dataclasses.replace(chosen, template=dataclasses.replace(chosen.template, stop_words=[word]))
    try:
        stopped = tiny.chat(messages, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    finally:
        tiny.chat_template = chosen
    assert stopped.finish_reason == "stop_sequence"
    assert stopped.text == free.text[:free.text.index(word)]


def test_embedded_model_in_bfloat16_on_cpu():
    skip_without_default_model()
    with LLM(dtype="bfloat16") as llm:
        assert llm.engine.info.dtype == "bfloat16"
        prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
        (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0))
    assert "Paris" in out.text


def test_embedded_model_greedy_matches_transformers(smollm2, default_model_hf):
    prompts = [
        smollm2.chat_prompt([{"role": "user", "content": "Name three colours."}]),
        smollm2.chat_prompt([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]),
        "The history of Rome",
        "import numpy as np\n",
    ]
    ids = [p if isinstance(p, list) else smollm2.tokenizer(p).input_ids for p in prompts]
    outs = smollm2.generate(ids, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs):
        ref, _ = hf_greedy_with_logits(default_model_hf, prompt_ids, 20)
        assert out.token_ids == ref


def test_batch_gives_the_same_tokens_as_each_prompt_alone(tiny):
    together = tiny.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, together):
        (alone,) = tiny.generate([prompt], GREEDY)
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text


def test_seed_reproducible_whatever_else_is_in_the_batch(tiny):
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    (alone,) = tiny.generate(["Once upon a time"], p)
    others = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (1, 2)]
    batch = tiny.generate(["hello", "Once upon a time", "world"], [others[0], p, others[1]])
    assert batch[1].token_ids == alone.token_ids
    (other_seed,) = tiny.generate(["Once upon a time"], SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=99))
    assert other_seed.token_ids != alone.token_ids


def test_prompts_as_token_ids_and_max_new_tokens(tiny):
    ids = tiny.tokenizer("Once upon a time").input_ids
    (a,) = tiny.generate([ids], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    (b,) = tiny.generate(["Once upon a time"], SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5 and a.finish_reason == "length"
    assert a.prompt_token_ids == ids


def test_stop_string_cuts_the_text(smollm2):
    (full,) = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(max_new_tokens=12, temperature=0))
    assert full.text.startswith(" 5, 6, 7")
    (out,) = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(max_new_tokens=12, temperature=0, stop=[" 7", "xyz"]))
    assert out.text == " 5, 6,"
    assert out.finish_reason == "stop_sequence"


def test_stop_token_ids(smollm2):
    (full,) = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(max_new_tokens=12, temperature=0))
    k = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    stop_id = full.token_ids[k]
    (out,) = smollm2.generate(["1, 2, 3, 4,"], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop_id]))
    assert out.token_ids == full.token_ids[: k + 1]
    assert out.finish_reason == "stop_sequence"


def test_logprobs(tiny):
    (out,) = tiny.generate(["Once upon a time"], SamplingParams(max_new_tokens=6, temperature=0, logprobs=3, ignore_eos=True))
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs) == 6
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert lp <= 0.0 and len(top) == 3
        assert top[0] == (tok, pytest.approx(lp))   # greedy picks the most likely token
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


# prompt logprobs against HF float32 on the CPU: tight in float32, loose in half precision
PROMPT_LOGPROB_ATOL = 1e-4 if EXACT else 0.1


def assert_prompt_logprobs_match(out, ref_logprobs: torch.Tensor, num_top: int) -> None:
    """``out``'s prompt logprobs against log-softmaxed logits of its prompt ([len, vocab])."""
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    if len(ids) == 1:
        return
    expected = ref_logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), expected, atol=PROMPT_LOGPROB_ATOL, rtol=0)
    top_values, top_ids = ref_logprobs[:-1].topk(num_top, dim=-1)
    got = out.prompt_top_logprobs[1:]
    if EXACT:
        assert [[t for t, _ in pairs] for pairs in got] == top_ids.tolist()
    got_values = torch.tensor([[v for _, v in pairs] for pairs in got]).reshape(top_values.shape)
    torch.testing.assert_close(got_values, top_values, atol=PROMPT_LOGPROB_ATOL, rtol=0)


def test_prompt_logprobs_match_transformers(tiny, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = ["Once upon a time there was a", "1, 2, 3", "a", "def fibonacci(n):"]
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    params = [SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=n) for n in (3, 0, 2)]
    params.insert(1, greedy)   # one that did not ask, in the same batch
    # Another request decodes while these are prefilled, so the batch mixes 1-token and n-token rows.
    engine = tiny.engine
    running = engine.add_request(tiny.tokenizer("Paris is").input_ids, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    outs = tiny.generate(prompts, params)
    while not running.is_finished:
        engine.step()
    engine.flush()

    assert outs[1].prompt_logprobs is None and outs[1].prompt_top_logprobs is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in tiny.generate(prompts, greedy)]   # sampling unchanged
    for out, p in zip(outs, params):
        if p.prompt_logprobs is None:
            continue
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0].float(), dim=-1)
        assert_prompt_logprobs_match(out, ref, p.prompt_logprobs)


def test_min_tokens_holds_back_eos(smollm2):
    prompt = smollm2.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    (free,) = smollm2.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0))
    assert free.finish_reason == "eos_token"
    n = len(free.token_ids) + 2
    (held,) = smollm2.generate([prompt], SamplingParams(max_new_tokens=n + 10, temperature=0, min_tokens=n))
    assert len(held.token_ids) >= n
    assert not set(held.token_ids[:n]) & smollm2.engine.eos_token_ids
    assert held.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]   # the same until EOS was due


def test_min_tokens_holds_back_stop_token_ids(tiny):
    (free,) = tiny.generate(["Once upon a time"], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
    stop_id = free.token_ids[0]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, min_tokens=4, stop_token_ids=[stop_id])
    (held,) = tiny.generate(["Once upon a time"], params)
    assert stop_id not in held.token_ids[:4] and len(held.token_ids) >= 4


def test_preemption_under_a_small_kv_pool_keeps_outputs_exact(tiny, small):
    params = SamplingParams(max_new_tokens=STORY_TOKENS, temperature=0, ignore_eos=True)
    expected = tiny.generate(STORIES, params)
    got = small.generate(STORIES, params)
    assert small.engine.scheduler.num_used_slots == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_chunked_prefill_gives_the_same_tokens(tiny_llama_dir, tiny):
    # A 7-token prefill budget splits every prompt over several steps, mixed with other requests'
    # decodes; greedy and seeded outputs must not change, nor prompt logprobs (never split).
    prompts = [f"Story number {i}: once upon a time there was a fox" for i in range(4)] + PROMPTS
    params = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=4, temperature=0, prompt_logprobs=1)] * 4
    params = params[: len(prompts)]
    expected = tiny.generate(prompts, params)
    with LLM(tiny_llama_dir, dtype=DTYPE, max_total_token_num=KV_TOKENS, max_prefill_tokens=7) as chunked:
        steps = []
        schedule = chunked.engine.scheduler.schedule
        chunked.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        got = chunked.generate(prompts, params)
    assert any(not item.samples for step in steps for item in step.scheduled), "no prompt was split"
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for g, e in zip(got, expected):
        if e.prompt_logprobs is not None:
            assert g.prompt_logprobs[1:] == pytest.approx(e.prompt_logprobs[1:], abs=1e-5)


def test_prompt_logprobs_are_computed_once_across_preemption(tiny, small, monkeypatch):
    params = SamplingParams(max_new_tokens=STORY_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    expected = tiny.generate(STORIES, params)
    preempted: list[int] = []
    scheduler = small.engine.scheduler
    preempt = scheduler._preempt
    monkeypatch.setattr(scheduler, "_preempt", lambda req: (preempted.append(req.req_id), preempt(req)))
    got = small.generate(STORIES, params)
    assert preempted
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        assert g.prompt_logprobs[0] is None and g.prompt_logprobs[1:] == pytest.approx(e.prompt_logprobs[1:], abs=1e-5)
        assert len(g.prompt_top_logprobs) == len(g.prompt_token_ids)


def test_tensor_parallel_2_logprobs_and_prompt_logprobs(tiny, tiny_tp2):
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    mixed = [params, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)] * 3
    expected = tiny.generate(PROMPTS, mixed)
    got = tiny_tp2.generate(PROMPTS, mixed)
    atol = 1e-4 if EXACT else 0.1
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None and g.prompt_logprobs is None
            continue
        assert g.logprobs == pytest.approx(e.logprobs, abs=atol)
        assert [[t for t, _ in top] for top in g.top_logprobs] == [[t for t, _ in top] for top in e.top_logprobs]
        assert g.prompt_logprobs[0] is None and g.prompt_logprobs[1:] == pytest.approx(e.prompt_logprobs[1:], abs=atol)
        for g_top, e_top in zip(g.prompt_top_logprobs[1:], e.prompt_top_logprobs[1:]):
            assert [v for _, v in g_top] == pytest.approx([v for _, v in e_top], abs=atol)


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_bloom_dir"])
def test_tensor_parallel_2_matches_1(model_dir, request):
    skip_without_two_ranks()
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    if model_dir == "tiny_llama_dir":   # the module's engines
        expected = request.getfixturevalue("tiny").generate(PROMPTS, params)
        got = request.getfixturevalue("tiny_tp2").generate(PROMPTS, params)
    else:
        path = request.getfixturevalue(model_dir)
        with LLM(path, dtype=DTYPE, max_total_token_num=KV_TOKENS) as tp1:
            expected = tp1.generate(PROMPTS, params)
        with LLM(path, tp=2, dtype=DTYPE, max_total_token_num=KV_TOKENS) as tp2:
            got = tp2.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_tensor_parallel_2_matches_1_under_grammars(tiny, tiny_tp2):
    # Only rank 0 holds the matchers and samples; the other rank must follow the same tokens.
    from llmserve.sampling_params import GuidedDecodingParams

    guided = [GuidedDecodingParams(regex="[a-z]{2,8}( [0-9]{1,3}){1,3}"), GuidedDecodingParams(choice=("yes", "no")),
              GuidedDecodingParams(json='{"type":"object","properties":{"n":{"type":"integer","minimum":0,'
                                        '"maximum":99}},"required":["n"],"additionalProperties":false}')]
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, guided_decoding=guided[i % 3])
              for i in range(len(PROMPTS))]
    expected = tiny.generate(PROMPTS, params)
    got = tiny_tp2.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "eos_token" for o in expected)


def test_a_grammar_that_does_not_compile_is_refused_at_admission(tiny):
    from llmserve.sampling_params import GuidedDecodingParams

    with pytest.raises(ValueError, match="guided_decoding regex cannot be compiled.*unclosed group"):
        tiny.generate(["hi"], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a(b")))
    assert len(tiny.generate(["still alive"], GREEDY)[0].token_ids) > 0


def test_invalid_requests_are_clear_errors_and_the_engine_keeps_serving(tiny):
    with pytest.raises(ValueError, match="max_new_tokens must be <="):
        tiny.generate(["hi"], SamplingParams(max_new_tokens=10_000))
    with pytest.raises(ValueError, match="no tokens"):
        tiny.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="prompt token ids"):
        tiny.generate([[10**9]], GREEDY)
    assert len(tiny.generate(["still alive"], GREEDY)[0].token_ids) > 0


@pytest.mark.parametrize("engine", ["tiny_tp2", "smollm2"])
def test_prefix_cache_hits_give_the_tokens_of_a_full_prefill(engine, request):
    """Tensor parallel (every rank mirrors the tree) and the embedded model (quantized weights):
    prompts sharing a system prompt, and a prompt's next turn, served from the cache, give the
    tokens of a cold prefill (tests/engine/test_prefix_cache.py has the rest of the cases)."""
    llm = request.getfixturevalue(engine)
    system = "You are a helpful assistant. Answer each question in one short sentence, and never apologize. "
    prompts = [system + q for q in ("Name a primary color.", "What is 2 + 2?")]
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    cold = []
    for p in prompts:
        llm.reset_prefix_cache()
        cold.append(llm.generate([p], params)[0])
    turn = prompts[-1] + cold[-1].text + " And 3 + 3?"     # shares the last prompt and its answer
    llm.reset_prefix_cache()
    cold_turn = llm.generate([turn], params)[0]
    llm.generate([prompts[0]], params)                     # caches the system prompt
    warm = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold[1:]]
    assert all(o.num_cached_tokens >= len(llm.tokenizer(system).input_ids) - 1 for o in warm)
    warm_turn = llm.generate([turn], params)[0]
    assert warm_turn.token_ids == cold_turn.token_ids and cold_turn.num_cached_tokens == 0
    assert warm_turn.num_cached_tokens > len(llm.tokenizer(prompts[-1]).input_ids)
