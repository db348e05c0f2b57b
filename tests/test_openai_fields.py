"""Every request field a vLLM user sends either works or is refused by name.

For each field of vLLM's completion and chat request models: a valid value is served and visibly acts (a
check on the response, against a baseline without the field), or — for what this server does not do —
is refused with a 400 naming the field; an invalid value is a 400 naming the field. Never a silent 200.
Then the features themselves: logprobs in both formats and in streams, echo scoring, n choices,
stop_reason, /tokenize, /detokenize, /version, and no compilation after warm-up through all of it.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jaxserve.engine_args import EngineArgs
from server.options import ServerOptions
from tests.server_harness import SHARED_ENGINE, running_server, scrape

TEMPLATE = ("{{ prefix or '' }}{% if tools %}T{% endif %}{% if documents %}D{% endif %}"
            "{% if reasoning_effort %}R{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
PROMPT = "Once upon a time"
BASE = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
CHAT_BASE = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def server(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)
    with running_server(args, options=ServerOptions(chat_template=TEMPLATE)) as running:
        yield running


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}{route}", json=body, timeout=120)


def sse_events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def ids_of(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def repeats(reply: dict) -> int:
    ids = ids_of(reply)
    return len(ids) - len(set(ids))


# (field, valid value, check(reply, baseline) for it, invalid value). A check of None means the field is
# refused by name unless at its default: the valid value must then be a 400 naming it.
COMMON = [
    ("model", "stories260K", lambda r, b: r["model"] == "stories260K", 17),
    ("n", 2, lambda r, b: len(r["choices"]) == 2, 0),
    ("best_of", 1, lambda r, b: len(r["choices"]) == 1, 3),
    ("temperature", 1.0, lambda r, b: text_of(r) != text_of(b), 5),
    ("top_p", 1e-6, lambda r, b: text_of(r) == text_of(b), 0),  # with temperature 1 (see EXTRA)
    ("top_k", 1, lambda r, b: text_of(r) == text_of(b), -2),  # with temperature 1
    ("min_p", 1.0, lambda r, b: text_of(r) == text_of(b), 1.5),  # with temperature 1
    ("presence_penalty", 2.0, lambda r, b: repeats(r) < repeats(b), 3),
    ("frequency_penalty", 2.0, lambda r, b: repeats(r) < repeats(b), -3),
    ("repetition_penalty", 100.0, lambda r, b: repeats(r) == 0 < repeats(b), 0),
    ("logit_bias", {"383": -100}, lambda r, b: 383 in ids_of(b) and 383 not in ids_of(r), {"x": 1}),
    ("seed", 7, lambda r, b: text_of(r) != text_of(b), "seven"),  # with temperature 1 (see EXTRA)
    ("stop", ["little"], lambda r, b: "little" in text_of(b) and text_of(b).startswith(text_of(r))
     and r["choices"][0]["stop_reason"] == "little", 5),
    ("stop_token_ids", [286], lambda r, b: r["choices"][0]["stop_reason"] == 286, ["a"]),
    ("include_stop_str_in_output", True, lambda r, b: text_of(r).endswith("little"), "sometimes"),
    ("ignore_eos", True, lambda r, b: r["usage"]["completion_tokens"] == 40, "sure"),
    ("min_tokens", 30, lambda r, b: r["usage"]["completion_tokens"] >= 30, -5),
    ("skip_special_tokens", False, lambda r, b: text_of(r) == "<s>" * 5, "maybe"),  # BOS forced by a bias
    ("allowed_token_ids", [383, 286], lambda r, b: set(ids_of(r)) <= {383, 286}, [99999]),
    ("truncate_prompt_tokens", 2, lambda r, b: r["usage"]["prompt_tokens"] == 2, -7),
    ("prompt_logprobs", 1, lambda r, b: r["choices"][0].get("prompt_logprobs") or r.get("prompt_logprobs"), -2),
    ("stream", True, "stream", "maybe"),
    ("stream_options", {"include_usage": True}, "stream", {"include_usage": "x"}),
    ("user", "user-1", lambda r, b: text_of(r) == text_of(b), 5),
    ("request_id", "abc123", lambda r, b: r["id"].endswith("abc123"), 5),
    ("return_token_ids", True, lambda r, b: "token_ids" in r["choices"][0], "maybe"),
    ("return_tokens_as_token_ids", True, lambda r, b: "return_tokens", "maybe"),
    ("cache_salt", "tenant", lambda r, b: text_of(r) == text_of(b), ""),
    ("response_format", {"type": "json_object"}, lambda r, b: isinstance(json.loads(text_of(r)), dict),
     {"type": "bogus"}),
    ("use_beam_search", True, None, "maybe"),
    ("length_penalty", 2.0, None, "long"),
    ("spaces_between_special_tokens", False, None, "maybe"),
    ("structured_outputs", {"choice": ["cat", "dog"]}, lambda r, b: text_of(r) in ("cat", "dog"),
     {"regex": "(unclosed"}),
    ("guided_json", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False},
     lambda r, b: isinstance(json.loads(text_of(r))["a"], int), {"type": "nonsense"}),
    ("guided_regex", "[a-z]{5}", lambda r, b: len(text_of(r)) == 5 and text_of(r).isalpha(), "(unclosed"),
    ("guided_choice", ["yes", "no"], lambda r, b: text_of(r) in ("yes", "no"), []),
    ("guided_grammar", 'root ::= "yes" | "no"', lambda r, b: text_of(r) in ("yes", "no"), "root ::= missing"),
    ("guided_decoding_backend", "xgrammar", lambda r, b: text_of(r) in ("yes", "no"), "magic"),
    ("guided_whitespace_pattern", "[ ]{3}", lambda r, b: text_of(r).startswith("{   "), 5),
    ("structural_tag", "{}", None, None),
    ("logits_processors", ["x.Y"], None, None),
    ("kv_transfer_params", {"a": 1}, None, None),
    ("vllm_xargs", {"a": 1}, None, None),
    ("priority", 1, None, "high"),
    ("bad_words", ["the"], None, "the"),
]
COMPLETION = COMMON + [
    ("echo", True, lambda r, b: text_of(r).startswith(PROMPT), "loud"),
    ("logprobs", 2, lambda r, b: len(r["choices"][0]["logprobs"]["top_logprobs"][0]) == 2, -1),
    ("max_tokens", 3, lambda r, b: r["usage"]["completion_tokens"] == 3, -1),
    ("add_special_tokens", False, lambda r, b: r["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] - 1,
     "maybe"),
    ("suffix", "end", None, None),
    ("prompt_embeds", "AAAA", None, None),
    ("max_repetition_pattern_size", 4, None, "big"),
]
CHAT = COMMON + [
    ("logprobs", True, lambda r, b: len(r["choices"][0]["logprobs"]["content"]) == 40, "sure"),
    ("top_logprobs", 3, lambda r, b: len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3, -1),
    ("max_tokens", 3, lambda r, b: r["usage"]["completion_tokens"] == 3, -1),
    ("max_completion_tokens", 3, lambda r, b: r["usage"]["completion_tokens"] == 3, 0),
    ("echo", True, lambda r, b: text_of(r).startswith("The cat"), "loud"),  # with a final assistant message
    ("add_generation_prompt", False, lambda r, b: r["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"],
     "maybe"),
    ("continue_final_message", True, lambda r, b: text_of(r) != text_of(b), "maybe"),  # see EXTRA
    ("add_special_tokens", True, lambda r, b: r["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] + 1,
     "maybe"),
    ("chat_template_kwargs", {"prefix": "Lily"}, lambda r, b: r["usage"]["prompt_tokens"] > b["usage"]["prompt_tokens"],
     "x"),
    ("documents", [{"title": "t", "text": "x"}],
     lambda r, b: r["usage"]["prompt_tokens"] > b["usage"]["prompt_tokens"], "x"),
    ("tools", [{"type": "function", "function": {"name": "f"}}],
     lambda r, b: r["usage"]["prompt_tokens"] > b["usage"]["prompt_tokens"], "x"),  # tool_choice none: EXTRA
    ("reasoning_effort", "low", lambda r, b: r["usage"]["prompt_tokens"] > b["usage"]["prompt_tokens"], "extreme"),
    ("tool_choice", "required", lambda r, b: r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f",
     "sometimes"),
    ("parallel_tool_calls", False, lambda r, b: len(r["choices"][0]["message"]["tool_calls"]) == 1, "x"),
    ("chat_template", "{{ messages }}", None, 5),
    ("include_reasoning", False, None, "x"),
    ("mm_processor_kwargs", {"a": 1}, None, None),
    ("messages", [{"role": "user", "content": "The cat"}], lambda r, b: text_of(r) != text_of(b),
     [{"role": "robot", "content": "x"}]),
]
# Values that make a field's effect visible (sampling fields need temperature > 0 to act).
EXTRA = {"temperature": {}, "top_p": {"temperature": 1.0, "seed": 3}, "top_k": {"temperature": 1.0, "seed": 3},
         "min_p": {"temperature": 1.0, "seed": 3}, "seed": {"temperature": 1.0},
         "include_stop_str_in_output": {"stop": ["little"]}, "ignore_eos": {}, "return_tokens_as_token_ids":
         {"logprobs": 1}, "echo": {}, "skip_special_tokens": {"logit_bias": {"1": 100}, "ignore_eos": True, "max_tokens": 5},
         "min_tokens": {"stop_token_ids": [286]}, "prompt_logprobs": {}, "top_logprobs": {"logprobs": True},
         "stream_options": {"stream": True}, "guided_decoding_backend": {"guided_choice": ["yes", "no"]},
         "guided_whitespace_pattern": {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
         "tools": {"tool_choice": "none"}, "tool_choice": {"tools": [{"type": "function", "function": {"name": "f"}}]},
         "parallel_tool_calls": {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                                 "max_tokens": 60}}


def baseline_for(server, route: str, body: dict) -> dict:
    reply = post(server, route, {**body, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def check_field(server, route, base, field, valid, check, invalid):
    extra = dict(EXTRA.get(field, {}))
    if route.endswith("chat/completions") and field in ("echo", "continue_final_message"):
        extra["messages"] = base["messages"] + [{"role": "assistant", "content": "The cat"}]
        extra["add_generation_prompt"] = False
    if field == "seed":
        baseline = baseline_for(server, route, {**base, **extra, "seed": 8})
    else:
        baseline = baseline_for(server, route, {**base, **{k: v for k, v in extra.items() if k not in (
            "temperature", "seed", "logprobs")}} if field in ("top_p", "top_k", "min_p") else base)
    body = {**base, **extra, field: valid}
    if field not in ("return_token_ids",):
        body.setdefault("return_token_ids", True)
    reply = post(server, route, body)
    if check is None:  # refused by name
        assert reply.status_code == 400, (field, reply.text)
        assert reply.json()["error"]["param"] == field, reply.text
    else:
        assert reply.status_code == 200, (field, reply.text)
        if check == "stream":
            events = sse_events(reply)
            assert events and (field != "stream_options" or "usage" in events[-1])
        elif check(reply.json(), baseline) == "return_tokens":
            tokens = reply.json()["choices"][0]["logprobs"]
            tokens = tokens["tokens"] if "tokens" in tokens else [c["token"] for c in tokens["content"]]
            assert all(t.startswith("token_id:") for t in tokens)
        else:
            assert check(reply.json(), baseline), (field, reply.json(), baseline)
    if invalid is not None:
        bad = post(server, route, {**base, **extra, field: invalid})
        assert bad.status_code == 400, (field, invalid, bad.text)
        assert (bad.json()["error"]["param"] or "").split(".")[0] == field, (field, bad.text)


@pytest.mark.parametrize("field, valid, check, invalid", COMPLETION, ids=[c[0] for c in COMPLETION])
def test_every_completion_field_works_or_is_refused_by_name(server, field, valid, check, invalid):
    check_field(server, "/v1/completions", BASE, field, valid, check, invalid)


@pytest.mark.parametrize("field, valid, check, invalid", CHAT, ids=[c[0] for c in CHAT])
def test_every_chat_field_works_or_is_refused_by_name(server, field, valid, check, invalid):
    check_field(server, "/v1/chat/completions", CHAT_BASE, field, valid, check, invalid)


def test_unknown_fields_are_ignored_with_a_warning(server, caplog):
    reply = post(server, "/v1/completions", {**BASE, "service_tier": "flex", "store": True})
    assert reply.status_code == 200
    assert any("ignored unknown fields ['service_tier', 'store']" in r.getMessage() for r in caplog.records)


# ---- the features, end to end ---------------------------------------------------------------------------

def test_completion_logprobs_agree_with_the_offline_engine(server, stories_llm):
    from jaxserve import SamplingParams
    reply = post(server, "/v1/completions", {**BASE, "max_tokens": 8, "logprobs": 3}).json()
    lp = reply["choices"][0]["logprobs"]
    offline = stories_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0].outputs[0]
    assert lp["token_logprobs"] == pytest.approx([e[t].logprob for t, e in zip(offline.token_ids, offline.logprobs)],
                                                 abs=1e-5)
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    assert all(len(top) == 3 and max(top.values()) >= lp["token_logprobs"][i] - 1e-6
               for i, top in enumerate(lp["top_logprobs"]))
    stream = sse_events(post(server, "/v1/completions", {**BASE, "max_tokens": 8, "logprobs": 3, "stream": True}))
    streamed = [x for e in stream for x in (e["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_echo_with_zero_max_tokens_scores_the_prompt(server, stories_llm):
    """What evaluation harnesses send: the prompt back, each token's logprob, nothing generated."""
    from jaxserve import SamplingParams
    text = "Once upon a time, there was a little girl"
    reply = post(server, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = reply["choices"][0]
    assert choice["text"] == text and reply["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    ids = stories_llm.get_tokenizer().encode(text)
    offline = stories_llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    expect = [e[t].logprob for t, e in zip(ids[1:], offline.prompt_logprobs[1:])]
    assert lp["token_logprobs"][1:] == pytest.approx(expect, abs=1e-5)
    assert sum(lp["token_logprobs"][1:]) < 0 and math.isfinite(sum(lp["token_logprobs"][1:]))


def test_chat_logprobs_format(server):
    reply = post(server, "/v1/chat/completions", {**CHAT_BASE, "max_tokens": 5, "logprobs": True,
                                                 "top_logprobs": 2}).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and "".join(c["token"] for c in content) == text_of(reply)
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2
        assert c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6


def test_n_choices_for_every_prompt_in_openai_order(server):
    reply = post(server, "/v1/completions", {"prompt": ["Once upon", "The cat"], "n": 3, "max_tokens": 5,
                                             "temperature": 1.0, "seed": 9}).json()
    assert [c["index"] for c in reply["choices"]] == list(range(6))
    again = post(server, "/v1/completions", {"prompt": ["Once upon", "The cat"], "n": 3, "max_tokens": 5,
                                             "temperature": 1.0, "seed": 9}).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in reply["choices"]]
    assert reply["usage"]["completion_tokens"] == 30
    chat = sse_events(post(server, "/v1/chat/completions", {**CHAT_BASE, "n": 2, "max_tokens": 4, "stream": True}))
    finished = [c["index"] for e in chat for c in e["choices"] if c.get("finish_reason")]
    assert sorted(finished) == [0, 1]


def test_tokenize_detokenize_and_version(server):
    tokens = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert tokens["tokens"] == [1, 403, 407, 261, 378] and tokens["count"] == 5 and tokens["max_model_len"] == 512
    assert "".join(tokens["token_strs"][1:]) == " " + PROMPT
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": PROMPT}]}).json()
    assert chat["count"] == 4  # the template adds no BOS; the chat path does not either
    assert post(server, "/detokenize", {"tokens": [403, 407, 261, 378]}).json() == {"prompt": PROMPT}
    assert post(server, "/detokenize", {"tokens": [99999]}).json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "x", "messages": []}).status_code == 400
    assert httpx.get(f"{server[0]}/version").json()["version"]


def test_nothing_compiles_over_a_workload_using_every_feature(server):
    base = server[0]
    before = scrape(base)["jaxserve:compilations_total"]
    bodies = [
        {**BASE, "logprobs": 5, "echo": True, "n": 2, "temperature": 0.7, "seed": 1},
        {**BASE, "max_tokens": 0, "echo": True, "logprobs": 1},
        {**BASE, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3, "min_tokens": 5,
         "logit_bias": {"383": -50, "286": 10}, "stream": True},
        {**BASE, "allowed_token_ids": [383, 286, 261], "prompt_logprobs": 3, "n": 3},
        {**CHAT_BASE, "logprobs": True, "top_logprobs": 5, "n": 2, "stop": ["girl"],
         "include_stop_str_in_output": True},
        {**BASE, "prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 30, "temperature": 1.0},
    ]

    def send(body):
        return post(server, "/v1/chat/completions" if "messages" in body else "/v1/completions", body).status_code

    # All at once, so the features share steps with each other and with plain requests.
    with ThreadPoolExecutor(len(bodies) * 2) as pool:
        assert list(pool.map(send, bodies * 2)) == [200] * len(bodies) * 2
    # (The counter is per process: an offline engine another test built here counts too; none may be added.)
    assert scrape(base)["jaxserve:compilations_total"] == before
