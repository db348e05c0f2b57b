"""Property-based fuzzing of the POST routes: 500 generated bodies each, never a 5xx, the server healthy after.

Bodies mix plausible values of every known field with arbitrary JSON of the wrong type, extra keys, and
(for the completions route) raw byte strings that are not JSON at all. Generations stay short, so the test
is about validation, not generation. Hypothesis runs derandomized: CI sees the same bodies every time.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.engine_args import EngineArgs
from server.options import ServerOptions
from tests.page_checks import assert_pages_released
from tests.server_harness import SHARED_ENGINE, running_server

EXAMPLES = 500
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=20))
anything = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
unicode_text = st.text(st.characters(codec="utf-8"), max_size=40)  # includes surrogates' neighbours, not them
small_int = st.integers(-3, 8)
token_ids = st.lists(st.integers(-2, 520), max_size=12)

# Per field: (values of the right type, extreme ones included; anything at all). Half the bodies use only
# the first kind, so they get past the schema and reach tokenizing, the context checks and the engine.
SAMPLING = {
    "max_tokens": (small_int, anything),
    "temperature": (st.floats(0, 2), anything),
    "top_p": (st.floats(0, 1), anything),
    "top_k": (st.integers(-1, 2**31), anything),
    "min_p": (st.floats(0, 1), anything),
    "seed": (st.integers(-2**63, 2**64), anything),
    "stop": (st.lists(unicode_text, max_size=3) | unicode_text, anything),
    "stop_token_ids": (token_ids, anything),
    "stream": (st.booleans(), anything),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "ignore_eos": (st.booleans(), anything),
    "cache_salt": (unicode_text, anything),
    "model": (st.just("stories260K"), anything),
    "n": (st.just(1), anything),
    "logprobs": (st.none(), anything),
    "presence_penalty": (st.just(0.0), anything),
}
COMPLETION = {**SAMPLING, "prompt": (unicode_text | token_ids | st.lists(unicode_text, min_size=1, max_size=3)
                                     | st.lists(token_ids, min_size=1, max_size=3), anything)}
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": unicode_text})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": unicode_text | st.lists(text_part, max_size=2)})
odd_message = st.fixed_dictionaries({"role": anything | st.just("robot"), "content": anything})
CHAT = {**SAMPLING, "messages": (st.lists(message, min_size=1, max_size=3), st.lists(odd_message, max_size=3)
                                 | anything),
        "add_generation_prompt": (st.booleans(), anything), "chat_template": (st.just("{{ messages }}"), anything)}


def bodies(fields: dict, required: str, cap_tokens: bool):
    """Half well-typed bodies (any subset of the fields, `required` always), half anything goes plus extra keys."""
    def body(kind: int):
        chosen = {k: v[kind] for k, v in fields.items()}
        optional = {k: v for k, v in chosen.items() if k != required}
        return st.fixed_dictionaries({required: chosen[required]}, optional=optional)
    extra = st.dictionaries(st.text(max_size=8), anything, max_size=2)
    hostile = st.tuples(body(1) | st.fixed_dictionaries({}, optional={k: v[1] for k, v in fields.items()}), extra)

    def capped(b: dict) -> dict:
        if cap_tokens and not isinstance(b.get("max_tokens"), int):
            b["max_tokens"] = 4  # chat defaults to the whole context: keep generations short
        return b
    return (body(0) | hostile.map(lambda pair: {**pair[1], **pair[0]})).map(capped)


@pytest.fixture(scope="module")
def server(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)
    options = ServerOptions(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
                            max_queued_requests=64)
    with running_server(args, options=options) as running:
        yield running


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def assert_healthy(server) -> None:
    base, async_engine = server
    assert httpx.get(f"{base}/health").status_code == 200 and async_engine.error is None
    assert server.context.admission.in_flight == 0
    assert_pages_released(async_engine.engine.scheduler)


def fuzz(server, route: str, strategy) -> None:
    """Send EXAMPLES bodies drawn from `strategy` (dicts as JSON, bytes as they are) on one connection."""
    sent = []
    with httpx.Client(base_url=server[0], timeout=60) as http:
        @FUZZ
        @given(body=strategy)
        def run(body):
            if isinstance(body, bytes):
                check(http.post(route, content=body, headers={"Content-Type": "application/json"}))
            else:
                check(http.post(route, json=body))
            sent.append(body)

        run()
    assert len(sent) >= EXAMPLES
    assert_healthy(server)


def test_fuzz_completions(server):
    fuzz(server, "/v1/completions", bodies(COMPLETION, "prompt", cap_tokens=False) | st.binary(max_size=64))


def test_fuzz_chat_completions(server):
    fuzz(server, "/v1/chat/completions", bodies(CHAT, "messages", cap_tokens=True))
