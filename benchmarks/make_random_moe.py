"""A random Qwen3-MoE checkpoint in Hugging Face layout (per-expert tensors, as hub checkpoints store
them), and the dense Qwen3 of its active size, for the MoE benchmark (`benchmarks/moe_vs_llama_cpp.sh`).

    .venv/bin/python benchmarks/make_random_moe.py --tokenizer DIR --out DIR [--dense-out DIR]

Defaults: hidden 1024, 16 layers, 16 / 4 heads (head_dim 64), 64 experts of intermediate 256, top 8,
vocabulary of the tokenizer given (32000 for the peers' llama110m-random): about 0.95B parameters, 0.25B
active per token. The dense model has the same attention and an MLP of top_k x expert intermediate
(2048): the active size. Weights are float32, deterministic in --seed; the tokenizer files are copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxserve.config import ModelConfig
from jaxserve.loader.safetensors import expert_tensor_names, hf_tensor_name
from jaxserve.loader.tree import flatten
from jaxserve.model.registry import random_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


def hf_tensors(module: nnx.Module) -> dict[str, np.ndarray]:
    """The module's parameters under Hugging Face names ([out, in] linears, one tensor per expert)."""
    tensors = {}
    for path, value in flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param))):
        value = np.asarray(value)
        experts = expert_tensor_names(path, value.shape[0]) if value.ndim == 3 else None
        if experts:
            tensors.update({name: np.ascontiguousarray(w.T) for name, w in zip(experts, value)})
            continue
        name, transpose = hf_tensor_name(path)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    return tensors


def write(config: dict, out: Path, tokenizer: Path, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)
    module = random_model(ModelConfig.from_hf_dict(config), jnp.float32, seed)
    tensors = hf_tensors(module)
    save_file(tensors, out / "model.safetensors")
    print(f"{out}: {sum(t.size for t in tensors.values()) / 1e9:.3f}B parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a model folder with tokenizer.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dense-out", type=Path, help="also write the dense model of the active size here")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-intermediate", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    vocab = json.loads((args.tokenizer / "config.json").read_text())["vocab_size"]
    common = {"vocab_size": vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 256, "head_dim": 64,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu", "attention_bias": False}
    moe = {**common, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
           "num_experts": args.experts, "num_experts_per_tok": args.top_k,
           "moe_intermediate_size": args.expert_intermediate, "intermediate_size": args.expert_intermediate * 4,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    write(moe, args.out, args.tokenizer, args.seed)
    if args.dense_out:
        dense = {**common, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                 "intermediate_size": args.top_k * args.expert_intermediate}
        write(dense, args.dense_out, args.tokenizer, args.seed)


if __name__ == "__main__":
    main()
