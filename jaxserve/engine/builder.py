"""Model construction: `EngineArgs` -> a model on its device mesh, with everything the engine needs.

1. `build_model` creates the device mesh (tensor x pipeline parallel, joining `jax.distributed` first
   when asked) and loads the weights straight onto it (Hugging Face safetensors or a checkpoint written
   by `jaxserve convert`) and resolves the runner (`--runner`: generate, or pooling with the model's pooler
   config; a pooling model loads no LM head); `_finish_build` resolves the rest: context length, token budget and buckets
   of a step, attention backend, and — once the weights are on the device — the KV page pool
   (`kv_budget`: pages, bytes, or a fraction of the free device memory).
2. Without a model it loads the built-in stories260K from inside the package like any other directory
   (`jaxserve/builtin_models/`); `demo-random` builds the random demo model instead: a small Llama with
   deterministic random weights and a byte-level tokenizer, whose text is noise. Each is served under a
   name that says what it is.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp

from jaxserve.builtin_models import describe as describe_model
from jaxserve.builtin_models import is_default, served_name
from jaxserve.config import CacheConfig, ModelConfig, SamplerConfig, SchedulerConfig, default_token_buckets
from jaxserve.engine.decode_epilogues import choose_decode_epilogues
from jaxserve.engine.images import NoImages, images_for
from jaxserve.engine.kernel_choice import choose_linear_kernels
from jaxserve.engine.precision import dtype_warnings
from jaxserve.engine_args import EngineArgs
from jaxserve.execution.cpu_matmuls import FEATURE_MAJOR
from jaxserve.execution.cpu_matmuls import compiler_options as cpu_matmul_options
from jaxserve.execution.cpu_matmuls import describe as describe_cpu_matmuls
from jaxserve.execution.cpu_matmuls import resolve_cpu_matmuls
from jaxserve.execution.gpu_fusion import compiler_options as gpu_step_options
from jaxserve.execution.kv_budget import KVShare, resolve_kv_budget
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.dtypes import resolve_dtype
from jaxserve.loader.formats import Checkpoint
from jaxserve.loader.load import load_checkpoint
from jaxserve.loader.placement import ShardedModel, experts_can_split, feature_major, scan_layers, split_experts
from jaxserve.loader.quantized import QuantizationFlags
from jaxserve.model.layer_loop import resolve_layer_loop
from jaxserve.model.registry import random_model
from jaxserve.pooling.config import PoolerConfig, resolve_runner
from jaxserve.quantization.weights import device_bytes
from jaxserve.text.tokenizer import Tokenizer
from pallas_kernels.dispatch import AttentionBackend, check_page_dtype, for_eigen_dots, select_attention_backend
from pallas_kernels.kv_quant import kv_quant_dtype
from sharding import make_plan
from sharding.multihost import initialize as initialize_distributed

logger = logging.getLogger(__name__)


def demo_model_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=Tokenizer.byte_level().vocab_size, hidden_size=128,
                       intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@dataclasses.dataclass
class BuiltModel:
    name: str
    model: ShardedModel
    model_config: ModelConfig
    tokenizer: Tokenizer
    dtype: object
    attention: AttentionBackend
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    sampler_config: SamplerConfig
    weights_seconds: float = 0.0
    runner: str = "generate"  # or "pooling" (resolved from --runner auto)
    pooler_config: PoolerConfig | None = None  # the pooling runner's
    # the step programs' compile options (on a CPU: which library runs the matmuls, execution/cpu_matmuls.py;
    # on a GPU: which products merge, execution/gpu_fusion.py)
    compiler_options: dict = dataclasses.field(default_factory=dict)
    # A vision model's encoder, encoder cache and step rows (`images.py`); for any other model, its refusal.
    images: object = None


def default_token_budget(max_num_seqs: int) -> int:
    """vLLM's chunked-prefill budget, and llama.cpp's batch: a burst of 16 chat prompts prefills in one
    step. On a CPU too: what a step carrying decodes may add is the ITL cap's choice, not the budget's
    (docs/performance.md, "Bursts of arrivals"); a budget of 512 there split such a burst over four steps,
    and the streams started by the first waited through the other three."""
    return max(max_num_seqs, 2048)


def _runner(args: EngineArgs, config: ModelConfig):
    """(runner, pooler config, config, args) for `--runner`: a pooling runner takes the model's
    sentence-transformers pooling, then --pooler-config, and its step stops at the final norm: an untied LM
    head is never read, so the config says there is none."""
    runner = resolve_runner(args.runner, args.model_dir)
    if runner != "pooling":
        return runner, None, config, args
    config = dataclasses.replace(config, has_lm_head=False)
    pooler = dataclasses.replace(PoolerConfig.for_model(args.model_dir, args.pooler_config),
                                 hidden_size=config.hidden_size)
    if args.max_model_len is None and pooler.max_seq_length:  # the context it was trained to embed
        args = dataclasses.replace(args, max_model_len=min(pooler.max_seq_length, config.max_position_embeddings))
    return runner, pooler, config, args


def build_model(args: EngineArgs) -> BuiltModel:
    demo, model_dir = args.random_demo, args.model_dir  # model_dir: None for the random demo
    config = demo_model_config() if demo else ModelConfig.from_pretrained(model_dir)
    plan = _mesh_plan(args, config)
    runner, pooler, config, args = _runner(args, config)
    start = time.perf_counter()
    # The demo model is float32 unless asked otherwise: its random weights are the checkpoint.
    dtype = resolve_dtype("float32" if demo and args.dtype == "auto" else args.dtype, config)
    name = served_name(args.model)
    if demo:
        logger.warning("serving the %s", describe_model(args.model))
    elif is_default(args.model):
        logger.info("serving the %s", describe_model(args.model))
    # The tokenizer first: a wrong one is refused before the weights are read.
    tokenizer = (Tokenizer.byte_level() if demo else
                 Tokenizer.from_pretrained(args.tokenizer or model_dir, model_dir=model_dir))
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer in {args.tokenizer} has {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocabulary of {config.vocab_size}")
    checkpoint = (Checkpoint.in_memory(random_model(config, dtype, args.demo_weights_seed)) if demo else
                  Checkpoint.read(model_dir))
    model, matmuls = _load(args, checkpoint, config, dtype, plan)
    built = _finish_build(args, name, model, tokenizer, matmuls)
    built = dataclasses.replace(built, runner=runner, pooler_config=pooler)
    # The vision encoder's weights (if the engine runs the checkpoint's images) count as the model's.
    return dataclasses.replace(built, images=images_for(args, built), weights_seconds=time.perf_counter() - start)


def build_from_module(args: EngineArgs, name: str, module, config: ModelConfig, tokenizer: Tokenizer,
                      dtype) -> BuiltModel:
    """For a caller that makes its own NNX module (benchmarks with a random model of a chosen size):
    shard it onto the mesh `args` asks for, then build the rest as `build_model` does."""
    model, matmuls = _load(args, Checkpoint.in_memory(module), config, dtype, _mesh_plan(args, config))
    return _finish_build(args, name, model, tokenizer, matmuls)


def _load(args: EngineArgs, checkpoint: Checkpoint, config: ModelConfig, dtype,
          plan) -> tuple[ShardedModel, str | None]:
    """`checkpoint`'s weights on the mesh of `plan`, laid out as the engine `args` asks for runs them:
    (the model, whose config says how its linear layers are quantized; the library of a CPU's products,
    `execution/cpu_matmuls.py`). The library is chosen before loading: a checkpoint stored feature-major
    is loaded as it lies only for the feature-major products (else its reader turns the layers back)."""
    config = checkpoint.served_config(config, QuantizationFlags.of(args))
    lies_turned, platform = checkpoint.lies_turned(config), jax.default_backend()
    for warning in dtype_warnings(args.dtype, args.quantization, config, dtype, platform, checkpoint.dtype):
        logger.warning("%s", warning)
    matmuls = resolve_cpu_matmuls(args.cpu_matmul_library, platform, config, dtype, devices=plan.tp * plan.pp,
                                  weights_in_place=checkpoint.in_place, stored_turned=lies_turned)
    model = load_checkpoint(checkpoint, AbstractModel(config, dtype, plan,
                                                      feature_major=lies_turned and matmuls == FEATURE_MAJOR))
    return _laid_out(args, model, matmuls, checkpoint.in_place, platform), matmuls


def build_abstract(args: EngineArgs, devices, platform: str, device_limit: int) -> BuiltModel:
    """The engine's model as shapes on a mesh of `devices` (compile-only ones, for `jaxserve plan`), from
    `args.model`'s config.json alone: no weights or tokenizer read. Everything else is resolved as serving
    on such devices resolves it (buckets, layer loop, attention kernels, quantization), and the KV pool is
    sized by the same code, from `device_limit` (the bytes JAX's allocator may use on one device) less
    the weights' share of a device."""
    if args.model_dir is None:
        raise ValueError(f"{args.model!r} has no config.json to plan from: give a model directory")
    config = ModelConfig.from_pretrained(args.model_dir)
    runner, pooler, config, args = _runner(args, config)
    plan = make_plan(args.parallel, num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads, devices=devices)
    dtype = resolve_dtype(args.dtype, config, platform)
    config = Checkpoint.read(args.model_dir).served_config(config, QuantizationFlags.of(args), platform)
    model = AbstractModel(config, dtype, plan).shapes()
    free_bytes = device_limit - bytes_per_device(model.params)
    built = _finish_build(args, served_name(args.model), _laid_out(args, model, None, platform=platform), None,
                          None, platform=platform, free_bytes=free_bytes)
    return dataclasses.replace(built, runner=runner, pooler_config=pooler)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of `tree`'s arrays (or shapes with shardings): its shard of each, the most any
    device holds (4-bit codes at half a byte)."""
    return sum(device_bytes(jax.ShapeDtypeStruct(a.sharding.shard_shape(a.shape), a.dtype))
               for a in jax.tree.leaves(tree))


def _mesh_plan(args: EngineArgs, config: ModelConfig):
    # Before anything touches a device: afterwards jax.devices() lists every host's devices.
    initialize_distributed(args.distributed_coordinator, args.num_processes, args.process_id)
    plan = make_plan(args.parallel, num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    logger.info("%s", plan.describe())
    return plan


def smallest_token_bucket(platform: str, dtype) -> int:
    """The smallest token bucket worth compiling for weights of `dtype` on `platform`, where a step of fewer
    tokens ran slower than one of this many (so it runs padded instead):
    - CPU, bfloat16: 2. XLA:CPU runs a one-row bfloat16 product in its own loop and two rows in its tuned
      kernels (the 124.7M model's step: 102-108 ms for one token, 21-22 ms for two; cpu_matmuls.py).
    - GPU, 2-byte floats: 16. On an H200 the one-token decode step of an 8-layer Llama-3-8B-shaped bf16 model
      took 4.25-6.07 ms while the 16-token step of the same run, with 16 sequences' KV to read, took 3.28-4.80
      (docs/performance.md). Up to a few dozen rows a GPU matmul costs what reading its weights costs.
    Else 1."""
    if platform == "cpu" and jnp.dtype(dtype) == jnp.bfloat16:
        return 2
    return 16 if platform == "gpu" and jnp.dtype(dtype).itemsize == 2 else 1


def token_buckets_for(budget: int, dtype, platform: str | None = None) -> tuple[int, ...]:
    """The default buckets, without those too small to run fast with these weights on `platform` (default:
    this process's backend)."""
    platform = platform or jax.default_backend()
    smallest = smallest_token_bucket(platform, dtype)
    buckets = tuple(b for b in default_token_buckets(budget) if b >= smallest or b == budget)
    if smallest > 1:
        logger.info("token buckets from %d: a %s step of fewer tokens runs padded to %d (a smaller step ran "
                    "slower on %s)", min(buckets), jnp.dtype(dtype).name, min(buckets), platform)
    return buckets


def _laid_out(args: EngineArgs, model: ShardedModel, matmuls: str | None, in_place: bool = False,
              platform: str | None = None) -> ShardedModel:
    """The loaded model laid out as the engine runs it: its layers under `lax.scan` where the layer loop
    says so (`scan_layers`); on a CPU (`matmuls`, None elsewhere) its linear layers feature-major for those
    products, unless loaded so, and on one device a mixture's experts held apart (`model/moe.py`).
    `in_place`: the weights are views of a mapped checkpoint's files (`Checkpoint.in_place`)."""
    if resolve_layer_loop(args.layer_loop, platform or jax.default_backend()) == "scan":
        model = scan_layers(model)
        repeats = model.layer_repeats
        logger.info("layers: %s", f"under lax.scan, {repeats} repeats of {model.plan.layers_per_stage // repeats} "
                    f"layer(s)" if repeats > 1 else "unrolled (no repeating period of layers to scan)")
    else:
        logger.info("layers: unrolled")
    apart = matmuls is not None and any(model.config.sparse_layers) and experts_can_split(model)
    start, turn = time.perf_counter(), matmuls == FEATURE_MAJOR and not model.feature_major
    if turn:
        # One pass for both: a mapped file's expert stacks are then copied once, into their split, not twice.
        model = feature_major(model, weights_in_place=in_place, experts_apart=apart)
        logger.info("linear layers feature-major: kernels turned to [out, in] in %.2f s",
                    time.perf_counter() - start)
    else:
        if matmuls == FEATURE_MAJOR:
            logger.info("linear layers feature-major: stored so by `jaxserve convert`, used where they lie")
        if apart:
            model = split_experts(model, weights_in_place=in_place)
    if apart:
        logger.info("experts: %d per sparse layer held as separate arrays, each tile's picked by lax.switch "
                    "(split %s)", model.config.num_experts,
                    "as the kernels turned" if turn else f"in {time.perf_counter() - start:.2f} s")
    return model


def _finish_build(args: EngineArgs, name: str, model: ShardedModel, tokenizer: Tokenizer | None,
                  matmuls: str | None, platform: str | None = None, free_bytes=None) -> BuiltModel:
    """Everything but the weights, for a model already on its mesh as it runs (`_laid_out`), but for the
    kernels of its quantized products, chosen here once the token buckets are known; `matmuls`: the CPU's
    product library. `platform` and `free_bytes`: the devices' kind and memory free after the weights, for
    a mesh of compile-only devices (`build_abstract`); default: this process's devices."""
    config, dtype, platform = model.config, model.dtype, platform or jax.default_backend()
    max_model_len = args.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{config.max_position_embeddings}")
    budget = args.max_num_batched_tokens or (args.token_buckets[-1] if args.token_buckets else
                                             default_token_budget(args.max_num_seqs))
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=budget,
        token_buckets=args.token_buckets or token_buckets_for(budget, dtype, platform),
        scheduling_policy=args.scheduling_policy,
        target_itl=None if args.target_itl_ms is None else args.target_itl_ms / 1e3,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills, waiting_served_ratio=args.waiting_served_ratio)
    attention = select_attention_backend(args.attention_backend, platform)
    check_page_dtype(args.kv_cache_dtype, model.plan.mesh.devices.flat[0])
    # Before the KV pool takes the free memory: timing the products needs a few hundred MB for a moment.
    model = choose_linear_kernels(model, args.quantized_matmul, platform, scheduler_config.token_buckets)
    model = choose_decode_epilogues(model, platform)
    if matmuls == "eigen":
        attention = for_eigen_dots(attention)
    logger.info("platform %s, %s weights, attention kernels: %s%s", platform,
                jax.numpy.dtype(dtype).name, attention.name,
                f", matrix products: {describe_cpu_matmuls(matmuls)}" if matmuls else "")
    # After loading: the weights' bytes are then in use, so a memory fraction counts only what is left.
    budget = resolve_kv_budget(config, kv_quant_dtype(args.kv_cache_dtype) or dtype, page_size=args.page_size, max_model_len=max_model_len,
                               max_num_seqs=args.max_num_seqs, num_pages=args.num_pages,
                               kv_cache_memory=args.kv_cache_memory,
                               gpu_memory_utilization=args.gpu_memory_utilization,
                               share=KVShare.of(config, model.plan),
                               **({} if free_bytes is None else {"free_bytes": free_bytes}))
    return BuiltModel(name=args.served_model_name or name, model=model, model_config=config,
                      tokenizer=tokenizer, dtype=dtype, attention=attention, scheduler_config=scheduler_config,
                      cache_config=CacheConfig(page_size=args.page_size, num_pages=budget.num_pages,
                                               enable_prefix_caching=args.enable_prefix_caching,
                                               kv_cache_dtype=args.kv_cache_dtype),
                      sampler_config=SamplerConfig(max_logprobs=args.max_logprobs,
                                                   max_logit_bias=args.max_logit_bias),
                      compiler_options=cpu_matmul_options(matmuls) | gpu_step_options(platform),
                      images=NoImages(args.served_model_name or name, None))
