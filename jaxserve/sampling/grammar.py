"""Structured outputs: which tokens a constrained sequence may draw next, from a grammar, on the host.

1. `StructuredOutputsParams` is a request's constraint in vLLM's shape: exactly one of `json` (a JSON
   Schema), `json_object`, `regex`, `choice` or `grammar` (Lark, or llama.cpp's GBNF). Every request
   spelling the server accepts (`response_format`, `structured_outputs`, `guided_*`) maps onto it.
2. `GrammarCompiler` turns it into an llguidance grammar (a JSON Schema is read strictly, as vLLM's
   default backend reads it: objects and arrays take only what they list; see jaxserve/sampling/json_schema.py),
   checks it against the model's tokenizer within fixed work limits (an invalid or too costly grammar is
   an `InvalidParameter` naming the field) and caches the result by spec. Each constrained sequence gets
   its own `Matcher`, a copy of the cached one.
3. Per step, `fill_masks` writes each constrained row's allowed-token bitmask (bit t of word t // 32 set:
   token t allowed) into the step's `[rows, ceil(vocab / 32)]` int32 array — in parallel over the rows —
   and the jitted step applies it to the logits before anything else. Unconstrained rows stay all ones.
   The matcher consumes each token the host accepts; a sequence whose grammar is complete stops.
4. A reasoning model thinks before it answers: with `reasoning_end` (e.g. "</think>") the grammar is
   wrapped so that anything but EOS may come first, then that text, then the constraint — the answer
   follows the schema, the thinking is free. Near the token budget, the closing walk writes the end of
   the thinking first, so even a cut-off answer parses.

llguidance, not xgrammar: it needs no torch (this project's whole point is a JAX stack without it), it
computes a mask in tens of microseconds without a per-schema precompilation pass, so a new schema costs
almost nothing on first use, and it bounds the work a grammar may cost ("fuel"), which a server facing
untrusted schemas needs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from typing import Any

import numpy as np

from jaxserve.errors import InvalidParameter
from jaxserve.sampling.json_schema import ascii_digits, prepare_schema

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused before compiling
_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first

# Work limits for building and running one grammar (llguidance "fuel"): about 20 ms of lexer
# construction and 5 ms of mask work per token at llguidance's documented rates. A grammar that needs
# more is refused at compile time, or ends its sequence if it runs out while matching.
_LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
               max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)

_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Whitespace JSON may have between tokens unless the request says otherwise: none, a space, or a line break
# and indentation — as llama.cpp's JSON grammars bound it. Unbounded whitespace lets a model that likes
# newlines (small models do) fill max_tokens with them and never close the object.
JSON_WHITESPACE = r"(\x20|\n{1,2}[\x20\t]{0,20})?"


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: set exactly one constraint."""
    json: str | dict | None = None  # a JSON Schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without optional whitespace (compact output)
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between tokens (default JSON_WHITESPACE)
    # vLLM's option for its llguidance backend (objects take only the properties they list): accepted, and
    # already how every JSON Schema is read here (jaxserve/sampling/json_schema.py).
    disable_additional_properties: bool = False
    # The text that ends a reasoning model's thinking ("</think>"): the constraint applies after it (see
    # _ReasoningEnd). None: from the first token.
    reasoning_end: str | None = None
    # Where the spec came from in the request, for error messages (e.g. "response_format.json_schema").
    field: str = dataclasses.field(default="structured_outputs", compare=False)

    def __post_init__(self):
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter(self.field, f"{self.field} needs exactly one of {', '.join(_KINDS)}"
                                   + (f"; got {', '.join(given)}" if given else ""))
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidParameter(self.field, f"{self.field}: choice must be a non-empty list of strings")
        if len(self.text) > MAX_SPEC_CHARS:
            raise InvalidParameter(self.field, f"{self.field}: the {self.kind} is longer than "
                                   f"{MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string (a JSON Schema serialised canonically): the cache key's core."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            try:
                return json.dumps(value, ensure_ascii=False)  # key order is property order: keep it
            except (TypeError, ValueError, RecursionError):
                raise InvalidParameter(self.field, f"{self.field}: the JSON Schema is not serialisable "
                                       f"(or nested too deeply)") from None
        if self.kind == "choice":
            return json.dumps(list(value), ensure_ascii=False)
        return "" if value is True else str(value)

    @property
    def key(self) -> tuple:
        return (self.kind, self.text, self.disable_any_whitespace, self.whitespace_pattern,
                self.reasoning_end)


@dataclasses.dataclass(frozen=True)
class _ReasoningEnd:
    """How the end of the thinking shows in tokens. A tag that is one added token (Qwen3's and DeepSeek-R1's
    "</think>") is matched by id: llguidance treats every added token as special, never as text. Any other
    tag is text, matched in the bytes however the model spells it."""
    text: bytes
    token: int | None  # the added token that is the tag, if it is one
    ids: tuple[int, ...]  # a tokenization of the tag: what the closing walk writes

    def after(self, tail: bytes, token: int, data: bytes) -> tuple[bytes | None, bytes]:
        """Given the last bytes of the thinking so far (`tail`), a token and its bytes: the new tail (None once
        the thinking ended) and the bytes that follow its end within the token."""
        if self.token is not None:
            return (None, b"") if token == self.token else (b"", b"")
        text = tail + data
        at = text.find(self.text)
        if at >= 0:
            return None, text[at + len(self.text):]
        return text[len(text) - len(self.text) + 1:] if len(text) >= len(self.text) else text, b""


class Matcher:
    """One sequence's position in its grammar (a thin wrapper: the engine speaks only this)."""

    def __init__(self, matcher, token_bytes: list[bytes], reasoning_end: _ReasoningEnd | None = None):
        self._m = matcher
        self._bytes = token_bytes
        self.in_string = self.escaped = False  # where the text is, for the closing walk's preferences
        self._end = reasoning_end
        self._tail: bytes | None = b"" if reasoning_end is not None else None  # None: not thinking

    @property
    def reasoning(self) -> bool:
        """Still in the free thinking before the constrained answer."""
        return self._tail is not None

    def consume(self, token: int) -> bool:
        """Advance by an accepted token; False if the grammar does not allow it (the sequence must end)."""
        data = self._bytes[token]
        if self._tail is not None:
            self._tail, data = self._end.after(self._tail, token, data)
        if self._tail is None:  # quotes in the thinking say nothing about the answer's strings
            self.in_string, self.escaped = _scan_json(self.in_string, self.escaped, data)
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence ends with finish_reason stop)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


# Closing a constrained output before its token budget runs out: the host walks the grammar to its end,
# picking per step the allowed token it likes best (lower first). Outside a JSON string: close containers,
# then whatever completes a pending key or value in one token; inside one: the closing quote. Then the
# shortest text, whitespace last. Any allowed token keeps the output valid; the order only makes it short.
_OUTSIDE_STRING = {b"}": 1, b"]": 1, b":": 2, b'"': 3, b"0": 4, b",": 5}
_INSIDE_STRING = {b'"': 1}
CLOSE_MARGIN = 6  # one free draw may lengthen the way out by about this much (a token like `{"` opens two things)
# Within this many spare draws of the way out, every free draw is checked before it is kept: one that
# enters a structure too long to finish in the budget (an object with required fields) is replaced by the
# first token of the way out.
GUARD_WINDOW = 48


def _scan_json(in_string: bool, escaped: bool, data: bytes) -> tuple[bool, bool]:
    """Whether the text is inside a JSON string (and after a backslash there) once `data` follows."""
    for byte in data:
        if escaped:
            escaped = False
        elif in_string and byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # quote
            in_string = not in_string
    return in_string, escaped


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; thread-safe (the server compiles off its event loop,
    the engine thread makes matchers)."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, Any] = collections.OrderedDict()  # key -> template matcher
        self._ll_tokenizer = None
        self._executor = None
        self._token_bytes: list[bytes] = []
        self._preference: dict[bool, np.ndarray] = {}
        self._favourites: dict[bool, list[int]] = {}  # token ids ranked below every plain text, best first
        self._reasoning_ends: dict[str, _ReasoningEnd] = {}

    def _ll(self):
        """llguidance's view of the tokenizer, built on first use (a large vocabulary takes a moment)."""
        import llguidance
        if self._ll_tokenizer is None:
            start = time.perf_counter()
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                                        eos_token=list(self._tokenizer.eos_token_ids) or None)
            self._executor = llguidance.LLExecutor()
            self._build_preferences()
            logger.info("structured outputs: llguidance %s over %d tokens ready in %.2fs", llguidance.__version__,
                        self.vocab_size, time.perf_counter() - start)
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Check (and cache) the spec's grammar; InvalidParameter naming the field if it is bad or too costly."""
        self._template(spec)

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        end = self._reasoning_end(spec.reasoning_end) if spec.reasoning_end else None
        return Matcher(self._template(spec).deep_copy(), self._token_bytes, end)

    def _reasoning_end(self, text: str) -> _ReasoningEnd:
        if text not in self._reasoning_ends:
            ids = tuple(self._tokenizer.encode(text, add_special_tokens=False))
            single = ids[0] if len(ids) == 1 and self._ll().is_special_token(ids[0]) else None
            self._reasoning_ends[text] = _ReasoningEnd(text.encode(), single, ids)
        return self._reasoning_ends[text]

    def _after_reasoning(self, grammar: str, text: str) -> str:
        """`grammar` wrapped to apply after the thinking: any tokens but EOS (and the tag), then the tag."""
        end = self._reasoning_end(text)
        answer = json.loads(grammar)["grammars"]  # one grammar: what _grammar makes of any spec
        answer[0]["name"] = "answer"
        if end.token is not None:
            closed = ",".join(str(t) for t in sorted({end.token, *self._ll_tokenizer.eos_tokens}))
            lark = f"start: <[^{closed}]>* <[{end.token}]> @answer"
        else:  # text: matched lazily, so the thinking ends at its first occurrence
            tag = "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
            lark = f"start: thinking @answer\nthinking[lazy]: /(?s:.*){tag}/"
        return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": lark}, *answer]})

    def _template(self, spec: StructuredOutputsParams):
        import llguidance
        key = spec.key
        with self._lock:
            tokenizer = self._ll()
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = _grammar(spec)
        if spec.reasoning_end:
            grammar = self._after_reasoning(grammar, spec.reasoning_end)
        limits = llguidance.LLParserLimits(**_LIMITS)
        start = time.perf_counter()
        # Built outside the lock: llguidance releases the GIL while it builds, so others keep going.
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidParameter(spec.field, f"{spec.field}: invalid {spec.kind}: {_first_line(matcher.get_error())}")
        elapsed = time.perf_counter() - start
        if elapsed > 0.5:
            logger.warning("structured outputs: a %s grammar took %.2fs to build", spec.kind, elapsed)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def closing(self, matcher: Matcher, budget: int, after: int | None = None) -> list[int] | None:
        """A way to the end of the grammar from where `matcher` is (or from after token `after` there), at
        most `budget` tokens long (ending in EOS, or with the grammar complete), or None if the walk finds
        none. The matcher does not move."""
        walk, path = matcher._m.deep_copy(), []
        in_string, escaped, thinking = matcher.in_string, matcher.escaped, matcher._tail
        if after is not None:
            if not walk.consume_token(after):
                return None
            data = self._token_bytes[after]
            if thinking is not None:
                thinking, data = matcher._end.after(thinking, after, data)
            if thinking is None:
                in_string, escaped = _scan_json(in_string, escaped, data)
        if thinking is not None:  # end the thinking first: the answer must still fit
            end = matcher._end.ids
            if len(end) > budget or not walk.consume_tokens(list(end)):
                return None
            path.extend(end)
        eos = self._ll_tokenizer.eos_tokens
        while len(path) < budget and not walk.is_stopped():
            forced = walk.compute_ff_tokens()[:budget - len(path)]  # text the grammar allows alone (a key)
            if forced:
                if not walk.consume_tokens(forced):  # llguidance's own tokens: never refused
                    return None
                path.extend(forced)
                for token in forced:
                    in_string, escaped = _scan_json(in_string, escaped, self._token_bytes[token])
                continue
            bits = np.frombuffer(walk.compute_bitmask(), np.uint8)
            # The favourites settle most steps with a few bit tests; the full ranking is the fallback.
            token = next((t for t in self._favourites[in_string] if bits[t >> 3] >> (t & 7) & 1), None)
            if token is None:
                allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
                if not allowed.any():
                    return None
                token = int(np.argmin(np.where(allowed, self._preference[in_string], np.inf)))
            path.append(token)
            if token in eos:
                return path
            if not walk.consume_token(token):
                return None
            in_string, escaped = _scan_json(in_string, escaped, self._token_bytes[token])
        return path if walk.is_stopped() else None

    def keeps_way_out(self, matcher: Matcher, token: int) -> bool:
        """Whether `token` leaves the way to the end of the grammar as it is: text that stays inside a JSON
        string, or whitespace between JSON tokens. Such a draw spends one token of the budget and nothing else."""
        if matcher.reasoning:  # the way out starts with the end of the thinking, wherever the thinking is
            return True
        data = self._token_bytes[token]
        if not data:
            return False
        if matcher.in_string:
            return not matcher.escaped and b'"' not in data and b"\\" not in data
        return data.isspace()

    def _build_preferences(self) -> None:
        """Each token's bytes, and how much the closing walk likes it outside / inside a string."""
        tok = self._ll_tokenizer
        self._token_bytes = [tok.decode_bytes([t]) if t < tok.vocab_size and not tok.is_special_token(t) else b""
                             for t in range(self.vocab_size)]
        self._preference, self._favourites = {}, {}
        for in_string, favourites in ((False, _OUTSIDE_STRING), (True, _INSIDE_STRING)):
            rank = np.array([favourites.get(text, 1e5 if text.isspace() else 10 + len(text)) if text else 1e6
                             for text in self._token_bytes])
            rank[list(tok.eos_tokens)] = 0  # once the grammar accepts, ending is the shortest way out
            self._preference[in_string] = rank
            self._favourites[in_string] = [int(t) for t in np.argsort(rank, kind="stable") if rank[t] < 10]

    def fill_masks(self, rows: list[tuple[Matcher, int]], masks: np.ndarray) -> None:
        """Write each (matcher, row)'s allowed tokens into masks[row] ([rows, mask_words] int32, C order)."""
        from llguidance.numpy import fill_next_token_bitmask_par
        fill_next_token_bitmask_par(self._executor, [(m._m, row) for m, row in rows], masks)


def _grammar(spec: StructuredOutputsParams) -> str:
    """The spec in llguidance's grammar format."""
    import llguidance
    kind, field = spec.kind, spec.field
    try:
        if kind in ("json", "json_object"):
            # A JSON Schema is strict (only what it lists); json_object is any object.
            schema = prepare_schema(json.loads(spec.text)) if kind == "json" else {"type": "object"}
            if spec.disable_any_whitespace:
                options = {"whitespace_flexible": False}
            else:
                options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern or JSON_WHITESPACE}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(ascii_digits(spec.regex))
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as e:  # not JSON, or a GBNF grammar that does not convert
        raise InvalidParameter(field, f"{field}: invalid {kind}: {_first_line(str(e))}") from None
    except RecursionError:
        raise InvalidParameter(field, f"{field}: the {kind} is nested too deeply") from None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "rejected"
