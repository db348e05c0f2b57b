"""LoRA over HTTP (issue 31): adapters from --lora-modules listed in /v1/models under their base, chosen by
`model` through the openai client (completions, chat, Responses), and loaded / unloaded at run time behind
the API key and only with --allow-runtime-lora-updating. One server (the fixtures' tiny Llama, two slots)."""

import dataclasses

import httpx
import openai
import pytest

from jaxserve.engine_args import EngineArgs
from server.cli import server_options_from
from server.options import ServerOptions
from tests.lora_model import LORA, golden_tokens, servable_base
from tests.page_checks import assert_pages_released
from tests.server_harness import running_server

KEY = "sk-lora-test"
OPTIONS = ServerOptions(api_key=KEY, allow_runtime_lora_updating=True,
                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = servable_base(tmp_path_factory.mktemp("lora_server") / "tiny-llama")
    args = EngineArgs(model=str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=4, page_size=8,
                      max_model_len=80, max_num_batched_tokens=136, token_buckets=(4, 136),
                      lora_modules=(f"r4_qv={LORA / 'r4_qv'}",
                                    f'{{"name": "r8_all", "path": "{LORA / "r8_all"}"}}'))
    with running_server(args, options=OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def complete(client, model: str) -> openai.types.Completion:
    prompt, _ = golden_tokens("base")
    return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)


def test_models_lists_adapters_under_their_base(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny-llama", "r4_qv", "r8_all"}
    assert cards["tiny-llama"].parent is None
    assert cards["r4_qv"].parent == "tiny-llama" and cards["r4_qv"].root == str(LORA / "r4_qv")


@pytest.mark.parametrize("model, golden", [("r4_qv", "r4_qv"), ("r8_all", "r8_all"), ("tiny-llama", "base")])
def test_completions_choose_the_adapter_by_model(client, model, golden):
    reply = complete(client, model)
    assert reply.model == model
    assert reply.choices[0].text.split() == words(golden_tokens(golden)[1]).split()


def test_chat_and_responses_use_the_adapter_too(client):
    prompt, _ = golden_tokens("base")
    text = words(prompt)
    # The template renders the message as the prompt's words, so the reply continues the golden prompt.
    chat = client.chat.completions.create(model="r8_all", messages=[{"role": "user", "content": text}],
                                          max_tokens=16, temperature=0)
    assert chat.model == "r8_all"
    assert chat.choices[0].message.content.split() == words(golden_tokens("r8_all")[1]).split()
    response = client.responses.create(model="r4_qv", input=text, max_output_tokens=16, temperature=0)
    assert response.model == "r4_qv"
    assert response.output_text.split() == words(golden_tokens("r4_qv")[1]).split()


def test_unknown_model_is_a_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "no-such-adapter")
    assert info.value.body["code"] == "model_not_found" and "r8_all" in info.value.body["message"]


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server[0]}{path}", json=body, headers=headers, timeout=60)


def test_runtime_load_and_unload(server, client):
    load = {"lora_name": "rslora", "lora_path": str(LORA / "r8_rslora_attn")}
    assert post(server, "/v1/load_lora_adapter", load, key=None).status_code == 401
    reply = post(server, "/v1/load_lora_adapter", load)
    assert reply.status_code == 200 and "rslora" in reply.text
    assert "rslora" in {m.id for m in client.models.list().data}
    assert complete(client, "rslora").choices[0].text.split() == words(golden_tokens("r8_rslora_attn")[1]).split()
    again = post(server, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    dora = post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(LORA / "dora")})
    assert dora.status_code == 400 and "DoRA" in dora.json()["error"]["message"]
    missing = post(server, "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "/nonexistent"})
    assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "rslora"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "rslora")
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "rslora"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_adapter_not_found"


def test_runtime_updating_is_off_without_the_switch(server, monkeypatch):
    monkeypatch.setattr(server.context, "options", dataclasses.replace(OPTIONS, allow_runtime_lora_updating=False))
    reply = post(server, "/v1/load_lora_adapter", {"lora_name": "r", "lora_path": str(LORA / "r4_mlp_alpha4")})
    assert reply.status_code == 404 and "--allow-runtime-lora-updating" in reply.json()["error"]["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "r4_qv"}).status_code == 404


def test_vllm_environment_switch_turns_it_on(monkeypatch):
    from server.cli import add_serve_parser
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    ns = parser.parse_args(["serve", "--enable-lora", "--lora-modules", f"a={LORA / 'r4_qv'}", "--max-loras", "3"])
    from jaxserve.entrypoints.args import engine_args_from

    args = engine_args_from(ns)
    assert args.lora_modules == (("a", str(LORA / "r4_qv")),) and args.max_loras == 3
    assert not server_options_from(ns, args).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert server_options_from(ns, args).allow_runtime_lora_updating


def test_metrics_carry_vllms_lora_gauge(server):
    text = httpx.get(f"{server[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_nothing_compiled_and_nothing_leaked(server):
    engine = server[1].engine
    assert engine.compilations_since_warmup == 0
    assert_pages_released(engine.scheduler)
