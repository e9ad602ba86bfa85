"""Two LoRA adapters served by a real ``llmserve serve --lora-modules``: selected by TGI's
``adapter_id``, OpenAI's ``model`` (from the openai client) and LMDeploy's ``adapter_name``, each
giving PEFT's greedy tokens; listed by /v1/models (parent: the base model) and /info; unknown
names refused in each API's shape."""

from __future__ import annotations

import httpx
import openai
import pytest
from lora_utils import ALL_TARGETS, AdapterSpec, make_peft_adapter, peft_greedy, peft_model_of

from serving_utils import ServerProcess

ADAPTERS = {"sql": AdapterSpec(r=8, targets=ALL_TARGETS, seed=4), "poet": AdapterSpec(r=4, targets=("q_proj", "v_proj"), alpha=32, seed=5)}
PROMPT = "The capital of France is"
STEPS = 8


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: make_peft_adapter(hf, root / name, spec) for name, spec in ADAPTERS.items()}
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--max-loras", "1", "--max-lora-rank", "8",
                       "--lora-modules", *(f"{n}={d}" for n, d in dirs.items())) as server:
        yield server, peft_model_of(hf, dirs)


def _tgi(server, adapter_id: str | None) -> httpx.Response:
    parameters = {"max_new_tokens": STEPS, "details": True, "ignore_eos": True}
    if adapter_id is not None:
        parameters["adapter_id"] = adapter_id
    return httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=120)


def test_each_adapter_over_tgi_and_openai_equals_peft(served, smollm2_tokenizer):
    server, peft_model = served
    prompt = smollm2_tokenizer(PROMPT).input_ids
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = {}
    for adapter in [None, "sql", "poet", "sql"]:   # one device slot: each switch loads on demand
        r = _tgi(server, adapter if adapter is not None else "None")
        assert r.status_code == 200, r.text
        ids = [t["id"] for t in r.json()["details"]["tokens"]]
        assert ids == peft_greedy(peft_model, adapter, prompt, STEPS)[0], adapter
        texts[adapter] = r.json()["generated_text"]
        c = client.completions.create(model=adapter or "tiny", prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert c.choices[0].text == texts[adapter] and c.model == (adapter or "tiny")
    assert len(set(texts.values())) == 3
    # LMDeploy's interactive route maps adapter_name the same way.
    r = httpx.post(server.url + "/v1/chat/interactive", timeout=120, json={
        "prompt": PROMPT, "adapter_name": "poet", "request_output_len": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_models_and_info_list_the_adapters(served):
    server, _ = served
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list().data
    cards = {m.id: m for m in models}
    assert set(cards) == {"tiny", "sql", "poet"}
    assert cards["sql"].parent == "tiny" and cards["poet"].parent == "tiny"
    assert httpx.get(server.url + "/v1/models/poet").json()["parent"] == "tiny"
    assert httpx.get(server.url + "/info").json()["lora_adapters"] == ["sql", "poet"]


def test_metrics_count_per_adapter(served):
    server, _ = served
    before = server.metrics()
    assert before['llmserve_lora_requests_total{lora_name="sql"}'] >= 0     # a series per adapter from the start
    assert _tgi(server, "poet").status_code == 200
    after = server.metrics()

    def grew(name: str) -> float:
        key = f'{name}{{lora_name="poet"}}'
        return after[key] - before.get(key, 0.0)

    assert grew("llmserve_lora_requests_total") == 1
    assert grew("llmserve_lora_generated_tokens_total") == STEPS
    assert grew("llmserve_lora_prompt_tokens_total") > 0
    assert after["llmserve_lora_adapters_resident"] == 1     # --max-loras 1


def test_unknown_adapters_are_refused_in_each_apis_shape(served):
    server, _ = served
    r = _tgi(server, "nope")
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "nope" in r.json()["error"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="none").completions.create(
            model="nope", prompt=PROMPT, max_tokens=2)
    r = httpx.post(server.url + "/v1/chat/interactive", json={"prompt": PROMPT, "adapter_name": "nope"}, timeout=60)
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]
    assert _tgi(server, "sql").status_code == 200      # and the server goes on


def test_runtime_loading_is_off_by_default(served):
    server, _ = served
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}, timeout=30)
    assert r.status_code == 404


def test_runtime_load_and_unload(tiny_llama_dir, tmp_path, smollm2_tokenizer):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter behind --allow-runtime-lora-updating:
    a loaded adapter serves PEFT's tokens; bad directories and unknown names are refused."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    spec = ADAPTERS["sql"]
    adapter_dir = make_peft_adapter(hf, tmp_path / "late", spec)
    big = make_peft_adapter(hf, tmp_path / "big", AdapterSpec(r=16, seed=9))
    with ServerProcess(tiny_llama_dir, "--allow-runtime-lora-updating", "--max-lora-rank", "8") as server:
        def call(route: str, **body) -> httpx.Response:
            return httpx.post(server.url + route, json=body, timeout=120)

        assert _tgi(server, "late").status_code == 422
        r = call("/v1/load_lora_adapter", lora_name="late", lora_path=adapter_dir)
        assert r.status_code == 200, r.text
        r = _tgi(server, "late")
        ids = [t["id"] for t in r.json()["details"]["tokens"]]
        want = peft_greedy(peft_model_of(hf, {"late": adapter_dir}), "late", smollm2_tokenizer(PROMPT).input_ids, STEPS)
        assert ids == want[0]
        assert "late" in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
        # refused: loaded already, a rank above --max-lora-rank, a path that is no adapter
        assert call("/v1/load_lora_adapter", lora_name="late", lora_path=adapter_dir).status_code == 400
        r = call("/v1/load_lora_adapter", lora_name="big", lora_path=big)
        assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
        assert call("/v1/load_lora_adapter", lora_name="tmp", lora_path=str(tmp_path)).status_code == 400
        assert call("/v1/load_lora_adapter", lora_name="rel", lora_path="late").status_code == 400
        assert call("/v1/unload_lora_adapter", lora_name="late").status_code == 200
        assert _tgi(server, "late").status_code == 422
        assert call("/v1/unload_lora_adapter", lora_name="late").status_code == 404
