"""Text <-> token ids: tokenizer loading, encoding, and the hand-off to chat templates and detokenizers.

How text moves through this layer:
1. `Tokenizer.from_pretrained` reads a Hugging Face model folder (tokenizer.json through the
   `tokenizers` library, plus the small JSON files that say which ids are BOS/EOS, whether BOS
   is prepended and what the chat template is). `Tokenizer.byte_level()` builds a file-free
   byte tokenizer for the demo model.
2. `apply_chat_template` renders chat messages to one prompt string in a sandboxed jinja2
   environment with a time limit and output caps (`chat_template.py`); any failure of the
   template is a `ChatTemplateError` (a ValueError).
3. `encode` turns the prompt into ids, with BOS exactly once.
4. While the engine samples, one `IncrementalDetokenizer` per choice (`detokenizer.py`) turns each
   new id into the text that has just become final.

No JAX here: the server and tests use this without touching a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import SecurityError
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from jaxserve.json_files import read_json_object
from jaxserve.text.chat_template import (TEMPLATE_TIME_LIMIT, ChatTemplateError, compile_template,
                                         find_chat_template, render)
from jaxserve.text.detokenizer import IncrementalDetokenizer

_LONG_TEXT = 4096  # characters from which encoding goes through encode_batch (see Tokenizer.encode)

# HF writes int(1e30) as model_max_length when a model sets none; treat huge values as unset.
_NO_MAX_LENGTH = 10**12


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts and chat template of one model."""

    def __init__(
        self,
        backend: _Backend,
        *,
        name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
    ):
        # A tokenizer.json may carry truncation/padding settings meant for training; the engine
        # does its own length checks and must see every id.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

        # Token strings and ids may each be given by a different file; fill one from the other.
        if bos_token_id is None and bos_token is not None:
            bos_token_id = backend.token_to_id(bos_token)
        if bos_token is None and bos_token_id is not None:
            bos_token = backend.id_to_token(bos_token_id)
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        eos_token_ids = _unique([*eos_token_ids, *([eos_id] if eos_id is not None else [])])
        if eos_token is None and eos_token_ids:
            eos_token = backend.id_to_token(eos_token_ids[0])
            eos_id = eos_token_ids[0]
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = eos_token_ids
        self._eos_id = eos_id  # the single EOS that add_eos_token appends

        # What tokenizer.json's post-processor already adds, so encode() can add BOS/EOS
        # exactly once. Without an explicit add_bos_token the post-processor is the authority.
        bare = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        extra = len(full) > len(bare)
        self._post_adds_bos = extra and bos_token_id is not None and full[0] == bos_token_id
        self._post_adds_eos = extra and eos_id is not None and full[-1] == eos_id
        self.add_bos_token: bool = self._post_adds_bos if add_bos_token is None else bool(add_bos_token)
        self.add_eos_token: bool = self._post_adds_eos if add_eos_token is None else bool(add_eos_token)

        self.chat_template: str | None = chat_template
        self.model_max_length: int | None = model_max_length
        self._max_token_chars: int | None = None
        self._token_strs: dict[int, str] = {}
        self._anchor: list[int] | None = None
        self._anchor_text = ""

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, model_dir: str | Path | None = None) -> Tokenizer:
        """Load from a Hugging Face model folder; only tokenizer.json is required. `model_dir`: the model's
        folder when the tokenizer comes from another one (its generation_config and config say which ids
        end the output)."""
        path = Path(path)
        model_dir = Path(model_dir) if model_dir is not None else path
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(_no_tokenizer_json(path, given=path != model_dir))
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON/schema
            raise ValueError(f"{tok_file} could not be read as a tokenizer: {e}") from e

        tok_cfg = read_json_object(path / "tokenizer_config.json")
        gen_cfg = read_json_object(model_dir / "generation_config.json")
        model_cfg = read_json_object(model_dir / "config.json")

        # generation_config is what the model authors stop on; the tokenizer's own EOS is added
        # because chat models often end a turn with it. config.json only when neither says.
        eos_ids = _as_ids(gen_cfg.get("eos_token_id"))
        eos_token = _token_content(tok_cfg.get("eos_token"))
        if not eos_ids and (eos_token is None or backend.token_to_id(eos_token) is None):
            eos_ids = _as_ids(model_cfg.get("eos_token_id"))

        bos_token = _token_content(tok_cfg.get("bos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None:
            fallback = _as_ids(gen_cfg.get("bos_token_id")) or _as_ids(model_cfg.get("bos_token_id"))
            bos_id = fallback[0] if fallback else None
            bos_token = None

        max_len = tok_cfg.get("model_max_length")
        if not isinstance(max_len, (int, float)) or max_len >= _NO_MAX_LENGTH:
            max_len = None

        return cls(
            backend,
            name=str(path),
            bos_token=bos_token,
            eos_token=eos_token,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=tok_cfg.get("add_bos_token"),
            add_eos_token=tok_cfg.get("add_eos_token"),
            chat_template=find_chat_template(path, tok_cfg),
            model_max_length=None if max_len is None else int(max_len),
        )

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """A file-free tokenizer for the demo model: one token per UTF-8 byte.

        Ids: <pad>=0, <s>=1 (BOS), </s>=2 (EOS), byte b = 3 + b; vocab size 259. Built as a
        merge-free BPE over the GPT-2 byte alphabet, so any text round-trips exactly.
        """
        byte_chars = _byte_alphabet()
        specials = ["<pad>", "<s>", "</s>"]
        vocab = {tok: i for i, tok in enumerate(specials)}
        vocab.update({ch: len(specials) + b for b, ch in enumerate(byte_chars)})
        backend = _Backend(models.BPE(vocab=vocab, merges=[]))
        # No regex split: with no merges every byte is its own token anyway.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(
            backend,
            name="byte_level",
            bos_token="<s>",
            eos_token="</s>",
            add_bos_token=True,
            add_eos_token=False,
            chat_template=_BYTE_LEVEL_CHAT_TEMPLATE,
        )

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT:
            # `encode_batch` releases the GIL while it works and `encode` does not: a long prompt tokenized
            # on a server's worker thread would otherwise stall its event loop (and /health) throughout.
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos, eos = self.bos_token_id, self._eos_id
        if bos is not None:
            # Honour add_bos_token whichever way the post-processor was written (HF rebuilds the
            # post-processor from this flag, so does the same thing).
            if self.add_bos_token and not self._post_adds_bos:
                ids = [bos, *ids]
            elif self._post_adds_bos and not self.add_bos_token:
                ids = ids[1:]
            # A prompt that itself starts with the BOS string (chat templates often write
            # bos_token) must not end up with two.
            if self.add_bos_token and ids[:2] == [bos, bos]:
                ids = ids[1:]
        if eos is not None:
            if self.add_eos_token and not self._post_adds_eos:
                ids = [*ids, eos]
            elif self._post_adds_eos and not self.add_eos_token:
                ids = ids[:-1]
        return ids

    @property
    def max_token_chars(self) -> int:
        """The longest token's string: no token covers more characters of a text than this (byte-level
        vocabularies spell each byte as one character, so it bounds the decoded text as well)."""
        if self._max_token_chars is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(1, max((len(t) for t in vocab), default=1))
        return self._max_token_chars

    def backend_json(self) -> str:
        """The `tokenizers` definition as JSON (what grammar libraries build their token tables from)."""
        return self._backend.to_str()

    def token_str(self, token_id: int) -> str:
        """One token's text as it reads inside a text (for logprob entries; special tokens included), cached
        per id. Decoded after an anchor token: a SentencePiece decoder drops the leading space of whatever
        comes first, and " there" must not show as "there"."""
        text = self._token_strs.get(token_id)
        if text is None:
            if self._anchor is None:
                self._anchor = self._backend.encode("a", add_special_tokens=False).ids[:1]
                self._anchor_text = self._backend.decode(self._anchor, skip_special_tokens=False)
            both = self._backend.decode([*self._anchor, token_id], skip_special_tokens=False)
            text = both[len(self._anchor_text):] if both.startswith(self._anchor_text) else \
                self._backend.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = text
        return text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def new_detokenizer(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        time_limit: float | None = TEMPLATE_TIME_LIMIT,
        **extra: Any,
    ) -> str:
        """Render messages to a prompt string (encode it with `encode`).

        `extra` reaches the template as variables (e.g. tools=..., documents=...). Any failure — a
        syntax error, a template's raise_exception(msg), a bad lookup, running past `time_limit`
        seconds or the output caps — raises `ChatTemplateError` with a message for the client.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError(f"tokenizer {self.name} has no chat template; pass chat_template=...")
        try:
            template = compile_template(source)
            variables = dict(messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                             add_generation_prompt=add_generation_prompt, **extra)
            return render(template, variables, time_limit)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, SecurityError, ValueError, TypeError, LookupError, AttributeError,
                ArithmeticError, RecursionError) as e:
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, add_bos={self.add_bos_token})"
        )


# One line per message, then the assistant header when a reply is wanted.
_BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# A slow tokenizer's files: a folder with one of these but no tokenizer.json is converted by transformers.
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "tokenizer_config.json")


def _no_tokenizer_json(path: Path, given: bool) -> str:
    """What to do about a folder without tokenizer.json (`given`: it was named by --tokenizer)."""
    slow = [name for name in _SLOW_TOKENIZER_FILES if (path / name).is_file()]
    convert = (f", or write one beside its {', '.join(slow)} with transformers: "
               f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)" if slow else "")
    return (f"no tokenizer.json in {path}{' (--tokenizer)' if given else ''}: jaxserve reads the `tokenizers` "
            f"library's format; pass --tokenizer DIR for a folder that has one{convert}")


def _token_content(value: Any) -> str | None:
    # tokenizer_config writes special tokens as "<s>" or as {"content": "<s>", "lstrip": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _unique(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _byte_alphabet() -> list[str]:
    """The printable character that byte b is written as by the ByteLevel pre-tokenizer.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are moved
    to U+0100 onward, in byte order, so that no byte becomes whitespace or a control char.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + shifted))
            shifted += 1
    return chars
