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
- `random-mm` (vLLM's): `random`'s text as a chat message, followed by images of random pixels sent as
  `data:` URLs (JPEG). Images per request drawn uniformly from [floor(n * (1 - r)), ceil(n * (1 + r))] and
  capped at the per-prompt limit; each image's size drawn from `buckets` {(height, width, frames):
  probability} (frames 1: images). The text comes from the same draws as `random`'s at the same seed, so
  1 or 4 images and none compare at the same text. `num_distinct_images` N > 0 (jaxserve's) draws every
  image from N made up front: N = 1 repeats one image, what an encoder cache is for.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import io
import json
import math
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
    images: int = 0  # images in `messages`


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


DEFAULT_MM_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"


def parse_mm_buckets(value) -> dict[tuple[int, int], float]:
    """`--random-mm-bucket-config` as vLLM takes it, a dict literal {(height, width, frames): probability}
    (text or a dict) -> {(height, width): probability}: entries of probability 0 dropped, the rest scaled to
    sum to 1. Frames above 1 are videos, which are not generated."""
    text = value
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"--random-mm-bucket-config {text!r} is not a dict such as {DEFAULT_MM_BUCKETS}: "
                             f"{e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--random-mm-bucket-config {text!r} is not a dict such as {DEFAULT_MM_BUCKETS}")
    buckets: dict[tuple[int, int], float] = {}
    for key, p in value.items():
        if not (isinstance(key, tuple) and len(key) == 3
                and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in key)):
            raise ValueError(f"--random-mm-bucket-config: {key!r} is not (height, width, frames), positive integers")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < math.inf:
            raise ValueError(f"--random-mm-bucket-config: {key!r} has probability {p!r}, not a number >= 0")
        if p and key[2] != 1:
            raise ValueError(f"--random-mm-bucket-config: {key!r} is a video ({key[2]} frames): only images "
                             f"(frames 1) are generated")
        if p:
            buckets[key[:2]] = buckets.get(key[:2], 0.0) + p
    if not buckets:
        raise ValueError(f"--random-mm-bucket-config {text!r}: no size has a probability above 0")
    total = sum(buckets.values())
    return {size: p / total for size, p in buckets.items()}


def image_data_url(pixels: np.ndarray) -> str:
    """[height, width, 3] uint8 as a `data:image/jpeg;base64,...` URL."""
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def random_mm_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                       tokenizer=None, *, base_items: int = 1, items_range_ratio: float = 0.0, limit: int = 16,
                       buckets=None, num_distinct_images: int = 0) -> list[SampleRequest]:
    if base_items < 0 or not 0 <= items_range_ratio <= 1 or num_distinct_images < 0:
        raise ValueError(f"random-mm: items per request must be >= 0, its range ratio in [0, 1] and the distinct "
                         f"images >= 0; got {base_items}, {items_range_ratio} and {num_distinct_images}")
    if base_items > limit:
        raise ValueError(f"--random-mm-base-items-per-request {base_items} is over the {limit} images a prompt may "
                         f"carry (--random-mm-limit-mm-per-prompt)")
    sizes = parse_mm_buckets(DEFAULT_MM_BUCKETS if buckets is None else buckets)
    texts = random_requests(n, input_len, output_len, range_ratio, seed, tokenizer, form="text")
    rng = np.random.default_rng([seed, 1])  # the images' own draws: the text is random's, whatever the images
    low, high = math.floor(base_items * (1 - items_range_ratio)), math.ceil(base_items * (1 + items_range_ratio))
    counts = np.minimum(rng.integers(low, high + 1, n), limit)
    shapes, probabilities = list(sizes), list(sizes.values())

    def new_image() -> str:
        height, width = shapes[rng.choice(len(shapes), p=probabilities)]
        return image_data_url(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))

    pool = [new_image() for _ in range(num_distinct_images)]
    requests = []
    for text, count in zip(texts, counts):
        urls = [pool[rng.integers(len(pool))] if pool else new_image() for _ in range(int(count))]
        content = [{"type": "text", "text": text.prompt},
                   *({"type": "image_url", "image_url": {"url": url}} for url in urls)]
        requests.append(SampleRequest(text.prompt, text.output_len, [{"role": "user", "content": content}],
                                      images=len(urls)))
    return requests
