"""Small bf16 model configs of each family, written as config.json folders, for compiling step programs for
real chips (tests/test_compiled_steps.py, tests/test_plan.py): `jaxserve plan` and the compile tests read
config.json only, so no weights are made.

Each starts from a parity fixture's config (tests/fixtures/parity/<case>: the family's own fields, such as
Gemma's layer types and soft caps, or a mixture's experts) with TPU-sized heads: head_dim 128, 8 query and
4 KV heads (so tensor parallelism over 4 splits both), a small vocabulary (its sort dominates a small
program's compile time) and bfloat16 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

PARITY = Path(__file__).resolve().parent / "fixtures" / "parity"
FAMILIES = {"llama": "llama_gqa_untied", "gemma2": "gemma2_softcap", "qwen3_moe": "qwen3_moe"}
HEADS = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128)


def tiny_config(family: str, **overrides) -> dict:
    config = json.loads((PARITY / FAMILIES[family] / "config.json").read_text())
    config.update(HEADS, hidden_size=256, intermediate_size=512, vocab_size=512, max_position_embeddings=1024,
                  torch_dtype="bfloat16")
    if family == "qwen3_moe":  # three layers, the middle one dense (mlp_only_layers): both MLPs in one step
        config.update(moe_intermediate_size=128)
    return config | overrides


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory
