"""The LoRA fixtures' tiny random Llama as a servable model folder: its files plus a word-level tokenizer over
its 256 ids (the fixture has none: its goldens are token ids), for the engine and server tests."""

from __future__ import annotations

import json
from pathlib import Path

LORA = Path(__file__).parent / "fixtures" / "lora"
ADAPTERS = ("r4_qv", "r8_all", "r8_rslora_attn", "r4_mlp_alpha4")


def servable_base(folder: Path) -> Path:
    """`folder` holding the base model (links to the fixture's files) and a tokenizer.json: token i is "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        link = folder / name
        if not link.exists():
            link.symlink_to((LORA / "base" / name).resolve())
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))
    return folder


def golden_tokens(name: str) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy continuation) of a fixture's golden."""
    import numpy as np

    g = np.load(LORA / name / "golden.npz")
    ids, n = g["input_ids"].tolist(), int(g["prompt_len"])
    return ids[:n], ids[n:]
