"""`--reasoning-parser`: the thinking comes back apart from the answer (chat `reasoning_content`, Responses
reasoning items), streamed and whole, and output constraints apply to the answer only.

The model is stories260K with a tokenizer in which `<think>` and `</think>` are single added tokens (two
byte tokens no story uses, renamed), as they are in Qwen3's and DeepSeek-R1's tokenizers. It never thinks
on its own: its story is all thinking, until a constraint's closing walk writes `</think>` and the
shortest valid answer before the token budget runs out — which is what a real reasoning model meets
when it thinks too long under a schema.
"""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest

from jaxserve.engine_args import EngineArgs
from jaxserve.sampling.grammar import GrammarCompiler, StructuredOutputsParams
from jaxserve.text.tokenizer import Tokenizer
from server.options import ServerOptions
from server.replies.reasoning import ReasoningParser, Splitter
from tests.server_harness import SHARED_ENGINE, running_server

# Qwen3's template, reduced to what it does with thinking: past turns' reasoning in a think block; the
# model opens its own; `enable_thinking: false` writes an empty block so the reply is all answer.
QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{%- endif %}{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"],
          "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def thinking_tokenizer_dir(stories_dir, out):
    """stories260K with `<think>` and `</think>` as added tokens (ids 4 and 5, formerly bytes 0x01, 0x02)."""
    out.mkdir(exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"):
        os.symlink(stories_dir / name, out / name)
    tokenizer = json.loads((stories_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for byte, tag in (("<0x01>", "<think>"), ("<0x02>", "</think>")):
        token = vocab.pop(byte)
        vocab[tag] = token
        tokenizer["added_tokens"].append({"id": token, "content": tag, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": False})
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


@pytest.fixture(scope="module")
def model_dir(stories_dir, tmp_path_factory):
    return thinking_tokenizer_dir(stories_dir, tmp_path_factory.mktemp("thinking") / "stories260K-think")


@pytest.fixture(scope="module")
def server(model_dir):
    # The server tests' shared sizes: the tokenizer's tags reuse stories260K's ids, so the model and its
    # programs are stories260K's, loaded from the run's cache.
    args = EngineArgs(model=str(model_dir), **SHARED_ENGINE)
    options = ServerOptions(chat_template=QWEN3_TEMPLATE, reasoning_parser="qwen3")
    with running_server(args, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


# ---- the parser, on text ------------------------------------------------------------------------

def split_streamed(text: str, thinking: bool, step: int) -> tuple[str, str]:
    splitter, reasoning, answer = Splitter(thinking), "", ""
    for i in range(0, len(text), step):
        r, a = splitter.feed(text[i:i + step])
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>\nLet me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),  # Qwen3 opens it itself
    ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),  # the prompt opened it (R1)
    ("still thinking </thi", True, ("still thinking </thi", "")),  # cut off: all thinking
    ("a </thin> b</think>c</think>", True, ("a </thin> b", "c</think>")),  # the first end tag ends it
    ("It is 4.", False, (None, "It is 4.")),  # the prompt closed the thinking
    ("<think>x</think>It is 4.", False, ("x", "It is 4.")),  # ... and the model thought anyway
    ("<", False, (None, "<")),
    ("</think>{\"a\": 1}", True, (None, "{\"a\": 1}")),  # an empty thinking is no thinking
    ("<thi", True, (None, "")),
])
def test_splitter_streamed_and_whole_agree(text, thinking, expected):
    assert Splitter(thinking).split(text) == expected
    for step in (1, 2, 3, 7):
        assert split_streamed(text, thinking, step) == (expected[0] or "", expected[1])


def test_where_a_reply_starts():
    qwen3, r1 = ReasoningParser("qwen3"), ReasoningParser("deepseek_r1")
    assert qwen3.starts_thinking("<|im_start|>assistant\n", None)
    assert not qwen3.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", {"enable_thinking": False})
    assert not qwen3.starts_thinking("<|im_start|>assistant\n", {"enable_thinking": False})
    assert r1.starts_thinking("<｜Assistant｜><think>\n", {"enable_thinking": False})  # R1 has no switch
    # A past turn's closed thinking is history, not the end of this reply's.
    assert qwen3.starts_thinking("<think>\nx\n</think>\n\nhi<|im_end|>\n<|im_start|>assistant\n", None)
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningParser("granite")


# ---- the grammar, without a model -----------------------------------------------------------------

@pytest.mark.parametrize("tag_is_a_token", [True, False])
def test_grammar_applies_after_the_thinking(model_dir, stories_dir, tag_is_a_token):
    """Anything but EOS may come before the end tag (an added token, or text however it is spelled), the
    schema after it; the closing walk writes the end tag first."""
    tokenizer = Tokenizer.from_pretrained(model_dir if tag_is_a_token else stories_dir)
    grammars = GrammarCompiler(tokenizer, 512)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, reasoning_end="</think>")
    matcher = grammars.matcher(spec)
    for token in tokenizer.encode('She said "no {', add_special_tokens=False):  # quotes and braces: free text
        assert matcher.consume(token) and matcher.reasoning
    way_out = grammars.closing(matcher, 40)
    assert tokenizer.decode(way_out, False).startswith("</think>{")
    for token in tokenizer.encode("</think>", add_special_tokens=False):
        assert matcher.consume(token)
    assert not matcher.reasoning and not matcher.in_string
    for token in tokenizer.encode('{"mood":"sad"}', add_special_tokens=False)[1:]:  # [0] is SentencePiece's space
        assert matcher.consume(token), matcher.error
    assert matcher.done


# ---- chat -------------------------------------------------------------------------------------------

def test_chat_returns_the_thinking_apart(client):
    reply = client.chat.completions.create(model="stories260K-think", messages=MESSAGES, max_tokens=24,
                                           temperature=0)
    message = reply.choices[0].message
    # It never closed the thinking: all of it is reasoning (vLLM's reading of a cut-off thought).
    assert message.reasoning_content and message.reasoning == message.reasoning_content
    assert message.content is None and reply.choices[0].finish_reason == "length"


def test_schema_applies_to_the_answer_after_the_thinking(client):
    body = dict(model="stories260K-think", messages=MESSAGES, max_tokens=48, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA}})
    reply = client.chat.completions.create(**body)
    message = reply.choices[0].message
    assert len(message.reasoning_content) > 20  # it thought freely, quotes and all
    jsonschema.validate(json.loads(message.content), SCHEMA)

    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (message.reasoning_content, message.content,
                                            reply.choices[0].finish_reason)


def test_required_tool_call_comes_after_the_thinking(client):
    tools = [{"type": "function", "function": {"name": "mood", "parameters": SCHEMA}}]
    reply = client.chat.completions.create(model="stories260K-think", messages=MESSAGES, tools=tools,
                                           tool_choice="required", max_tokens=128, temperature=0)
    message = reply.choices[0].message
    assert message.reasoning_content and message.tool_calls
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), SCHEMA)


def test_enable_thinking_false_is_all_answer(client, server):
    body = dict(model="stories260K-think", messages=MESSAGES, max_tokens=24, temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "[a-z ]+"}})
    message = client.chat.completions.create(**body).choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content and set(message.content) <= set("abcdefghijklmnopqrstuvwxyz ")  # constrained at once


def test_include_reasoning_false_drops_it(server):
    reply = httpx.post(f"{server[0]}/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "include_reasoning": False}, timeout=60).json()
    assert "reasoning_content" not in reply["choices"][0]["message"]


# ---- Responses ----------------------------------------------------------------------------------

def test_responses_reasoning_item_then_the_answer(client):
    body = dict(model="stories260K-think", input="Tell me a story", max_output_tokens=48, temperature=0,
                text={"format": {"type": "json_schema", "name": "m", "schema": SCHEMA}})
    response = client.responses.create(**body)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.status == "completed"  # the grammar ended (steered there), not max_output_tokens
    thinking = response.output[0].content[0].text
    assert thinking and response.output[0].summary == []
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens

    events = list(client.responses.create(**body, stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        *["response.reasoning_text.delta"] * sum(e.type == "response.reasoning_text.delta" for e in events),
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * sum(e.type == "response.output_text.delta" for e in events),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]  # the closing walk ended the grammar within max_output_tokens: complete
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
    assert events[-1].response.output_text == response.output_text


def test_responses_follow_up_keeps_the_thinking_in_history(client, server):
    first = client.responses.create(model="stories260K-think", input="Hi", max_output_tokens=6, temperature=0)
    follow = client.responses.create(model="stories260K-think", input="More", max_output_tokens=6, temperature=0,
                                     previous_response_id=first.id)
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": None, "reasoning_content": first.output[0].content[0].text},
               {"role": "user", "content": "More"}]
    tokenized = httpx.post(f"{server[0]}/tokenize", json={"messages": history}).json()
    assert follow.usage.input_tokens == tokenized["count"]  # the template wrote the past thinking back
