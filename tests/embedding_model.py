"""The embedding fixture as a servable model directory, shared by the engine and server tests.

`tests/fixtures/embedding/qwen3_embed` is a tiny random Qwen3 saved as sentence-transformers saves it
(bare decoder, no `model.` prefix, no LM head) with goldens over token ids and no tokenizer. The copy
made here adds a word-level tokenizer whose word `t<i>` is token i, so text inputs map to known ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "embedding" / "qwen3_embed"

# Shapes no other test uses (the run shares one compilation cache): a 16-token budget makes the goldens'
# 23- and 40-token prompts arrive in chunks.
ENGINE_KWARGS = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(8, 16), page_size=4,
                     num_pages=96, max_model_len=64)


def golden() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURE / "golden.npz"))


def golden_prompts() -> list[list[int]]:
    g = golden()
    return [g["input_ids"][i, :n].tolist() for i, n in enumerate(g["lengths"])]


def as_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def servable_copy(root: Path, **config: object) -> Path:
    """The fixture with a tokenizer, under `root`; `config`: entries added to its config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = root / "qwen3_embed"
    shutil.copytree(FIXTURE, target)
    if config:
        (target / "config.json").write_text(json.dumps({**json.loads((FIXTURE / "config.json").read_text()),
                                                        **config}, indent=2))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(target / "tokenizer.json"))
    return target
