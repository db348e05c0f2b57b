"""Which adapters the engine knows, which it holds on the host, and which holds each device slot.

1. Named adapters (`--lora-modules`, `/v1/load_lora_adapter`) are registered by name; `lookup(name)` gives
   the `LoRARequest` a request names as its `model`. `unregister` removes the name at once: no new request
   may use it, while the queued and running ones that already resolved it finish with it.
2. `resolve(lora_request)` (any thread) reads and checks the adapter (`adapter.py`) and gives the request
   an `ActiveLoRA` that holds the host copy, so admitting it later never touches the disk and cannot
   fail. Resolved adapters stay in a host LRU of `max_cpu_loras` (the next request for one skips the read).
3. The scheduler (engine thread) calls `acquire(active)` when it admits the request: the slot that
   already holds the adapter, or a free one (empty, else the least recently used slot no running request
   uses), filled through the runner's `write_lora`. None when every slot is in use: the request waits in
   the queue and the others go ahead. `release(slot)` at finish or preemption; the adapter stays in its
   slot for the next request that wants it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Callable

from jaxserve.config import ModelConfig
from jaxserve.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from jaxserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class ActiveLoRA:
    """A request's adapter, resolved: what the scheduler admits it with."""
    request: LoRARequest
    adapter: LoRAAdapter

    @property
    def key(self) -> tuple:
        """Names the adapter in the prefix cache and in the slots (id and path: a reused id with another
        folder is another adapter)."""
        return ("lora", self.request.lora_int_id, self.request.lora_path)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters resident on the device at once (slots 1..max_loras)
    max_lora_rank: int = 16  # the slots' rank: adapters of higher rank are refused
    max_cpu_loras: int | None = None  # adapters kept read on the host; default max_loras

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


class LoRAManager:
    def __init__(self, config: LoRAConfig, model_config: ModelConfig,
                 write_slot: Callable[[int, LoRAAdapter | None], None]):
        self.config = config
        self.model_config = model_config
        self._write_slot = write_slot
        self._lock = threading.Lock()  # registry and host cache: the server's threads and the engine's
        self._named: dict[str, LoRARequest] = {}
        self._host: OrderedDict[tuple, ActiveLoRA] = OrderedDict()  # least recently used first
        self._next_id = 1
        # Device slots 1..max_loras (engine thread only): the adapter key each holds, and its users.
        self._held: list[tuple | None] = [None] * (config.max_loras + 1)
        self._users = [0] * (config.max_loras + 1)
        self._idle: OrderedDict[int, None] = OrderedDict()  # loaded slots nobody uses; least recent first
        self.loads = 0  # adapters written into slots (for tests and metrics)

    @classmethod
    def start(cls, config: LoRAConfig, model_config: ModelConfig, slots, write_slot, modules) -> "LoRAManager":
        """The engine's manager over its device `slots`, with the `--lora-modules` (name, path) registered."""
        manager = cls(config, model_config, write_slot)
        for name, path in modules:
            manager.register(name, path)
        logger.info("LoRA: %d slots of rank %d (%.1f MB on the device), adapters %s", config.max_loras,
                    config.max_lora_rank, slots.num_bytes / 1e6,
                    ", ".join(r.lora_name for r in manager.names()) or "none yet")
        return manager

    # ---- names ------------------------------------------------------------------------------------------

    def register(self, name: str, path: str) -> LoRARequest:
        """Read and check the adapter, then make `name` refer to it. Raises LoRAError; ValueError when the
        name is taken."""
        with self._lock:
            if name in self._named:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            request = LoRARequest(name, self._fresh_id(), path)
        self.resolve(request)  # reads it now: a bad adapter is refused here, not when a request uses it
        with self._lock:
            if name in self._named:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            self._named[name] = request
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return request

    def _fresh_id(self) -> int:
        used = {r.lora_int_id for r in self._named.values()}
        while self._next_id in used:
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    def unregister(self, name: str) -> None:
        """Forget `name` (KeyError if unknown); requests already using it finish with it."""
        with self._lock:
            del self._named[name]
        logger.info("LoRA adapter %r unloaded", name)

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._named.get(name)

    def names(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._named.values())

    # ---- the host copies ------------------------------------------------------------------------------

    def resolve(self, request: LoRARequest) -> ActiveLoRA:
        """The adapter of `request`, read (or taken from the host LRU); raises LoRAError."""
        key = ("lora", request.lora_int_id, request.lora_path)
        with self._lock:
            active = self._host.get(key)
            if active is not None:
                self._host.move_to_end(key)
                return ActiveLoRA(request, active.adapter) if active.request != request else active
        adapter = load_adapter(request.lora_path, self.model_config, self.config.max_lora_rank)
        active = ActiveLoRA(request, adapter)
        with self._lock:
            self._host[key] = active
            while len(self._host) > self.config.cpu_capacity:
                self._host.popitem(last=False)
        return active

    # ---- the device slots (engine thread) ----------------------------------------------------------------

    def acquire(self, active: ActiveLoRA) -> int | None:
        """A slot holding the adapter for one more user, or None when all slots are in use."""
        key = active.key
        if key in self._held:
            slot = self._held.index(key)
        else:
            slot = next((s for s in range(1, len(self._held)) if self._held[s] is None), None)
            if slot is None and self._idle:
                slot = next(iter(self._idle))
            if slot is None:
                return None
            self._write_slot(slot, active.adapter)
            self._held[slot] = key
            self.loads += 1
        self._users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None

    @property
    def slots_in_use(self) -> int:
        return sum(1 for users in self._users if users)


__all__ = ["ActiveLoRA", "LoRAConfig", "LoRAError", "LoRAManager", "LoRARequest"]


def resolve_adapter(manager: LoRAManager | None, lora_request: LoRARequest | None) -> ActiveLoRA | None:
    """The adapter a request runs under, read and checked (None: the base model); a ValueError when the
    engine has no LoRA."""
    if lora_request is None:
        return None
    if manager is None:
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                         "(start the engine with enable_lora / --enable-lora)")
    return manager.resolve(lora_request)
