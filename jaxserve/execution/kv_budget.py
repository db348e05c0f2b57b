"""KV memory budget: how many pages the cache gets, decided once at start, after the weights are loaded.

1. One page costs K and V for every layer: 2 * layers * kv_heads * page_size * head_dim * itemsize bytes,
   plus, for int8 / fp8 pages, a float32 scale per token and KV head (`kv_token_bytes`): the same memory
   holds 3.8x more int8 tokens than float32 at head_dim 64. A device holds its share of every page
   (`KVShare`): its pipeline stage's layers and its tensor-parallel KV heads; byte budgets are per device.
2. The pool comes from the first of: `num_pages` (exact), `kv_cache_memory` (bytes per device),
   `gpu_memory_utilization` (that fraction of a device's memory still free once the weights are on it),
   else the default of every decode slot at full context. Free memory comes from the devices'
   `memory_stats()` when serving, and from the chip's HBM less the weights when `jaxserve plan` sizes a
   slice that is not here: the same code decides both. A device without memory statistics (the CPU)
   cannot honour a fraction: the default is used and the log says so.
3. A pool that cannot hold one full-context sequence (plus the null page) is refused with a ValueError
   naming the option, since such a server would reject or stall its longest requests forever.
4. The capacity is logged in pages, tokens, bytes and full-context sequences.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
from pallas_kernels.kv_quant import kv_token_bytes

from jaxserve.config import ModelConfig
from jaxserve.scheduling.pages import pages_needed

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVBudget:
    num_pages: int  # page 0 (the null page) included
    page_bytes: int  # one device's share of a page
    source: str  # which option decided it, for the log and error messages


@dataclasses.dataclass(frozen=True)
class KVShare:
    """What one device holds of every page: the layers of its pipeline stage (padding layers included) and
    the KV heads of its tensor-parallel shard. The whole model on one device by default."""
    layers: int | None = None  # None: every layer
    kv_heads: int | None = None  # None: every KV head

    @classmethod
    def of(cls, config: ModelConfig, plan) -> "KVShare":
        """`plan`: the `MeshPlan`; KV heads split over its `tensor` axis and replicate over `kv_replica`."""
        return cls(plan.layers_per_stage, config.num_kv_heads // (plan.tp // plan.kv_replicas))


def page_bytes(config: ModelConfig, page_size: int, dtype, share: KVShare = KVShare()) -> int:
    """`dtype`: the pages' dtype (the model's float dtype, or int8 / float8_e4m3fn for quantized pages);
    `share`: one device's part (default: the whole page)."""
    layers = share.layers or config.num_layers
    return layers * page_size * kv_token_bytes(share.kv_heads or config.num_kv_heads, config.head_dim, dtype)


def device_free_bytes() -> int | None:
    """Bytes every local device can still allocate (limit minus in use, the least of them), or None
    without statistics."""
    free = []
    for device in jax.local_devices():
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free)


_FROM_DEVICES = object()


def resolve_kv_budget(config: ModelConfig, dtype, *, page_size: int, max_model_len: int, max_num_seqs: int,
                      num_pages: int | None = None, kv_cache_memory: int | None = None,
                      gpu_memory_utilization: float | None = None, share: KVShare = KVShare(),
                      free_bytes=_FROM_DEVICES) -> KVBudget:
    """The page pool for these options (see the module docstring); raises ValueError if it is too small.
    `share`: what one device holds of a page; `free_bytes`: a device's memory free after the weights (default:
    read from the devices; None: unknown)."""
    per_page = page_bytes(config, page_size, dtype, share)
    full_context_pages = pages_needed(max_model_len, page_size)
    default = max_num_seqs * full_context_pages + 1
    if num_pages is not None and kv_cache_memory is not None:
        raise ValueError("num_pages and kv_cache_memory both size the KV cache: give one of them")
    if num_pages is not None:
        budget = KVBudget(num_pages, per_page, f"num_pages {num_pages}")
    elif kv_cache_memory is not None:
        budget = KVBudget(kv_cache_memory // per_page, per_page,
                          f"kv_cache_memory {kv_cache_memory} bytes ({per_page} bytes per page a device)")
    elif gpu_memory_utilization is not None:
        free = device_free_bytes() if free_bytes is _FROM_DEVICES else free_bytes
        if free is None:
            logger.warning("gpu_memory_utilization %.2f ignored: device %s reports no memory statistics; "
                           "KV cache falls back to the default of %d pages (every slot at full context). "
                           "Set --kv-cache-memory or --num-pages to size it.", gpu_memory_utilization,
                           jax.devices()[0], default)
            budget = KVBudget(default, per_page, "the default (every slot at full context)")
        else:
            usable = int(free * gpu_memory_utilization)
            budget = KVBudget(usable // per_page, per_page,
                              f"gpu_memory_utilization {gpu_memory_utilization} of {free} free bytes after "
                              f"the weights ({per_page} bytes per page a device)")
    else:
        budget = KVBudget(default, per_page, "the default (every slot at full context)")
    if budget.num_pages - 1 < full_context_pages:
        need = (full_context_pages + 1) * per_page
        raise ValueError(f"KV cache from {budget.source} has {max(budget.num_pages, 0)} pages, which cannot "
                         f"hold even one full-context sequence: max_model_len {max_model_len} needs "
                         f"{full_context_pages} pages of {page_size} tokens + the null page "
                         f"({need} bytes). Give more memory or pages, or lower max_model_len.")
    usable_pages = budget.num_pages - 1
    logger.info("KV cache: %d pages x %d tokens = %d tokens (%.1f MB of %s pages a device) from %s; holds %.1f "
                "full-context sequences of %d tokens (%d decode slots)", usable_pages, page_size,
                usable_pages * page_size, budget.num_pages * per_page / 1e6, jax.numpy.dtype(dtype).name,
                budget.source, usable_pages / full_context_pages,
                max_model_len, max_num_seqs)
    return budget
