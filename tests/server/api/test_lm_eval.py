"""lm-evaluation-harness end to end: its `local-completions` backend against a real server scores
a multiple-choice task and a rolling-loglikelihood (perplexity) task exactly as its own `hf`
backend does on the same tiny random weights, using the server's tokenizer remotely
(/tokenizer_info, /tokenize, /detokenize); its `local-chat-completions` backend runs a
generate_until task. The tasks are local YAML files over local JSON data: no hub."""

from __future__ import annotations

import json

import pytest

MC_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small green frog"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "The sky is", "choices": [" blue", " made of cheese", " green"], "answer": 0},
]
ROLLING_DOCS = [{"text": "Once upon a time there was a little fox who lived in the woods."},
                {"text": "Paris is the capital of France, and Rome is the capital of Italy."}]
GEN_DOCS = [{"question": "Name a colour.", "answer": "Blue"}, {"question": "Say hi.", "answer": "Hi"}]


def write_task(folder, name: str, docs: list[dict], fields: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{fields}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_task(folder, "llmserve_mc", MC_DOCS, "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
               "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    write_task(folder, "llmserve_rolling", ROLLING_DOCS, "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
               "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    write_task(folder, "llmserve_gen", GEN_DOCS, "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
               "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
               "metric_list:\n  - metric: exact_match\n")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(folder), include_defaults=False)   # indexing its ~10k built-in tasks takes seconds


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def evaluate(tasks, names: list[str], model: str, model_args: str, **kw) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=tasks,
                                   log_samples=True, batch_size=1, **kw)


def loglikelihoods(results: dict, task: str) -> list[float]:
    """Each request's score (a choice's loglikelihood, a document's rolling loglikelihood)."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    scores = []
    for sample in samples:
        for resp in sample["resps"]:
            value = resp[0]
            scores.append(value[0] if isinstance(value, (list, tuple)) else value)
    return scores


def test_loglikelihood_tasks_match_lm_evals_hf_backend(tiny_server, tiny_llama_dir, tasks):
    names = ["llmserve_mc", "llmserve_rolling"]
    served = evaluate(tasks, names, "local-completions",
                      f"base_url={tiny_server.url}/v1/completions,model=tiny,num_concurrent=1,max_retries=1")
    hf = evaluate(tasks, names, "hf", f"pretrained={tiny_llama_dir},dtype=float32", device="cpu")
    for task in names:
        ours, theirs = loglikelihoods(served, task), loglikelihoods(hf, task)
        assert len(ours) == len(theirs) > 0
        assert all(v < 0 for v in ours), ours            # real scores, not the 0 a missing logprob gives
        assert ours == pytest.approx(theirs, abs=1e-3)
    for metric in ("acc,none",):
        assert served["results"]["llmserve_mc"][metric] == pytest.approx(hf["results"]["llmserve_mc"][metric], abs=1e-3)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        ours, theirs = served["results"]["llmserve_rolling"][metric], hf["results"]["llmserve_rolling"][metric]
        assert ours == pytest.approx(theirs, rel=1e-3) and ours > 1.5


def test_generate_until_through_chat_completions(tiny_server, tasks):
    results = evaluate(tasks, ["llmserve_gen"], "local-chat-completions",
                       f"base_url={tiny_server.url}/v1/chat/completions,model=tiny,num_concurrent=1,max_retries=1",
                       apply_chat_template=True)
    samples = sorted(results["samples"]["llmserve_gen"], key=lambda s: s["doc_id"])
    assert "exact_match,none" in results["results"]["llmserve_gen"]
    # each answer is what the server answers that conversation greedily, cut at the task's "\n"
    oai = tiny_server.openai_client()
    for doc, sample in zip(GEN_DOCS, samples, strict=True):
        direct = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": doc["question"]}],
                                             max_tokens=6, temperature=0, stop=["\n"])
        assert sample["resps"][0][0] == direct.choices[0].message.content
