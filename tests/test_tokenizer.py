"""Tokenizer loading, BOS/EOS handling, chat templates and incremental detokenization.

The central property: streaming ids one at a time through an IncrementalDetokenizer and
flushing gives exactly the text a full decode adds after the prompt, and no streamed chunk
ever holds half a UTF-8 character.
"""

import json
import random
import sys
import time

import pytest
import tokenizers

from jaxserve.text.chat_template import ChatTemplateError, compile_template
from jaxserve.text.tokenizer import Tokenizer

FFFD = "\ufffd"
ONCE = [1, 403, 407, 261, 378]  # "Once upon a time" with BOS


@pytest.fixture(scope="module")
def tok(stories_dir):
    return Tokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def raw(stories_dir):
    """The bare `tokenizers` object, to name pieces independently of the code under test."""
    return tokenizers.Tokenizer.from_file(str(stories_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.byte_level()


def stream(tok, prompt, completion, skip_special_tokens=True):
    """Feed ids one by one; return (chunks from add, chunk from flush, detokenizer)."""
    det = tok.new_detokenizer(prompt, skip_special_tokens=skip_special_tokens)
    chunks = [det.add(i) for i in completion]
    return chunks, det.flush(), det


def expected(tok, prompt, completion, skip_special_tokens=True):
    full = tok.decode(prompt + completion, skip_special_tokens)
    base = tok.decode(prompt, skip_special_tokens)
    assert full.startswith(base)
    return full[len(base):]


def is_prefix_stable(tok, prompt, completion, skip_special_tokens=True):
    """True when no id retroactively changes text a full decode already showed as final.

    Outside this, no streaming scheme can match the full decode: e.g. with the ByteFallback
    decoder, a stray continuation byte turns the *whole* preceding byte run into U+FFFD.
    """
    ids = prompt + completion
    full = tok.decode(ids, skip_special_tokens)
    return all(
        full.startswith(tok.decode(ids[:k], skip_special_tokens).rstrip(FFFD))
        for k in range(len(prompt), len(ids))
    )


# -- stories260K: loading, encode, decode -------------------------------------------------------


def test_stories_special_tokens_and_encode(tok):
    assert tok.encode("Once upon a time") == ONCE
    assert tok.encode("Once upon a time", add_special_tokens=False) == ONCE[1:]
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (1, 2)  # generation_config [1, 2], then tokenizer's </s> = 2
    assert tok.vocab_size == 512
    assert tok.add_bos_token is True and tok.add_eos_token is False
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.model_max_length == 512
    assert tok.chat_template is None


def test_bos_never_twice(tok):
    # The post-processor already prepends <s>; a prompt that itself starts with "<s>" (as a
    # chat template writing bos_token would) must still get just one.
    assert tok.encode("<s>Once upon a time") == ONCE
    assert tok.encode("<s>Once", add_special_tokens=False)[0] == 1


def test_decode_round_trip(tok):
    for text in ["Once upon a time", "Lily saw a big, red ball.\nShe was happy!", "café 日本語 🙂 naïve"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 403, 2], skip_special_tokens=False) == "<s> Once</s>"


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_config_variants(tmp_path, stories_dir):
    """Dict-form tokens, add_bos_token=False, named templates, a .jinja file, eos fallbacks."""
    (tmp_path / "tokenizer.json").symlink_to(stories_dir / "tokenizer.json")
    cfg = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": {"content": "</s>"},
        "add_bos_token": False,
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default {{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    t = Tokenizer.from_pretrained(tmp_path)
    assert t.bos_token_id == 1 and t.eos_token_ids == (1, 2)
    assert t.encode("Once upon a time") == ONCE[1:]  # post-processor's BOS removed
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "default hi"

    (tmp_path / "chat_template.jinja").write_text("file {{ bos_token }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([]) == "file <s>"

    # Nothing in tokenizer_config or generation_config: config.json decides.
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0, 2], "bos_token_id": 1}))
    t = Tokenizer.from_pretrained(tmp_path)
    assert t.eos_token_ids == (2, 0) and t.bos_token_id == 1 and t.eos_token == "</s>"
    assert t.add_bos_token is True  # detected from the post-processor
    assert t.encode("Once upon a time") == ONCE


# -- incremental detokenization on stories260K ------------------------------------------------


def test_leading_space_after_text_and_after_bare_bos(tok):
    there = tok.encode("there", add_special_tokens=False)  # "▁there"
    chunks, tail, det = stream(tok, ONCE, there)
    assert chunks == [" there"] and tail == "" and det.text == " there"

    story = tok.encode("Once upon a time, there", add_special_tokens=False)
    chunks, _, det = stream(tok, [1], story)
    assert chunks[0] == "Once" and det.text == "Once upon a time, there"
    chunks, _, det = stream(tok, [], story)  # no prompt at all
    assert det.text == "Once upon a time, there"


@pytest.mark.parametrize("text", ["  there", "there  was", "   ", "there\n\nwas", "\n\n  x \n", " \t a"])
def test_spaces_and_newlines(tok, text):
    completion = tok.encode(text, add_special_tokens=False)
    for prompt in (ONCE, [1], []):
        chunks, tail, det = stream(tok, prompt, completion)
        assert det.text == "".join(chunks) + tail == expected(tok, prompt, completion)
    # The SentencePiece normaliser prepends one "▁", so after text it shows as one extra space.
    assert stream(tok, ONCE, completion)[2].text == " " + text


def test_special_tokens_in_completion(tok):
    there, was = tok.encode("there was", add_special_tokens=False)
    completion = [there, 2, 1, was, 2]
    chunks, _, det = stream(tok, ONCE, completion)
    assert det.text == " there was" and det.token_ids == completion
    assert chunks[1:3] == ["", ""]
    _, _, det = stream(tok, ONCE, completion, skip_special_tokens=False)
    assert det.text == " there</s><s> was</s>"
    assert det.text == expected(tok, ONCE, completion, skip_special_tokens=False)


def test_multibyte_characters_split_over_byte_tokens(tok, raw):
    text = "café 日本語 🙂 naïve"
    completion = tok.encode(text, add_special_tokens=False)
    pieces = [raw.id_to_token(i) for i in completion]
    assert "<0xF0>" in pieces and "<0xE6>" in pieces  # emoji and CJK come as byte pieces
    for prompt in (ONCE, [1]):
        chunks, tail, det = stream(tok, prompt, completion)
        assert not any(FFFD in c for c in chunks + [tail])
        assert det.text == expected(tok, prompt, completion)
        # Each character came out whole, as soon as its last byte arrived.
        assert "🙂" in chunks and "日" in chunks and "本" in chunks
    # Several CJK characters in a row form one long byte run: still streamed per character.
    run = tok.encode("日本語日本語", add_special_tokens=False)
    chunks, _, det = stream(tok, ONCE, run)
    assert [c for c in chunks if c] == [" ", *"日本語日本語"]


def test_sequence_ending_mid_character(tok, raw):
    completion = tok.encode("naïve 🙂", add_special_tokens=False)[:-1]  # drop the emoji's last byte
    assert raw.id_to_token(completion[-1]) == "<0x99>"
    chunks, tail, det = stream(tok, ONCE, completion)
    assert not any(FFFD in c for c in chunks)
    assert FFFD in tail  # held back until the end, then shown as a full decode shows it
    assert det.text == expected(tok, ONCE, completion) == " naïve " + FFFD * 3


def test_prompt_ending_in_multibyte_character(tok):
    # The first window starts a few ids before the prompt's end; it must not start inside
    # the bytes of "日" (that would turn the whole byte run into U+FFFD).
    prompt = tok.encode("Once upon a 日本語")
    completion = tok.encode("日 there", add_special_tokens=False)
    checked = 0
    for cut in range(len(prompt) - 7, len(prompt) + 1):
        if tok.decode(prompt[:cut] + completion).startswith(tok.decode(prompt[:cut])):
            chunks, tail, det = stream(tok, prompt[:cut], completion)
            assert det.text == expected(tok, prompt[:cut], completion)
            assert not any(FFFD in c for c in chunks + [tail])
            checked += 1
    assert checked >= 3  # the cuts between characters


def test_window_stays_short(tok):
    """Cost per token is O(window): no decode call grows with the sequence length."""
    det = tok.new_detokenizer(tok.encode("Once upon a time " * 50))
    spans = []
    decode = det._decode
    det._decode = lambda start, end: (spans.append(end - start), decode(start, end))[1]
    line = tok.encode("Lily saw a   big red ball 🙂 日本.\n", add_special_tokens=False)
    story = (line + [2] * 40) * 25  # runs of skipped special ids must not widen the window either
    for i in story:
        det.add(i)
    det.flush()
    assert len(story) > 1000 and max(spans) <= 12


def _check_invariant(tok, prompt, completion, skip_special_tokens=True):
    chunks, tail, det = stream(tok, prompt, completion, skip_special_tokens)
    assert det.text == "".join(chunks) + tail
    assert det.text == expected(tok, prompt, completion, skip_special_tokens), (prompt, completion)
    # Held-back text is only ever an unfinished character, so a chunk from add() can carry
    # U+FFFD only where the final text has one for good.
    return chunks


def test_random_sequences_realistic(tok, raw):
    """Random mixes of word pieces, whole characters as byte runs, and special ids."""
    rng = random.Random(1234)
    words = [i for i in range(tok.vocab_size) if not raw.id_to_token(i).startswith("<")]
    chars = "aé日本🙂ï€\n "
    def sample(n):
        out = []
        for _ in range(n):
            r = rng.random()
            if r < 0.6:
                out.append(rng.choice(words))
            elif r < 0.9:
                ch = rng.choice(chars)
                out += [raw.token_to_id(f"<0x{b:02X}>") for b in ch.encode()]
            else:
                out.append(rng.choice([0, 1, 2]))
        return out
    for case in range(300):
        prompt, completion = sample(rng.randrange(0, 8)), sample(rng.randrange(1, 25))
        skip = case % 4 != 0
        chunks = _check_invariant(tok, prompt, completion, skip)
        assert not any(FFFD in c for c in chunks)


def test_random_sequences_any_ids(tok):
    """Uniformly random ids (half of them bytes, so much invalid UTF-8)."""
    rng = random.Random(99)
    checked = 0
    for _ in range(400):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        completion = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        det = tok.new_detokenizer(prompt)
        for i in completion:
            det.add(i)
        det.flush()  # must never fail, whatever the ids
        full, base = tok.decode(prompt + completion), tok.decode(prompt)
        if full.startswith(base) and is_prefix_stable(tok, prompt, completion):
            assert det.text == full[len(base):], (prompt, completion)
            checked += 1
    assert checked >= 250  # about 320 of the 400 are prefix-stable


# -- byte_level --------------------------------------------------------------------------------


def test_byte_level_basics(byte_tok):
    assert byte_tok.vocab_size == 259
    assert (byte_tok.bos_token_id, byte_tok.eos_token_ids, byte_tok.add_bos_token) == (1, (2,), True)
    assert byte_tok.encode("A") == [1, 3 + ord("A")]
    assert byte_tok.encode("é", add_special_tokens=False) == [3 + b for b in "é".encode()]
    assert [byte_tok.decode([3 + b]) for b in b" \n\t~A"] == [" ", "\n", "\t", "~", "A"]
    assert byte_tok.decode([0, 1, 2, 3 + 65]) == "A"


def test_byte_level_round_trip(byte_tok):
    rng = random.Random(7)
    alphabet = [chr(c) for c in [*range(0x20, 0x7F), *range(0xA0, 0x2FF), *range(0x4E00, 0x4E80),
                                 *range(0x1F600, 0x1F650), 0, 9, 10, 13, 0xFEFF, 0x10FFFF]]
    texts = ["", " ", "  leading and trailing  ", "emoji 🙂👍🏽🇯🇵 family 👨‍👩‍👧", "\r\n\t\x00"]
    texts += ["".join(rng.choices(alphabet, k=rng.randrange(1, 40))) for _ in range(100)]
    for text in texts:
        ids = byte_tok.encode(text)
        assert ids[0] == 1 and len(ids) == 1 + len(text.encode())
        assert byte_tok.decode(ids) == text
        # Stream the rest after a prompt cut at a random character boundary.
        cut = rng.randrange(len(text) + 1)
        prompt = byte_tok.encode(text[:cut])
        chunks, tail, det = stream(byte_tok, prompt, byte_tok.encode(text[cut:], add_special_tokens=False))
        assert not any(FFFD in c for c in chunks + [tail])
        assert det.text == text[cut:]


def test_byte_level_incremental_random_bytes(byte_tok):
    rng = random.Random(5)
    for _ in range(300):
        prompt = [1] + [rng.randrange(3, 259) for _ in range(rng.randrange(0, 6))]
        completion = [rng.randrange(0, 259) for _ in range(rng.randrange(1, 16))]
        full, base = byte_tok.decode(prompt + completion), byte_tok.decode(prompt)
        if full.startswith(base):
            _check_invariant(byte_tok, prompt, completion)


def test_byte_level_chat_template(byte_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    assert byte_tok.apply_chat_template(messages) == "<|system|>\nBe brief.\n<|user|>\nHi 🙂\n<|assistant|>\n"
    assert byte_tok.apply_chat_template(messages, add_generation_prompt=False).endswith("Hi 🙂\n")


# -- chat templates ----------------------------------------------------------------------------

TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'assistant' %}
[{{ m.role }}] {{ m['content'] }}{{ eos_token }}
    {% else %}
[{{ m.role }}] {{ m['content'] }}
    {% endif %}
{% endfor %}
{% if tools %}tools={{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}[assistant]{% endif %}"""


def test_chat_template_renders(tok):
    messages = [{"role": "user", "content": "a<b"}, {"role": "assistant", "content": "ok"}]
    out = tok.apply_chat_template(messages, chat_template=TEMPLATE, tools=[{"name": "f<x>"}])
    # trim_blocks/lstrip_blocks as in transformers: block tags leave no blank lines or indent.
    assert out == '<s>\n[user] a<b\n[assistant] ok</s>\ntools=[{"name": "f<x>"}]\n[assistant]'
    out = tok.apply_chat_template(messages, add_generation_prompt=False, chat_template=TEMPLATE)
    assert out.endswith("ok</s>\n")


def test_chat_template_is_compiled_once(tok):
    source = "{% for m in messages %}{{ m.content }}{% endfor %} #once"
    tok.apply_chat_template([], chat_template=source)
    before = compile_template.cache_info()
    tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=source)
    after = compile_template.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_chat_template_helpers(tok):
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('Conversation roles must alternate') }}")
    year = tok.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}")
    assert year.isdigit() and len(year) == 4


def test_chat_template_is_sandboxed(tok):
    # Sandbox violations surface as ChatTemplateError (a ValueError: the server's 400) naming the cause.
    with pytest.raises(ChatTemplateError, match="SecurityError: access to attribute"):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):  # immutable: templates cannot edit messages
        tok.apply_chat_template([{"role": "user"}], chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="too large"):  # no gigabyte strings
        tok.apply_chat_template([], chat_template="{{ 'x' * 10**9 }}")


def test_chat_template_time_limit(tok):
    slow = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="more than 0.2 s"):
        tok.apply_chat_template([], chat_template=slow, time_limit=0.2)
    assert time.perf_counter() - start < 2
    assert sys.gettrace() is None  # the deadline hook is gone again


def test_no_chat_template(tok):
    with pytest.raises(ValueError, match="has no chat template; pass chat_template="):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
