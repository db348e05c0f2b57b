"""What `jaxserve bench serve` sends: a list of requests drawn from a dataset, reproducible from a seed.

- `random`: prompts of about `input_len` tokens and `output_len` output tokens, both drawn uniformly from
  [len * (1 - range_ratio), len * (1 + range_ratio)]. With a tokenizer, prompts are token ids (exact
  lengths; `form="text"` decodes them to text); without one, text of common words (the server's usage
  gives the true prompt length). Token-id prompts begin with the special tokens the tokenizer adds (a
  Llama's BOS), as text would reach the model: `input_len` counts them, as vLLM's random dataset does.
- `prefix-repetition`: `num_prefixes` shared prefixes of `prefix_len` tokens, each request one of them
  plus its own `suffix_len` tokens: what a prefix cache is for.
- `jsonl`: a file with one request per line, `{"prompt": ...}` or `{"messages": [...]}`, optionally
  `"max_tokens"`; requests without one take `output_len`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

_WORDS = ("time little girl park ball dog happy play sun tree friend big red day went saw home water cat bird "
          "house river light small green garden book moon star road").split()


@dataclasses.dataclass
class SampleRequest:
    prompt: str | list[int] | None  # completions: text or token ids
    output_len: int
    messages: list[dict] | None = None  # chat: a conversation
    prompt_len: int | None = None  # known only for token-id prompts


def _lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    low, high = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, n)


def _plain_token_ids(tokenizer) -> np.ndarray:
    """Ids that decode to ordinary text: no special tokens, no byte-fallback pieces."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    special = {i for t, i in vocab.items() if t.startswith("<") and t.endswith(">")}
    return np.array(sorted(set(vocab.values()) - special))


def _leading_special_ids(tokenizer) -> list[int]:
    """What the tokenizer adds in front of any text (Llama: [BOS]; Qwen: nothing)."""
    return tokenizer.encode("", add_special_tokens=True).ids


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from tokenizers import Tokenizer
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    return Tokenizer.from_file(str(file))


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                    tokenizer=None, form: str = "ids") -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    inputs, outputs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    if tokenizer is None:
        return [SampleRequest(" ".join(rng.choice(_WORDS, int(k))), int(o)) for k, o in zip(inputs, outputs)]
    ids = _plain_token_ids(tokenizer)
    lead = _leading_special_ids(tokenizer) if form == "ids" else []
    requests = []
    for k, o in zip(inputs, outputs):
        tokens = lead[:int(k)] + rng.choice(ids, max(0, int(k) - len(lead))).tolist()
        prompt = tokens if form == "ids" else tokenizer.decode(tokens)
        requests.append(SampleRequest(prompt, int(o), prompt_len=int(k) if form == "ids" else None))
    return requests


def prefix_repetition_requests(n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                               seed: int = 0, tokenizer=None) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        prefixes = [" ".join(rng.choice(_WORDS, prefix_len)) for _ in range(num_prefixes)]
        return [SampleRequest(prefixes[i % num_prefixes] + " " + " ".join(rng.choice(_WORDS, suffix_len)),
                              output_len) for i in range(n)]
    ids, lead = _plain_token_ids(tokenizer), _leading_special_ids(tokenizer)
    prefixes = [lead[:prefix_len] + rng.choice(ids, max(0, prefix_len - len(lead))).tolist()
                for _ in range(num_prefixes)]
    return [SampleRequest(prefixes[i % num_prefixes] + rng.choice(ids, suffix_len).tolist(), output_len,
                          prompt_len=prefix_len + suffix_len) for i in range(n)]


def jsonl_requests(path: str, n: int | None, output_len: int) -> list[SampleRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON: {e}") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise ValueError(f"{path}:{number}: each line needs exactly one of 'prompt' or 'messages'")
            requests.append(SampleRequest(row.get("prompt"), int(row.get("max_tokens", output_len)),
                                          messages=row.get("messages")))
    if not requests:
        raise ValueError(f"{path}: no requests")
    if n is not None:  # cycle through the file to reach n requests
        requests = [requests[i % len(requests)] for i in range(n)]
    return requests
