"""Configuration: one dataclass per concern, each validated once in `__post_init__`.

1. `ModelConfig` is read from a Hugging Face `config.json` and normalised so the model code sees one shape
   of config for every supported `model_type` (Llama, Mistral, Qwen2, Qwen3; Gemma 2 and 3 and the
   mixtures of experts Qwen3-MoE and Mixtral with their own keys read by `config_families.py`). Layer-wise
   differences (sliding or global attention, sparse or dense MLP) are per-layer tuples: data, not code.
2. `CacheConfig` sizes the paged KV cache; `SchedulerConfig` fixes the slots, the token budget of a step
   and the token-count buckets its arrays are padded to, so every array shape is known at start.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxserve.config_families import FULL, SLIDING, family_fields, text_config
from jaxserve.json_files import json_object_option, read_json_object

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral")
# `--kv-cache-dtype`: "auto" keeps float pages of the model's dtype; int8 / fp8 (e4m3) pages carry a float32
# scale per token and KV head (pallas_kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# `--quantization`: quantize a float checkpoint's linear layers at load (a pre-quantized one is detected).
QUANTIZATION_METHODS = ("none", "int8", "fp8")
# How a step program runs the layers (`jaxserve/model/layer_loop.py`).
LAYER_LOOPS = ("auto", "unroll", "scan")
# What runs a CPU step program's matrix products (`jaxserve/execution/cpu_matmuls.py`).
CPU_MATMUL_LIBRARIES = ("auto", "ynnpack", "eigen", "ynnpack-feature-major")
LINEAR_CODE_DTYPES = ("int8", "fp8", "int4", "uint4")  # uint4: asymmetric int4 with zero points
# `--quantized-matmul`: what runs weight-only quantized products (jaxserve/engine/kernel_choice.py): "auto" times
# a Pallas kernel against XLA's product per shape at start on a GPU or TPU (XLA on a CPU), "xla" never runs the
# kernels, "pallas" runs them for every decode-sized product (in interpret mode on a CPU: tests).
QUANTIZED_MATMULS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class LinearQuantization:
    """How the decoder layers' linear layers are stored and run (norms stay float, and the LM head and the
    token embedding unless `lm_head` / `embedding`).

    Part of `ModelConfig`, so the model's graph, the step programs and their cache key all follow it."""
    codes: str  # one of LINEAR_CODE_DTYPES
    block_size: int | None = None  # input rows per scale; None: one scale per output channel
    strategy: str = "weight_only"  # how a step multiplies (jaxserve.quantization.STRATEGIES)
    min_rows: int = 1  # smaller batches are padded to this many rows (the CPU's integer GEMM starts at 2)
    # Dynamic strategies: activation scales per row and block of about this many input features (None: per row)
    act_block: int | None = None
    source: str = "quantized at load"  # where the codes come from, for the log: or the checkpoint's format
    lm_head: bool = False  # the (untied) LM head quantized too, as llama.cpp's Q8_0 files store it
    embedding: bool = False  # the (untied) token embedding too, one scale per token row, as Q8_0 files store it

    def __post_init__(self):
        if self.codes not in LINEAR_CODE_DTYPES:
            raise ValueError(f"linear weight codes must be one of {LINEAR_CODE_DTYPES}, got {self.codes!r}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def has_zeros(self) -> bool:
        return self.codes == "uint4"

    @property
    def quantized_parts(self) -> str:
        """What is quantized, for the log: "linear layers", "linear layers, LM head and token embedding"."""
        parts = ["linear layers", *(["LM head"] if self.lm_head else []),
                 *(["token embedding"] if self.embedding else [])]
        return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (Qwen2 always; Llama when configured)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Per layer: "sliding_attention" (the layer uses `sliding_window`) or "full_attention". Empty: every
    # layer slides when `sliding_window` is set (Mistral, Mixtral). Filled in by __post_init__.
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its ** -0.5, not head_dim's
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own (unscaled) RoPE base
    # Qwen2-VL / Qwen2.5-VL: frequencies turned by the (time, row, column) position axes, in order
    # (model/mrope.py); None: 1-D positions. A text-only prompt's three axes are equal: plain RoPE.
    mrope_section: tuple[int, ...] | None = None
    num_experts: int = 0  # mixture of experts: 0 = dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum 1
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP; () = all dense
    # False for a pooling runner: it stops at the final norm, so an untied LM head is neither loaded nor
    # required (embedding checkpoints saved as the bare decoder have none).
    has_lm_head: bool = True
    linear_quantization: LinearQuantization | None = None  # None: float linear layers (set by the loader)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if not self.layer_types:
            kind = SLIDING if self.sliding_window else FULL
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (False,) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        for name in ("layer_types", "sparse_layers"):
            if len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; supported: silu, gelu_pytorch_tanh")
        if any(self.sparse_layers) and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must add up to head_dim / 2 = "
                             f"{self.head_dim // 2}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: default, llama3, linear")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """`source`: where `cfg` came from, named by every error (a missing key, a value out of range)."""
        cfg = text_config(cfg)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} in {source} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        try:
            return cls._from_text_config(cfg)
        except KeyError as e:
            raise ValueError(f"{source} has no {e.args[0]!r}, which a {model_type} config needs") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _from_text_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg["model_type"]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # Newer transformers write rope settings under `rope_parameters`; older ones use rope_theta/rope_scaling.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params else None)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling["rope_type"] = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_scaling["rope_type"] == "default":  # transformers 5 spells "no scaling" this way
                rope_scaling = None
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        # Qwen2/3 carry a sliding_window value even when it is switched off by use_sliding_window.
        sliding_window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding_window = None
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            o_proj_bias=model_type != "qwen2" and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "float32",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            mrope_section=tuple(cfg["mrope_section"]) if cfg.get("mrope_section") else None,
        )
        return cls(**{**fields, **family_fields(cfg, cfg["num_hidden_layers"])})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: --model must be a Hugging Face model directory")
        return cls.from_hf_dict(read_json_object(config_file), source=str(config_file))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def first_layers(self, count: int) -> "ModelConfig":
        """This config cut to its first `count` layers (a pipeline stage's model)."""
        return dataclasses.replace(self, num_layers=count, layer_types=self.layer_types[:count],
                                   sparse_layers=self.sparse_layers[:count])


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int = 512  # page 0 included (reserved null page)
    enable_prefix_caching: bool = True  # keep full pages after a request ends and reuse them by content
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8  # sequences running at once (decode slots)
    max_model_len: int = 2048  # prompt + completion, per sequence
    max_num_batched_tokens: int = 512  # token budget of one step: decodes + prefill chunks
    # Padded token counts of a step, one compiled program each; default: powers of two up to the budget.
    token_buckets: tuple[int, ...] | None = None
    # Which waiting request runs first (vLLM's --scheduling-policy): "fcfs" (arrival order) or "priority"
    # (lower `priority` first, ties by arrival; a higher-priority arrival may preempt a lower one).
    scheduling_policy: str = "fcfs"
    # Inter-token latency a step that carries decodes should stay under, in seconds: its prefill share is
    # cut to what the step-time model predicts fits (scheduling/step_cost.py). None: derived from the
    # decode step measured at warm-up (no cap before a measurement); 0: no cap.
    target_itl: float | None = None
    # vLLM's knobs: a prefill chunk holds at most this many tokens (0: no limit), and at most this many
    # sequences prefill in one step (None: as many as the budget allows).
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int | None = None
    # TGI's knob: a step that carries decodes prefills at full width, past the ITL target, when the
    # sequences waiting for their prefill are at least this many times those decoding (0: never).
    waiting_served_ratio: float = 1.2

    def __post_init__(self):
        validate_scheduling_options(self.scheduling_policy, self.target_itl, self.long_prefill_token_threshold,
                                    self.max_num_partial_prefills, self.waiting_served_ratio)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token in each step")
        buckets = self.token_buckets or default_token_buckets(self.max_num_batched_tokens)
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"token_buckets must be strictly increasing positive sizes, got {buckets}")
        if buckets[-1] != self.max_num_batched_tokens:
            raise ValueError(f"the largest token bucket ({buckets[-1]}) must equal max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})")
        object.__setattr__(self, "token_buckets", tuple(buckets))

    def seqs_for(self, bucket: int) -> int:
        """Sequence rows of a step padded to `bucket` tokens: every sequence has at least one token."""
        return min(bucket, self.max_num_seqs)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Fixed sizes of the per-sequence sampling inputs and outputs of a step."""
    max_logprobs: int = 20  # top logprobs a request may ask for, per sampled and per prompt token
    max_logit_bias: int = 128  # entries per sequence: logit_bias, allowed_token_ids, min_tokens' masked ids

    def __post_init__(self):
        if not 1 <= self.max_logprobs <= 1024:
            raise ValueError(f"max_logprobs must be in [1, 1024], got {self.max_logprobs}")
        if not 1 <= self.max_logit_bias <= 65536:
            raise ValueError(f"max_logit_bias must be in [1, 65536], got {self.max_logit_bias}")


def validate_scheduling_options(policy: str, target_itl: float | None, long_prefill_token_threshold: int,
                                max_num_partial_prefills: int | None, waiting_served_ratio: float) -> None:
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
    if target_itl is not None and target_itl < 0:
        raise ValueError(f"the inter-token latency target must be >= 0 (0: no cap), got {target_itl}")
    if long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}")
    if max_num_partial_prefills is not None and max_num_partial_prefills < 1:
        raise ValueError(f"max_num_partial_prefills must be >= 1, got {max_num_partial_prefills}")
    if not 0 <= waiting_served_ratio < float("inf"):
        raise ValueError(f"waiting_served_ratio must be a finite number >= 0 (0: off), got {waiting_served_ratio}")


def default_token_buckets(budget: int) -> tuple[int, ...]:
    """1, 2, 4, ... below the budget, then the budget itself."""
    buckets, b = [], 1
    while b < budget:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [budget])


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` shape (see docs/speculative.md).

    `ngram` drafts by prompt lookup: the longest n-gram (prompt_lookup_max down to prompt_lookup_min tokens)
    that ends the sequence and occurred earlier in it proposes the tokens that followed it. `draft_model`
    drafts with a smaller model of the same vocabulary, run on the device. Each step a sequence verifies up
    to `num_speculative_tokens` drafts; above `disable_by_batch_size` running sequences nobody drafts.
    `adaptive_drafting` (jaxserve's own key, default on) prices every step: each sequence verifies as many
    drafts as its acceptance pays for against the measured cost of the verify step, none where drafting
    does not pay (`jaxserve/speculative/payoff.py`); off, every draft found is verified, as in vLLM."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft model's directory (draft_model)
    disable_by_batch_size: int | None = None
    adaptive_drafting: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config num_speculative_tokens must be an integer in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's rule: either bound defaults to the other, both to 5.
            low, high = low or high or 5, high or low or 5
            if not 1 <= low <= high:
                raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{low} and {high}")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
            if self.model is not None:
                raise ValueError("speculative_config: the ngram method takes no model")
        elif self.model is None:
            raise ValueError("speculative_config: the draft_model method needs a model directory")
        if not isinstance(self.adaptive_drafting, bool):
            raise ValueError(f"speculative_config adaptive_drafting must be true or false, got {self.adaptive_drafting!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the CLI's JSON text or the `LLM` argument's dict. vLLM's spellings are accepted: a `model` of
        "[ngram]" (or "ngram") means the ngram method, and a model without a method is a draft model."""
        if value is None or isinstance(value, cls):
            return value
        fields = dict(json_object_option(value, "speculative_config", '{"method": "ngram", ...}'))
        if fields.get("model") in ("[ngram]", "ngram") and fields.get("method") in (None, "ngram"):
            fields.pop("model")
            fields["method"] = "ngram"
        if "method" not in fields and fields.get("model"):
            fields["method"] = "draft_model"
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for name in ("method", "num_speculative_tokens"):
            if name not in fields:
                raise ValueError(f"speculative_config needs {name!r}")
        return cls(**fields)
