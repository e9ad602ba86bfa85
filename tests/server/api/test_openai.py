"""OpenAI's interface end to end: a real server, driven by the `openai` SDK and
huggingface_hub's InferenceClient."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client

from serving_utils import ServerProcess, llmserve_command

PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return tiny_server.openai_client()


@pytest.fixture(scope="module")
def tgi(tiny_server) -> Client:
    return Client(tiny_server.url, timeout=60)


def test_models(oai, tiny_server):
    [model] = oai.models.list().data
    assert model.id == "tiny" and model.owned_by == "llmserve"


def test_completion_greedy_matches_tgi(oai, tgi, tiny_server):
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    expected = tgi.generate(PROMPT, max_new_tokens=10)
    assert r.choices[0].text == expected.generated_text
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(httpx.post(tiny_server.url + "/tokenize", json={"inputs": PROMPT}).json())
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 10, n_prompt + 10)


def test_completion_stream_with_usage(oai):
    full = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    # the second time the prompt is in the prefix cache: all of it but its last token
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


def test_n_choices_and_seed(oai):
    def run():
        return oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, seed=7, temperature=1.0)
    a, b = run(), run()
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]   # seeded: reproducible
    assert len(set(texts)) > 1                                                   # the choices differ
    assert a.usage.completion_tokens == 24


def test_several_prompts_in_one_request(oai):
    r = oai.completions.create(model="tiny", prompt=[PROMPT, "Hello there"], max_tokens=4, temperature=0)
    single = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    assert len(r.choices) == 2 and r.choices[1].text == single.choices[0].text


def test_completion_logprobs_and_echo(oai, smollm2_tokenizer):
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    num_prompt = len(smollm2_tokenizer(PROMPT).input_ids)
    # the prompt's tokens, then the 5 generated ones; the first prompt token has no logprob (null, as OpenAI)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    for token, logprob, top in zip(lp.tokens[num_prompt:], lp.token_logprobs[num_prompt:], lp.top_logprobs[num_prompt:]):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(logprob, abs=1e-5)   # greedy = top-1
    assert lp.text_offset[num_prompt] == len(PROMPT)
    # each offset is where that token's text starts in the echoed text
    assert [c.text[a:b] for a, b in zip(lp.text_offset[:num_prompt], lp.text_offset[1:])] == \
        [smollm2_tokenizer.decode([t]) for t in smollm2_tokenizer(PROMPT).input_ids]


def test_stop_strings_and_stop_token_ids(oai, tgi):
    base = tgi.generate(PROMPT, max_new_tokens=12)
    text, ids = base.generated_text, [t.id for t in base.details.tokens]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    # vLLM's extras travel in the body; a stop token ends the output without being shown
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                               extra_body={"stop_token_ids": [ids[3]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[3]) + 1
    # ...unless min_tokens says the output is not long enough yet
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                               extra_body={"stop_token_ids": [ids[0]], "min_tokens": 6})
    assert r.usage.completion_tokens >= 6


def test_vllm_sampling_extras_are_applied(oai):
    def run(**extra):
        return oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=3, temperature=1.0,
                                      extra_body=extra).choices[0].text
    assert run(top_k=1) == oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert run(repetition_penalty=1.3) == run(repetition_penalty=1.3)
    r = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8


def test_chat_completion(oai, tiny_server):
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length" and r.usage.completion_tokens == 6
    stream = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == c.message.content
    assert stream[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1   # the same prompt again
    # max_completion_tokens is the newer name of max_tokens
    r2 = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert r2.usage.completion_tokens == 3 and c.message.content.startswith(r2.choices[0].message.content)


def test_chat_prompt_is_the_tokenizers_chat_template(oai, tiny_server, smollm2_tokenizer):
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    expected = smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if hasattr(expected, "keys"):   # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert r.usage.prompt_tokens == len(expected)


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_text_content_parts(oai):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    a = oai.chat.completions.create(model="tiny", messages=parts, max_tokens=4, temperature=0)
    b = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_huggingface_hub_chat_completion(tiny_server, oai):
    hub = InferenceClient(base_url=tiny_server.url, timeout=60)
    expected = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    out = hub.chat_completion(MESSAGES, max_tokens=5, temperature=0)
    assert out.choices[0].message.content == expected.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in hub.chat_completion(MESSAGES, max_tokens=5, temperature=0, stream=True))
    assert streamed == expected.choices[0].message.content


def test_embedded_model_answers(embedded_server):
    client = embedded_server.openai_client(timeout=120)
    [model] = client.models.list().data
    r = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0, stream=True))
    assert text == r.choices[0].message.content
    tgi = Client(embedded_server.url, timeout=120)
    out = tgi.generate("The capital of France is", max_new_tokens=3)
    assert "Paris" in out.generated_text


def test_chat_template_file(tiny_llama_dir, tmp_path, smollm2_tokenizer):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    with ServerProcess(tiny_llama_dir, "--chat-template", str(template)) as server:
        client = server.openai_client()
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=1,
                                           temperature=0)
    rendered = "SYSTEM: You are terse.\nUSER: Name a colour.\nASSISTANT:"
    assert r.usage.prompt_tokens == len(smollm2_tokenizer(rendered, add_special_tokens=False).input_ids)


def test_unreadable_chat_template_fails_at_startup(tiny_llama_dir, tmp_path):
    proc = subprocess.run([*llmserve_command(), "serve", "--model", tiny_llama_dir, "--port", "0",
                           "--chat-template", str(tmp_path / "missing.jinja")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot read the chat template" in proc.stderr


# -- scoring a prompt (lm-evaluation-harness's loglikelihood requests) ----------------------

def hf_prompt_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    """HF transformers' logprob of each prompt token after the first, on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_echo_with_max_tokens_0_scores_the_prompt_as_hf_does(tiny_server, tiny_llama_dir, smollm2_tokenizer):
    ids = smollm2_tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == smollm2_tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert lp["tokens"] == [smollm2_tokenizer.decode([t]) for t in ids]          # no generated token
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(hf_prompt_logprobs(tiny_llama_dir, ids), abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert r.json()["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids), "prompt_tokens_details": None}
    # without echo there is nothing to answer
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": ids, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs(tiny_server, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPT).input_ids
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    scored = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                        json=body | {"max_tokens": 0, "echo": True, "logprobs": 0}).json()["choices"][0]["logprobs"]
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=60, json=body | {"prompt_logprobs": 2})
    [choice] = r.json()["choices"]
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, expected, entries in zip(ids[1:], scored["token_logprobs"][1:], prompt_logprobs[1:]):
        # the top 2, plus the prompt's own token when it is not among them
        assert 2 <= len(entries) <= 3 and entries[str(token_id)]["logprob"] == pytest.approx(expected, abs=1e-5)
        ranked = sorted((e for e in entries.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
    assert choice["logprobs"] is None and len(smollm2_tokenizer(choice["text"]).input_ids) <= 3


def test_streamed_echo_carries_the_prompts_logprobs_first(oai, smollm2_tokenizer):
    num_prompt = len(smollm2_tokenizer(PROMPT).input_ids)
    chunks = list(oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                         echo=True, stream=True))
    full = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and len(first.logprobs.tokens) == num_prompt + 1
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == full.choices[0].logprobs.token_logprobs


def test_streamed_scoring_is_one_chunk_of_the_prompt(tiny_server, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPT).input_ids
    chunks = list(tiny_server.openai_client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True, stream_options={"include_usage": True}))
    [scored] = [c for c in chunks if c.choices]
    assert scored.choices[0].text == PROMPT and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.tokens == [smollm2_tokenizer.decode([t]) for t in ids]
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)
