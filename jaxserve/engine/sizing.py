"""Will it fit, and how fast can it be: the engine's step programs compiled for a slice that is not here.

1. `plan_target(args, target)` builds the engine's model as shapes from config.json
   (`builder.build_abstract`) on the target's compile-only devices (`sharding/compile_only.py`), with the KV
   pool sized by the code that sizes it when serving there, and compiles its step programs
   (`execution/programs.py`) with the target's own compiler: the decode program and the largest one.
2. Per device it adds up what running a program holds: its arguments (weights, KV pool, sampler state), its
   outputs less those aliased to donated arguments, and its temp buffers (`memory_analysis()`); it fits
   when the largest of them fits in what JAX's allocator may use (`device_limit`), and the pool holds
   max_num_seqs sequences of max_model_len.
3. When it does not, `advice` names the smallest single changes that make it fit, each checked by the same
   arithmetic (the weights and pool recomputed, the programs' own buffers as compiled): more chips of the
   family, `--quantization int8`, `--kv-cache-dtype int8|fp8`, a shorter `--max-model-len`, fewer
   `--max-num-seqs`.
4. Roofline floors (`roofline.py`) from the chip's spec-sheet figures: the decode step at 1 and at
   max_num_seqs sequences, at full context, and prefill tokens a second.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax

from jaxserve.config import ModelConfig
from jaxserve.engine.builder import BuiltModel, build_abstract, bytes_per_device
from jaxserve.engine.images import abstract_rows
from jaxserve.engine.roofline import StepWork
from jaxserve.engine_args import EngineArgs
from jaxserve.execution.kv_budget import KVShare, page_bytes, resolve_kv_budget
from jaxserve.execution.heads import head_for
from jaxserve.execution.programs import StepPrograms
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.dtypes import resolve_dtype
from jaxserve.loader.formats import Checkpoint
from jaxserve.loader.quantized import QuantizationFlags
from jaxserve.lora.slots import LoRASlots
from jaxserve.scheduling.pages import pages_needed
from pallas_kernels.kv_quant import kv_quant_dtype
from sharding import ParallelConfig, make_plan
from sharding.chips import Chip, Target, parse_target
from sharding.compile_only import compile_devices, compile_options

DEFAULT_UTILIZATION = 0.9  # the capacity figure's fraction when --gpu-memory-utilization is not given
# JAX's allocator on a GPU takes this fraction of the memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise; on a TPU it may use the HBM.
GPU_ALLOCATOR_FRACTION = 0.75


def device_limit(chip: Chip) -> int:
    """Bytes JAX's allocator may use on one device of `chip` (what `memory_stats()["bytes_limit"]` says there)."""
    if chip.is_tpu:
        return chip.hbm_bytes
    return int(chip.hbm_bytes * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_ALLOCATOR_FRACTION)))


@dataclasses.dataclass
class ProgramMemory:
    tokens: int  # the program's token bucket
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    compile_seconds: float

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass
class Footprint:
    """One device's bytes under a set of options."""
    weights: int
    kv_pool: int
    pool_tokens: int  # tokens the pool holds (the null page not counted)
    other: int  # the programs' own: sampler state, inputs, outputs, temp buffers

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.other


@dataclasses.dataclass
class Plan:
    target: Target
    args: EngineArgs
    built: BuiltModel
    programs: list[ProgramMemory]
    footprint: Footprint
    limit: int  # bytes per device JAX may use
    kv_bytes_per_token: int  # per device
    capacity_tokens: int  # at --gpu-memory-utilization (or DEFAULT_UTILIZATION)
    utilization: float
    work: StepWork
    compiler: str
    advice: list[dict]  # {"flags", "why"}: the smallest single changes that make it fit

    @property
    def wanted_tokens(self) -> int:
        return self.args.max_num_seqs * self.built.scheduler_config.max_model_len

    @property
    def fits(self) -> bool:
        return _fits(self.footprint, self.limit, self.wanted_tokens)

    def roofline(self) -> dict:
        context = self.built.scheduler_config.max_model_len
        seqs = sorted({1, self.args.max_num_seqs})
        return {"decode_step_s": {str(n): self.work.decode_step_seconds(n, context) for n in seqs},
                "decode_context_tokens": context,
                "prefill_tok_s": self.work.prefill_tokens_per_second(context),
                "chip": {"hbm_bandwidth_bytes_s": self.target.chip.hbm_bandwidth,
                         "bf16_flops": self.target.chip.bf16_flops, "source": self.target.chip.source}}

    def to_json(self) -> dict:
        c = self.built.model_config
        return {
            "fits": self.fits,
            "target": self.target.name,
            "devices": self.target.chips,
            "hosts": self.target.hosts,
            "chip": self.target.chip.description,
            "model": self.built.name,
            "model_type": c.model_type,
            "parallel": {"tensor": self.built.model.plan.tp, "pipeline": self.built.model.plan.pp},
            "dtype": jax.numpy.dtype(self.built.dtype).name,
            "quantization": c.linear_quantization and c.linear_quantization.codes,
            "quantization_strategy": c.linear_quantization and c.linear_quantization.strategy,
            "kv_cache_dtype": self.args.kv_cache_dtype,
            "max_model_len": self.built.scheduler_config.max_model_len,
            "max_num_seqs": self.args.max_num_seqs,
            "per_device": {
                "hbm_bytes": self.target.chip.hbm_bytes,
                "limit_bytes": self.limit,
                "weights_bytes": self.footprint.weights,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_pool_bytes": self.footprint.kv_pool,
                "kv_pool_tokens": self.footprint.pool_tokens,
                "kv_capacity_tokens": self.capacity_tokens,
                "kv_capacity_sequences": self.capacity_tokens / self.built.scheduler_config.max_model_len,
                "kv_capacity_utilization": self.utilization,
                "program_temp_bytes_max": max((p.temp_bytes for p in self.programs), default=0),
                "total_bytes": self.footprint.total,
                "programs": [dataclasses.asdict(p) | {"peak_bytes": p.peak_bytes} for p in self.programs],
            },
            "programs_compiled": len(self.programs),
            "compiler": self.compiler,
            "roofline": self.roofline(),
            "advice": self.advice,
        }


def default_parallel(args: EngineArgs, target: Target) -> EngineArgs:
    """Every chip of the target in use: tensor parallelism over what pipeline parallelism leaves, unless the
    flags chose both."""
    p = args.parallel
    if p.tensor_parallel_size * p.pipeline_parallel_size == target.chips:
        return args
    if p.tensor_parallel_size != 1 and p.pipeline_parallel_size * p.tensor_parallel_size != target.chips:
        raise ValueError(f"--tensor-parallel-size {p.tensor_parallel_size} x --pipeline-parallel-size "
                         f"{p.pipeline_parallel_size} must use all {target.chips} chips of {target.name}")
    if target.chips % p.pipeline_parallel_size:
        raise ValueError(f"--pipeline-parallel-size {p.pipeline_parallel_size} does not divide the "
                         f"{target.chips} chips of {target.name}")
    return dataclasses.replace(args, tensor_parallel_size=target.chips // p.pipeline_parallel_size)


def plan_target(args: EngineArgs, target: Target, programs: str = "decode,largest",
                progress: Callable[[int], object] | None = None) -> Plan:
    """Build, compile and size `args`' engine for `target` (see the module docstring). `programs`: which
    step programs to compile ("decode", "largest", "all", or "none"); `progress(n)` is told how many before
    they compile and called with 1 after each."""
    args = default_parallel(args, target)
    devices = compile_devices(target)
    limit = device_limit(target.chip)
    built = build_abstract(args, devices, target.platform, limit)
    buckets = _buckets(built, programs)
    tracker = progress(len(buckets)) if progress else None
    compiled = compile_programs(step_programs(built, args), buckets, target, tracker)
    plan_ = built.model.plan
    share = KVShare.of(built.model_config, plan_)
    page_dtype = kv_quant_dtype(args.kv_cache_dtype) or built.dtype
    per_token = page_bytes(built.model_config, 1, page_dtype, share)
    weights = bytes_per_device(built.model.params)
    utilization = args.gpu_memory_utilization or DEFAULT_UTILIZATION
    capacity = _capacity(built, args, share, page_dtype, limit - weights, utilization)
    pool_pages = built.cache_config.num_pages
    kv_pool = pool_pages * built.cache_config.page_size * per_token
    peak = max((p.peak_bytes for p in compiled), default=weights + kv_pool)
    footprint = Footprint(weights, kv_pool, (pool_pages - 1) * built.cache_config.page_size,
                          max(peak - weights - kv_pool, 0))
    c = built.model_config
    heads = c.num_heads // plan_.tp
    work = StepWork.of(built.model.params, c, target.chip, per_token, plan_.layers_per_stage, heads, plan_.pp)
    plan = Plan(target, args, built, compiled, footprint, limit, per_token, capacity, utilization, work,
                compiler_name(target), [])
    if not plan.fits:
        plan.advice = advice(plan)
    return plan


def _buckets(built: BuiltModel, programs: str) -> list[int]:
    buckets = built.scheduler_config.token_buckets
    decode = next(b for b in buckets if b >= built.scheduler_config.max_num_seqs)
    wanted = {"none": [], "decode": [decode], "largest": [buckets[-1]], "all": list(buckets)}
    chosen = []
    for name in programs.split(","):
        if name not in wanted:
            raise ValueError(f"--programs takes decode, largest, all or none (comma-separated), got {name!r}")
        chosen += [b for b in wanted[name] if b not in chosen]
    return chosen


def step_programs(built: BuiltModel, args: EngineArgs) -> StepPrograms:
    """The step programs serving `args` would compile: LoRA slots, draft verification and a vision model's
    image input included."""
    lora = None if not args.enable_lora else LoRASlots.abstract_stack(
        built.model_config, args.max_loras, args.max_lora_rank, built.dtype, built.model.plan)
    return StepPrograms.build(built.model, built.model_config, built.cache_config, built.scheduler_config,
                              built.attention, built.dtype, built.sampler_config,
                              head=head_for(built.runner, built.sampler_config.max_logprobs),
                              lora_stack=lora, max_drafts=args.speculative_config.num_speculative_tokens
                              if args.speculative_config else 0, compiler_options=built.compiler_options,
                              image_rows=abstract_rows(args, built))


def compile_programs(programs: StepPrograms, buckets: list[int], target: Target, tracker=None) -> list[ProgramMemory]:
    """Compile the programs of `buckets` for `target` side by side (XLA compiles outside the GIL) and read
    their memory."""
    device, options = compile_devices(target)[0], compile_options(target)

    def one(bucket: int) -> ProgramMemory:
        start = time.perf_counter()
        with jax.default_device(device):  # Pallas' GPU lowering asks the default device what it is
            memory = programs.lower(programs.layouts[bucket]).compile(options).memory_analysis()
        if tracker is not None:
            tracker.update(1)
        return ProgramMemory(bucket, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                             memory.alias_size_in_bytes, memory.temp_size_in_bytes, time.perf_counter() - start)

    with ThreadPoolExecutor(max(1, min(len(buckets), os.cpu_count() or 1))) as pool:
        return list(pool.map(one, buckets))


def _capacity(built: BuiltModel, args: EngineArgs, share: KVShare, page_dtype, free: int, utilization: float) -> int:
    """Tokens the pool holds at `utilization` of the memory the weights leave, sized by the serving code."""
    try:
        budget = resolve_kv_budget(built.model_config, page_dtype, page_size=args.page_size,
                                   max_model_len=built.scheduler_config.max_model_len,
                                   max_num_seqs=args.max_num_seqs, gpu_memory_utilization=utilization,
                                   share=share, free_bytes=max(free, 0))
    except ValueError:  # not even one full-context sequence
        return 0
    return (budget.num_pages - 1) * args.page_size


def compiler_name(target: Target) -> str:
    if target.chip.is_tpu:
        version = _version("libtpu")
        return f"libtpu {version} (XLA:TPU and Mosaic, compile-only) for {target.topology}"
    return (f"XLA:GPU from jax-cuda13-plugin {_version('jax-cuda13-plugin')} with ptxas "
            f"{_version('nvidia-cuda-nvcc')} for {target.chip.description} ({target.topology})")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


# ---- advice: the smallest single changes that make it fit ---------------------------------------------------

@functools.lru_cache(maxsize=64)
def _placed_weights(model_dir: str, target: Target, tp: int, pp: int, expert_parallel: bool, dtype_flag: str,
                    quantization: QuantizationFlags) -> tuple[ModelConfig, object, int, KVShare]:
    """(config, dtype, weight bytes a device holds, the device's share of a page) for these options: the
    abstract model placed on the target's mesh. Cached: the advice's searches over context length and
    sequences keep the weights."""
    config = ModelConfig.from_pretrained(model_dir)
    plan_ = make_plan(ParallelConfig(tp, pp, expert_parallel), num_layers=config.num_layers,
                      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, devices=compile_devices(target))
    dtype = resolve_dtype(dtype_flag, config, target.platform)
    config = Checkpoint.read(model_dir).served_config(config, quantization, target.platform)
    weights = bytes_per_device(AbstractModel(config, dtype, plan_).shapes().params)
    return config, dtype, weights, KVShare.of(config, plan_)


def footprint(args: EngineArgs, target: Target, other: int) -> Footprint:
    """One device's bytes for `args` on `target` without compiling: the weights and the pool recomputed,
    `other` (the programs' own buffers) as compiled for the plan being advised."""
    config, dtype, weights, share = _placed_weights(
        args.model_dir, target, args.tensor_parallel_size, args.pipeline_parallel_size, args.enable_expert_parallel,
        args.dtype, QuantizationFlags.of(args))
    page_dtype = kv_quant_dtype(args.kv_cache_dtype) or dtype
    max_len = args.max_model_len or config.max_position_embeddings
    free = device_limit(target.chip) - weights
    if args.gpu_memory_utilization is not None:
        budget = resolve_kv_budget(config, page_dtype, page_size=args.page_size, max_model_len=max_len,
                                   max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                                   share=share, free_bytes=max(free, 0))
        pages = budget.num_pages
    else:
        pages = args.num_pages or args.max_num_seqs * pages_needed(max_len, args.page_size) + 1
    per_page = page_bytes(config, args.page_size, page_dtype, share)
    return Footprint(weights, pages * per_page, (pages - 1) * args.page_size, other)


def advice(plan: Plan) -> list[dict]:
    """The smallest single changes that make `plan` fit: {"flags": the serve flags to change, "why"}."""
    args, target, other = plan.args, plan.target, plan.footprint.other
    max_len = plan.built.scheduler_config.max_model_len
    wanted = lambda a: a.max_num_seqs * (a.max_model_len or max_len)

    def fits(trial: EngineArgs, on: Target) -> bool:
        try:
            return _fits(footprint(trial, on, other), device_limit(on.chip), wanted(trial))
        except ValueError:  # an option this model cannot take (heads that do not split, a pool below one sequence)
            return False

    found = []
    for bigger in _bigger_targets(target):
        try:
            trial = default_parallel(dataclasses.replace(args, tensor_parallel_size=1), bigger)
        except ValueError:  # stages that do not divide the chips
            continue
        if fits(trial, bigger):
            found.append(_advice(f"--target {bigger.name}", f"more chips: {bigger.chips} x {bigger.chip.name}, "
                                 f"tensor parallel {trial.parallel.tensor_parallel_size}"))
            break
    if args.quantization is None and plan.built.model_config.linear_quantization is None:
        trial = dataclasses.replace(args, quantization="int8")
        if fits(trial, target):
            found.append(_advice("--quantization int8", "int8 weights: a byte a weight"))
    if args.kv_cache_dtype == "auto":
        for dtype in ("fp8", "int8") if target.chip.fp8 or target.chip.is_tpu else ("int8",):
            trial = dataclasses.replace(args, kv_cache_dtype=dtype)
            if fits(trial, target):
                found.append(_advice(f"--kv-cache-dtype {dtype}", "a byte per cached K/V element"))
                break
    shorter = _largest(lambda n: fits(dataclasses.replace(args, max_model_len=n), target), args.page_size,
                       max_len - 1, args.page_size)
    if shorter:
        found.append(_advice(f"--max-model-len {shorter}", f"the longest context that fits at --max-num-seqs "
                                                            f"{args.max_num_seqs}"))
    fewer = _largest(lambda n: fits(dataclasses.replace(args, max_num_seqs=n), target), 1, args.max_num_seqs - 1, 1)
    if fewer:
        found.append(_advice(f"--max-num-seqs {fewer}", f"the most sequences that fit at --max-model-len {max_len}"))
    if not found:
        found.append(_advice("", "no single change fits: combine them (e.g. --quantization int8 with "
                                 "--kv-cache-dtype int8 and a shorter --max-model-len), or use a larger slice"))
    return found


def _advice(flags: str, why: str) -> dict:
    return {"flags": flags, "why": why}


def _fits(f: Footprint, limit: int, wanted_tokens: int) -> bool:
    return f.total <= limit and f.pool_tokens >= wanted_tokens


def _bigger_targets(target: Target) -> list[Target]:
    chip = target.chip
    names = ([f"{chip.name}-{n}" for n in (1, 4, 8, 16, 32, 64, 128, 256)] if chip.grid_dims == 2 else
             [f"{chip.name}-{n}" for n in (8, 16, 32, 64, 128, 256)] if chip.is_tpu else
             [chip.name] + [f"{chip.name}x{n}" for n in (2, 4, 8, 16, 32, 64)])
    targets = [parse_target(name) for name in names]
    return [t for t in targets if t.chips > target.chips]


def _largest(ok: Callable[[int], bool], low: int, high: int, step: int) -> int | None:
    """The largest multiple of `step` in [low, high] for which `ok` holds (ok is monotone: true below some n)."""
    low, high = -(-low // step), high // step
    if high < low or not ok(low * step):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid * step):
            low = mid
        else:
            high = mid - 1
    return low * step

