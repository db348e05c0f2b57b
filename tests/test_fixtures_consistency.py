"""The golden fixtures in tests/fixtures are whole and self-consistent (numpy + safetensors only, no JAX).

The generators in tools/ run under a separate torch venv; these checks guard what they committed:

1. parity/: each golden's greedy tokens are the argmax of its logits; issue 29's families carry 64
   greedy tokens and a config_legacy.json, MoE checkpoints have experts exactly where the config says.
2. quantized/: every quantized linear has the documented tensors, dtypes and shapes for its format.
3. lora/: adapters hold A [r, in] and B [out, r] for exactly their target modules; refusal fixtures are marked.
4. embedding/: the sentence-transformers files and the pooled goldens agree with the stored hidden states.
"""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

ROOT = Path(__file__).parent / "fixtures"
PARITY = sorted(p for p in (ROOT / "parity").iterdir() if (p / "golden.npz").is_file())
PROMPT_LEN, EOS_ID = 48, 2


def header(path: Path) -> dict:
    """dtype and shape per tensor, read from the safetensors header (works for float8 too)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in meta.items()}


def load_config(path: Path) -> dict:
    return json.loads(path.read_text())


def check_golden(path: Path, vocab: int) -> dict:
    g = dict(np.load(path))
    ids, logits = g["input_ids"], g["logits"]
    assert ids.dtype == np.int32 and ids.shape == (PROMPT_LEN + 16,) and int(g["prompt_len"]) == PROMPT_LEN
    assert logits.dtype == np.float32 and logits.shape == (len(ids), vocab)
    np.testing.assert_array_equal(logits[PROMPT_LEN - 1:-1].argmax(-1), ids[PROMPT_LEN:])
    assert EOS_ID not in ids[PROMPT_LEN:]
    return g


@pytest.mark.parametrize("case", PARITY, ids=[p.name for p in PARITY])
def test_parity_golden(case):
    cfg = load_config(case / "config.json")
    g = check_golden(case / "golden.npz", cfg["vocab_size"])
    tensors = header(case / "model.safetensors")
    assert {dtype for dtype, _ in tensors.values()} == {"F32"}
    assert ("lm_head.weight" in tensors) == (not cfg["tie_word_embeddings"])
    if "greedy" not in g:
        return
    greedy = g["greedy"]
    assert greedy.dtype == np.int32 and greedy.shape == (64,) and EOS_ID not in greedy
    np.testing.assert_array_equal(greedy[:16], g["input_ids"][PROMPT_LEN:])
    legacy = load_config(case / "config_legacy.json")
    assert legacy["model_type"] == cfg["model_type"] and "rope_theta" in legacy and "rope_parameters" not in legacy
    if "layer_types" in cfg:  # the legacy spelling derives them: layer i slides iff (i + 1) % pattern != 0
        pattern = legacy.get("sliding_window_pattern", 2)
        derived = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(cfg["num_hidden_layers"])]
        assert derived == cfg["layer_types"]


@pytest.mark.parametrize("case", [p for p in PARITY if p.name in ("qwen3_moe", "mixtral")], ids=lambda p: p.name)
def test_moe_experts_where_the_config_says(case):
    cfg = load_config(case / "config.json")
    tensors = header(case / "model.safetensors")
    n_experts, hidden = cfg["num_local_experts"], cfg["hidden_size"]
    for layer in range(cfg["num_hidden_layers"]):
        if cfg["model_type"] == "mixtral":  # w1 = gate, w3 = up, w2 = down
            prefix, inter = f"model.layers.{layer}.block_sparse_moe", cfg["intermediate_size"]
            names = ("w1", "w3", "w2")
        else:
            prefix, inter = f"model.layers.{layer}.mlp", cfg["moe_intermediate_size"]
            names = ("gate_proj", "up_proj", "down_proj")
            sparse = layer not in cfg["mlp_only_layers"] and (layer + 1) % cfg["decoder_sparse_step"] == 0
            if not sparse:
                assert tensors[f"{prefix}.gate_proj.weight"] == ("F32", (cfg["intermediate_size"], hidden))
                assert not any(k.startswith(f"{prefix}.experts.") for k in tensors)
                continue
        assert tensors[f"{prefix}.gate.weight"] == ("F32", (n_experts, hidden))
        for e in range(n_experts):
            gate, up, down = (f"{prefix}.experts.{e}.{n}.weight" for n in names)
            assert tensors[gate] == tensors[up] == ("F32", (inter, hidden))
            assert tensors[down] == ("F32", (hidden, inter))
        assert not any(k.startswith(f"{prefix}.experts.{n_experts}.") for k in tensors)


QUANTIZED = sorted((ROOT / "quantized").glob("*/config.json"))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each quantized linear."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return dict(zip(LINEARS, [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]))


@pytest.mark.parametrize("config_path", QUANTIZED, ids=[p.parent.name for p in QUANTIZED])
def test_quantized_layout(config_path):
    case = config_path.parent
    cfg = load_config(config_path)
    qc = cfg["quantization_config"]
    g = check_golden(case / "golden.npz", cfg["vocab_size"])
    tensors = header(case / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[name][0] == "F32"
    for layer in range(cfg["num_hidden_layers"]):
        for lin, (out_f, in_f) in linear_shapes(cfg).items():
            p = f"model.layers.{layer}.{lin}"
            if qc["quant_method"] == "compressed-tensors":
                weights = qc["config_groups"]["group_0"]["weights"]
                assert weights["strategy"] == "channel" and weights["symmetric"] and weights["num_bits"] == 8
                dtype = {"int-quantized": "I8", "float-quantized": "F8_E4M3"}[qc["format"]]
                assert tensors[f"{p}.weight"] == (dtype, (out_f, in_f))
                assert tensors[f"{p}.weight_scale"] == ("F32", (out_f, 1))
                continue
            gs = qc["group_size"]
            assert qc["bits"] == 4 and in_f % gs == 0
            assert tensors[f"{p}.scales"] == ("F16", (in_f // gs, out_f))
            assert tensors[f"{p}.qzeros"] == ("I32", (in_f // gs, out_f // 8))
            assert f"{p}.weight" not in tensors
            if qc["quant_method"] == "awq":
                assert qc["version"] == "gemm" and qc["zero_point"] is True
                assert tensors[f"{p}.qweight"] == ("I32", (in_f, out_f // 8))
                continue
            assert qc["checkpoint_format"] == "gptq" and qc["desc_act"] is False
            assert tensors[f"{p}.qweight"] == ("I32", (in_f // 8, out_f))
            with safe_open(case / "model.safetensors", "np") as f:
                np.testing.assert_array_equal(f.get_tensor(f"{p}.g_idx"), np.arange(in_f) // gs)
                stored = f.get_tensor(f"{p}.qzeros").view(np.uint32)
            nibbles = (stored[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
            if qc["sym"]:
                assert np.all(stored == 0x77777777)  # v1 stores zero - 1 = 7
            else:
                assert nibbles.max() <= 14 and len(np.unique(nibbles)) > 1  # zero - 1 with zero in 1..15
    if qc["quant_method"] == "compressed-tensors":
        act = qc["config_groups"]["group_0"]["input_activations"]
        assert act["dynamic"] and act["strategy"] == "token" and qc["ignore"] == ["lm_head"]
        assert g["logits_act_quant"].shape == g["logits"].shape and g["logits_act_quant"].dtype == np.float32


LORA = ROOT / "lora"
ADAPTERS = sorted(p.parent for p in LORA.glob("*/adapter_config.json"))


def test_lora_base_golden():
    check_golden(LORA / "base" / "golden.npz", load_config(LORA / "base" / "config.json")["vocab_size"])


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[p.name for p in ADAPTERS])
def test_lora_adapter(adapter):
    base = load_config(LORA / "base" / "config.json")
    cfg = load_config(adapter / "adapter_config.json")
    tensors = header(adapter / "adapter_model.safetensors")
    shapes = {lin.split(".")[1]: s for lin, s in linear_shapes(base).items()}
    refusal = adapter.name in ("dora", "modules_to_save")
    assert (adapter / "golden.npz").is_file() != refusal
    assert cfg["peft_type"] == "LORA" and cfg["use_dora"] == (adapter.name == "dora")
    for layer in range(base["num_hidden_layers"]):
        for module, (out_f, in_f) in shapes.items():
            kind = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            targeted = module in cfg["target_modules"]
            assert (f"{key}.lora_A.weight" in tensors) == targeted, key
            if targeted:
                assert tensors[f"{key}.lora_A.weight"] == ("F32", (cfg["r"], in_f))
                assert tensors[f"{key}.lora_B.weight"] == ("F32", (out_f, cfg["r"]))
    if refusal:
        extra = {k for k in tensors if ".lora_A." not in k and ".lora_B." not in k}
        assert extra and (cfg["modules_to_save"] is not None) == (adapter.name == "modules_to_save")
    else:
        assert cfg["modules_to_save"] is None
        check_golden(adapter / "golden.npz", base["vocab_size"])


EMBED = ROOT / "embedding" / "qwen3_embed"


def test_embedding_fixture():
    modules = load_config(EMBED / "modules.json")
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    pooling = load_config(EMBED / "1_Pooling" / "config.json")
    assert pooling["pooling_mode_lasttoken"] and pooling["include_prompt"]
    assert not any(v for k, v in pooling.items() if k.startswith("pooling_mode_") and k != "pooling_mode_lasttoken")
    tensors = header(EMBED / "model.safetensors")
    assert "embed_tokens.weight" in tensors and not any(k.startswith(("model.", "lm_head")) for k in tensors)
    g = np.load(EMBED / "golden.npz")
    lengths, hidden = g["lengths"], g["hidden_states"]
    assert hidden.shape == (len(lengths), lengths.max(), pooling["word_embedding_dimension"])
    for i, n in enumerate(lengths):
        assert not g["input_ids"][i, n:].any() and not hidden[i, n:].any()
        np.testing.assert_array_equal(g["last_token"][i], hidden[i, n - 1])
        np.testing.assert_allclose(g["mean"][i], hidden[i, :n].mean(axis=0), atol=1e-6, rtol=0)
    for key in ("last_token", "mean"):
        norms = np.linalg.norm(g[key], axis=-1, keepdims=True)
        np.testing.assert_allclose(g[f"{key}_normalized"], g[key] / norms, atol=1e-6, rtol=0)


VLM = ROOT / "vlm"


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_vlm_golden(family):
    """Each conversation's greedy tokens are its logits' argmax, its image-token runs match its images'
    token counts, and the vision tower's weights are in the checkpoint beside the language model's."""
    cfg = load_config(VLM / family / "config.json")
    g = dict(np.load(VLM / family / "golden.npz"))
    image_token = cfg["image_token_index"] if family == "gemma3" else cfg["image_token_id"]
    for case in ("text_only", "one_image", "two_images", "second_turn"):
        ids, greedy, logits = g[f"{case}.input_ids"], g[f"{case}.greedy"], g[f"{case}.logits"]
        assert logits.shape == (len(ids) + len(greedy), cfg["text_config"]["vocab_size"])
        np.testing.assert_array_equal(logits[len(ids) - 1:-1].argmax(-1), greedy)
        np.testing.assert_array_equal(g[f"{case}.token_type_ids"], (ids == image_token).astype(np.int32))
        tokens = [len(g[f"image{i}.embeddings"]) for i in g[f"{case}.images"]]
        assert int((ids == image_token).sum()) == sum(tokens)
    names = header(VLM / family / "model.safetensors")
    vision = [n for n in names if "vision_tower" in n or "visual" in n]
    assert vision and any(n.endswith("embed_tokens.weight") for n in names)
