"""What each model family's `config.json` says beyond the Llama shape, normalised to `ModelConfig` fields.

1. `text_config` unwraps a multimodal checkpoint to its language model's config: Gemma 3 (`model_type`
   gemma3), with the defaults transformers' `Gemma3TextConfig` fills in for keys hub files leave out, and
   Qwen2-VL / Qwen2.5-VL, a Qwen2 decoder whose rotary positions are multimodal (`mrope_section`; its text
   settings nested in `text_config` by transformers 5, flat in hub files). The vision tower's weights are
   skipped by name when the language model loads (`loader/safetensors.py`; the engine loads them apart).
2. `family_fields` reads the per-family keys in either spelling checkpoints use (transformers 5:
   `layer_types`, `rope_parameters` per layer kind, `num_local_experts`; transformers 4: the sliding
   window pattern, `rope_local_base_freq`, `num_experts`) and turns layer-wise choices into per-layer
   tuples (attention kind, sparse or dense MLP), so layers differ by data, not by code.
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_TYPES = ("gemma2", "gemma3_text")
MOE_TYPES = ("qwen3_moe", "mixtral")
# Vision-language checkpoints: their image processors (jaxserve/multimodal/) and encoders (jaxserve/model/).
GEMMA3_VISION_TYPES = ("gemma3",)
QWEN_VL_TYPES = ("qwen2_5_vl", "qwen2_vl")

# transformers' Gemma3TextConfig defaults: the text_config of multimodal Gemma 3 checkpoints on the hub
# spells out only what differs from these (gemma-3-4b-it names 6 keys).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a checkpoint: `cfg` itself, or a multimodal Gemma 3's or Qwen-VL's
    text part."""
    if cfg.get("model_type") in QWEN_VL_TYPES:
        return _qwen_vl_text_config(cfg)
    if cfg.get("model_type") != "gemma3":
        return cfg
    text = {**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {}), "model_type": "gemma3_text"}
    # The outer config carries the dtype and the tied-embedding flag of the whole checkpoint.
    for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
        if key in cfg and key not in (cfg.get("text_config") or {}):
            text[key] = cfg[key]
    return text


def _qwen_vl_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Qwen-VL checkpoint's language model as a `qwen2` config with its `mrope_section`. Its rope settings
    carry the section beside the theta: transformers 5 `rope_parameters` {"mrope_section", "rope_type":
    "default"}, hub files `rope_scaling` {"type": "mrope", "mrope_section"} (transformers reads "mrope" as
    default rope: the section alone makes it multimodal)."""
    text = {**{k: v for k, v in cfg.items() if k not in ("vision_config", "text_config")},
            **(cfg.get("text_config") or {}), "model_type": "qwen2"}
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        rope = dict(text.get(key) or {})
        section = rope.pop("mrope_section", None) or section
        if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
            rope.pop("type", None)
            rope["rope_type"] = "default"
        text[key] = rope or None
    if section is None:
        raise ValueError(f"a {cfg.get('model_type')} config needs mrope_section in its rope_parameters or "
                         f"rope_scaling")
    text["mrope_section"] = list(section)
    return text


def _layer_types(cfg: dict[str, Any], num_layers: int, default_pattern: int) -> tuple[str, ...]:
    """Gemma's per-layer attention kinds: `layer_types`, else every `pattern`-th layer global."""
    if cfg.get("layer_types"):
        kinds = tuple(cfg["layer_types"])
        if len(kinds) != num_layers or set(kinds) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} / {FULL!r}, got {kinds}")
        return kinds
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default_pattern
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta) of Gemma 3 in either spelling."""
    per_kind = cfg.get("rope_parameters") or {}
    if FULL in per_kind or SLIDING in per_kind:
        full, local = dict(per_kind.get(FULL) or {}), dict(per_kind.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding layers with rope_type {local['rope_type']!r} are not supported")
        theta = float(full.pop("rope_theta", 1_000_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else None
        return theta, scaling, float(local.get("rope_theta", 10_000.0))
    scaling = cfg.get("rope_scaling")
    return float(cfg.get("rope_theta", 1_000_000.0)), scaling, float(cfg.get("rope_local_base_freq", 10_000.0))


def family_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """`ModelConfig` keyword arguments particular to `cfg`'s family (empty for the Llama family)."""
    model_type = cfg["model_type"]
    if model_type in GEMMA_TYPES:
        gemma3 = model_type == "gemma3_text"
        fields = dict(
            layer_types=_layer_types(cfg, num_layers, 6 if gemma3 else 2),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
            qk_norm=gemma3,
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        )
        if gemma3:
            theta, scaling, local_theta = _gemma3_rope(cfg)
            fields.update(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)
        return fields
    if model_type in MOE_TYPES:
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if model_type == "mixtral":
            sparse = (True,) * num_layers
            moe_size, normalise = cfg["intermediate_size"], True  # Mixtral always renormalises the top-k
        else:
            step = cfg.get("decoder_sparse_step") or 1
            dense = set(cfg.get("mlp_only_layers") or ())
            sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
            moe_size, normalise = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False))
        return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=moe_size, norm_topk_prob=normalise, sparse_layers=sparse,
                    qk_norm=model_type == "qwen3_moe", hidden_act=cfg.get("hidden_act", "silu"))
    return {}
