"""LoRA adapters through every door: a real tritonserver with vllm_backend's multi_lora.json and `lora_name` (as
`serve --lora-modules` writes them), the gateway's `model: NAME`, /v1/models, run-time load and unload, the metric;
each adapter's text equal to PEFT's merged model's, and bad names and adapters refused with the server still up."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import httpx
import pytest

from tests.conftest import (
    GATEWAY_API_KEY, free_port, generate_through_triton, greedy_tokens, hf_model, make_peft_adapter,
    served_by_triton, start_gateway,
)

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
STEPS = 12
ADAPTERS = {"doll": (8, ["q_proj", "v_proj"]), "sheep": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_dir):
    """name -> (folder, PEFT's greedy text for PROMPT); "base": the base model's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer.encode(PROMPT)
    made = {"base": (None, hf_model(default_model_dir))}
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        path = tmp_path_factory.mktemp(f"adapter-{name}")
        made[name] = (str(path), make_peft_adapter(default_model_dir, path, rank, targets, seed=i))
    return {name: (path, tokenizer.decode(greedy_tokens(model, prompt, STEPS), skip_special_tokens=True))
            for name, (path, model) in made.items()}


@pytest.fixture(scope="module")
def lora_server(adapters, tmp_path_factory):
    args = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 8, "max_loras": 2}
    modules = {name: path for name, (path, _) in adapters.items() if path}
    with served_by_triton(args, tmp_path_factory.mktemp("lora-triton") / "tritonserver.log", modules) as server:
        yield server


@pytest.fixture(scope="module")
def lora_gateway(lora_server, tmp_path_factory):
    port = free_port()
    process = start_gateway(lora_server.grpc_url, port, tmp_path_factory.mktemp("lora-gw") / "gateway.log",
                            env={"NPU_LLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"},
                       timeout=120)
    process.terminate()
    process.wait(15)


def _generate(server, lora_name: str | None) -> dict:
    """vllm_backend's request form on Triton's generate endpoint: lora_name among the parameters."""
    parameters = {"max_tokens": STEPS, "temperature": 0, "ignore_eos": True, "exclude_input_in_output": True}
    if lora_name is not None:
        parameters["lora_name"] = lora_name
    try:
        return generate_through_triton(server, {"text_input": PROMPT, "parameters": parameters})
    except urllib.error.HTTPError as e:
        e.msg = e.read().decode()  # (what Triton said, in the failure's message)
        raise


def _refusal(server, lora_name: str) -> str:
    with pytest.raises(urllib.error.HTTPError) as failure:
        _generate(server, lora_name)
    return json.loads(failure.value.msg)["error"]


def test_triton_serves_each_adapter_of_multi_lora_json_as_peft_merges_it(lora_server, adapters):
    texts = {name: _generate(lora_server, None if name == "base" else name)["text_output"] for name in adapters}
    assert texts == {name: text for name, (_, text) in adapters.items()}
    assert len(set(texts.values())) == 3  # (each adapter changes the answer)


def test_triton_refuses_an_unknown_adapter_with_vllm_backends_text(lora_server):
    assert _refusal(lora_server, "bactrian") == "LoRA bactrian is not supported, we currently support ['doll', " \
                                                "'sheep']"
    assert _generate(lora_server, "doll")["text_output"]  # (and goes on serving)


def test_a_model_without_enable_lora_refuses_lora_name(triton_server):
    assert _refusal(triton_server, "doll") == "LoRA feature is not enabled."


def test_the_gateway_lists_and_serves_adapters_by_model_name(lora_gateway, adapters):
    models = lora_gateway.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["smollm2-135m-instruct", "doll", "sheep"]
    assert {m["id"]: m.get("parent") for m in models[1:]} == {"doll": "smollm2-135m-instruct",
                                                              "sheep": "smollm2-135m-instruct"}
    assert models[1]["root"] == adapters["doll"][0]
    for name in ("doll", "sheep", "smollm2-135m-instruct"):
        body = {"model": name, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
        answer = lora_gateway.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == adapters["base" if "smollm" in name else name][1]
        assert answer.json()["model"] == name
    unknown = lora_gateway.post("/v1/completions", json={"model": "bactrian", "prompt": PROMPT, "max_tokens": 2})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_at_run_time_and_bad_ones_are_refused(lora_gateway, adapters, tmp_path):
    doll_path = adapters["doll"][0]
    loaded = lora_gateway.post("/v1/load_lora_adapter", json={"lora_name": "doll2", "lora_path": doll_path})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'doll2' added successfully."
    body = {"model": "doll2", "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    assert lora_gateway.post("/v1/completions", json=body).json()["choices"][0]["text"] == adapters["doll"][1]
    again = lora_gateway.post("/v1/load_lora_adapter", json={"lora_name": "doll2", "lora_path": doll_path})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 64}))
    bad = lora_gateway.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "rank 64 is above max_lora_rank=16" in bad.json()["error"]["message"]
    gone = lora_gateway.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "x")})
    assert gone.status_code == 400 and "no adapter_config.json" in gone.json()["error"]["message"]
    unloaded = lora_gateway.post("/v1/unload_lora_adapter", json={"lora_name": "doll2"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'doll2' removed successfully."
    assert lora_gateway.post("/v1/completions", json=body).status_code == 404
    missing = lora_gateway.post("/v1/unload_lora_adapter", json={"lora_name": "doll2"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == \
        "The lora adapter 'doll2' cannot be found."
    assert [m["id"] for m in lora_gateway.get("/v1/models").json()["data"]][1:] == ["doll", "sheep"]
    # loaded again, under a new id: it serves its own weights
    sheep_path = adapters["sheep"][0]
    assert lora_gateway.post("/v1/load_lora_adapter", json={"lora_name": "doll2", "lora_path": sheep_path}).status_code \
        == 200
    assert lora_gateway.post("/v1/completions", json=body).json()["choices"][0]["text"] == adapters["sheep"][1]
    assert lora_gateway.post("/v1/unload_lora_adapter", json={"lora_name": "doll2"}).status_code == 200
    # the server stayed up, and the others still serve
    body["model"] = "sheep"
    assert lora_gateway.post("/v1/completions", json=body).json()["choices"][0]["text"] == adapters["sheep"][1]


def test_runtime_updates_are_off_without_the_switch(gateway):
    answer = httpx.post(f"{gateway}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"},
                        headers={"Authorization": f"Bearer {GATEWAY_API_KEY}"})
    assert answer.status_code == 404


def test_triton_reports_the_adapters_in_vllm_lora_requests_info(lora_server):
    _generate(lora_server, "sheep")
    text = urllib.request.urlopen(lora_server.metrics_url, timeout=5).read().decode()
    series = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert series and all('max_lora="2"' in line for line in series)
    assert any('running_lora_adapters="sheep"' in line for line in series)


def test_the_chat_ui_picks_an_adapter(lora_gateway, lora_server, tmp_path_factory):
    """The model picker lists the base model and its adapters; a reply from the adapter chosen is that adapter's
    (the gateway's own answer to the same chat, which differs from the base model's)."""
    from tests.ui_browser import ask, chromium_page, open_ui, reply_done, running_ui, set_field

    messages = [{"role": "user", "content": "Name a colour."}]

    def answer(model):
        body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
        return lora_gateway.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    expected, base = answer("sheep"), answer("smollm2-135m-instruct")
    assert expected != base
    with running_ui(str(lora_gateway.base_url), lora_server.metrics_url, tmp_path_factory.mktemp("lora-ui")) as url, \
            chromium_page() as page:
        open_ui(page, url)
        page.locator("#model input").click()
        options = page.locator("[role=option]")
        options.first.wait_for(timeout=15000)
        # (the chosen one is marked with a tick on a line of its own)
        names = [o.split("\n")[-1].strip() for o in options.all_inner_texts()]
        assert names == ["smollm2-135m-instruct", "doll", "sheep"]
        options.nth(2).click()
        set_field(page, "#temperature input[type=number]", "0")
        set_field(page, "#max-tokens input[type=number]", "12")
        ask(page, messages[0]["content"])
        assert reply_done(page).strip() == expected.strip()


def test_ids_given_at_run_time_are_never_given_again():
    from backend.triton.loras import LoRARepository

    repository = LoRARepository(True, {"a": "/a", "b": "/b"})
    first = repository.new("c", "/c")
    repository.add(first)
    repository.remove("c")
    second = repository.new("c", "/c2")
    assert [first.lora_int_id, second.lora_int_id] == [3, 4]
    with pytest.raises(ValueError, match="The lora adapter 'a' has already been loaded."):
        repository.new("a", "/x")


def test_lora_modules_take_vllms_two_forms(tmp_path, monkeypatch):
    from backend.triton.loras import parse_lora_modules

    monkeypatch.chdir(tmp_path)
    assert parse_lora_modules(["sql=loras/sql", '{"name": "chat", "path": "/loras/chat", "base_model_name": "m"}']) == \
        {"sql": str(tmp_path / "loras" / "sql"), "chat": "/loras/chat"}
    for bad, match in (("sql", "expected NAME=PATH or a JSON object"), ("=/x", "needs an adapter name"),
                       ('{"name": "a", "path": "/a", "rank": 8}', "the JSON form has name, path")):
        with pytest.raises(ValueError, match=match):
            parse_lora_modules([bad])
