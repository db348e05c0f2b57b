#!/usr/bin/env python3
"""Generate a tiny random Qwen3 embedding model (sentence-transformers layout) and golden pooled states (issue 30).

Run under the golden venv (recipe in golden_common.py; needs sentence-transformers for the cross-check):

    .venv-golden/bin/python tools/make_embedding_fixtures.py

Steps, into ``tests/fixtures/embedding/qwen3_embed/``:

1. A float32 Qwen3 (hidden 64, 2 layers, GQA 4:2, head_dim 32, QK-norm, tied embeddings as Qwen3-Embedding)
   saved as sentence-transformers saves its Transformer module: the bare ``Qwen3Model`` (AutoModel) with
   ``save_pretrained`` (config.json architectures ["Qwen3Model"], tensor names without a "model." prefix,
   no lm_head), plus modules.json (Transformer -> Pooling -> Normalize), 1_Pooling/config.json
   (pooling_mode_lasttoken true, include_prompt true), sentence_bert_config.json and
   config_sentence_transformers.json as Qwen3-Embedding ships them (no tokenizer: token ids only).
2. Four token sequences of lengths 4, 11, 23 and 40, each run alone through AutoModel (no padding can
   influence anything). Golden ``golden.npz``:

       input_ids               int32 [4, 40]      right-padded with 0; only the first lengths[i] count
       lengths                 int32 [4]          4, 11, 23, 40
       hidden_states           float32 [4, 40, 64] last_hidden_state (after the final RMSNorm), 0 past length
       last_token              float32 [4, 64]    hidden_states[i, lengths[i] - 1]
       mean                    float32 [4, 64]    mean of hidden_states[i, :lengths[i]]
       last_token_normalized   float32 [4, 64]    last_token / max(||last_token||_2, 1e-12)
       mean_normalized         float32 [4, 64]    mean / max(||mean||_2, 1e-12)

3. sentence-transformers' own Pooling (loaded from 1_Pooling/, and a mean-pooling twin) and Normalize
   modules reproduce last_token_normalized and the mean pooling from the same hidden states.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers.models import Normalize, Pooling
from transformers import AutoModel

from golden_common import (FIXTURES_ROOT, fresh_dir, list_dir, random_model, save_model, save_npz_deterministic,
                           setup_determinism)

OUT_DIR = FIXTURES_ROOT / "embedding" / "qwen3_embed"
INIT_SEED = 5001
LENGTHS = (4, 11, 23, 40)
QWEN3 = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, attention_bias=False, use_sliding_window=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
             dtype="float32")
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def pooling_config(mode: str, dim: int) -> dict:
    cfg = {"word_embedding_dimension": dim}
    cfg.update({f"pooling_mode_{m}": m == mode for m in POOLING_MODES})
    cfg["include_prompt"] = True
    return cfg


def write_json(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def normalized(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


def st_pool(pooling_dir, hidden: np.ndarray, normalize: bool) -> np.ndarray:
    """sentence-transformers' Pooling (+ Normalize) over one unpadded sequence's hidden states."""
    modules = [Pooling.load(str(pooling_dir))] + ([Normalize()] if normalize else [])
    feats = {"token_embeddings": torch.from_numpy(hidden[None]),
             "attention_mask": torch.ones(1, hidden.shape[0], dtype=torch.int64)}
    for mod in modules:
        feats = mod(feats)
    return feats["sentence_embedding"][0].numpy()


def main() -> int:
    setup_determinism()
    out = fresh_dir(OUT_DIR)
    model = random_model("qwen3", QWEN3, INIT_SEED, auto_class=AutoModel)
    save_model(model, out)
    hidden_size = QWEN3["hidden_size"]
    write_json(out / "modules.json", MODULES)
    write_json(out / "1_Pooling" / "config.json", pooling_config("lasttoken", hidden_size))
    write_json(out / "sentence_bert_config.json", {"max_seq_length": QWEN3["max_position_embeddings"],
                                                   "do_lower_case": False})
    write_json(out / "config_sentence_transformers.json",
               {"prompts": {"query": "", "document": ""}, "default_prompt_name": None,
                "similarity_fn_name": "cosine"})

    rng = np.random.default_rng(INIT_SEED)
    ids = np.zeros((len(LENGTHS), max(LENGTHS)), dtype=np.int32)
    hidden = np.zeros((len(LENGTHS), max(LENGTHS), hidden_size), dtype=np.float32)
    reloaded = AutoModel.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(3, QWEN3["vocab_size"], size=n)
        with torch.no_grad():
            h = model(torch.tensor(ids[None, i, :n], dtype=torch.long)).last_hidden_state[0].numpy()
            again = reloaded(torch.tensor(ids[None, i, :n], dtype=torch.long)).last_hidden_state[0].numpy()
        assert np.array_equal(h, again), "reloaded checkpoint differs"
        hidden[i, :n] = h
    last = np.stack([hidden[i, n - 1] for i, n in enumerate(LENGTHS)])
    mean = np.stack([hidden[i, :n].mean(axis=0) for i, n in enumerate(LENGTHS)]).astype(np.float32)
    arrays = {"input_ids": ids, "lengths": np.array(LENGTHS, dtype=np.int32), "hidden_states": hidden,
              "last_token": last, "mean": mean, "last_token_normalized": normalized(last),
              "mean_normalized": normalized(mean)}
    save_npz_deterministic(out / "golden.npz", arrays)

    with tempfile.TemporaryDirectory() as tmp:
        mean_dir = Path(tmp)
        write_json(mean_dir / "config.json", pooling_config("mean_tokens", hidden_size))
        for i, n in enumerate(LENGTHS):
            st_last = st_pool(out / "1_Pooling", hidden[i, :n], normalize=True)
            st_mean = st_pool(mean_dir, hidden[i, :n], normalize=False)
            assert np.allclose(st_last, arrays["last_token_normalized"][i], atol=1e-6, rtol=0), i
            assert np.allclose(st_mean, mean[i], atol=1e-6, rtol=0), i
    cos = arrays["last_token_normalized"] @ arrays["last_token_normalized"].T
    print(f"sentence-transformers Pooling/Normalize agree; |last_token| {np.linalg.norm(last, axis=-1).round(2)}, "
          f"|mean| {np.linalg.norm(mean, axis=-1).round(2)}; cosine between sequences "
          f"{cos[np.triu_indices(4, 1)].round(3)}")
    list_dir(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
