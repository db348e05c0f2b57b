"""Engine options, shared by the CLI, the server and the offline `LLM` API.

`EngineArgs` holds what a user sets; `jaxserve.model_builder` turns it into a model on its devices. This
module imports nothing heavy (no JAX): the CLI builds its parsers from these defaults, and a command
that never touches a model (`jaxserve bench serve`, `--help`) must start without loading the engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.builtin_models import RANDOM_DEMO_MODEL, directory_of, is_random_demo, resolve_model
from jaxserve.config import (KV_CACHE_DTYPES, QUANTIZATION_METHODS, QUANTIZED_MATMULS, SpeculativeConfig,
                             validate_scheduling_options)
from jaxserve.json_files import json_object_option, read_json_object
from jaxserve.pooling.config import RUNNERS, parse_pooler_overrides

if TYPE_CHECKING:
    from sharding import ParallelConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineArgs:
    # A Hugging Face or `jaxserve convert` directory; None: the built-in stories260K (set to its directory here);
    # "demo-random": the random demo model (jaxserve/builtin_models/__init__.py).
    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None  # a directory whose tokenizer (and chat template) replaces the model's
    dtype: str = "auto"
    max_num_seqs: int = 8
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    page_size: int = 16
    num_pages: int | None = None  # default: enough for every slot at full context
    kv_cache_memory: int | None = None  # bytes of KV cache on each device (instead of num_pages)
    gpu_memory_utilization: float | None = None  # fraction of device memory free after the weights
    enable_prefix_caching: bool = True  # reuse cached KV pages of shared prompt prefixes
    kv_cache_dtype: str = "auto"  # KV pages: "auto" (the model's dtype), "int8" or "fp8" (e4m3), scaled per token
    # Linear layers: "int8" / "fp8" quantize a float checkpoint at load (per output channel); None follows
    # the checkpoint (a pre-quantized one stays quantized); "none" insists on float weights.
    quantization: str | None = None
    # How quantized linear layers run: None picks per backend (docs/quantization.md); "weight_only" keeps
    # float activations (more accurate, slow on CPU), "dynamic_int8" / "dynamic_fp8" quantize them per token.
    quantization_strategy: str | None = None
    quantize_lm_head: bool = False  # with --quantization: the (untied) LM head too, as llama.cpp's Q8_0 does
    quantize_embedding: bool = False  # with --quantization: the (untied) token embedding too, per token row
    # Weight-only quantized products of decode-sized batches: "auto" times a Pallas kernel against XLA's at start
    # on a GPU / TPU, the faster per shape; "xla" / "pallas" force one (jaxserve/engine/kernel_choice.py).
    quantized_matmul: str = "auto"
    max_num_batched_tokens: int | None = None  # token budget of one step; default: 2048
    token_buckets: tuple[int, ...] | None = None  # padded step sizes; default: powers of two up to the budget
    scheduling_policy: str = "fcfs"  # or "priority": lower request priority first, may preempt
    target_itl_ms: float | None = None  # ITL cap on steps that carry decodes; None: derived at warm-up; 0: off
    long_prefill_token_threshold: int = 0  # most tokens of one prefill chunk (0: no limit)
    max_num_partial_prefills: int | None = None  # most sequences prefilling in one step (None: no limit)
    waiting_served_ratio: float = 1.2  # prefill past the ITL target when waiting / decoding >= this (0: never)
    attention_backend: str = "auto"
    layer_loop: str = "auto"  # "scan" | "unroll"; auto: unrolled on CPU, scanned elsewhere (layer_loop.py)
    cpu_matmul_library: str = "auto"  # "ynnpack" | "eigen": what runs a CPU step's dots (execution/cpu_matmuls.py)
    max_logprobs: int = 20  # top logprobs a request may ask for (per sampled and per prompt token)
    max_logit_bias: int = 128  # logit_bias + allowed_token_ids entries a request may carry
    demo_weights_seed: int = 0  # seeds the random demo model's weights (model="demo-random")
    tensor_parallel_size: int = 1  # devices per tensor-parallel group (heads, MLP columns, vocabulary)
    pipeline_parallel_size: int = 1  # pipeline stages (contiguous blocks of layers)
    enable_expert_parallel: bool = False  # MoE: whole experts per tensor-parallel device, not slices of all
    distributed_coordinator: str | None = None  # HOST:PORT of process 0, or "auto" (Cloud TPU, SLURM, ...)
    num_processes: int | None = None
    process_id: int | None = None
    # "generate", "pooling" (embeddings: prefill only, no sampling) or "auto" (vLLM's rule: a
    # sentence-transformers directory or a bare `...Model` architecture pools); see jaxserve/pooling/.
    runner: str = "auto"
    pooler_config: dict | str | None = None  # pooling runner: {"pooling_type": ..., "normalize": ...} over the model's
    enable_lora: bool = False  # serve LoRA adapters beside the base model (docs/lora.md)
    lora_modules: tuple = ()  # named adapters to load at start: "name=DIR", or {"name": ..., "path": ...}
    max_loras: int = 1  # adapters on the device at once (one step mixes them freely)
    max_lora_rank: int = 16  # the device slots' rank; adapters of higher rank are refused
    max_cpu_loras: int | None = None  # adapters kept read on the host (LRU); default max_loras

    # vLLM's --speculative-config: JSON text or a dict, parsed into a SpeculativeConfig (see docs/speculative.md)
    speculative_config: SpeculativeConfig | dict | str | None = None

    # Images in requests (vision-language checkpoints; jaxserve/multimodal/). vLLM's names: file:// URLs only
    # under this directory (None: refused); hosts that http(s) image URLs may name, then also on private
    # addresses (None: any host with only public addresses); images per prompt, {"image": N} or its JSON.
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    limit_mm_per_prompt: dict | str | None = None
    media_fetch_timeout: float = 10.0  # seconds for one image URL: resolving, connecting, redirects, body
    max_media_bytes: int = 20 << 20  # bytes of one encoded image (fetched, read or base64-decoded)
    # The vision encoder (jaxserve/engine/images.py): image tokens one step places as encoder rows (the name of
    # vLLM's SchedulerConfig budget; None: four images' tokens, within max_num_batched_tokens), and GiB of encoder
    # output kept for images no running request needs (a repeated image skips the encoder; 0: none kept).
    max_num_encoder_input_tokens: int | None = None
    mm_encoder_cache_gb: float = 0.25

    def __post_init__(self):
        self.model = resolve_model(self.model)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        parse_pooler_overrides(self.pooler_config)  # a bad --pooler-config fails before the model loads
        if self.model_dir is not None and not Path(self.model).is_dir():
            raise ValueError(f"model {self.model!r} is not a directory (a Hugging Face model folder), nor "
                             f"the random demo model's name {RANDOM_DEMO_MODEL!r}")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"tokenizer {self.tokenizer!r} is not a directory (one with a tokenizer.json)")
        if self.tokenizer is not None and self.random_demo:
            raise ValueError("tokenizer needs a model: the random demo model has its own byte-level tokenizer")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        if self.quantized_matmul not in QUANTIZED_MATMULS:
            raise ValueError(f"quantized_matmul must be one of {', '.join(QUANTIZED_MATMULS)}, got "
                             f"{self.quantized_matmul!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        validate_scheduling_options(self.scheduling_policy, self.target_itl_ms, self.long_prefill_token_threshold,
                                    self.max_num_partial_prefills, self.waiting_served_ratio)
        self.parallel  # validates the sizes now, not at model build time
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")
        if self.allowed_media_domains is not None:
            self.allowed_media_domains = tuple(self.allowed_media_domains)
        if not self.media_fetch_timeout > 0 or self.max_media_bytes < 1:
            raise ValueError(f"media_fetch_timeout and max_media_bytes must be positive, got "
                             f"{self.media_fetch_timeout} and {self.max_media_bytes}")
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError(f"max_num_encoder_input_tokens must be a positive number of image tokens, got "
                             f"{self.max_num_encoder_input_tokens}")
        if not 0 <= self.mm_encoder_cache_gb < float("inf"):
            raise ValueError(f"mm_encoder_cache_gb must be a size in GiB >= 0, got {self.mm_encoder_cache_gb}")
        self.lora_modules = tuple(parse_lora_module(m) for m in self.lora_modules)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and "
                                 f"{self.max_lora_rank}")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                 f"({self.max_loras})")
            if self.pipeline_parallel_size > 1 or (self.num_processes or 1) > 1:
                raise ValueError("LoRA adapters are served on one process without pipeline parallelism for now "
                                 "(tensor parallelism works)")

    @property
    def image_limit(self) -> int:
        """Images one prompt may carry (--limit-mm-per-prompt's "image")."""
        return self.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def random_demo(self) -> bool:
        """Whether this is the random demo model (built in memory, no files)."""
        return is_random_demo(self.model)

    @property
    def model_dir(self) -> str | None:
        """The model's directory; None for the random demo model, which has none."""
        return directory_of(self.model)

    @property
    def parallel(self) -> ParallelConfig:
        from sharding import ParallelConfig  # imports JAX: only once a model is built
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.enable_expert_parallel)


DEFAULT_IMAGES_PER_PROMPT = 16  # each image is a fetch and an encoder run: bounded unless the operator says
MM_MODALITIES = ("image", "video", "audio")


def parse_mm_limits(value) -> dict[str, int]:
    """`--limit-mm-per-prompt` as vLLM takes it: '{"image": 4}' (JSON text or a dict; a modality's value may
    also be {"count": N, ...}). Only images are served: a video or audio limit is accepted and has nothing
    to limit."""
    if value is None:
        return {}
    value = json_object_option(value, "--limit-mm-per-prompt", '{"image": 4}')
    limits = {}
    for modality, limit in value.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if modality not in MM_MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {modality!r} (one of {', '.join(MM_MODALITIES)})")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality} must be a count >= 0, got {limit!r}")
        limits[modality] = count
    return limits


def parse_lora_module(entry) -> tuple[str, str]:
    """One `--lora-modules` entry as (name, path): `name=DIR`, vLLM's JSON form `{"name": ..., "path": ...}`
    (as a string or a dict), or a (name, path) pair."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules entry {entry!r} is not valid JSON: {e}") from e
    if isinstance(entry, dict):
        name, path = entry.get("name"), entry.get("path")
        extra = sorted(set(entry) - {"name", "path", "base_model_name"})
        if extra:
            raise ValueError(f"--lora-modules entry {entry!r}: unknown key(s) {', '.join(extra)}")
    elif isinstance(entry, str):
        name, _, path = entry.partition("=")
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        name, path = entry
    else:
        raise ValueError(f"--lora-modules entry {entry!r}: expected name=DIR or {{\"name\": ..., \"path\": ...}}")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules entry {entry!r}: expected name=DIR or {{\"name\": ..., \"path\": ...}}")
    return name, path


_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str | None, mode: str = "auto") -> dict:
    """Sampling defaults for requests that leave a field unset. `auto` (vLLM's default): what the model's
    generation_config.json sets of temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
    (as max_tokens); `vllm`: none (the engine's neutral defaults)."""
    if mode not in ("auto", "vllm"):
        raise ValueError(f"generation_config must be 'auto' or 'vllm', got {mode!r}")
    path = Path(model_dir) / "generation_config.json" if model_dir else None
    if mode == "vllm" or path is None or not path.is_file():
        return {}
    config = read_json_object(path)
    defaults = {ours: config[theirs] for theirs, ours in _GENERATION_KEYS.items() if config.get(theirs) is not None}
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
